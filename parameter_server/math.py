"""The parameter server's math: pure functions on state dicts (``dict[str, torch.Tensor]``).

Nothing here touches files, the network or a clock, and nothing mutates its inputs: every function takes
tensors and returns new ones (Flower's ``aggregate.py`` style), so it is tested against hand-computed values.
The two exceptions say so in their names and contracts, for the parameter server's round, where a new
model-sized tensor costs more than the arithmetic on it: :func:`nesterov_step_` consumes its gradient and
writes into buffers it is given, and :class:`StreamingMean` may sum into buffers from an allocator
(``parameter_server/buffers.py``). Both give the same bits as the pure functions.

Sign convention, end to end (same as the original Hypha parameter server, hypha-protocols.md §4):

* a trainer, after its inner steps, sends ``delta = θ_local − θ_global_prev`` (the *negative* of DiLoCo's
  pseudo-gradient ``Δ = θ_prev − θ_local``);
* the parameter server averages them, ``g = mean(delta)``, and takes the outer Nesterov step
  ``m ← g`` (first round) or ``m ← μ·m + g`` (later rounds), ``u = lr·(μ·m + g)``;
* every trainer applies ``θ_new = θ_global_prev + u`` (``u`` is a delta, not full weights).

Equivalently ``θ_new = θ_prev − lr·(Δ + μ·m_Δ)``: PyTorch ``SGD(nesterov=True, dampening=0)`` applied to ``−g``.
Floating-point buffers (BatchNorm's running statistics) are not stepped: ``u = g``, so they become the
trainers' mean (``nesterov_step(averaged=...)``).

The mean here is the true (optionally sample-weighted) mean, *not* the original's pairwise running average
``acc_k = (f_k + acc_{k−1}) / 2``, which for three updates gives ``f₁/4 + f₂/4 + f₃/2``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import NamedTuple

import torch

from hypha_tensors.encoding import DecodedView, add_scaled_
from parameter_server.exceptions import NoUpdatesError, TensorRefused

StateDict = dict[str, torch.Tensor]
"""Tensor name → tensor, as in ``model.state_dict()``."""

Allocator = Callable[[Mapping[str, tuple[tuple[int, ...], torch.dtype]]], StateDict]
"""name → (shape, dtype) → CPU tensors of those shapes and dtypes, contents undefined
(:meth:`parameter_server.buffers.BufferPool.take`)."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float16/bfloat16/float32, float64 for float64: at least float32, never less than the input."""
    return torch.promote_types(dtype, torch.float32)


def _check_same_signature(
    name: str, tensor: torch.Tensor, shape: torch.Size, dtype: torch.dtype, what: str
) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TensorRefused(name, f"{what} is a {type(tensor).__name__}, not a tensor")
    _check_shape_and_dtype(name, tensor.shape, tensor.dtype, shape, dtype, what)


def _check_shape_and_dtype(
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    expected_shape: Sequence[int],
    expected_dtype: torch.dtype,
    what: str,
) -> None:
    if tuple(shape) != tuple(expected_shape):
        raise TensorRefused(name, f"{what} has shape {tuple(shape)}, expected {tuple(expected_shape)}")
    if dtype != expected_dtype:
        raise TensorRefused(name, f"{what} has dtype {dtype}, expected {expected_dtype}")


def _check_same_names(names: Iterable[str], expected: Iterable[str], what: str) -> None:
    names, expected = set(names), set(expected)
    missing = sorted(expected - names)
    if missing:
        raise TensorRefused(missing[0], f"missing from {what}")
    unknown = sorted(names - expected)
    if unknown:
        raise TensorRefused(unknown[0], f"unknown name in {what}")


class StreamingMean:
    """The (optionally sample-weighted) mean of pseudo-gradients added one at a time.

    Contract:

    * ``add(update, weight)`` accepts a state dict of floating-point tensors. The first update fixes the
      names, shapes and dtypes; a later update that differs in any of them raises ``TensorRefused`` naming
      the first offending tensor (missing and unknown names are checked before shapes and dtypes), and the
      accumulator is left exactly as it was. Integer and bool tensors are refused: a mean of them has no
      meaning for a pseudo-gradient.
    * ``weight`` is the update's share, typically its number of training samples; it must be finite and
      ``>= 0``, else ``ValueError``. Weights are relative: ``mean([a, b], [1, 3]) == a/4 + 3b/4``.
    * ``result()`` returns ``Σ wᵢ·xᵢ / Σ wᵢ`` as new tensors in each input's dtype; it may be called at any
      time and does not reset the accumulator. With nothing added, or all weights zero, ``NoUpdatesError``.
      ``take()`` returns the same once, computed in the accumulator (the parameter server's round close).
    * Inputs are never mutated or retained.
    * An update whose ``weight × |value|`` could overflow the accumulator's dtype raises ``TensorRefused``
      (and changes nothing): each accumulator element is at most ``Σ wᵢ·max|xᵢ|`` in magnitude, and that bound
      is kept per tensor, so finite inputs never make a sum Inf. Honest updates are nowhere near it (float32's
      largest value is 3.4e38).

    Accumulator dtype: float32 for float16, bfloat16 and float32 inputs, float64 for float64 inputs. float32
    accumulates with a relative error of about ``N · 6e-8`` for N updates, far below the float16/bfloat16
    resolution the deltas are often sent in and harmless at float32 for the dozens-to-thousands of trainers
    a round has; a float64 accumulator would double the server's peak memory (8 bytes per parameter, 1 GB
    for GPT-2 small) for no visible gain. Peak memory is one accumulator plus the update being added (plus
    one tensor's float32 copy while a half-precision tensor is being added); no list of updates is kept.

    ``allocate`` (an :data:`Allocator`, e.g. the parameter server's buffer pool): where the accumulator comes
    from, zeroed here (reused memory is refilled far faster than fresh pages are faulted in); without it, new
    zeros. An update given as a :class:`~hypha_tensors.encoding.DecodedView` (int8, float16, bfloat16 on
    the wire) is decoded straight into the accumulator a slice at a time, with no decoded copy of a whole
    tensor; so is a half-precision tensor. Either way the sum has the same bits as decoding (or ``.to``)
    first.
    """

    def __init__(self, allocate: Allocator | None = None) -> None:
        self._allocate = allocate
        self._accumulators: StateDict | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        #: Σ weight · max|x| per tensor: a bound on the magnitude of every element of its accumulator.
        self._magnitudes: dict[str, float] = {}
        self._total_weight = 0.0
        self.count = 0
        """How many updates were added (including any with weight 0)."""

    def add(
        self,
        update: Mapping[str, torch.Tensor],
        weight: float = 1.0,
        *,
        signatures: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
        peaks: Mapping[str, float] | None = None,
    ) -> None:
        """Add one update with the given weight (see the class docstring for what is refused).

        ``signatures`` (name → (shape, dtype)) and ``peaks`` (name → :func:`largest_magnitude`), when the
        caller measured them already (:func:`measure` of an update that is decoded at every read), spare
        reading the update for the checks: then each ``update[name]`` is read once, when it is added."""
        weight = float(weight)
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"weight must be finite and >= 0, got {weight!r}")
        if self._accumulators is None:
            self._start(update, signatures)
        else:
            # Check everything before touching the accumulator, so a refused update leaves no trace.
            _check_same_names(update, self._accumulators, "this update")
            for name, accumulator in self._accumulators.items():
                if signatures is None:
                    _check_same_signature(
                        name, update[name], accumulator.shape, self._dtypes[name], "this update"
                    )
                else:
                    shape, dtype = signatures[name]
                    _check_shape_and_dtype(
                        name, shape, dtype, accumulator.shape, self._dtypes[name], "this update"
                    )
        assert self._accumulators is not None
        magnitudes = {}
        for name, accumulator in self._accumulators.items():
            peak = peaks[name] if peaks is not None else largest_magnitude(update[name])
            # Python floats: weight · peak is Inf rather than an error when it is past float64's range.
            magnitude = self._magnitudes.get(name, 0.0) + weight * peak
            if magnitude > torch.finfo(accumulator.dtype).max:
                if self.count == 0:
                    self._accumulators = None  # the first update fixes the signature only if it is taken
                raise TensorRefused(
                    name,
                    f"weight {weight:g} × its largest value {peak:g} would overflow the round's "
                    f"{str(accumulator.dtype).removeprefix('torch.')} sum",
                )
            magnitudes[name] = magnitude
        for name, accumulator in self._accumulators.items():
            if isinstance(update, DecodedView):
                update.add_into(name, accumulator, alpha=weight)
                continue
            tensor = update[name]
            if tensor.device != accumulator.device:
                tensor = tensor.to(accumulator.device)
            # add_ with alpha is fused (no w·x temporary); a half-precision tensor is widened a slice at a time.
            add_scaled_(accumulator, tensor, alpha=weight)
        self._magnitudes.update(magnitudes)
        self._total_weight += weight
        self.count += 1

    def _start(
        self,
        update: Mapping[str, torch.Tensor],
        signatures: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    ) -> None:
        wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        devices: dict[str, torch.device] = {}
        dtypes = {}
        for name in sorted(update):
            if signatures is None:
                tensor = update[name]
                if not isinstance(tensor, torch.Tensor):
                    raise TensorRefused(name, f"is a {type(tensor).__name__}, not a tensor")
                shape, dtype, device = tensor.shape, tensor.dtype, tensor.device
            else:
                (shape, dtype), device = signatures[name], torch.device("cpu")
            if not dtype.is_floating_point:
                raise TensorRefused(name, f"dtype {dtype} is not floating point")
            wanted[name] = (tuple(shape), _compute_dtype(dtype))
            devices[name] = torch.device(device)
            dtypes[name] = dtype
        if self._allocate is not None and all(device.type == "cpu" for device in devices.values()):
            accumulators = self._allocate(wanted)
            torch._foreach_zero_(list(accumulators.values()))
        else:
            accumulators = {
                name: torch.zeros(shape, dtype=dtype, device=devices[name])
                for name, (shape, dtype) in wanted.items()
            }
        self._dtypes = dtypes
        self._accumulators = {name: accumulators[name] for name in sorted(wanted)}

    @property
    def total_weight(self) -> float:
        """The sum of the weights added so far."""
        return self._total_weight

    def bound(self) -> float:
        """An upper bound on ``|x|`` over every element ``x`` of :meth:`result` (all tensors), from the largest
        values the updates were added with: ``max over tensors of Σ wᵢ·max|xᵢ| / Σ wᵢ``. Exact arithmetic;
        float rounding may exceed it by a relative ``count · 2⁻²⁴`` at most. ``NoUpdatesError`` like
        :meth:`result`. Costs nothing: the parameter server uses it to know a step is finite without
        reading it."""
        self._check_result()
        return max(self._magnitudes.values(), default=0.0) / self._total_weight

    def result(self) -> StateDict:
        """The weighted mean so far, in the inputs' dtypes (new tensors)."""
        self._check_result()
        assert self._accumulators is not None
        return {
            name: (accumulator / self._total_weight).to(self._dtypes[name])
            for name, accumulator in self._accumulators.items()
        }

    def take(self) -> StateDict:
        """The weighted mean, divided in the accumulator itself (no model-sized copy for float32 inputs): the
        accumulator is handed over, and this StreamingMean holds nothing afterwards (``NoUpdatesError``)."""
        self._check_result()
        assert self._accumulators is not None
        accumulators, self._accumulators = self._accumulators, None
        total, self._total_weight = self._total_weight, 0.0
        self._magnitudes = {}
        return {name: tensor.div_(total).to(self._dtypes[name]) for name, tensor in accumulators.items()}

    def _check_result(self) -> None:
        if self._accumulators is None:
            raise NoUpdatesError("no update was added")
        if self._total_weight == 0:
            raise NoUpdatesError(f"the {self.count} update(s) added all have weight 0")


def largest_magnitude(tensor: torch.Tensor) -> float:
    """``max|x|`` over ``tensor`` as a Python float (0.0 when empty; NaN when it holds one). One pass with
    ``aminmax`` and no copy (15x faster than ``vector_norm(ord=inf)`` on CPU, 4 ms for 25M float32 values);
    float8 is widened to float16, which holds its values exactly."""
    if tensor.numel() == 0:
        return 0.0
    if tensor.element_size() == 1 and tensor.dtype.is_floating_point:
        tensor = tensor.to(torch.float16)
    low, high = torch.aminmax(tensor)
    low, high = float(low), float(high)
    if math.isnan(low) or math.isnan(high):
        return math.nan
    return max(-low, high)


def check_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    """``TensorRefused(name, "contains NaN")`` (or ``"contains Inf"``) for the first floating-point tensor, in
    name order, that holds one: what :func:`hypha_tensors.weights.validate` says of them, with one
    ``aminmax`` pass per tensor and no temporary (``isfinite`` makes a float copy and three bool tensors of
    the tensor's size: 30x slower on a model)."""
    for name in sorted(tensors):
        tensor = tensors[name]
        if not tensor.dtype.is_floating_point:
            continue
        peak = largest_magnitude(tensor)
        if math.isnan(peak):
            raise TensorRefused(name, "contains NaN")
        if math.isinf(peak):
            raise TensorRefused(name, "contains Inf")


def measure(update: Mapping[str, torch.Tensor]) -> tuple[float, dict[str, float]]:
    """``(update_norm(update), {name: largest_magnitude(tensor)})`` of the floating-point tensors, reading
    each tensor once, in sorted order (an update decoded at every read is decoded once here)."""
    total = 0.0
    peaks: dict[str, float] = {}
    for name in sorted(update):
        tensor = update[name]
        if not tensor.dtype.is_floating_point:
            continue
        peaks[name] = largest_magnitude(tensor)
        total = math.hypot(total, _norm_of(tensor))
    return total, peaks


#: Values whose float64 norm is taken at a time (8 MiB of float64): a tensor's norm is combined from its
#: slices' with ``math.hypot`` instead of widening the whole tensor to float64 (a copy twice its size).
NORM_SLICE = 1 << 20


def _norm_of(tensor: torch.Tensor) -> float:
    if tensor.numel() == 0:
        return 0.0
    if tensor.element_size() == 1:
        tensor = tensor.to(torch.float16)
    if tensor.numel() <= NORM_SLICE or not tensor.is_contiguous():
        return float(torch.linalg.vector_norm(tensor, dtype=torch.float64))
    flat = tensor.view(-1)
    total = 0.0
    for start in range(0, flat.numel(), NORM_SLICE):
        part = float(torch.linalg.vector_norm(flat[start : start + NORM_SLICE], dtype=torch.float64))
        if math.isnan(part):
            return part  # NaN wins over Inf, as in a norm taken whole (hypot(inf, nan) is inf)
        total = math.hypot(total, part)
    return total


def update_norm(update: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of all the floating-point tensors of ``update`` taken together (integer tensors are
    skipped). Summed in float64 (a slice of :data:`NORM_SLICE` values at a time) and combined with
    ``math.hypot``: finite for any finite float32, float16 or bfloat16 input (a float32 square is at most
    ~1.2e77, float64 reaches 1.8e308); ``math.inf`` when a float64 input's squares overflow or a value is
    Inf, NaN when one is NaN."""
    total = 0.0
    for name in sorted(update):
        tensor = update[name]
        if tensor.dtype.is_floating_point:
            total = math.hypot(total, _norm_of(tensor))
    return total


def norm_limit(
    round_norms: Sequence[float],
    previous_norms: Sequence[float],
    *,
    fallback: float | Callable[[], float],
    ratio: float,
) -> float:
    """The largest update norm a round accepts: ``ratio`` × a reference norm.

    The reference is the larger of the median of ``round_norms`` (the round's updates accepted so far) and
    the median of ``previous_norms`` (those of the last round that took a step), leaving out an empty or
    zero median; with neither, ``fallback`` (the parameter server uses the global weights' norm: an update
    ``ratio`` times larger than the whole model is not a training step), and no bound (``math.inf``) when that
    is 0 too (nothing to measure against). ``fallback`` may be a function giving it, called only when it is needed (the
    norm of a model is a pass over all its weights). The larger of the two, so that a
    round whose first updates are small does not refuse an honest trainer that ran more steps; the median,
    so that one outlier cannot move it. ``ratio`` must be > 1 and ``fallback`` >= 0, else ``ValueError``.

    Example: round [1, 2, 10] (median 2), previous [3, 4] (median 3.5), ratio 10 → 35.
    """
    if not math.isfinite(ratio) or ratio <= 1:
        raise ValueError(f"ratio must be finite and > 1, got {ratio!r}")
    if not callable(fallback):
        _check_fallback(fallback)
    medians = [statistics.median(norms) for norms in (round_norms, previous_norms) if norms]
    references = [median for median in medians if median > 0]
    if not references:
        if callable(fallback):
            fallback = fallback()
            _check_fallback(fallback)
        return ratio * fallback if fallback > 0 else math.inf
    return ratio * max(references)


def _check_fallback(fallback: float) -> None:
    if not math.isfinite(fallback) or fallback < 0:
        raise ValueError(f"fallback must be finite and >= 0, got {fallback!r}")


def mean(updates: Iterable[Mapping[str, torch.Tensor]], weights: Iterable[float] | None = None) -> StateDict:
    """The (weighted) mean of ``updates``; see ``StreamingMean`` for the contract.

    ``updates`` may be a generator (e.g. loading one file at a time), so that only one update is in memory
    at once. ``weights``, if given, must have one entry per update, else ``ValueError``.
    """
    streaming = StreamingMean()
    if weights is None:
        for update in updates:
            streaming.add(update)
    else:
        weights_iterator = iter(weights)
        for index, update in enumerate(updates):
            try:
                weight = next(weights_iterator)
            except StopIteration:
                raise ValueError(f"{index} weight(s) for more updates") from None
            streaming.add(update, weight)
        if next(weights_iterator, None) is not None:
            raise ValueError(f"more weights than the {streaming.count} update(s)")
    return streaming.result()


def nesterov_step(
    *,
    gradient: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor] | None,
    learning_rate: float,
    momentum_factor: float,
    averaged: Collection[str] = (),
) -> tuple[StateDict, StateDict]:
    """One outer Nesterov step: return ``(update, new_momentum)``.

    * ``gradient`` is ``g``, the mean of the trainers' ``θ_local − θ_global`` (see the module docstring for
      the sign convention: trainers apply ``θ_new = θ_prev + update``).
    * ``momentum`` is ``None`` on the first round: ``m ← g`` (a copy). Otherwise ``m ← μ·m + g``, and it must
      have exactly the gradient's names, shapes and dtypes, else ``TensorRefused``.
    * ``update = lr·(μ·m + g)`` with the *new* ``m``.
    * ``learning_rate`` (lr) and ``momentum_factor`` (μ) must be finite, lr > 0 and 0 <= μ < 1, else
      ``ValueError``.
    * Names in ``averaged`` (floating-point *buffers*, e.g. BatchNorm's ``running_mean``/``running_var``) are
      not stepped: their ``update`` is ``g`` itself, so ``θ_new = θ_prev + mean(delta)`` is the trainers'
      (weighted) mean of their local values, and they have no momentum (a running variance given momentum
      overshoots below zero and the model returns NaN). ``momentum`` need not name them, and any entry it
      has for them (a checkpoint of an older server) is ignored; ``new_momentum`` never names them.

    Every returned tensor has its input's dtype; the arithmetic is done in at least float32 and rounded once
    at the end (the original computed in the input dtype; for float32 inputs the two are identical up to
    that single rounding). The inputs are never mutated and the outputs never alias them.

    Reference check (lr 0.1, μ 0.7): g = 0.5 on the first round gives u = 0.085; then g = [0.1 … 0.5] gives
    [0.0415, 0.0585, 0.0755, 0.0925, 0.1095].
    """
    stepped, momentum = _check_step(gradient, momentum, learning_rate, momentum_factor, averaged)
    averaged = frozenset(averaged)
    update: StateDict = {}
    new_momentum: StateDict = {}
    for name in sorted(gradient):
        g = gradient[name]
        if name in averaged:
            update[name] = g.clone()  # θ ← the mean: no learning rate, no momentum
            continue
        g_wide = g.to(_compute_dtype(g.dtype))
        # In place on tensors made here (a model-sized allocation costs more than the arithmetic on it).
        if momentum is None:
            m_wide = g_wide.clone()
        else:
            m_wide = momentum[name].to(device=g.device, dtype=g_wide.dtype) * momentum_factor
            m_wide.add_(g_wide)
        update[name] = torch.add(g_wide, m_wide, alpha=momentum_factor).mul_(learning_rate).to(g.dtype)
        # m_wide is always a new tensor (a clone or the result of arithmetic), never g or the old momentum.
        new_momentum[name] = m_wide.to(g.dtype)
    return update, new_momentum


def nesterov_step_(
    *,
    gradient: StateDict,
    momentum: Mapping[str, torch.Tensor] | None,
    learning_rate: float,
    momentum_factor: float,
    averaged: Collection[str] = (),
    momentum_out: Mapping[str, torch.Tensor] | None = None,
) -> tuple[StateDict, StateDict]:
    """:func:`nesterov_step` without model-sized allocations, for the parameter server's round: the same
    checks and refusals (made before anything is written), the same ``(update, new_momentum)`` bit for bit,
    but written into tensors it is given:

    * ``gradient`` is consumed: each float32/float64 tensor of it becomes that name's ``update`` (the same
      tensor object, ``u = lr·(g + μ·m)`` computed in place); an ``averaged`` name's update is ``g`` itself.
    * the new momentum of a stepped name goes into ``momentum_out[name]`` when given (same shape and dtype,
      contiguous, not aliasing the gradient); it may be ``momentum[name]`` itself: the momentum is then
      updated in place. Without ``momentum_out``, new tensors.
    * a float16/bfloat16 name (computed in float32, rounded once) gets new tensors, as in
      :func:`nesterov_step`, and so does a momentum on another device than its gradient.

    Nothing else is mutated: ``momentum`` only when it is ``momentum_out``.
    """
    stepped, momentum = _check_step(gradient, momentum, learning_rate, momentum_factor, averaged)
    update: StateDict = {}
    new_momentum: StateDict = {}
    for name in sorted(gradient):
        g = gradient[name]
        if name not in stepped:
            update[name] = g  # θ ← the mean: no learning rate, no momentum
            continue
        old = None if momentum is None else momentum[name]
        if g.dtype != _compute_dtype(g.dtype) or (old is not None and old.device != g.device):
            single_update, single_momentum = nesterov_step(
                gradient={name: g},
                momentum=None if old is None else {name: old},
                learning_rate=learning_rate,
                momentum_factor=momentum_factor,
            )
            update[name], new_momentum[name] = single_update[name], single_momentum[name]
            continue
        # The operations of nesterov_step on the same operands, in place: the same bits.
        target = None if momentum_out is None else momentum_out[name]
        if old is None:
            m = g.clone() if target is None else target.copy_(g)
        else:
            m = old * momentum_factor if target is None else torch.mul(old, momentum_factor, out=target)
            m.add_(g)
        update[name] = g.add_(m, alpha=momentum_factor).mul_(learning_rate)
        new_momentum[name] = m
    return update, new_momentum


class StepBounds(NamedTuple):
    """Upper bounds on the largest magnitude of each result of one outer step (:func:`step_bounds`)."""

    gradient: float
    momentum: float
    update: float
    weights: float


#: Each bound of :func:`step_bounds` is grown by this factor per operation, for float rounding: a float32
#: operation errs by at most 2⁻²⁴ relative, so bounds built on bounds stay bounds for thousands of rounds.
BOUND_ROUNDING = 1 + 2**-20


def step_bounds(
    *,
    gradient: float,
    momentum: float | None,
    weights: float,
    learning_rate: float,
    momentum_factor: float,
    averaged: bool = False,
) -> StepBounds:
    """Bounds on ``max|g|``, ``max|m'|``, ``max|u|`` and ``max|θ + u|`` of a Nesterov step, from bounds on
    ``max|g|`` (``gradient``), ``max|m|`` (``momentum``; None on the first round: ``m' = g``) and ``max|θ|``
    (``weights``): ``m' = μ·m + g``, ``u = lr·(g + μ·m')`` (``u = g`` for ``averaged`` buffers),
    ``θ' = θ + u``, each grown by :data:`BOUND_ROUNDING` per operation. A step whose bounds are all finite
    and within its dtype's range cannot give Inf or NaN from finite inputs."""
    mu, lr = momentum_factor, learning_rate
    g = gradient * BOUND_ROUNDING
    m = g if momentum is None else (mu * momentum + g) * BOUND_ROUNDING
    u = lr * (g + mu * m) * BOUND_ROUNDING**2
    if averaged:
        u = max(u, g)
    return StepBounds(g, m, u, (weights + u) * BOUND_ROUNDING)


def _check_step(
    gradient: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor] | None,
    learning_rate: float,
    momentum_factor: float,
    averaged: Collection[str],
) -> tuple[list[str], dict[str, torch.Tensor] | None]:
    """The refusals of :func:`nesterov_step` (before anything is computed: a refusal names the first bad
    tensor in name order); (the stepped names, sorted; the momentum without ``averaged`` names)."""
    if not math.isfinite(learning_rate) or learning_rate <= 0:
        raise ValueError(f"learning_rate must be finite and > 0, got {learning_rate!r}")
    if not math.isfinite(momentum_factor) or not 0 <= momentum_factor < 1:
        raise ValueError(f"momentum_factor must be finite and in [0, 1), got {momentum_factor!r}")
    # Check everything before computing anything: a refusal names the first bad tensor in name order.
    for name in sorted(gradient):
        g = gradient[name]
        if not isinstance(g, torch.Tensor) or not g.dtype.is_floating_point:
            raise TensorRefused(name, "gradient is not a floating-point tensor")
    averaged = frozenset(averaged)
    stepped = sorted(name for name in gradient if name not in averaged)
    if momentum is not None:
        momentum = {name: tensor for name, tensor in momentum.items() if name not in averaged}
        _check_same_names(momentum, stepped, "the momentum")
        for name in stepped:
            _check_same_signature(
                name, momentum[name], gradient[name].shape, gradient[name].dtype, "the momentum"
            )
    return stepped, momentum
