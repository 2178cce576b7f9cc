"""The round logic of the parameter server: who may send, when a round closes, and the outer step.

No HTTP here: :class:`RoundCoordinator` is driven by the server (``submit``, ``wait_result``) and by its own
timer, and hands each closed round to a ``persist`` hook (checkpoint, model file) *before* publishing it, so
a result trainers can see is always on disk. Published rounds are also put on :attr:`RoundCoordinator.published`
for the service (eval loss, round report).

Round rules (docs/training.md, step 7):

* Rounds are numbered from 1; round ``rounds_completed + 1`` is open until ``update_rounds`` rounds are done
  (or :meth:`RoundCoordinator.finish` is called, e.g. on the control plane's ``Done``).
* Each expected peer (``updates.peers``, and any peer the control plane named since) may add one update per
  round. A second one, one for a round that is not the open one, or one that arrives while the round is
  closing raises ``RoundConflict`` (409) and changes nothing: an update is never counted twice.
* The round closes when every peer it waits for sent, or ``round_timeout`` seconds after the *first accepted*
  update. The first accepted update is announced to the ``on_first_update`` hook (the service asks the
  control plane whom to wait for, and asks again while the round waits); :meth:`RoundCoordinator.expect`
  then sets the peers the round waits for (a trainer that died is dropped, a replacement added; later rounds
  start with the same) and may shorten its timeout to when they are projected to send. ``left_out`` names
  the peers the round waited for when it opened, or was told of, that it closed without. A round nobody
  sent to stays open indefinitely: trainers may need long for their inner steps.
* ``g`` is the mean of the accepted updates, weighted by their ``X-Samples`` when ``weighted`` (a missing
  count weighs 1; unweighted means every update weighs 1). Nesterov: ``(u, m) = nesterov_step(g, m)``,
  ``θ_r = θ_{r-1} + u``. If no update with a positive weight was accepted, no step is taken: ``u = 0``, the
  momentum is unchanged, and the result says ``stepped=False``.
* Floating-point *buffers* (``buffers``: BatchNorm's running statistics, named by the model) are averaged,
  not stepped: their ``u`` is ``g``, so ``θ_r`` holds the participants' (weighted) mean of their local
  values, and the momentum has no entry for them. They count in an update's norm like the parameters: a
  trainer cannot move them further than the bound lets it move anything.
* Bounds on an update (refused with ``UpdateRefused``, 422 ``refused_update``, the round unchanged): its L2
  norm (float64) must be finite and at most ``update_norm_ratio`` × the larger of the medians of the norms
  of the round's accepted updates and of the last stepped round's (:func:`~parameter_server.math.norm_limit`;
  the job's first update, or the first after a restart, is measured against the global weights' norm), and
  its sample-weighted values must not overflow the round's sum. X-Samples is bounded by the server.
* A step that is not finite (the mean, ``u``, the new weights or the momentum hold Inf or NaN: a float16
  model past its range, an absurd learning rate) is *discarded*: ``u = 0``, the weights and the momentum stay
  as they were, and the result says ``stepped=False`` and ``discarded=<reason>``. A round never ends the job.
* Only floating-point tensors are averaged and stepped, and ``u`` holds only them: other tensors (integer
  buffers such as step counters) keep their global value, and trainers neither send nor receive them.
* **Encodings** (:mod:`hypha_tensors.encoding`; docs/training.md, "Encodings"): an update may come as a
  :class:`~hypha_tensors.encoding.DecodedView` (decoded at every read): its norm and peaks are measured in one
  pass and it is added in a second, so only one decoded tensor is in memory at a time. The result is sent in
  the job's encoding too, with error feedback: the round sends ``Q(u + e)``, keeps
  ``e' = u + e − deQ(Q(u + e))`` and applies what trainers decode, ``θ_r = θ_{r−1} + deQ(Q(u + e))``, so a
  trainer that merges the result holds θ_r bit for bit. ``RoundResult.update`` is that applied (decoded)
  update, ``RoundResult.encoded`` the tensors of the result file. The residual ``e`` lives in memory only: a
  server resumed from a checkpoint starts again from ``e = 0`` (at most half a quantum per value is lost,
  once: the error of one round without feedback).
* The results of the last :data:`KEEP_RESULTS` rounds are kept (their records: the file, no tensors); an
  older one raises ``RoundPruned`` (410).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from hypha_tensors.encoding import DecodedView, EncodingError, encode, encode_with_feedback
from hypha_tensors.formats import SCALE_SUFFIX, Encoding
from parameter_server.buffers import BufferPool
from parameter_server.exceptions import (
    RoundConflict,
    RoundPruned,
    TensorRefused,
    UnknownRound,
    UpdateRefused,
)
from parameter_server.math import (
    StateDict,
    StreamingMean,
    check_finite,
    largest_magnitude,
    measure,
    nesterov_step_,
    norm_limit,
    step_bounds,
    update_norm,
)
from worker_daemon import telemetry

logger = logging.getLogger("parameter_server")

KEEP_RESULTS = 2
#: Free buffer sets kept after a round (parameter_server/buffers.py): the next round's accumulator, its new
#: weights, and its new momentum when the momentum cannot be updated in place.
SPARE_SETS = 3
#: A step whose bounds (math.step_bounds) stay under this fraction of its dtype's largest value is finite
#: without a check: a factor of 4 to spare beyond the rounding the bounds allow for.
_HEADROOM = 0.25
#: An update may be at most this many times the round's reference norm (docs/training.md). Trainers that ran
#: 3x more inner steps than the others send updates a few times larger; 1e38 tensors are ~1e37x larger.
DEFAULT_UPDATE_NORM_RATIO = 10.0


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

    def file_tensors(self) -> StateDict:
        """The tensors of the file trainers fetch: :attr:`encoded`, or :attr:`update` when it is None."""
        return self.update if self.encoded is None else self.encoded

    def file_metadata(self) -> dict[str, str]:
        """The header metadata that says the file's encoding (``hypha.encoding``, ``hypha.block_size``)."""
        return self.encoding.metadata()


@dataclass
class _OpenRound:
    number: int
    opened_at: float
    mean: StreamingMean = field(default_factory=StreamingMean)
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


class _Step(NamedTuple):
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


def _aliases(tensors: StateDict | None) -> StateDict | None:
    """New tensor objects on the same memory: each one held counts as a holder of that memory
    (:meth:`BufferPool.held_elsewhere`), so what is handed out this way is never updated in place."""
    return None if tensors is None else {name: tensor.detach() for name, tensor in tensors.items()}


def _record(result: RoundResult) -> RoundResult:
    """What the coordinator keeps of a published round: everything but its tensors."""
    return dataclasses.replace(result, update={}, encoded=None)


def _relative(times: Mapping[str, float]) -> dict[str, float]:
    first = min(times.values(), default=0.0)
    return {peer: round(at - first, 3) for peer, at in times.items()}


class RoundCoordinator:
    """Collects the open round's updates and takes the outer step; see the module docstring for the rules.

    ``weights`` are the global weights after ``rounds_completed`` rounds and ``momentum`` the outer momentum
    (None before the first step). ``last_result`` (a server resumed from a checkpoint) is served as round
    ``rounds_completed``'s result. ``persist`` may raise: the round is then not published and :attr:`failure`
    is set (the service stops; the checkpoint of the previous round stands; this coordinator's momentum may
    already be the failed round's).

    Memory: a round's model-sized tensors (the accumulator, which becomes ``u``; the new weights; the new
    momentum) come from a :class:`~parameter_server.buffers.BufferPool` and are reused once nothing holds
    them. **Weights are never mutated** while anyone holds them. The momentum is updated in place when only
    this coordinator holds it (:attr:`momentum` and ``persist`` get aliases, which count as holders) and the
    step is finite for certain: :func:`~parameter_server.math.step_bounds` of ``max|g|`` (free, from the
    mean), ``max|m|`` and ``max|θ|`` (carried over) well inside the dtype's range, with a lossless encoding;
    then no result is read to check it either, else each is checked and a bad step discarded as before.
    :meth:`result` and :meth:`wait_result` give a round's record without its tensors (its file serves
    ``u``); the full result goes to :attr:`published` only.
    """

    def __init__(
        self,
        *,
        expected: tuple[str, ...] | list[str],
        weights: Mapping[str, torch.Tensor],
        momentum: Mapping[str, torch.Tensor] | None,
        rounds_completed: int,
        update_rounds: int,
        round_timeout: float,
        weighted: bool,
        learning_rate: float,
        momentum_factor: float,
        persist: PersistHook | None = None,
        on_first_update: FirstUpdateHook | None = None,
        last_result: RoundResult | None = None,
        clock: Callable[[], float] = time.monotonic,
        update_norm_ratio: float = DEFAULT_UPDATE_NORM_RATIO,
        buffers: Collection[str] = (),
        encoding: Encoding | None = None,
    ) -> None:
        self.expected = tuple(expected)
        self._told: tuple[str, ...] = ()
        self.weights: StateDict = dict(weights)
        #: The momentum's own tensors, never handed out (:attr:`momentum` gives aliases): it may be updated in
        #: place when nothing else holds its memory.
        self._momentum: StateDict | None = None if momentum is None else dict(momentum)
        #: Where a round's model-sized tensors come from (and go back to when nothing holds them).
        self._pool = BufferPool()
        #: Held by the step (a thread) while it may write the momentum in place, and by :attr:`momentum`
        #: while it makes aliases: an alias is never made of a momentum being written.
        self._momentum_lock = threading.Lock()
        self.rounds_completed = rounds_completed
        self.update_rounds = update_rounds
        self.round_timeout = round_timeout
        self.weighted = weighted
        self.learning_rate = learning_rate
        self.momentum_factor = momentum_factor
        self._persist = persist
        self._on_first_update = on_first_update
        self._clock = clock
        self._floating = sorted(
            name for name, tensor in self.weights.items() if tensor.dtype.is_floating_point
        )
        self.update_norm_ratio = update_norm_ratio
        #: Floating-point buffers (BatchNorm's running statistics): averaged, never stepped (θ ← the mean).
        self.buffers = frozenset(buffers)
        #: The job's encoding of results (updates arrive decoded, :class:`DecodedView`, or as tensors).
        self.encoding = encoding or Encoding()
        #: The results' error-feedback residual e (empty: zero; always empty for float32). Memory only.
        self._residual: StateDict = {}
        #: The accepted norms of the last round that took a step (the next round's reference, with its own).
        self._previous_norms: list[float] = []
        #: The global weights' norm: the reference of an update when no round gives one (None: not measured
        #: since the weights changed; it is needed only then).
        self._weights_norm: float | None = None
        #: Upper bounds on max|θ| and max|m| (None: measure them when a step needs them).
        self._weights_bound: float | None = None
        self._momentum_bound: float | None = None
        #: The largest finite value of the weights' floating-point dtypes (the smallest of them).
        self._finite_max = min(
            (torch.finfo(self.weights[name].dtype).max for name in self._floating), default=math.inf
        )
        #: A name the encoding refuses (its scales' suffix): such a step is left to the encoder to refuse.
        self._scale_names = any(name.endswith(SCALE_SUFFIX) for name in self._floating)
        #: Whether the control plane's ``Expect`` replies count samples: None until one arrived.
        self.counts_reported: bool | None = None
        self._results: dict[int, RoundResult] = {}
        self._fetched: dict[int, set[str]] = {}
        if last_result is not None and last_result.round_number == rounds_completed:
            # Resumed from a checkpoint: round ``rounds_completed``'s result is served again.
            self._results[rounds_completed] = _record(last_result)
            self._fetched[rounds_completed] = set()
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()
        self._finished = rounds_completed >= update_rounds
        self._round: _OpenRound | None = None if self._finished else self._new_round(rounds_completed + 1)
        self.published: asyncio.Queue[RoundResult] = asyncio.Queue()
        """Every published round, in order, for the service's eval and report."""
        self.failure: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        """Set to the exception if closing a round failed (the service then exits 1)."""

    # --- state -----------------------------------------------------------------------------------------------

    @property
    def momentum(self) -> StateDict | None:
        """The outer momentum after the last round (None before the first step): aliases of the coordinator's
        tensors. While anyone holds them, the next round writes its momentum elsewhere: they never change."""
        with self._momentum_lock:
            return _aliases(self._momentum)

    @property
    def pool(self) -> BufferPool:
        """The buffer pool of the round's model-sized tensors (for tests and benchmarks)."""
        return self._pool

    @property
    def open_round(self) -> int | None:
        """The round accepting updates (also while it is closing), or None once the job is finished."""
        return None if self._round is None else self._round.number

    @property
    def received(self) -> list[str]:
        """Peers whose update the open round accepted, in arrival order."""
        return [] if self._round is None else list(self._round.participants)

    @property
    def finished(self) -> bool:
        return self._finished

    def result(self, round_number: int) -> RoundResult | None:
        """Round ``round_number``'s record (its file, participants, digest; no tensors), if kept."""
        return self._results.get(round_number)

    def counted(self, round_number: int, peer: str) -> int | None:
        """The samples the control plane counted for ``peer`` in open round ``round_number``, if it said."""
        if self._round is None or self._round.number != round_number:
            return None
        return self._round.counted.get(peer)

    def _new_round(self, number: int) -> _OpenRound:
        # The control plane's latest word on who trains, else everyone the job started with.
        expected = self._told or self.expected
        return _OpenRound(
            number,
            self._clock(),
            mean=StreamingMean(self._pool.take),
            expected=expected,
            opened_expecting=expected,
        )

    def _check_round(self, round_number: int) -> None:
        if round_number < 1 or round_number > self.update_rounds:
            raise UnknownRound(f"round {round_number} is not a round of this job (1..{self.update_rounds})")

    # --- updates ---------------------------------------------------------------------------------------------

    def check_can_submit(self, peer: str, round_number: int) -> None:
        """Raise ``UnknownRound`` or ``RoundConflict`` unless ``peer`` may send an update for ``round_number``
        now. Cheap: the server calls it before reading a body, and ``submit`` checks again."""
        self._check_round(round_number)
        current = self._round
        if current is None or round_number < current.number:
            raise RoundConflict(f"round {round_number} is closed")
        if round_number > current.number:
            raise RoundConflict(f"round {round_number} is not open yet (round {current.number} is)")
        if current.closing:
            raise RoundConflict(f"round {round_number} is closed")
        if peer in current.participants:
            raise RoundConflict(f"{peer} already sent its update for round {round_number}")

    def record_refusal(self, peer: str, round_number: int, reason: str) -> None:
        """Note that ``peer``'s update for the open round was refused (reported in ``refused``)."""
        if self._round is not None and self._round.number == round_number and not self._round.closing:
            self._round.refused[peer] = reason

    def count_bytes_in(self, round_number: int, size: int) -> None:
        """Add ``size`` body bytes received for ``round_number`` (accepted or not) to its report."""
        if self._round is not None and self._round.number == round_number:
            self._round.bytes_in += size

    async def submit(
        self, peer: str, round_number: int, update: Mapping[str, torch.Tensor], samples: int | None
    ) -> None:
        """Add ``peer``'s update (already validated against the global signature) to the open round.

        Raises ``RoundConflict``/``UnknownRound`` like :meth:`check_can_submit` (also when the round closed
        while the update was being read); ``UpdateRefused`` (noted in the round's ``refused``, the round
        unchanged) if its norm is out of bounds or its weighted values would overflow the round's sum (see the
        module docstring). Closing the round, if this was the last expected update, runs in the background.
        """
        async with self._lock:
            self.check_can_submit(peer, round_number)
            current = self._round
            assert current is not None
            weight = float(samples if samples is not None else 1) if self.weighted else 1.0
            # A decoded view stays one: reading its tensors here would decode them all at once.
            floating: Mapping[str, torch.Tensor] = (
                update.restrict(self._floating)
                if isinstance(update, DecodedView)
                else {name: update[name] for name in self._floating}
            )
            try:
                # A thread: measuring and adding a large model's tensors would stall every other request.
                norm = await asyncio.to_thread(self._measure_and_add, current, floating, weight)
            except UpdateRefused as refusal:
                current.refused[peer] = str(refusal)
                logger.warning("round %d: update from %s refused: %s", round_number, peer, refusal)
                raise
            current.norms.append(norm)
            current.participants.append(peer)
            current.accepted_at[peer] = self._clock()
            current.refused.pop(peer, None)
            current.samples += samples or 0
            logger.info(
                "round %d: update from %s accepted (%d/%d, weight %g)",
                round_number,
                peer,
                len(current.participants),
                len(current.expected),
                weight,
            )
            if set(current.expected) <= set(current.participants):
                self._start_closing(current, "every expected trainer sent its update")
            elif len(current.participants) == 1:
                current.first_update_at = self._clock()
                current.timer = asyncio.get_running_loop().call_later(
                    self.round_timeout,
                    self._on_timeout,
                    current,
                    f"round_timeout {self.round_timeout:g} s after the first update",
                )
                if self._on_first_update is not None:
                    self._on_first_update(current.number, peer)

    def _measure_and_add(
        self, current: _OpenRound, update: Mapping[str, torch.Tensor], weight: float
    ) -> float:
        """Check ``update``'s norm against the round's bound and add it to the round's mean; its norm.
        ``UpdateRefused`` (nothing added) if it is out of bounds or cannot be decoded. Runs in a thread,
        under the lock. Each tensor is read twice: measured (norm, largest value), then added."""
        try:
            norm, peaks = measure(update)
        except EncodingError as error:
            raise UpdateRefused(str(error)) from None
        limit = norm_limit(
            current.norms, self._previous_norms, fallback=self._reference_norm, ratio=self.update_norm_ratio
        )
        if not norm <= limit:  # also NaN
            raise UpdateRefused(
                f"the update's L2 norm {norm:.6g} is over this round's bound {limit:.6g} "
                f"({self.update_norm_ratio:g}x the reference norm)"
            )
        # A decoded view says its signatures without decoding; tensors are checked as they are.
        signatures = (
            {name: update.signature(name) for name in update} if isinstance(update, DecodedView) else None
        )
        try:
            current.mean.add(update, weight, signatures=signatures, peaks=peaks)
        except (TensorRefused, EncodingError) as error:
            raise UpdateRefused(str(error)) from None
        return norm

    def _reference_norm(self) -> float:
        """The global weights' norm (measured once per weights, when an update has no other reference)."""
        if self._weights_norm is None:
            self._weights_norm = update_norm({name: self.weights[name] for name in self._floating})
        return self._weights_norm

    def expect(
        self,
        round_number: int,
        peers: list[str] | tuple[str, ...],
        timeout: float | None,
        samples: Mapping[str, int] | None = None,
    ) -> None:
        """The control plane's word on the open round: wait only for ``peers`` (the job's trainers still
        training: one that died is dropped, a replacement added — it may send from now on), and close at most
        ``timeout`` seconds from now (never later than ``round_timeout`` after the first update). ``samples``,
        when the control plane counts them: the samples each trainer reported for this round so far (the most
        its X-Samples may claim). Ignored unless round ``round_number`` is open."""
        self.counts_reported = samples is not None
        current = self._round
        if current is None or current.number != round_number or current.closing:
            return
        if samples is not None:
            current.counted = dict(samples)
        told = tuple(dict.fromkeys(peers))
        if told != current.expected:
            logger.info("round %d: the control plane expects %s", round_number, list(told))
        current.expected = self._told = told
        # A replacement trainer may send from now on (and in later rounds).
        self.expected = tuple(dict.fromkeys([*self.expected, *told]))
        if set(current.expected) <= set(current.participants) and current.participants:
            self._start_closing(current, "every trainer still training sent its update")
            return
        if timeout is None or current.first_update_at is None:
            return
        left = self.round_timeout - (self._clock() - current.first_update_at)
        if timeout < left:
            if current.timer is not None:
                current.timer.cancel()
            current.timer = asyncio.get_running_loop().call_later(
                max(0.0, timeout),
                self._on_timeout,
                current,
                f"the expected trainers were due {timeout:.1f} s after the first update's report",
            )

    def _on_timeout(self, current: _OpenRound, why: str) -> None:
        if self._round is current and not current.closing:
            self._start_closing(current, why)

    def _start_closing(self, current: _OpenRound, why: str) -> None:
        current.closing = True
        if current.timer is not None:
            current.timer.cancel()
        logger.info("round %d closes: %s", current.number, why)
        task = asyncio.create_task(self._close(current), name=f"close round {current.number}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _kept(self, discarded: str | None = None) -> _Step:
        """No step: u = 0, the weights and the momentum kept (zeros encode exactly in every encoding; the
        residual is kept for the next step)."""
        zeros = {name: torch.zeros_like(self.weights[name]) for name in self._floating}
        return _Step(
            zeros,
            self.weights,
            self._momentum,
            discarded=discarded,
            encoded=encode(zeros, self.encoding),
            bounds=(self._weights_bound, self._momentum_bound),
        )

    def _step(self, current: _OpenRound) -> _Step:
        """The closed round's outer step (or none: u = 0, weights and momentum kept); runs in a thread.
        With a lossy encoding the step applied is the decoded ``Q(u + e)`` (see the module docstring)."""
        if current.mean.count == 0 or current.mean.total_weight == 0:
            return self._kept()
        bounds = self._bounds(current.mean.bound()) if not self.encoding.lossy else None
        gradient = current.mean.take()  # the round is over: no copy, the accumulator becomes u
        with self._momentum_lock:
            update, momentum = nesterov_step_(
                gradient=gradient,
                momentum=self._momentum,
                learning_rate=self.learning_rate,
                momentum_factor=self.momentum_factor,
                averaged=self.buffers,
                momentum_out=self._momentum_target(gradient, in_place=bounds is not None),
            )
        if bounds is not None:  # finite for certain, and float32 sends u as it is
            new_weights = self._add_to_weights(update)
            return _Step(
                update, new_weights, momentum, stepped=True, encoded=dict(update), residual={}, bounds=bounds
            )
        # Checked here rather than when saving: a step that is not finite is thrown away, the job goes on.
        try:
            check_finite(update)
        except TensorRefused as error:
            return self._kept(f"the outer step is not finite ({error.name!r} {error.reason})")
        try:
            sent = encode_with_feedback(update, self._residual, self.encoding, keep_decoded=True)
        except EncodingError as error:  # past float16's range
            return self._kept(f"the outer step cannot be sent as {self.encoding} ({error})")
        assert sent.decoded is not None
        update = sent.decoded  # what trainers decode, and so what is applied here
        new_weights = self._add_to_weights(update)
        for what, tensors in (
            ("the new weights are", {name: new_weights[name] for name in self._floating}),
            ("the new momentum is", momentum),
        ):
            try:
                check_finite(tensors)
            except TensorRefused as error:
                return self._kept(f"{what} not finite ({error.name!r} {error.reason})")
        # Bounds unknown (or too large to prove anything): measured again when the next step needs them.
        return _Step(
            update, new_weights, momentum, stepped=True, encoded=sent.encoded, residual=sent.residual
        )

    def _bounds(self, gradient_bound: float) -> tuple[float, float] | None:
        """(bound on max|θ'|, bound on max|m'|) of a step whose mean is bounded by ``gradient_bound``, if they
        prove every result of the step finite (see the class docstring); else None. Measures max|θ| and
        max|m| (one ``aminmax`` pass) when no earlier step bounds them."""
        if self._weights_bound is None:
            self._weights_bound = max(
                (largest_magnitude(self.weights[name]) for name in self._floating), default=0.0
            )
        if self._momentum_bound is None:
            tensors = () if self._momentum is None else self._momentum.values()
            self._momentum_bound = max((largest_magnitude(tensor) for tensor in tensors), default=0.0)
        bounds = step_bounds(
            gradient=gradient_bound,
            momentum=None if self._momentum is None else self._momentum_bound,
            weights=self._weights_bound,
            learning_rate=self.learning_rate,
            momentum_factor=self.momentum_factor,
            averaged=bool(self.buffers),
        )
        if not max(bounds) <= _HEADROOM * self._finite_max or self._scale_names:  # also NaN
            return None
        return bounds.weights, bounds.momentum

    def _momentum_target(self, gradient: StateDict, *, in_place: bool) -> StateDict | None:
        """Where :func:`nesterov_step_` writes the new momentum: the momentum itself when ``in_place`` (the
        step cannot be discarded) and nothing but this coordinator holds it, else a set from the pool."""
        wanted = {
            name: (tuple(tensor.shape), tensor.dtype)
            for name, tensor in gradient.items()
            if name not in self.buffers and tensor.dtype in (torch.float32, torch.float64)
        }
        if not wanted or any(tensor.device.type != "cpu" for tensor in gradient.values()):
            return None
        momentum = self._momentum
        if (
            in_place
            and momentum is not None
            and momentum.keys() == wanted.keys()
            and self._pool.owns(momentum)
            and not self._pool.held_elsewhere(momentum)
        ):
            return momentum
        return self._pool.take(wanted)

    def _add_to_weights(self, update: StateDict) -> StateDict:
        """``θ + u`` as new weights (the same operation as ``tensor + u``, into a set from the pool); names
        without an update keep their tensor."""
        wanted = {
            name: (tuple(self.weights[name].shape), self.weights[name].dtype)
            for name in self._floating
            if name in update
            and update[name].dtype == self.weights[name].dtype
            and self.weights[name].device.type == "cpu" == update[name].device.type
        }
        targets = self._pool.take(wanted) if wanted else {}
        new_weights = {}
        for name, tensor in self.weights.items():
            if name not in update:
                new_weights[name] = tensor
            elif name in targets:
                new_weights[name] = torch.add(tensor, update[name], out=targets[name])
            else:
                new_weights[name] = tensor + update[name]
        return new_weights

    async def _close(self, current: _OpenRound) -> None:
        # One span per round: its step and checkpoint, with what the round was (duration: open → close).
        with telemetry.span("round", **{"hypha.round": current.number}) as traced:
            closed = await self._close_round(current)
            if closed is None:
                telemetry.annotate(traced, **{"hypha.failed": True})
            else:
                telemetry.annotate(
                    traced,
                    **{
                        "hypha.participants": list(closed.participants),
                        "hypha.participant_count": len(closed.participants),
                        "hypha.left_out": list(closed.left_out),
                        "hypha.refused_count": len(closed.refused),
                        "hypha.samples": closed.samples,
                        "hypha.bytes_in": closed.bytes_in,
                        "hypha.duration_s": closed.duration,
                        "hypha.stepped": closed.stepped,
                        "hypha.discarded": closed.discarded,
                    },
                )
        if closed is not None:
            async with self._changed:
                self._changed.notify_all()

    async def _close_round(self, current: _OpenRound) -> RoundResult | None:
        """Step, persist and publish the round; its result, or None if that failed (:attr:`failure` set)."""
        try:
            async with self._lock:
                step = await asyncio.to_thread(self._step, current)
                result = RoundResult(
                    round_number=current.number,
                    update=step.update,
                    participants=tuple(current.participants),
                    left_out=tuple(
                        peer
                        for peer in dict.fromkeys([*current.opened_expecting, *current.expected])
                        if peer not in current.participants
                    ),
                    refused=dict(current.refused),
                    samples=current.samples,
                    duration=round(self._clock() - current.opened_at, 3),
                    bytes_in=current.bytes_in,
                    stepped=step.stepped,
                    arrivals=_relative(current.accepted_at),
                    discarded=step.discarded,
                    encoded=step.encoded,
                    encoding=self.encoding,
                )
                if step.discarded is not None:
                    logger.error("round %d: its step is discarded, u = 0: %s", current.number, step.discarded)
                elif not step.stepped:
                    logger.warning("round %d closed without a usable update: u = 0", current.number)
                if self._persist is not None:
                    await self._persist(result, step.weights, _aliases(step.momentum))
                if step.weights is not self.weights:
                    self._weights_norm = None
                self.weights, self._momentum = step.weights, step.momentum
                self._weights_bound, self._momentum_bound = step.bounds
                if step.residual is not None:
                    self._residual = step.residual
                if step.stepped:
                    self._previous_norms = list(current.norms)
                del step
                self._publish(result)
        except Exception as error:
            logger.exception("closing round %d failed", current.number)
            if not self.failure.done():
                self.failure.set_result(error)
            return None
        return result

    def _publish(self, result: RoundResult) -> None:
        # A record without tensors: the file serves u, and u's memory goes back to the pool once the
        # published result is dropped by whoever reads it.
        self._results[result.round_number] = _record(result)
        self._fetched.setdefault(result.round_number, set())
        for old in [number for number in self._results if number <= result.round_number - KEEP_RESULTS]:
            del self._results[old]
        self.rounds_completed = result.round_number
        if self._finished or self.rounds_completed >= self.update_rounds:
            self._finished = True
            self._round = None
        else:
            self._round = self._new_round(result.round_number + 1)
        self.published.put_nowait(result)
        self._pool.trim(SPARE_SETS)
        logger.info(
            "round %d published: participants %s, left out %s, refused %s",
            result.round_number,
            list(result.participants),
            list(result.left_out),
            result.refused,
        )

    def finish(self) -> None:
        """Accept no more updates (the control plane said ``Done``). A round being closed still publishes."""
        self._finished = True
        if self._round is not None and not self._round.closing:
            if self._round.timer is not None:
                self._round.timer.cancel()
            self._round = None

    # --- results ---------------------------------------------------------------------------------------------

    async def wait_result(self, round_number: int, timeout: float) -> RoundResult | None:
        """Round ``round_number``'s result, waiting up to ``timeout`` seconds for it to close; None if it is
        still open then. ``UnknownRound`` outside ``1..update_rounds`` or past the round the job finished
        with; ``RoundPruned`` if the result is no longer kept."""
        self._check_round(round_number)

        def ready() -> bool:
            return round_number <= self.rounds_completed or (self._finished and self._round is None)

        if not ready() and timeout > 0:
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait_for(ready), timeout)
        if round_number in self._results:
            return self._results[round_number]
        if round_number <= self.rounds_completed:
            raise RoundPruned(
                f"round {round_number}'s result is no longer kept (last {KEEP_RESULTS} rounds are)"
            )
        if self._finished and self._round is None:
            raise UnknownRound(f"the job finished after round {self.rounds_completed}")
        return None

    async def mark_fetched(self, peer: str, round_number: int) -> None:
        """``peer`` received round ``round_number``'s result."""
        if round_number in self._fetched:
            self._fetched[round_number].add(peer)
            async with self._changed:
                self._changed.notify_all()

    def _last_round_fetched(self) -> bool:
        last = self._results.get(self.rounds_completed)
        if last is None:
            return True
        return set(last.participants) <= self._fetched.get(last.round_number, set())

    async def wait_last_result_fetched(self, timeout: float) -> bool:
        """Wait until every participant of the last round fetched its result (True) or ``timeout`` (False)."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(self._last_round_fetched), timeout)
            except TimeoutError:
                return False
        return True

    async def aclose(self) -> None:
        """Cancel the timer and any round being closed (shutdown)."""
        if self._round is not None and self._round.timer is not None:
            self._round.timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
