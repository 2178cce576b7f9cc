"""An owner's discard of the last closed round n (docs/training.md, "Discarding a round"): round n + 1
closes by going back to round n − 1's weights and momentum instead of stepping. A base class of
:class:`~parameter_server.rounds.RoundCoordinator` (its state is the coordinator's)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from hypha_tensors.encoding import encode
from parameter_server.exceptions import TensorRefused
from parameter_server.math import StateDict, check_finite
from parameter_server.rounds.records import OpenRound, Step
from parameter_server.rounds.step import StepArithmetic
from parameter_server.rounds.validation import LossChecks

logger = logging.getLogger("parameter_server")

PreviousRound = Callable[[], tuple[StateDict, StateDict | None] | None]
"""Loads the weights and momentum of the round before the one the owner discards (None: not kept)."""


class OwnerDiscard(StepArithmetic):
    """The owner's discard: :meth:`request_discard` (from the control plane's reply), taken by the closing
    round (:meth:`_discarding`)."""

    _round: OpenRound | None
    _discard: tuple[int, PreviousRound] | None
    _checks: LossChecks

    def request_discard(self, round_number: int, previous: PreviousRound) -> str | None:
        """The owner discards round ``round_number``, the last closed one (docs/training.md, "Discarding a
        round"): round n + 1, open now, closes by going back to round n − 1's weights and momentum, which
        ``previous`` loads (in the closing thread; None or an error: the round steps as usual, and says
        so). Why it cannot be honoured, or None: a round other than the last closed one, round n + 1 already
        closing, a streaming job (its rounds step one fragment each) or a lossy encoding (u would not take
        every trainer back exactly)."""
        current = self._round
        if round_number < 1 or current is None or current.number != round_number + 1 or current.closing:
            return f"round {round_number} is not the last closed round of an open round"
        if self.streaming:
            return "a streaming job's rounds step one fragment each: one cannot be undone alone"
        if self.encoding.lossy:
            return f"the {self.encoding.name} encoding cannot send the way back exactly"
        if self._discard is None or self._discard[0] != round_number:
            logger.warning(
                "round %d is discarded by the job's owner: round %d goes back", round_number, current.number
            )
        self._discard = (round_number, previous)
        return None

    async def _discarding(self, current: OpenRound, number: int, previous: PreviousRound) -> Step | None:
        """Round ``current`` (n + 1) goes back to round n − 1 (:meth:`request_discard`): its updates dropped;
        None (a usual step then) when round n − 1 cannot be loaded."""
        try:
            loaded = await asyncio.to_thread(previous)
        except Exception:
            logger.exception("round %d cannot be discarded: round %d cannot be loaded", number, number - 1)
            return None
        if loaded is None or any(
            name not in loaded[0] or loaded[0][name].shape != self.weights[name].shape
            for name in current.names
        ):
            logger.error("round %d cannot be discarded: round %d is not kept", number, number - 1)
            return None
        current.held.clear()
        current.verdicts = {}
        self._checks.loss = None  # the weights change
        reason = (
            f"the owner discarded round {number}: the weights and momentum of round {number - 1} are "
            f"restored and round {current.number}'s updates are dropped"
        )
        logger.error("round %d: %s", current.number, reason)
        return await asyncio.to_thread(self._rolled_back, current, *loaded, reason)

    def _rolled_back(
        self,
        current: OpenRound,
        weights: StateDict,
        momentum: StateDict | None,
        reason: str,
    ) -> Step:
        """An owner's discard (see the coordinator's :meth:`request_discard`): u = ``weights`` − θ over the
        round's tensors, so that θ + u — what every trainer's merge and the checkpoint replay compute — is
        the earlier round's ``weights`` (bit for bit where the two are within a factor 2 of each other, the
        subtraction then being exact; else within rounding), and ``momentum`` (that round's) replaces the
        outer momentum. Lossless encodings only: u is sent as it is. Kept as it was (u = 0) when u is not
        finite."""
        update = {
            name: weights[name].to(self.weights[name].dtype) - self.weights[name] for name in current.names
        }
        try:
            check_finite(update)
        except TensorRefused as error:
            return self._kept(
                current, f"{reason}; but going back is not finite ({error.name!r} {error.reason})"
            )
        return Step(
            update,
            self._add_to_weights(update),
            None if momentum is None else dict(momentum),
            stepped=True,
            discarded=reason,
            encoded=encode(update, self.encoding),
            residual={},
        )
