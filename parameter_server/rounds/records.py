"""What a round is made of, open and closed: :class:`RoundResult` (published), the open round's state and
a closed round's step (:mod:`parameter_server.rounds`)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from hypha_tensors.formats import Encoding
from parameter_server.math import StateDict, StreamingMean
from parameter_server.rounds.robust import Aggregate, HeldUpdate, Verdict


@dataclass
class RoundResult:
    """A closed round. ``update`` is ``u_r`` (global names); ``path`` is the file serving it once persisted."""

    round_number: int
    update: StateDict
    participants: tuple[str, ...]
    left_out: tuple[str, ...]
    refused: dict[str, str]
    samples: int
    duration: float
    bytes_in: int
    stepped: bool
    #: Seconds after the round's first accepted update at which each participant's update was accepted.
    arrivals: dict[str, float] = field(default_factory=dict)
    path: Path | None = None
    #: :func:`~hypha_tensors.weights.digest` of θ_r, published with the result (set by the persist hook).
    digest: str | None = None
    eval_loss: float | None = None
    #: Why ``eval_loss`` is None although the job has eval data (not finite, data unavailable, …), or None.
    eval_error: str | None = None
    #: Why the round's step was thrown away (u = 0, weights and momentum kept), or None.
    discarded: str | None = None
    #: The result file's tensors in ``encoding`` (``update`` is what they decode to); None: ``update`` itself.
    encoded: StateDict | None = None
    encoding: Encoding = field(default_factory=Encoding)
    #: The fragment the round synced (0 without fragments; F: every fragment, a streaming job's last round):
    #: ``update`` holds its tensors only.
    fragment: int = 0
    #: peer → {"verdict", "reason", "norm_ratio", "cosine"} when the round verified or robustly aggregated its
    #: updates (parameter_server/rounds/robust.py); empty otherwise.
    verdicts: dict[str, dict[str, object]] = field(default_factory=dict)

    def file_tensors(self) -> StateDict:
        """The tensors of the file trainers fetch: :attr:`encoded`, or :attr:`update` when it is None."""
        return self.update if self.encoded is None else self.encoded

    def file_metadata(self) -> dict[str, str]:
        """The header metadata that says the file's encoding (``hypha.encoding``, ``hypha.block_size``)."""
        return self.encoding.metadata()


@dataclass
class OpenRound:
    number: int
    opened_at: float
    #: The running mean, or (a rule that holds its updates) the aggregate put here when the round closes.
    mean: StreamingMean | Aggregate = field(default_factory=StreamingMean)
    participants: list[str] = field(default_factory=list)
    accepted_at: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    samples: int = 0
    bytes_in: int = 0
    closing: bool = False
    timer: asyncio.TimerHandle | None = None
    #: The peers this round waits for (the coordinator's ``expected`` until :meth:`RoundCoordinator.expect`).
    expected: tuple[str, ...] = ()
    #: Those it waited for when it opened: one that died meanwhile is reported as left out.
    opened_expecting: tuple[str, ...] = ()
    first_update_at: float | None = None
    #: The L2 norms of the accepted updates, in arrival order.
    norms: list[float] = field(default_factory=list)
    #: Samples the control plane counted for each trainer in this round (its last ``Expect`` that said).
    counted: dict[str, int] = field(default_factory=dict)
    #: The fragment the round syncs (0 without fragments) and its floating-point names (sorted): an update
    #: must carry exactly those, and the round steps them alone.
    fragment: int = 0
    names: tuple[str, ...] = ()
    #: A rule that aggregates when the round closes: its accepted updates, as they came (spooled views keep
    #: their files open until then), and Σ weight · max|x| per tensor (the bound on an unclipped sum).
    held: list[HeldUpdate] = field(default_factory=list)
    magnitudes: dict[str, float] = field(default_factory=dict)
    #: Each held update's verdict, set when the round closes, and the samples of those rejected.
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    rejected_samples: int = 0


class Step(NamedTuple):
    """A closed round's outer step: u, the new weights and momentum; ``stepped`` False with u = 0 and
    everything kept when there was nothing to average or the step is ``discarded`` (why)."""

    update: StateDict
    weights: StateDict
    momentum: StateDict | None
    stepped: bool = False
    discarded: str | None = None
    #: ``update`` in the job's encoding (what the result file holds) and the new error-feedback residual.
    encoded: StateDict | None = None
    residual: StateDict | None = None
    #: Upper bounds on max|θ| and max|m| after the step (None: unknown, measured when next needed).
    bounds: tuple[float | None, float | None] = (None, None)


PersistHook = Callable[[RoundResult, StateDict, StateDict | None], Awaitable[None]]
"""Called with (result, new global weights, new momentum) before the result is published."""
FirstUpdateHook = Callable[[int, str], None]
"""Called with (round number, peer) when a round accepts its first update (must not block)."""


def aliases(tensors: StateDict | None) -> StateDict | None:
    """New tensor objects on the same memory: each one held counts as a holder of that memory
    (:meth:`BufferPool.held_elsewhere`), so what is handed out this way is never updated in place."""
    return None if tensors is None else {name: tensor.detach() for name, tensor in tensors.items()}


def record(result: RoundResult) -> RoundResult:
    """What the coordinator keeps of a published round: everything but its tensors."""
    return dataclasses.replace(result, update={}, encoded=None)


def relative(times: Mapping[str, float]) -> dict[str, float]:
    first = min(times.values(), default=0.0)
    return {peer: round(at - first, 3) for peer, at in times.items()}
