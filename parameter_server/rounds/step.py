"""A closed round's outer step, on the coordinator's state (:mod:`parameter_server.rounds`): the mean taken
from the round's accumulator, Nesterov on it, ``θ + u`` into buffers from the pool, the finiteness checks and
the encoding of ``u`` with error feedback.

A round steps the tensors it synced only: every tensor in a job without fragments, the round's fragment in a
streaming job (``hypha_tensors.fragments``). The momentum is per tensor name: the fragment's entries are
stepped (an entry a fragment has not had yet starts as ``m ← g``), every other entry is carried over as it
is, and so are the other fragments' weights (the same tensor objects: a carried tensor is held by the new
weights as well, so the pool never hands its memory out while they are published).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from hypha_tensors.encoding import EncodingError, encode, encode_with_feedback
from hypha_tensors.formats import Encoding
from parameter_server.buffers import BufferPool
from parameter_server.exceptions import TensorRefused
from parameter_server.math import (
    StateDict,
    check_finite,
    largest_magnitude,
    nesterov_step_,
    step_bounds,
)
from parameter_server.rounds.records import OpenRound, Step

#: A step whose bounds (math.step_bounds) stay under this fraction of its dtype's largest value is finite
#: without a check: a factor of 4 to spare beyond the rounding the bounds allow for.
_HEADROOM = 0.25


class StepArithmetic:
    """The outer step of :class:`~parameter_server.rounds.RoundCoordinator` (a base class of it: the state
    below is the coordinator's, set in its ``__init__``). Every method runs in the closing round's thread,
    under the coordinator's lock; none of them changes the coordinator's state: the caller installs the
    returned :class:`~parameter_server.rounds.records.Step`."""

    weights: StateDict
    _momentum: StateDict | None
    _momentum_lock: threading.Lock
    _pool: BufferPool
    _floating: list[str]
    _fragments: tuple[tuple[str, ...], ...]
    buffers: frozenset[str]
    encoding: Encoding
    learning_rate: float
    momentum_factor: float
    _residual: StateDict
    _weights_bound: float | None
    _momentum_bound: float | None
    _finite_max: float
    _scale_names: bool

    @property
    def streaming(self) -> bool:
        """Whether rounds sync one fragment each (more than one fragment)."""
        return len(self._fragments) > 1

    def _kept(self, current: OpenRound, discarded: str | None = None) -> Step:
        """No step: u = 0 over the round's tensors, the weights and the momentum kept (zeros encode exactly
        in every encoding; the residual is kept for the next step)."""
        zeros = {name: torch.zeros_like(self.weights[name]) for name in current.names}
        return Step(
            zeros,
            self.weights,
            self._momentum,
            discarded=discarded,
            encoded=encode(zeros, self.encoding),
            bounds=(self._weights_bound, self._momentum_bound),
        )

    def _step(self, current: OpenRound) -> Step:
        """The closed round's outer step (or none: u = 0, weights and momentum kept); runs in a thread.
        With a lossy encoding the step applied is the decoded ``Q(u + e)`` (see the package docstring)."""
        if current.mean.count == 0 or current.mean.total_weight == 0:
            return self._kept(current)
        with self._momentum_lock:
            old_momentum = self._old_momentum(current.names)
        bounds = (
            self._bounds(current.mean.bound(), first=old_momentum is None)
            if not self.encoding.lossy
            else None
        )
        gradient = current.mean.take()  # the round is over: no copy, the accumulator becomes u
        with self._momentum_lock:
            update, stepped_momentum = nesterov_step_(
                gradient=gradient,
                momentum=old_momentum,
                learning_rate=self.learning_rate,
                momentum_factor=self.momentum_factor,
                averaged=self.buffers,
                momentum_out=self._momentum_target(gradient, old_momentum, in_place=bounds is not None),
            )
        momentum = self._merged_momentum(stepped_momentum)
        if bounds is not None:  # finite for certain, and float32 sends u as it is
            new_weights = self._add_to_weights(update)
            return Step(
                update, new_weights, momentum, stepped=True, encoded=dict(update), residual={}, bounds=bounds
            )
        # Checked here rather than when saving: a step that is not finite is thrown away, the job goes on.
        try:
            check_finite(update)
        except TensorRefused as error:
            return self._kept(current, f"the outer step is not finite ({error.name!r} {error.reason})")
        try:
            sent = encode_with_feedback(update, self._residual, self.encoding, keep_decoded=True)
        except EncodingError as error:  # past float16's range
            return self._kept(current, f"the outer step cannot be sent as {self.encoding} ({error})")
        assert sent.decoded is not None
        update = sent.decoded  # what trainers decode, and so what is applied here
        new_weights = self._add_to_weights(update)
        # The tensors this step made: the others are the previous round's, finite already.
        for what, tensors in (
            ("the new weights are", {name: new_weights[name] for name in update}),
            ("the new momentum is", stepped_momentum),
        ):
            try:
                check_finite(tensors)
            except TensorRefused as error:
                return self._kept(current, f"{what} not finite ({error.name!r} {error.reason})")
        # Bounds unknown (or too large to prove anything): measured again when the next step needs them.
        return Step(update, new_weights, momentum, stepped=True, encoded=sent.encoded, residual=sent.residual)

    def _old_momentum(self, names: Sequence[str]) -> StateDict | None:
        """The momentum the step of ``names`` starts from: all of it without fragments (None before the
        first step); in a streaming job, the fragment's entries (the coordinator's own tensor objects), None
        when it has none yet (its first step: ``m ← g``), zeros for the entries it lacks when it has some
        (a model whose buffers changed: ``μ·0 + g`` is ``m ← g`` for those)."""
        if not self.streaming or self._momentum is None:
            return self._momentum
        stepped = [name for name in names if name not in self.buffers]
        present = [name for name in stepped if name in self._momentum]
        if not present:
            return None
        return {
            name: self._momentum[name] if name in self._momentum else torch.zeros_like(self.weights[name])
            for name in stepped
        }

    def _merged_momentum(self, stepped: StateDict) -> StateDict:
        """The momentum after a step whose new entries are ``stepped``: those alone without fragments; in a
        streaming job, every other entry carried over unchanged (the other fragments')."""
        if not self.streaming or self._momentum is None:
            return stepped
        return {**self._momentum, **stepped}

    def _bounds(self, gradient_bound: float, *, first: bool) -> tuple[float, float] | None:
        """(bound on max|θ'|, bound on max|m'|) of a step whose mean is bounded by ``gradient_bound``, if they
        prove every result of the step finite (see the coordinator's docstring); else None. Measures max|θ|
        and max|m| (one ``aminmax`` pass) when no earlier step bounds them. ``first``: the step starts the
        momentum of its tensors (``m ← g``). Both bounds hold over every tensor, stepped or carried over."""
        if self._weights_bound is None:
            self._weights_bound = max(
                (largest_magnitude(self.weights[name]) for name in self._floating), default=0.0
            )
        if self._momentum_bound is None:
            tensors = () if self._momentum is None else self._momentum.values()
            self._momentum_bound = max((largest_magnitude(tensor) for tensor in tensors), default=0.0)
        bounds = step_bounds(
            gradient=gradient_bound,
            momentum=None if first else self._momentum_bound,
            weights=self._weights_bound,
            learning_rate=self.learning_rate,
            momentum_factor=self.momentum_factor,
            averaged=bool(self.buffers),
        )
        if not max(bounds) <= _HEADROOM * self._finite_max or self._scale_names:  # also NaN
            return None
        momentum_bound = bounds.momentum
        if self.streaming:  # the other fragments' entries are carried over as they are
            momentum_bound = max(momentum_bound, self._momentum_bound)
        return bounds.weights, momentum_bound

    def _momentum_target(
        self, gradient: StateDict, momentum: StateDict | None, *, in_place: bool
    ) -> StateDict | None:
        """Where :func:`nesterov_step_` writes the new momentum: ``momentum`` itself (the step's old
        momentum, the coordinator's own tensors) when ``in_place`` (the step cannot be discarded) and nothing
        but this coordinator holds it, else a set from the pool."""
        wanted = {
            name: (tuple(tensor.shape), tensor.dtype)
            for name, tensor in gradient.items()
            if name not in self.buffers and tensor.dtype in (torch.float32, torch.float64)
        }
        if not wanted or any(tensor.device.type != "cpu" for tensor in gradient.values()):
            return None
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
        without an update keep their tensor (the same object: the new weights hold it too)."""
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
