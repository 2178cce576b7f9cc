"""The held-out loss checks of a closing round (docs/training.md, "Robust aggregation and verification"):
the validation step of each update and the rule that discards a round whose loss rises.

* **Validation** (``rounds.verification.validation_every`` N): in a round whose number is a multiple of N,
  each held update is applied alone to the global weights — ``θ + lr·Δᵢ`` over the round's tensors, the
  outer step it would take by itself without momentum (``θ + Δᵢ`` for averaged buffers, as the step does) —
  and the held-out loss of that is compared with the global weights' own: over ``max_validation_rise`` ×,
  the update is rejected (:func:`~parameter_server.rounds.robust.judge`). One update at a time: memory is
  one copy of the round's tensors (plus the model the evaluator loads them into); time, one eval per update
  plus one of the global weights when their loss is not known yet.
* **Discard** (``rounds.discard_if_loss_rises`` F): after the outer step, the held-out loss of the new
  weights is compared with the previous weights'; over F ×, the round is discarded: the previous weights and
  momentum stay (weights are never mutated; while the rule is set the step writes its momentum into a new
  buffer rather than in place, one more momentum size during the step) and the round's result is u = 0, so
  trainers continue from them. One eval per round, which then serves as the round's reported eval loss.

``evaluate`` is the server's (parameter_server/service.py): it runs the evaluator in a thread, never two at
once on the model, and gives ``inf`` for a loss that is not finite, None when there is none (no loss, no
data, an error: the check is then skipped, and logged).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence

import torch

from parameter_server.aggregation import AggregationRule
from parameter_server.math import StateDict
from parameter_server.rounds.robust import HeldUpdate, Validation

logger = logging.getLogger("parameter_server")

Evaluate = Callable[[Mapping[str, torch.Tensor]], Awaitable[float | None]]
"""The held-out loss of some weights (inf: not finite; None: none could be computed)."""


def applied_alone(
    weights: Mapping[str, torch.Tensor],
    update: Mapping[str, torch.Tensor],
    names: Sequence[str],
    *,
    learning_rate: float,
    buffers: Collection[str] = (),
) -> StateDict:
    """The global ``weights`` with ``update`` applied alone: ``θ + lr·Δ`` over ``names`` (``θ + Δ`` for a
    buffer); every other tensor is the global one (the same object). New tensors for ``names`` only."""
    candidate = dict(weights)
    for name in names:
        tensor = weights[name]
        alpha = 1.0 if name in buffers else learning_rate
        candidate[name] = torch.add(tensor, update[name].to(tensor.dtype), alpha=alpha)
    return candidate


class LossChecks:
    """The coordinator's held-out loss checks (see the module docstring). :attr:`loss` is the held-out loss
    of the coordinator's current global weights when known (None: not measured since they changed)."""

    def __init__(self, rule: AggregationRule, evaluate: Evaluate | None, *, learning_rate: float) -> None:
        self.rule = rule
        self._evaluate = evaluate
        self.learning_rate = learning_rate
        self.loss: float | None = None
        if rule.evaluates and evaluate is None:
            logger.warning("the job validates updates or discards rounds by their loss, but has no eval data")

    @property
    def discards(self) -> bool:
        """Whether a round may be discarded by its loss (the step must then keep the previous momentum)."""
        return self._evaluate is not None and self.rule.discard_if_loss_rises is not None

    def published_loss(self) -> float | None:
        """:attr:`loss` when it is known and finite (a round's report says the rest itself)."""
        return self.loss if self.loss is not None and math.isfinite(self.loss) else None

    async def _measure(self, weights: Mapping[str, torch.Tensor]) -> float | None:
        assert self._evaluate is not None
        try:
            return await self._evaluate(weights)
        except Exception:  # a check that cannot run must not fail the round
            logger.exception("the held-out loss check could not run")
            return None

    async def _baseline(self, weights: Mapping[str, torch.Tensor]) -> float | None:
        """The loss of the current global ``weights``, measured once per weights."""
        if self.loss is None:
            self.loss = await self._measure(weights)
        return self.loss

    async def validate(
        self,
        round_number: int,
        held: Sequence[HeldUpdate],
        weights: Mapping[str, torch.Tensor],
        names: Sequence[str],
        buffers: Collection[str],
    ) -> dict[str, Validation]:
        """Peer → the validation scores of its update, in a round that validates (empty otherwise, or when
        the global weights' loss is unknown or not finite: nothing to compare with)."""
        if self._evaluate is None or not held or not self.rule.verification.validates(round_number):
            return {}
        baseline = await self._baseline(weights)
        if baseline is None or not math.isfinite(baseline):
            logger.warning(
                "round %d: no validation: the global weights' held-out loss is %s", round_number, baseline
            )
            return {}
        scores: dict[str, Validation] = {}
        for update in held:
            candidate = await asyncio.to_thread(
                applied_alone,
                weights,
                update.update,
                names,
                learning_rate=self.learning_rate,
                buffers=buffers,
            )
            loss = await self._measure(candidate)
            del candidate
            if loss is not None:
                scores[update.peer] = Validation(loss, baseline)
        return scores

    async def discard_reason(
        self, round_number: int, before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]
    ) -> str | None:
        """Why the round whose step took the global weights from ``before`` to ``after`` is discarded, or
        None; :attr:`loss` becomes the loss of the weights that stay (unknown without the rule)."""
        if after is before:  # no step: the weights and their loss stay
            return None
        if not self.discards:
            self.loss = None
            return None
        factor = self.rule.discard_if_loss_rises
        assert factor is not None
        previous = await self._baseline(before)
        loss = await self._measure(after)
        if (
            previous is not None
            and math.isfinite(previous)
            and loss is not None
            and not loss <= factor * previous
        ):
            return (
                f"its held-out loss rises from {previous:.4g} to {loss:.4g} (more than {factor:g}x): "
                "the previous weights and momentum are kept"
            )
        self.loss = loss
        return None
