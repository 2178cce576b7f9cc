"""Streaming DiLoCo: a trainer sends one fragment of the model a round and trains on without waiting
(docs/training.md, "Overlap: streaming"; Douillard et al., arXiv 2501.18512).

For a job whose trainer JSON carries ``"overlap": {"mode": "streaming", "fragments": F, "mix": α}``. The model's
tensors are split into F fragments once, at start, from the trainer's global weights (their names, sizes and
tied groups: :func:`hypha_tensors.fragments.partition`, the very rule the parameter server applies to its
canonical names and aliases); round r (numbered from 1) syncs fragment f = (r − 1) mod F only. Notation as in
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
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hypha_tensors.fragments import FragmentError, fragment_of_round, partition_state
from worker_daemon.executors.overlap import JobFinished, PendingResult
from worker_daemon.executors.pseudo_gradient import StateDict, float_state, load_into, tied_groups

if TYPE_CHECKING:
    from accelerate import Accelerator

    from hypha_tensors.encoding import ErrorFeedback
    from worker_daemon.executors.bridge_client import BridgeClient, ReceiveStream
    from worker_daemon.executors.consistency import Merged, Published
    from worker_daemon.executors.job import TrainConfig

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


class StreamingRounds:
    """The outer steps of a streaming trainer (the module docstring's a–c): :meth:`poll` between steps,
    :meth:`finish_round` at the end of each round's steps. ``global_previous`` is the full θ of the last
    merged round; ``round_number`` the round being trained (renumbered after a fetch of the full weights);
    ``fragments`` the names of each fragment, computed once here."""

    def __init__(
        self,
        *,
        client: BridgeClient,
        side_client: BridgeClient,
        results: ReceiveStream,
        model: torch.nn.Module,
        config: TrainConfig,
        work_dir: Path,
        global_previous: StateDict,
        published_dtypes: dict[str, torch.dtype],
        feedback: ErrorFeedback | None,
        round_number: int,
    ) -> None:
        assert config.overlap is not None and config.overlap.streaming
        assert config.overlap.fragments is not None and config.overlap.mix is not None
        self.client = client
        #: Used only by the background thread (a refetch): the bridge client is not thread-safe.
        self.side_client = side_client
        self.results = results
        self.model = model
        self.config = config
        self.work_dir = work_dir
        self.global_previous = global_previous
        self.published_dtypes = published_dtypes
        self.feedback = feedback
        self.round_number = round_number
        self.mix = config.overlap.mix
        self.fragments = fragments_of(global_previous, config.overlap.fragments)
        self.pending: PendingResult | None = None
        self._polls = 0

    def fragment(self, round_number: int) -> frozenset[str]:
        """The names round ``round_number`` syncs."""
        return self.fragments[fragment_of_round(round_number, len(self.fragments))]

    def poll(self) -> None:
        """Between two steps: merge the pending result if it has come (raises :class:`JobFinished`)."""
        self._polls += 1
        if self.pending is not None and self.pending.done():
            self.merge(steps=self._polls - 1, waited=0.0)

    def finish_round(self, stats: Any) -> None:
        """After a round's steps: merge the previous round's result (waiting for it if need be), then send
        this round's fragment and go on training."""
        from worker_daemon.executors.training import send_update

        ended = time.perf_counter()
        if self.pending is not None:
            self.pending.wait()
            self.merge(steps=stats.steps, waited=time.perf_counter() - ended)
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
            "round %d starts at once (streaming: fragment %d of %d in flight)",
            sent,
            stats.steps,
            stats.mean_loss,
            stats.samples,
            stats.samples_per_second,
            time.perf_counter() - ended,
            self.round_number,
            fragment_of_round(sent, len(self.fragments)),
            len(self.fragments),
        )

    def _receiver(
        self, round_number: int, fragment: frozenset[str]
    ) -> Callable[[], tuple[Merged, Published | None]]:
        from worker_daemon.executors.training import receive_result

        global_previous, dtypes = self.global_previous, dict(self.published_dtypes)

        def receive() -> tuple[Merged, Published | None]:
            return receive_result(
                client=self.side_client,
                results=self.results,
                config=self.config,
                work_dir=self.work_dir,
                round_number=round_number,
                global_previous=global_previous,
                published_dtypes=dtypes,
                fragment=fragment,
            )

        return receive

    def merge(self, *, steps: int, waited: float) -> None:
        """(c): mix θ_r's fragment into the live model (or load the full weights fetched instead, whole),
        keep θ_r, send ``"update-received"``."""
        pending = self.pending
        assert pending is not None
        merged, publication = pending.wait()
        self.pending = None
        if merged.refetched_because is None:
            fragment = self.fragment(pending.round_number)
            mix_into(self.model, merged.weights, fragment, self.mix)
            how = f"fragment {fragment_of_round(pending.round_number, len(self.fragments))} mixed in"
        else:
            load_into(self.model, merged.weights)
            how = "the full weights loaded whole"
        del pending
        self.global_previous = merged.weights
        if publication is not None:
            self.published_dtypes.clear()
            self.published_dtypes.update(publication.dtypes)
        # After the full weights were fetched the round in progress is the one after theirs.
        self.round_number = merged.rounds_completed + 1
        reply = self.client.status("update-received")
        logger.info(
            "round %d merged after %d steps of round %d%s, %s%s",
            merged.rounds_completed,
            steps,
            self.round_number,
            f" (waited {waited:.2f} s)" if waited > 0 else "",
            how,
            "" if merged.digest is None else f", weights {merged.digest} (checked)",
        )
        if reply["type"] == "Done":
            raise JobFinished(merged.rounds_completed)


def train_streaming(
    *,
    rounds: StreamingRounds,
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_schedule: Any | None,
    batches: Iterator[dict[str, torch.Tensor]],
    slowdown: float,
    job_id: str | None,
) -> int:
    """Run a streaming job to its end: rounds of steps (merging the previous round's result between two of
    them), each ended by :meth:`StreamingRounds.finish_round`; 0 when the scheduler said ``Done``."""
    from worker_daemon.executors.training import EXIT_OK, run_round

    sizes = [
        sum(rounds.global_previous[group[0]].numel() for group in tied_groups(rounds.global_previous)
            if group[0] in fragment)
        for fragment in rounds.fragments
    ]  # fmt: skip
    logger.info(
        "streaming: %d fragments of %s elements, mix %g (round r syncs fragment (r − 1) mod %d)",
        len(rounds.fragments),
        "/".join(str(size) for size in sizes),
        rounds.mix,
        len(rounds.fragments),
    )
    try:
        while True:
            stats = run_round(
                accelerator=accelerator,
                client=rounds.client,
                model=model,
                optimizer=optimizer,
                lr_schedule=lr_schedule,
                batches=batches,
                input_names=rounds.config.model.input_names,
                round_number=lambda: rounds.round_number,
                slowdown=slowdown,
                between_steps=rounds.poll,
            )
            rounds.finish_round(stats)
    except JobFinished as finished:
        logger.info("job %s: done after %d rounds", job_id, finished.rounds)
        return EXIT_OK
