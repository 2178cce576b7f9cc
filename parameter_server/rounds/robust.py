"""Robust aggregation and verification of a closed round's updates (:mod:`parameter_server.aggregation` for
the rules; docs/training.md, "Robust aggregation and verification").

A round whose rule needs every update at once (:attr:`AggregationRule.holds_updates`) keeps each accepted
update as it came — a :class:`~hypha_tensors.spooled.SpooledView` of its spool file, whose open descriptor
keeps the (unlinked) bytes on disk until the round closes — with its weight, norm and largest values. When
the round closes, :func:`judge` scores them (norm ÷ the round's median norm; :func:`cosines_to_others`) and
gives each a :class:`Verdict`; :func:`aggregate` then combines the updates not rejected. Both read the
updates **one tensor name at a time**: memory is about M × the largest tensor (plus slices of 2^20 values
per update in float64 for the cosines, or a sort of them), never M × the model.

Pure functions on tensors otherwise: nothing here mutates an update.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hypha_tensors.encoding import add_scaled_
from parameter_server.aggregation import (
    ACCEPTED,
    CLIPPED_MEAN,
    DOWN_WEIGHTED,
    MEDIAN,
    REJECTED,
    TRIMMED_MEAN,
    AggregationRule,
)
from parameter_server.exceptions import NoUpdatesError

StateDict = dict[str, torch.Tensor]
Allocator = Callable[[Mapping[str, tuple[tuple[int, ...], torch.dtype]]], StateDict]

#: Values of each update handled at a time (the cosines' float64 sums, the order statistics' sort).
SLICE = 1 << 20


@dataclass
class HeldUpdate:
    """An accepted update of a round that aggregates when it closes. ``update`` maps the round's names to
    tensors (read, and decoded, at every access when it is a spooled view); ``peaks`` its largest values."""

    peer: str
    update: Mapping[str, torch.Tensor]
    weight: float
    norm: float
    peaks: dict[str, float] = field(default_factory=dict)
    samples: int = 0


@dataclass(frozen=True)
class Validation:
    """The validation step's scores of one update (parameter_server/rounds/validation.py): the held-out loss
    of the global weights with this update alone applied, and the global weights' own."""

    loss: float
    baseline: float

    @property
    def ratio(self) -> float:
        """``loss ÷ baseline`` (inf for a rise from 0)."""
        if self.baseline > 0:
            return self.loss / self.baseline
        return 1.0 if self.loss <= self.baseline else math.inf


@dataclass(frozen=True)
class Verdict:
    """What became of one update: ``accepted``, ``down-weighted`` (clipped) or ``rejected`` (left out of the
    aggregate), why, and its scores (None when not defined: a round of one update has no cosine; no
    ``validation`` outside the rounds that validate)."""

    verdict: str
    reason: str
    norm_ratio: float | None
    cosine: float | None
    validation: Validation | None = None

    def as_json(self) -> dict[str, Any]:
        def rounded(value: float | None) -> float | None:
            return None if value is None or not math.isfinite(value) else round(value, 6)

        body: dict[str, Any] = {
            "verdict": self.verdict,
            "reason": self.reason,
            "norm_ratio": rounded(self.norm_ratio),
            "cosine": rounded(self.cosine),
        }
        if self.validation is not None:  # a round without validation reports as before
            body["validation_loss"] = rounded(self.validation.loss)
            body["loss_ratio"] = rounded(self.validation.ratio)
        return body


def median_norm(norms: Sequence[float]) -> float:
    """The median of ``norms`` (0.0 when there are none)."""
    return float(statistics.median(norms)) if norms else 0.0


def cosines_to_others(
    updates: Sequence[Mapping[str, torch.Tensor]], names: Sequence[str], norms: Sequence[float]
) -> list[float | None]:
    """Each update's cosine similarity to the sum (so the mean, unweighted) of the others, over ``names``:
    ``<x_i, S − c_i·x_i> / (|x_i| · |S − c_i·x_i|)`` with ``S = Σ c_j·x_j``, ``norms`` the updates' L2 norms
    and ``c_j = min(1, median norm / |x_j|)``: in the reference each update counts with its norm clipped to
    the round's median norm, so that one large update cannot turn the others' mean against every honest
    update (a reversed update 5× the others', under the norm limit, would otherwise make the honest ones look
    reversed: bench/robustness.py). The cosine's own update is not clipped (a positive scale keeps its
    direction).
    Read a tensor name at a time (every update's tensor of it), summed in float64 a slice of :data:`SLICE`
    values at a time. None where it is not defined: fewer than 2 updates, a zero update or zero others."""
    count = len(updates)
    if count < 2:
        return [None] * count
    median = median_norm(norms)
    clipped = [clip_scale(norm, median, 1.0) if median > 0 else 1.0 for norm in norms]
    scales = torch.tensor(clipped, dtype=torch.float64).unsqueeze(1)
    dots = [0.0] * count
    others_squared = [0.0] * count
    for name in names:
        tensors = [update[name].reshape(-1) for update in updates]
        size = tensors[0].numel()
        for start in range(0, size, SLICE):
            stack = torch.stack([tensor[start : start + SLICE] for tensor in tensors]).to(torch.float64)
            stack.mul_(scales)  # each clipped to the median norm; the cosine's own direction is unchanged
            total = stack.sum(dim=0)
            for index in range(count):
                others = total - stack[index]
                dots[index] += float(torch.dot(stack[index], others))
                others_squared[index] += float(torch.dot(others, others))
        del tensors
    cosines: list[float | None] = []
    for index in range(count):
        # stack[index] was c_i·x_i: its norm is c_i·|x_i|
        denominator = clipped[index] * norms[index] * math.sqrt(others_squared[index])
        if not denominator > 0 or not math.isfinite(denominator):
            cosines.append(None)
        else:
            cosines.append(max(-1.0, min(1.0, dots[index] / denominator)))
    return cosines


def clip_scale(norm: float, median: float, factor: float) -> float:
    """The factor ``clipped_mean`` multiplies an update by: ``min(1, factor · median / norm)``."""
    limit = factor * median
    if norm <= limit or norm == 0:
        return 1.0
    return limit / norm


def judge(
    held: Sequence[HeldUpdate],
    cosines: Sequence[float | None],
    rule: AggregationRule,
    validations: Mapping[str, Validation] | None = None,
) -> dict[str, Verdict]:
    """Each held update's verdict (by peer, in order). Rejected, when the rule verifies: a norm over
    ``max_norm_ratio`` × the round's median norm, or, with 3 updates or more, a cosine to the mean of the
    others under ``min_cosine``; and, whatever the rule, an update whose ``validations`` entry (the round
    validated it) shows a held-out loss over ``max_validation_rise`` × the global weights'. Down-weighted:
    ``clipped_mean`` clips it (norm over ``clip_factor`` × the median). Otherwise accepted."""
    median = median_norm([update.norm for update in held])
    verification = rule.verification
    validations = validations or {}
    verdicts: dict[str, Verdict] = {}
    for update, cosine in zip(held, cosines, strict=True):
        validation = validations.get(update.peer)
        if median > 0:
            ratio: float = update.norm / median
        else:
            ratio = 0.0 if update.norm == 0 else math.inf
        shown = None if not math.isfinite(ratio) else ratio
        if rule.verifies and ratio > verification.max_norm_ratio:
            reason = (
                f"its norm is {ratio:.3g}x the round's median norm (more than {verification.max_norm_ratio:g}x)"
                if math.isfinite(ratio)
                else f"its norm is {update.norm:.3g} while the round's median norm is 0"
            )
            verdicts[update.peer] = Verdict(REJECTED, reason, shown, cosine, validation)
        elif rule.verifies and len(held) >= 3 and cosine is not None and cosine < verification.min_cosine:
            reason = (
                f"its cosine similarity to the mean of the others is {cosine:.3f} "
                f"(under {verification.min_cosine:g})"
            )
            verdicts[update.peer] = Verdict(REJECTED, reason, shown, cosine, validation)
        elif validation is not None and not validation.ratio <= verification.max_validation_rise:
            reason = (
                f"its update alone raises the held-out loss from {validation.baseline:.4g} to "
                f"{validation.loss:.4g} (more than {verification.max_validation_rise:g}x)"
            )
            verdicts[update.peer] = Verdict(REJECTED, reason, shown, cosine, validation)
        elif rule.name == CLIPPED_MEAN and clip_scale(update.norm, median, rule.clip_factor) < 1.0:
            reason = f"its norm is {ratio:.3g}x the round's median norm: clipped to {rule.clip_factor:g}x"
            verdicts[update.peer] = Verdict(DOWN_WEIGHTED, reason, shown, cosine, validation)
        else:
            verdicts[update.peer] = Verdict(ACCEPTED, "", shown, cosine, validation)
    return verdicts


def trim_count(count: int, fraction: float) -> int:
    """Values dropped on each side of a coordinate by ``trimmed_mean``: ``⌊fraction · count⌋``, at least 1
    when ``count >= 3``, and always leaving at least one value."""
    trimmed = math.floor(fraction * count)
    if count >= 3:
        trimmed = max(trimmed, 1)
    return max(0, min(trimmed, (count - 1) // 2))


def order_mean(stack: torch.Tensor, trimmed: int) -> torch.Tensor:
    """Per column of ``stack`` (updates × values): the mean of its values once the ``trimmed`` smallest and
    largest are dropped, a slice of :data:`SLICE` columns at a time (``trimmed = (M − 1) // 2``: the median,
    the mean of the two middle values for an even M)."""
    count, size = stack.shape
    out = torch.empty(size, dtype=stack.dtype)
    for start in range(0, size, SLICE):
        ordered = stack[:, start : start + SLICE].sort(dim=0).values
        out[start : start + SLICE] = ordered[trimmed : count - trimmed].mean(dim=0)
    return out


class Aggregate:
    """A closed round's aggregate, in the shape the outer step takes a round's mean in
    (:class:`~parameter_server.math.StreamingMean`'s ``count``, ``total_weight``, ``bound()``, ``take()``)."""

    def __init__(self, tensors: StateDict | None, *, count: int, total_weight: float, bound: float) -> None:
        self._tensors = tensors
        self.count = count
        self.total_weight = total_weight
        self._bound = bound

    def bound(self) -> float:
        """An upper bound on ``|x|`` over every value of the aggregate."""
        self._check()
        return self._bound

    def take(self) -> StateDict:
        """The aggregate, handed over once."""
        self._check()
        assert self._tensors is not None
        tensors, self._tensors = self._tensors, None
        return tensors

    def _check(self) -> None:
        if self._tensors is None or self.total_weight == 0:
            raise NoUpdatesError("no update counts in this round's aggregate")


def aggregate(
    kept: Sequence[HeldUpdate],
    rule: AggregationRule,
    *,
    names: Sequence[str],
    dtypes: Mapping[str, torch.dtype],
    median: float,
    allocate: Allocator | None = None,
) -> Aggregate:
    """The rule's aggregate of the ``kept`` updates over ``names`` (each in ``dtypes[name]``; computed in at
    least float32). ``mean``/``clipped_mean``: ``Σ wᵢ·sᵢ·xᵢ / Σ wᵢ`` with ``sᵢ`` 1 or
    :func:`clip_scale` (``median``: the round's median norm). ``trimmed_mean``/``median``: the order
    statistics of the updates of positive weight, unweighted. Read a tensor name at a time."""
    if rule.name in (TRIMMED_MEAN, MEDIAN):
        contributors = [update for update in kept if update.weight > 0]
        count = len(contributors)
        if count == 0:
            return Aggregate(None, count=len(kept), total_weight=0.0, bound=0.0)
        trimmed = (count - 1) // 2 if rule.name == MEDIAN else trim_count(count, rule.trim_fraction)
        out: StateDict = {}
        for name in names:
            first = contributors[0].update[name]
            dtype = torch.promote_types(dtypes[name], torch.float32)
            stack = torch.empty((count, first.numel()), dtype=dtype)
            stack[0].copy_(first.reshape(-1))
            del first
            for index, update in enumerate(contributors[1:], start=1):
                stack[index].copy_(update.update[name].reshape(-1))
            out[name] = (
                order_mean(stack, trimmed).reshape(stack_shape(contributors[0], name)).to(dtypes[name])
            )
            del stack
        bound = max(
            (max(update.peaks.get(name, 0.0) for update in contributors) for name in names), default=0.0
        )
        return Aggregate(out, count=count, total_weight=float(count), bound=bound)

    total = sum(update.weight for update in kept)
    if not kept or total == 0:
        return Aggregate(None, count=len(kept), total_weight=0.0, bound=0.0)
    scales = [
        clip_scale(update.norm, median, rule.clip_factor) if rule.name == CLIPPED_MEAN else 1.0
        for update in kept
    ]
    wanted = {
        name: (stack_shape(kept[0], name), torch.promote_types(dtypes[name], torch.float32)) for name in names
    }
    sums = allocate(wanted) if allocate is not None else {}
    out = {}
    for name in names:
        shape, dtype = wanted[name]
        target = sums[name].zero_() if name in sums else torch.zeros(shape, dtype=dtype)
        for update, scale in zip(kept, scales, strict=True):
            add_scaled_(target, update.update[name], alpha=update.weight * scale)
        out[name] = target.div_(total).to(dtypes[name])
    bound = max(
        (
            sum(
                update.weight * scale * update.peaks.get(name, 0.0)
                for update, scale in zip(kept, scales, strict=True)
            )
            / total
            for name in names
        ),
        default=0.0,
    )
    return Aggregate(out, count=len(kept), total_weight=total, bound=bound)


def stack_shape(update: HeldUpdate, name: str) -> tuple[int, ...]:
    """The shape of ``update``'s tensor ``name`` (from its signature, without reading it, when it can)."""
    signature = getattr(update.update, "signature", None)
    if callable(signature):
        return tuple(signature(name)[0])
    return tuple(update.update[name].shape)
