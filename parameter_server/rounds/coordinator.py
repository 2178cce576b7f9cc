"""The round coordinator (:mod:`parameter_server.rounds`): who may send, when a round closes, and publishing
its result; the step itself is :mod:`parameter_server.rounds.step`'s."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import torch

from hypha_tensors.encoding import DecodedView, EncodingError
from hypha_tensors.formats import SCALE_SUFFIX, Encoding
from hypha_tensors.fragments import fragment_of_round, syncs_everything
from parameter_server.aggregation import ACCEPTED, REJECTED, AggregationRule
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
    measure,
    norm_limit,
    update_norm,
)
from parameter_server.rounds import robust
from parameter_server.rounds.discard import OwnerDiscard, PreviousRound
from parameter_server.rounds.records import (
    FirstUpdateHook,
    OpenRound,
    PersistHook,
    RoundResult,
    Step,
    aliases,
    record,
    relative,
)
from parameter_server.rounds.robust import HeldUpdate, Validation
from parameter_server.rounds.validation import Evaluate, LossChecks
from worker_daemon import telemetry

logger = logging.getLogger("parameter_server")

KEEP_RESULTS = 2
#: Free buffer sets kept after a round (parameter_server/buffers.py): the next round's accumulator, its new
#: weights, and its new momentum when the momentum cannot be updated in place.
SPARE_SETS = 3
#: An update may be at most this many times the round's reference norm (docs/training.md). Trainers that ran
#: 3x more inner steps than the others send updates a few times larger; 1e38 tensors are ~1e37x larger.
DEFAULT_UPDATE_NORM_RATIO = 10.0


class RoundCoordinator(OwnerDiscard):
    """Collects the open round's updates and takes the outer step; see the package docstring for the rules.

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

    ``fragments`` (a streaming job): the names of each fragment of the model, as
    :func:`hypha_tensors.fragments.partition` gives them (canonical names; others, such as aliases, are left
    out); every floating-point tensor must be in exactly one, and each must hold one (``ValueError``).
    Round r then takes the updates of fragment ``(r − 1) mod F``'s tensors only (:meth:`round_names`) and
    steps them alone; the job's last round (``update_rounds``) takes and steps every fragment's, each with its
    own momentum. None: one fragment, every floating-point tensor each round.

    ``evaluate`` (a job with eval data): the held-out loss of some weights, for the rule's validation step
    and its discard rule (:mod:`parameter_server.rounds.validation`).
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
        fragments: Sequence[Iterable[str]] | None = None,
        aggregation: AggregationRule | None = None,
        evaluate: Evaluate | None = None,
    ) -> None:
        self.expected = tuple(expected)
        #: How the round's updates become its mean, and whether each is verified first.
        self.aggregation = aggregation or AggregationRule()
        #: The held-out loss checks of a closing round (validation, discard), when the rule asks for them.
        self._checks = LossChecks(self.aggregation, evaluate, learning_rate=learning_rate)
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
        #: The floating-point names of each fragment (one fragment, every such name, without fragments).
        self._fragments = _fragment_names(self._floating, fragments)
        self.update_norm_ratio = update_norm_ratio
        #: Floating-point buffers (BatchNorm's running statistics): averaged, never stepped (θ ← the mean).
        self.buffers = frozenset(buffers)
        #: The job's encoding of results (updates arrive decoded, :class:`DecodedView`, or as tensors).
        self.encoding = encoding or Encoding()
        #: The results' error-feedback residual e (empty: zero; always empty for float32). Memory only.
        self._residual: StateDict = {}
        #: Per fragment, the accepted norms of the last round of it that took a step (the reference of its
        #: next round, with that round's own): the fragments of a model differ in size.
        self._previous_norms: dict[int, list[float]] = {}
        #: Per fragment, the global weights' norm over its tensors: the reference of an update when no round
        #: gives one (absent: not measured since they changed; it is needed only then).
        self._weights_norms: dict[int, float] = {}
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
        #: An owner's discard of the last closed round n, taken when round n + 1 closes: (n, what loads round
        #: n − 1's weights and momentum, run in the closing thread) — :meth:`request_discard`.
        self._discard: tuple[int, PreviousRound] | None = None
        if last_result is not None and last_result.round_number == rounds_completed:
            # Resumed from a checkpoint: round ``rounds_completed``'s result is served again.
            self._results[rounds_completed] = record(last_result)
            self._fetched[rounds_completed] = set()
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()
        self._finished = rounds_completed >= update_rounds
        self._round: OpenRound | None = None if self._finished else self._new_round(rounds_completed + 1)
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
            return aliases(self._momentum)

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

    def _new_round(self, number: int) -> OpenRound:
        # The control plane's latest word on who trains, else everyone the job started with.
        expected = self._told or self.expected
        return OpenRound(
            number,
            self._clock(),
            mean=StreamingMean(self._pool.take),
            expected=expected,
            opened_expecting=expected,
            fragment=self.round_fragment(number),
            names=self.round_names(number),
        )

    def _check_round(self, round_number: int) -> None:
        if round_number < 1 or round_number > self.update_rounds:
            raise UnknownRound(f"round {round_number} is not a round of this job (1..{self.update_rounds})")

    # --- fragments -------------------------------------------------------------------------------------------

    @property
    def fragment_count(self) -> int:
        """F: the fragments rounds take turns on (1 without fragments: every round syncs every tensor)."""
        return len(self._fragments)

    def fragment_of(self, round_number: int) -> int:
        """The fragment round ``round_number`` (from 1) syncs: ``(round_number − 1) mod F``."""
        return fragment_of_round(round_number, len(self._fragments))

    def syncs_everything(self, round_number: int) -> bool:
        """Whether round ``round_number`` of a streaming job syncs every fragment: the job's last round does
        (docs/training.md, "Overlap: streaming")."""
        return self.streaming and syncs_everything(round_number, self.update_rounds)

    def round_fragment(self, round_number: int) -> int:
        """The fragment round ``round_number`` syncs (:meth:`fragment_of`), or F for every fragment (a
        streaming job's last round)."""
        if self.syncs_everything(round_number):
            return len(self._fragments)
        return self.fragment_of(round_number)

    def round_names(self, round_number: int) -> tuple[str, ...]:
        """The floating-point (canonical) names an update for round ``round_number`` carries, sorted: its
        fragment's (every floating-point name without fragments, and in a streaming job's last round)."""
        if self.syncs_everything(round_number):
            return tuple(self._floating)
        return self._fragments[self.fragment_of(round_number)]

    def check_names(self, round_number: int, names: Iterable[str]) -> None:
        """In a streaming job, ``TensorRefused`` unless the model's floating-point names among ``names``
        (canonical) are exactly round ``round_number``'s fragment's, saying which fragment the round syncs:
        an update of another fragment's tensors, or of the whole model, is refused. Names that are not the
        model's, or not floating point, are left to the signature check. Nothing to check without fragments."""
        if not self.streaming:
            return
        expected = self.round_names(round_number)
        given = set(names)
        if self.syncs_everything(round_number):
            where = (
                f"round {round_number} syncs every fragment (the job's last round, {len(expected)} tensors)"
            )
        else:
            fragment = self.fragment_of(round_number)
            where = (
                f"round {round_number} syncs fragment {fragment + 1} of {len(self._fragments)} "
                f"({len(expected)} tensors)"
            )
        missing = sorted(set(expected) - given)
        if missing:
            raise TensorRefused(missing[0], f"missing: {where}")
        outside = sorted((given - set(expected)) & set(self._floating))
        if outside:
            what = f"{len(outside)} tensors outside it" if len(outside) > 1 else "a tensor outside it"
            raise TensorRefused(outside[0], f"not in this round's fragment: {where}, the update has {what}")

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
            self._close_if_answered(self._round)

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
        unchanged) if its names are not the round's fragment's (:meth:`check_names`), its norm is out of
        bounds or its weighted values would overflow the round's sum (see the package docstring). Closing the round, if this was the last expected update, runs in the background.
        """
        async with self._lock:
            self.check_can_submit(peer, round_number)
            current = self._round
            assert current is not None
            weight = float(samples if samples is not None else 1) if self.weighted else 1.0
            try:
                self.check_names(round_number, update)
            except TensorRefused as error:
                current.refused[peer] = str(error)
                logger.warning("round %d: update from %s refused: %s", round_number, peer, error)
                self._close_if_answered(current)
                raise UpdateRefused(str(error)) from None
            # A decoded view stays one: reading its tensors here would decode them all at once.
            floating: Mapping[str, torch.Tensor] = (
                update.restrict(current.names)
                if isinstance(update, DecodedView)
                else {name: update[name] for name in current.names}
            )
            try:
                # A thread: measuring and adding a large model's tensors would stall every other request.
                if self.aggregation.holds_updates:
                    # Kept as it came (a spooled view keeps its file) until the round closes.
                    norm, peaks = await asyncio.to_thread(self._measure_and_hold, current, floating, weight)
                    current.held.append(HeldUpdate(peer, floating, weight, norm, peaks, samples or 0))
                else:
                    norm = await asyncio.to_thread(self._measure_and_add, current, floating, weight)
            except UpdateRefused as refusal:
                current.refused[peer] = str(refusal)
                logger.warning("round %d: update from %s refused: %s", round_number, peer, refusal)
                self._close_if_answered(current)
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
            if not self._close_if_answered(current) and len(current.participants) == 1:
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
        self, current: OpenRound, update: Mapping[str, torch.Tensor], weight: float
    ) -> float:
        """Check ``update``'s norm against the round's bound and add it to the round's mean; its norm.
        ``UpdateRefused`` (nothing added) if it is out of bounds or cannot be decoded. Runs in a thread,
        under the lock. Each tensor is read twice: measured (norm, largest value), then added."""
        norm, peaks = self._measure(current, update)
        # A decoded view says its signatures without decoding; tensors are checked as they are.
        signatures = (
            {name: update.signature(name) for name in update} if isinstance(update, DecodedView) else None
        )
        try:
            current.mean.add(update, weight, signatures=signatures, peaks=peaks)
        except (TensorRefused, EncodingError) as error:
            raise UpdateRefused(str(error)) from None
        return norm

    def _measure_and_hold(
        self, current: OpenRound, update: Mapping[str, torch.Tensor], weight: float
    ) -> tuple[float, dict[str, float]]:
        """For a round that aggregates when it closes (:mod:`parameter_server.rounds.robust`): the bounds of
        :meth:`_measure_and_add` (norm, and a weighted sum that cannot overflow even unclipped), nothing added:
        the caller holds the update. Its norm and largest values. Runs in a thread, under the lock."""
        norm, peaks = self._measure(current, update)
        if set(update) != set(current.names):
            missing = sorted(set(current.names) - set(update))
            name = missing[0] if missing else sorted(set(update) - set(current.names))[0]
            raise UpdateRefused(f"tensor {name!r}: {'missing from' if missing else 'unknown in'} this update")
        magnitudes = {}
        for name in current.names:
            dtype = torch.promote_types(self.weights[name].dtype, torch.float32)
            magnitude = current.magnitudes.get(name, 0.0) + weight * peaks.get(name, 0.0)
            if magnitude > torch.finfo(dtype).max:
                raise UpdateRefused(
                    f"tensor {name!r}: weight {weight:g} × its largest value {peaks.get(name, 0.0):g} would "
                    f"overflow the round's {str(dtype).removeprefix('torch.')} sum"
                )
            magnitudes[name] = magnitude
        current.magnitudes.update(magnitudes)
        return norm, peaks

    def _measure(
        self, current: OpenRound, update: Mapping[str, torch.Tensor]
    ) -> tuple[float, dict[str, float]]:
        """``update``'s norm and largest values, ``UpdateRefused`` if it cannot be decoded or its norm is out
        of the round's bound."""
        try:
            norm, peaks = measure(update)
        except EncodingError as error:
            raise UpdateRefused(str(error)) from None
        limit = norm_limit(
            current.norms,
            self._previous_norms.get(current.fragment, []),
            fallback=functools.partial(self._reference_norm, current),
            ratio=self.update_norm_ratio,
        )
        if not norm <= limit:  # also NaN
            raise UpdateRefused(
                f"the update's L2 norm {norm:.6g} is over this round's bound {limit:.6g} "
                f"({self.update_norm_ratio:g}x the reference norm)"
            )
        return norm, peaks

    def _reference_norm(self, current: OpenRound) -> float:
        """The global weights' norm over the round's tensors (measured once per weights, when an update has
        no other reference)."""
        norm = self._weights_norms.get(current.fragment)
        if norm is None:
            norm = update_norm({name: self.weights[name] for name in current.names})
            self._weights_norms[current.fragment] = norm
        return norm

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
        if self._close_if_answered(current, "every trainer still training sent its update"):
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

    def _close_if_answered(
        self, current: OpenRound, why: str = "every expected trainer sent its update"
    ) -> bool:
        """Start closing ``current`` when every trainer it expects answered — its update accepted, or refused
        (a trainer whose update is refused sends no other for the round: its executor stops) — and at least
        one was accepted; whether it did."""
        if current.closing or not current.participants:
            return False
        if not set(current.expected) <= {*current.participants, *current.refused}:
            return False
        self._start_closing(current, why if not current.refused else f"{why} (or was refused)")
        return True

    def _on_timeout(self, current: OpenRound, why: str) -> None:
        if self._round is current and not current.closing:
            self._start_closing(current, why)

    def _start_closing(self, current: OpenRound, why: str) -> None:
        current.closing = True
        if current.timer is not None:
            current.timer.cancel()
        logger.info("round %d closes: %s", current.number, why)
        task = asyncio.create_task(self._close(current), name=f"close round {current.number}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _close(self, current: OpenRound) -> None:
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

    async def _close_round(self, current: OpenRound) -> RoundResult | None:
        """Step, persist and publish the round; its result, or None if that failed (:attr:`failure` set)."""
        try:
            async with self._lock:
                discard, self._discard = self._discard, None
                if discard is not None and discard[0] == current.number - 1:
                    step = await self._discarding(current, *discard)
                    if step is not None:
                        return await self._closed(current, step)
                validations = await self._checks.validate(
                    current.number, current.held, self.weights, current.names, self.buffers
                )
                # Held while the step runs, the previous momentum is never written in place: a discarded
                # round keeps it.
                previous_momentum = self.momentum if self._checks.discards else None
                step = await asyncio.to_thread(self._aggregate_and_step, current, validations)
                reason = await self._checks.discard_reason(current.number, self.weights, step.weights)
                if reason is not None:
                    logger.error("round %d is discarded: %s", current.number, reason)
                    step = await asyncio.to_thread(self._kept, current, reason)
                del previous_momentum
                return await self._closed(current, step)
        except Exception as error:
            logger.exception("closing round %d failed", current.number)
            if not self.failure.done():
                self.failure.set_result(error)
            return None

    async def _closed(self, current: OpenRound, step: Step) -> RoundResult:
        """Persist and publish the closed round's ``step`` (under the lock); the round's result."""
        rejected = {peer for peer, verdict in current.verdicts.items() if verdict.verdict == REJECTED}
        result = RoundResult(
            round_number=current.number,
            update=step.update,
            # The updates that count: a rejected one is left out of the aggregate.
            participants=tuple(peer for peer in current.participants if peer not in rejected),
            left_out=tuple(
                peer
                for peer in dict.fromkeys([*current.opened_expecting, *current.expected])
                if peer not in current.participants
            ),
            refused=dict(current.refused),
            samples=current.samples - current.rejected_samples,
            duration=round(self._clock() - current.opened_at, 3),
            bytes_in=current.bytes_in,
            stepped=step.stepped,
            arrivals=relative(current.accepted_at),
            discarded=step.discarded,
            encoded=step.encoded,
            encoding=self.encoding,
            fragment=current.fragment,
            verdicts={peer: verdict.as_json() for peer, verdict in current.verdicts.items()},
            # When the checks measured it: the loss of the weights this round publishes.
            eval_loss=self._checks.published_loss(),
        )
        if step.discarded is not None and not step.stepped:
            logger.error("round %d: its step is discarded, u = 0: %s", current.number, step.discarded)
        elif not step.stepped:
            logger.warning("round %d closed without a usable update: u = 0", current.number)
        if self._persist is not None:
            await self._persist(result, step.weights, aliases(step.momentum))
        if step.weights is not self.weights:
            if current.fragment >= len(self._fragments):  # every fragment stepped
                self._weights_norms.clear()
            self._weights_norms.pop(current.fragment, None)  # the other fragments' are unchanged
        self.weights, self._momentum = step.weights, step.momentum
        self._weights_bound, self._momentum_bound = step.bounds
        if step.residual is not None:  # the other fragments' residuals wait for their rounds
            self._residual = {**self._residual, **step.residual}
        if step.stepped:
            self._previous_norms[current.fragment] = [
                norm
                for peer, norm in zip(current.participants, current.norms, strict=True)
                if peer not in rejected
            ]
        del step
        self._publish(result)
        return result

    def _aggregate_and_step(self, current: OpenRound, validations: Mapping[str, Validation]) -> Step:
        """The closed round's step, after its held updates (if its rule holds them) were judged (with their
        ``validations``, in a round that validates) and aggregated (:mod:`parameter_server.rounds.robust`).
        Runs in a thread, under the lock."""
        if current.held:
            try:
                self._aggregate_held(current, validations)
            finally:
                current.held.clear()  # their spool files close: the bytes leave the disk
        return self._step(current)

    def _aggregate_held(self, current: OpenRound, validations: Mapping[str, Validation]) -> None:
        """Score every held update, give each its verdict, and put the aggregate of those not rejected where
        the step takes the round's mean from."""
        held = list(current.held)
        norms = [update.norm for update in held]
        cosines = robust.cosines_to_others([update.update for update in held], current.names, norms)
        verdicts = robust.judge(held, cosines, self.aggregation, validations)
        for peer, verdict in verdicts.items():
            if verdict.verdict != ACCEPTED:
                logger.warning(
                    "round %d: update from %s %s: %s", current.number, peer, verdict.verdict, verdict.reason
                )
        kept = [update for update in held if verdicts[update.peer].verdict != REJECTED]
        current.verdicts = verdicts
        current.rejected_samples = sum(
            update.samples for update in held if verdicts[update.peer].verdict == REJECTED
        )
        current.mean = robust.aggregate(
            kept,
            self.aggregation,
            names=current.names,
            dtypes={name: self.weights[name].dtype for name in current.names},
            median=robust.median_norm(norms),
            allocate=self._pool.take,
        )

    def _publish(self, result: RoundResult) -> None:
        # A record without tensors: the file serves u, and u's memory goes back to the pool once the
        # published result is dropped by whoever reads it.
        self._results[result.round_number] = record(result)
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
        return self._round_fetched(self.rounds_completed)

    def _round_fetched(self, round_number: int) -> bool:
        result = self._results.get(round_number)
        if result is None:
            return True
        return set(result.participants) <= self._fetched.get(round_number, set())

    async def wait_result_fetched(self, round_number: int, timeout: float) -> bool:
        """Wait until every participant of round ``round_number`` fetched its result (True) or ``timeout``
        (False): a round's report waits so that its ``bytes_out`` counts the result's downloads."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._round_fetched(round_number)), timeout
                )
            except TimeoutError:
                return False
        return True

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


def _fragment_names(
    floating: Sequence[str], fragments: Sequence[Iterable[str]] | None
) -> tuple[tuple[str, ...], ...]:
    """The floating-point names of each fragment, sorted (see :class:`RoundCoordinator`'s ``fragments``)."""
    if fragments is None:
        return (tuple(floating),)
    known = set(floating)
    names = [tuple(sorted(set(fragment) & known)) for fragment in fragments]
    counted: dict[str, int] = {}
    for fragment in names:
        for name in fragment:
            counted[name] = counted.get(name, 0) + 1
    twice = sorted(name for name, count in counted.items() if count > 1)
    if twice:
        raise ValueError(f"tensor {twice[0]!r} is in two fragments")
    absent = sorted(known - set(counted))
    if absent:
        raise ValueError(f"tensor {absent[0]!r} is in no fragment")
    for index, fragment in enumerate(names):
        if not fragment:
            raise ValueError(f"fragment {index + 1} of {len(names)} holds no floating-point tensor")
    return tuple(names)
