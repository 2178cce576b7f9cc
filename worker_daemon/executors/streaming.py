"""Streaming DiLoCo: a trainer sends one fragment of the model a round and trains on without waiting
(docs/training.md, "Overlap: streaming"; Douillard et al., arXiv 2501.18512).

For a job whose trainer JSON carries ``"overlap": {"mode": "streaming", "fragments": F, "mix": α}``. The model's
tensors are split into F fragments once, at start, from the trainer's global weights (their names, sizes and
tied groups: :func:`hypha_tensors.fragments.partition`, the very rule the parameter server applies to its
canonical names and aliases); round r (numbered from 1) syncs fragment f = (r − 1) mod F only, and the job's
last round (the JSON's ``"rounds"``, when given) every fragment: below, f is then the whole model
(:func:`round_fragment`). Notation as in
docs/training.md: θ_{r−1} the trainer's digest-checked copy of the FULL global weights after round r − 1 (its
``global_previous``), θ_live its model, ·_f the tensors of fragment f (every name of each tied group in it).
Trainer i:

a. at the end of round r's steps (r from 1, or from the round after the fetched weights' ``rounds_completed``):
   if round r − 1's result is not merged yet, waits for it and merges it (c) first; then sends Q(Δ_f + e_f),
   Δ_f = θ_live,f − θ_{r−1,f}, for round r's fragment f only, through the unchanged ``training.send_update``
   (encoding and error feedback: the residuals of the other fragments are kept for their rounds). The live
   model is NOT changed: round r + 1's steps start at once, from θ_live (no proxy);
b. a background thread (:class:`~worker_daemon.executors.overlap.PendingResult`) reads round r's result
   exactly as ``training.receive_result`` does: the result holds u_r,f, fragment f's tensors only (any other
   set of names is a drift), merged into the full θ_{r−1} (the other tensors unchanged) and the digest of the
   full θ_r checked against the published one; on any drift the full global weights θ_k (k ≥ r) are fetched
   instead;
c. when that is done, between two steps, on the main thread: θ_live,f ← α·θ_live,f + (1 − α)·θ_r,f for every
   tensor of fragment f, in place, once per tied group, floating-point buffers too (:func:`mix_into`; α = 0
   replaces the fragment by the global one exactly); θ_{r−1} ← θ_r; ``"update-received"`` — ``Done`` ends the
   job at once (the partial round is dropped). After a fetch of the full weights θ_k: they are loaded into the
   model whole (θ_live ← θ_k, the local progress dropped) and the round in progress becomes k + 1.

So round r + 1's ``"update"`` never precedes round r's ``"update-received"``, and at most one fragment is in
flight. AdamW's state is kept throughout.

Memory: no more than a trainer that waits (the model, AdamW's state, θ_{r−1}, the error-feedback residual): no
proxy and no copy of the last update; the delta sent and the merged tensors are of one fragment (the merged
θ_r shares every other tensor with θ_{r−1}), and the mixing works in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hypha_tensors.fragments import FragmentError, fragment_of_round, partition_state, syncs_everything
from worker_daemon.executors.overlap import OverlappedRounds, PendingResult
from worker_daemon.executors.pseudo_gradient import float_state, load_into, tied_groups

if TYPE_CHECKING:
    from worker_daemon.executors.consistency import Merged

logger = logging.getLogger("worker_daemon.executors.training")


# --- the fragments and the mixing (pure, tested against a written-out reference) --------------------------------


def fragments_of(global_previous: Mapping[str, torch.Tensor], count: int) -> list[frozenset[str]]:
    """The names of each of the ``count`` fragments of the global weights (every name of a tied group in the
    group's fragment); ``JobConfigError`` when the model cannot be split so."""
    from worker_daemon.executors.exceptions import JobConfigError

    try:
        return partition_state(global_previous, tied_groups(global_previous), count)
    except FragmentError as error:
        raise JobConfigError(f"the model cannot be split into {count} fragments: {error}") from error


def round_fragment(
    fragments: Sequence[frozenset[str]], round_number: int, rounds: int | None
) -> frozenset[str]:
    """The names round ``round_number`` syncs: fragment ``(r − 1) mod F``'s, or every fragment's in the job's
    last round (``rounds``: the job's rounds, None when not known: fragments only)."""
    if syncs_everything(round_number, rounds):
        return frozenset().union(*fragments)
    return fragments[fragment_of_round(round_number, len(fragments))]


@torch.no_grad()
def mix_into(
    model: torch.nn.Module, merged: Mapping[str, torch.Tensor], fragment: Collection[str], mix: float
) -> None:
    """θ_live,f ← mix·θ_live,f + (1 − mix)·θ_r,f, in place on the model's floating-point entries of
    ``fragment``, once per group of tied names (tied parameters share one storage: mixing per name would mix
    twice); every other entry is left alone. ``merged`` must name the fragment's groups (any name of a group
    will do); everything is checked before the model is touched (``UpdateError``)."""
    from worker_daemon.executors.exceptions import UpdateError

    live = float_state(model)
    pairs = []
    for group in tied_groups(live):
        if not any(name in fragment for name in group):
            continue
        value = next((merged[name] for name in group if name in merged), None)
        if value is None:
            raise UpdateError(f"the merged weights have no tensor {group[0]!r}")
        target = live[group[0]]
        if value.shape != target.shape:
            raise UpdateError(
                f"the merged {group[0]!r} has shape {tuple(value.shape)}, expected {tuple(target.shape)}"
            )
        pairs.append((target, value))
    for target, value in pairs:
        value = value.to(target.device, target.dtype)
        if mix == 0.0:
            target.copy_(value)  # exactly θ_r,f
        else:
            target.mul_(mix).add_(value, alpha=1.0 - mix)


# --- the streaming loop -------------------------------------------------------------------------------------------


class StreamingRounds(OverlappedRounds):
    """The outer steps of a streaming trainer (the module docstring's a–c): :meth:`poll` between steps,
    :meth:`finish_round` at the end of each round's steps; ``fragments`` the names of each fragment, computed
    once here from the global weights."""

    def __init__(self, **state: Any) -> None:
        super().__init__(**state)
        overlap = self.config.overlap
        assert overlap is not None and overlap.streaming
        assert overlap.fragments is not None and overlap.mix is not None
        self.mix = overlap.mix
        self.fragments = fragments_of(self.global_previous, overlap.fragments)
        #: The job's rounds (None: not said; then its last round syncs its fragment only, as the others).
        self.rounds = overlap.rounds

    def fragment(self, round_number: int) -> frozenset[str]:
        """The names round ``round_number`` syncs (every fragment's in the job's last round)."""
        return round_fragment(self.fragments, round_number, self.rounds)

    def describe(self, round_number: int) -> str:
        if syncs_everything(round_number, self.rounds):
            return f"all {len(self.fragments)} fragments (the job's last round)"
        return f"fragment {fragment_of_round(round_number, len(self.fragments))} of {len(self.fragments)}"

    def announce(self) -> None:
        groups = tied_groups(self.global_previous)
        sizes = [
            sum(self.global_previous[group[0]].numel() for group in groups if group[0] in fragment)
            for fragment in self.fragments
        ]
        logger.info(
            "streaming: %d fragments of %s elements, mix %g (round r syncs fragment (r − 1) mod %d%s)",
            len(self.fragments),
            "/".join(str(size) for size in sizes),
            self.mix,
            len(self.fragments),
            "" if self.rounds is None else f"; round {self.rounds}, the last, syncs them all",
        )

    def finish_round(self, stats: Any) -> None:
        """After a round's steps: merge the previous round's result (waiting for it if need be), then send
        this round's fragment and go on training."""
        from worker_daemon.executors.training import send_update

        ended = self._wait_for_previous(stats)
        sent = self.round_number
        fragment = self.fragment(sent)
        delta = send_update(
            client=self.client,
            model=self.model,
            global_previous=self.global_previous,
            config=self.config,
            work_dir=self.work_dir,
            round_number=sent,
            stats=stats,
            feedback=self.feedback,
            fragment=fragment,
        )
        del delta  # no proxy: the model trains on as it is
        self.pending = PendingResult(round_number=sent, receive=self._receiver(sent, fragment))
        self.round_number = sent + 1
        self._polls = 0
        # "sent in": from the end of the steps (a wait for the previous result and its merge included) to the
        # start of the next round (bench/wan.py reads it).
        logger.info(
            "round %d: %d steps, loss %.4f, %d samples, %.1f samples/s, sent in %.2f s; "
            "round %d starts at once (streaming: %s in flight)",
            sent,
            stats.steps,
            stats.mean_loss,
            stats.samples,
            stats.samples_per_second,
            time.perf_counter() - ended,
            self.round_number,
            self.describe(sent),
        )

    def apply(self, pending: PendingResult, merged: Merged) -> str:
        """(c): mix θ_r's fragment into the live model (or load the full weights fetched instead, whole)."""
        if merged.refetched_because is None:
            mix_into(self.model, merged.weights, self.fragment(pending.round_number), self.mix)
            if syncs_everything(pending.round_number, self.rounds):
                return f"all {len(self.fragments)} fragments mixed in"
            return f"fragment {fragment_of_round(pending.round_number, len(self.fragments))} mixed in"
        load_into(self.model, merged.weights)
        return "the full weights loaded whole"
