"""Encode and decode dicts of tensors for the wire, and error feedback: pure functions, no files, no network.

The encodings (:class:`~hypha_tensors.formats.Encoding`; docs/training.md, "Encodings"):

* ``float32``: the tensors as they are (no copy; any floating dtype is kept). Exact.
* ``float16`` / ``bfloat16``: each value rounded to the nearest value of that dtype (relative error at most
  2^-11 / 2^-8); decoding back to float32 is exact. A value past float16's range (|x| > 65504) is refused.
* ``int8``: the flattened tensor is cut into blocks of ``block_size`` consecutive values (the last one may be
  shorter); block b has the scale ``s_b = max|x| / 127`` over the block (float32), each value is sent as
  ``q = round(x / s_b)`` in [-127, 127] (an all-zero block has ``s_b = 0`` and ``q = 0``). The int8 tensor
  keeps the tensor's shape and name; its scales travel as a 1-D float32 tensor ``name + ".__scale__"``.
  Decoding is ``q · s_b`` in float32, one correctly rounded multiplication per value, so every machine
  decodes the same bits. Round trip: ``|x − q·s_b| ≤ s_b / 2 = max|x| / 254`` per block (up to float32
  rounding, for scales in float32's normal range); zeros are exact.

Contracts every function keeps:

* Inputs are never mutated or retained; NaN or Inf anywhere is refused (:class:`EncodingError`), on both
  sides: a decoder also refuses scales that are negative, not finite, or so large that ``128 · s`` would
  overflow float32, and a float16/bfloat16 value that is not finite.
* Names whose tensors are the very same object (tied weights) are encoded once and share the encoded tensors
  (and residuals, and decoded tensors), so ``hypha_tensors.weights.save`` stores them once.
* Decoding gives float32 (or ``dtype``) tensors; ``float32`` gives back the tensors it was given.

**Error feedback** (:func:`encode_with_feedback`, :class:`ErrorFeedback`): the sender keeps what encoding
lost, ``e`` (zero at first), and sends ``Q(x + e)``; then ``e' = (x + e) − deQ(Q(x + e))``. So after k
updates the receiver has ``Σ deQ(…) = Σ x − e_k``: the sum of what was sent tracks the sum of the true
updates within one residual (``|e_k| ≤ s_b / 2`` per value for int8), instead of drifting by k of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch

from hypha_tensors.formats import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    INT8,
    SCALE_SUFFIX,
    Encoding,
    EncodingError,
)

__all__ = [
    "DecodedView",
    "add_scaled_",
    "EncodedTensor",
    "Encoding",
    "EncodingError",
    "ErrorFeedback",
    "Feedback",
    "block_count",
    "check",
    "decode",
    "decode_tensor",
    "encode",
    "encode_tensor",
    "encode_with_feedback",
    "group",
    "scale_name",
    "wire_dtype",
]

#: The int8 grid: q in [-QMAX, QMAX] (symmetric: -128 is never produced).
QMAX = 127
SCALE_DTYPE = torch.float32
#: The largest scale a decoder accepts: ``128 · s`` (int8's extreme value) stays a finite float32.
MAX_SCALE = torch.finfo(torch.float32).max / 128
_HALF_DTYPES = {FLOAT16: torch.float16, BFLOAT16: torch.bfloat16}
#: Values widened or decoded per slice when a tensor is added into another (4 MiB of float32 scratch): no
#: copy of a whole tensor, whose fresh pages cost more than the arithmetic.
SLICE = 1 << 20

StateDict = dict[str, torch.Tensor]


class EncodedTensor(NamedTuple):
    """One tensor on the wire: ``values`` (the tensor's shape, in the encoding's dtype) and, for int8, its
    per-block ``scales``."""

    values: torch.Tensor
    scales: torch.Tensor | None = None


def scale_name(name: str) -> str:
    """The name the scales of int8 tensor ``name`` travel under."""
    return name + SCALE_SUFFIX


def block_count(numel: int, block_size: int) -> int:
    """Blocks of ``block_size`` values a tensor of ``numel`` values is cut into (the last may be shorter)."""
    return -(-numel // block_size)


def wire_dtype(encoding: Encoding, dtype: torch.dtype) -> torch.dtype:
    """The dtype a floating-point tensor of ``dtype`` travels in."""
    if encoding.name == FLOAT32:
        return dtype
    if encoding.name == INT8:
        return torch.int8
    return _HALF_DTYPES[encoding.name]


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (floating point) holds no NaN and no Inf: one ``aminmax`` pass, which propagates NaN,
    and no temporary (``isfinite`` makes a model-sized float copy and three bool tensors: 30x slower)."""
    if tensor.numel() == 0:
        return True
    if tensor.element_size() == 1:
        tensor = tensor.to(torch.float16)  # no aminmax for float8; float16 holds its values exactly
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def _refuse_not_finite(tensor: torch.Tensor, name: str, what: str = "contains NaN or Inf") -> None:
    if not _all_finite(tensor):
        raise EncodingError(what, name=name)


# --- one tensor ----------------------------------------------------------------------------------------------


def encode_tensor(tensor: torch.Tensor, encoding: Encoding, *, name: str = "tensor") -> EncodedTensor:
    """``tensor`` (floating point, finite) in ``encoding``; :class:`EncodingError` otherwise."""
    if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
        raise EncodingError("is not a floating-point tensor", name=name)
    if tensor.requires_grad:
        tensor = tensor.detach()  # a new object: only when needed, float32 sends the tensor itself
    _refuse_not_finite(tensor, name)
    if encoding.name == FLOAT32:
        return EncodedTensor(tensor)
    if encoding.name in _HALF_DTYPES:
        values = tensor.to(_HALF_DTYPES[encoding.name])
        # float32 → float16 overflows to Inf past 65504 (bfloat16 has float32's range).
        _refuse_not_finite(values, name, f"is past {encoding.name}'s range")
        return EncodedTensor(values)
    return _quantize(tensor, encoding.block_size)


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """``flat`` (1-D) as a (blocks, block_size) grid, zero-padded at the end (a copy only when padded)."""
    count = block_count(flat.numel(), block_size)
    padding = count * block_size - flat.numel()
    if padding:
        flat = torch.cat([flat, flat.new_zeros(padding)])
    return flat.view(count, block_size)


def _quantize(tensor: torch.Tensor, block_size: int) -> EncodedTensor:
    flat = tensor.reshape(-1).to(torch.float32)
    grid = _blocks(flat, block_size)
    scales = grid.abs().amax(dim=1) / QMAX if grid.shape[0] else grid.new_zeros(0)
    # An all-zero block divides by 1 (its q are 0); clamp: x/s of the largest value may round past 127.
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = torch.round(grid / divisor[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    values = quantized.view(-1)[: flat.numel()].reshape(tensor.shape)
    return EncodedTensor(values.clone() if values.numel() != quantized.numel() else values, scales)


def check(entry: EncodedTensor, encoding: Encoding, *, name: str = "tensor") -> None:
    """Refuse (:class:`EncodingError`) what :func:`decode_tensor` would, short of reading the values: values
    that are not a tensor of the encoding's dtype (float32: any floating dtype), scales where there should be
    none, missing int8 scales, or scales of another dtype or shape than the blocks' or out of range
    (negative, not finite, or over :data:`MAX_SCALE`)."""
    values, scales = entry
    if not isinstance(values, torch.Tensor):
        raise EncodingError("is not a tensor", name=name)
    if encoding.name != INT8 and scales is not None:
        raise EncodingError(f"has scales, which {encoding.name} has not", name=name)
    if encoding.name == FLOAT32:
        if not values.dtype.is_floating_point:
            raise EncodingError(f"has dtype {values.dtype}, not a floating-point one", name=name)
        return
    expected = wire_dtype(encoding, torch.float32)
    if values.dtype != expected:
        raise EncodingError(f"has dtype {values.dtype}; {encoding} sends {expected}", name=name)
    if encoding.name != INT8:
        return
    count = block_count(values.numel(), encoding.block_size)
    if not isinstance(scales, torch.Tensor):
        raise EncodingError(f"has no scales ({scale_name(name)!r})", name=name)
    if scales.dtype != SCALE_DTYPE or tuple(scales.shape) != (count,):
        raise EncodingError(
            f"has scales of dtype {scales.dtype} and shape {tuple(scales.shape)}, expected "
            f"{SCALE_DTYPE} and ({count},) (blocks of {encoding.block_size})",
            name=name,
        )
    if count and not bool(((scales >= 0) & (scales <= MAX_SCALE)).all()):  # also False for NaN
        raise EncodingError(f"has a scale that is negative, not finite or over {MAX_SCALE:.3g}", name=name)


def decode_tensor(
    entry: EncodedTensor, encoding: Encoding, *, dtype: torch.dtype = torch.float32, name: str = "tensor"
) -> torch.Tensor:
    """The tensor ``entry`` encodes (``dtype``; float32 gives ``entry.values`` back as it is). Refuses
    (:class:`EncodingError`) what :func:`check` refuses, and non-finite float16/bfloat16 values."""
    check(entry, encoding, name=name)
    values, scales = entry
    if encoding.name == FLOAT32:
        return values
    if encoding.name in _HALF_DTYPES:
        _refuse_not_finite(values, name)
        return values.to(dtype)
    assert scales is not None
    grid = _blocks(values.reshape(-1).to(dtype), encoding.block_size)
    # One correctly rounded multiplication per value: the same bits on every machine.
    grid.mul_(scales.to(dtype)[:, None])
    return grid.view(-1)[: values.numel()].view(values.shape)


def add_scaled_(target: torch.Tensor, tensor: torch.Tensor, *, alpha: float) -> torch.Tensor:
    """``target += alpha · tensor`` in ``target``'s dtype, and ``target``: the same bits as
    ``target.add_(tensor.to(target.dtype), alpha=alpha)``, but a ``tensor`` of another dtype (float16 into a
    float32 sum) is widened a slice of :data:`SLICE` values at a time instead of copied whole. Same shape and
    device required (``RuntimeError`` otherwise, from torch)."""
    if tensor.dtype == target.dtype or not (target.is_contiguous() and tensor.is_contiguous()):
        return target.add_(tensor.to(target.dtype), alpha=alpha)
    if target.shape != tensor.shape:
        raise RuntimeError(f"cannot add a tensor of shape {tuple(tensor.shape)} into {tuple(target.shape)}")
    return _add_slices(target, tensor, None, 0, alpha)


def _add_slices(
    target: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None, block_size: int, alpha: float
) -> torch.Tensor:
    """``target += alpha · decoded`` where decoded is ``values`` in ``target``'s dtype, times its block's
    scale when ``scales`` are given (int8): :func:`decode_tensor`'s operations on each slice, then
    ``add_``. Both contiguous, same number of elements."""
    flat_target = target.view(-1)
    flat_values = values.reshape(-1)
    count = flat_values.numel()
    step = SLICE if scales is None else max(1, SLICE // block_size) * block_size
    scratch = torch.empty(min(step, count), dtype=target.dtype, device=target.device)
    wide_scales = None if scales is None else scales.to(target.dtype)
    for start in range(0, count, step):
        stop = min(start + step, count)
        part = scratch[: stop - start]
        part.copy_(flat_values[start:stop])
        if wide_scales is not None:
            first, whole = start // block_size, (stop - start) // block_size
            if whole:
                part[: whole * block_size].view(whole, block_size).mul_(
                    wide_scales[first : first + whole, None]
                )
            if (stop - start) % block_size:  # the tensor's last block, shorter than the others
                part[whole * block_size :].mul_(wide_scales[first + whole])
        flat_target[start:stop].add_(part, alpha=alpha)
    return target


# --- dicts of tensors ----------------------------------------------------------------------------------------


def encode(tensors: Mapping[str, torch.Tensor], encoding: Encoding) -> StateDict:
    """The wire tensors of ``tensors``: ``name`` → values, and for int8 ``name + ".__scale__"`` → scales.
    Tied names (the same tensor object) share their encoded tensors. A name that ends in ``.__scale__`` is
    refused."""
    encoded: StateDict = {}
    done: dict[int, EncodedTensor] = {}
    for name in sorted(tensors):
        if name.endswith(SCALE_SUFFIX):
            raise EncodingError(f"a tensor's name may not end in {SCALE_SUFFIX!r}", name=name)
        tensor = tensors[name]
        entry = done.get(id(tensor))
        if entry is None:
            entry = done[id(tensor)] = encode_tensor(tensor, encoding, name=name)
        encoded[name] = entry.values
        if entry.scales is not None:
            encoded[scale_name(name)] = entry.scales
    return encoded


def group(encoded: Mapping[str, torch.Tensor], encoding: Encoding) -> dict[str, EncodedTensor]:
    """Wire tensors grouped by tensor: name → (values, scales or None). Only the structure is checked here
    (a scale without its tensor, or scales in an encoding that has none: :class:`EncodingError`); what the
    values and scales must be is checked when they are decoded."""
    scales = {
        name.removesuffix(SCALE_SUFFIX): tensor
        for name, tensor in encoded.items()
        if name.endswith(SCALE_SUFFIX)
    }
    if scales and encoding.name != INT8:
        raise EncodingError(f"{encoding.name} has no scales", name=scale_name(sorted(scales)[0]))
    grouped = {
        name: EncodedTensor(tensor, scales.get(name))
        for name, tensor in sorted(encoded.items())
        if not name.endswith(SCALE_SUFFIX)
    }
    orphans = sorted(set(scales) - set(grouped))
    if orphans:
        raise EncodingError("scales without their tensor", name=scale_name(orphans[0]))
    return grouped


def decode(
    encoded: Mapping[str, torch.Tensor], encoding: Encoding, *, dtype: torch.dtype = torch.float32
) -> StateDict:
    """The tensors ``encoded`` (wire tensors, as :func:`encode` gives them) stands for; names whose values
    are the same tensor object (aliases of a loaded file) get the same decoded tensor."""
    decoded: StateDict = {}
    done: dict[int, torch.Tensor] = {}
    for name, entry in group(encoded, encoding).items():
        tensor = done.get(id(entry.values))
        if tensor is None:
            tensor = done[id(entry.values)] = decode_tensor(entry, encoding, dtype=dtype, name=name)
        decoded[name] = tensor
    return decoded


class DecodedView(Mapping[str, torch.Tensor]):
    """Grouped wire tensors read as the tensors they encode, decoded anew at every read (nothing cached):
    a reader that takes one tensor at a time holds one decoded tensor at a time. ``dtypes`` gives the
    decoded dtype per name (float32 when absent); :meth:`signature` says what a read gives without
    decoding. Decoding errors surface at the read (:class:`EncodingError`)."""

    def __init__(
        self,
        entries: Mapping[str, EncodedTensor],
        encoding: Encoding,
        *,
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        self.entries = dict(entries)
        self.encoding = encoding
        self._dtypes = dict(dtypes or {})

    def __getitem__(self, name: str) -> torch.Tensor:
        dtype = self._dtypes.get(name, torch.float32)
        return decode_tensor(self.entries[name], self.encoding, dtype=dtype, name=name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def add_into(self, name: str, target: torch.Tensor, *, alpha: float) -> torch.Tensor:
        """``target += alpha · self[name]``, decoding a slice at a time into ``target``'s dtype (no decoded copy
        of the whole tensor): the same bits as ``target.add_(self[name].to(target.dtype), alpha=alpha)``.
        Refuses (:class:`EncodingError`) what a read refuses, before ``target`` is touched."""
        entry = self.entries[name]
        check(entry, self.encoding, name=name)
        values, scales = entry
        if self.encoding.name in _HALF_DTYPES:
            _refuse_not_finite(values, name)
        if self.encoding.name == FLOAT32:  # the tensor as it is (any floating dtype), widened by slices
            return add_scaled_(target, values, alpha=alpha)
        dtype = self._dtypes.get(name, torch.float32)
        if (
            dtype != target.dtype
            or values.device != target.device
            or not (values.is_contiguous() and target.is_contiguous())
        ):
            return target.add_(self[name].to(target.dtype), alpha=alpha)
        if values.shape != target.shape:
            raise EncodingError(f"has shape {tuple(values.shape)}, the sum {tuple(target.shape)}", name=name)
        return _add_slices(target, values, scales, self.encoding.block_size, alpha)

    def signature(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of ``self[name]``, without decoding it."""
        values = self.entries[name].values
        if self.encoding.name == FLOAT32:
            return tuple(values.shape), values.dtype
        return tuple(values.shape), self._dtypes.get(name, torch.float32)

    def restrict(self, names: list[str] | tuple[str, ...]) -> DecodedView:
        """The view of ``names`` only (each must be present: ``KeyError``)."""
        return DecodedView({name: self.entries[name] for name in names}, self.encoding, dtypes=self._dtypes)


# --- error feedback ------------------------------------------------------------------------------------------


class Feedback(NamedTuple):
    """One encoding with error feedback: the wire tensors, what the receiver decodes (when asked for), and
    the new residual (empty for a lossless encoding)."""

    encoded: StateDict
    decoded: StateDict | None
    residual: StateDict


def encode_with_feedback(
    tensors: Mapping[str, torch.Tensor],
    residual: Mapping[str, torch.Tensor] | None,
    encoding: Encoding,
    *,
    keep_decoded: bool = False,
) -> Feedback:
    """Encode ``v = x + e`` (``e``: ``residual``, zero for a name it lacks) and return the wire tensors, the
    decoded ``deQ(Q(v))`` (``keep_decoded``) and the new residual ``e' = v − deQ(Q(v))``, all float32 for a
    lossy encoding. A lossless one (float32) sends ``x`` as it is and keeps no residual. A residual of
    another shape, or a ``v`` that cannot be encoded (not finite, past float16's range), raises
    :class:`EncodingError`; nothing is returned then, so the caller's residual stands."""
    if not encoding.lossy:
        encoded = encode(tensors, encoding)
        return Feedback(encoded, dict(tensors) if keep_decoded else None, {})
    residual = residual or {}
    encoded: StateDict = {}
    decoded: StateDict = {}
    new_residual: StateDict = {}
    done: dict[int, tuple[EncodedTensor, torch.Tensor | None, torch.Tensor]] = {}
    for name in sorted(tensors):
        if name.endswith(SCALE_SUFFIX):
            raise EncodingError(f"a tensor's name may not end in {SCALE_SUFFIX!r}", name=name)
        tensor = tensors[name]
        if id(tensor) not in done:
            if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
                raise EncodingError("is not a floating-point tensor", name=name)
            value = tensor.detach().to(torch.float32)
            carried = residual.get(name)
            if carried is not None:
                if carried.shape != value.shape:
                    raise EncodingError(
                        f"has shape {tuple(value.shape)}, its residual {tuple(carried.shape)}", name=name
                    )
                value = value + carried.to(value.device, torch.float32)
            entry = encode_tensor(value, encoding, name=name)
            sent = decode_tensor(entry, encoding, name=name)
            done[id(tensor)] = (entry, sent if keep_decoded else None, value - sent)
        entry, sent, left = done[id(tensor)]
        encoded[name] = entry.values
        if entry.scales is not None:
            encoded[scale_name(name)] = entry.scales
        if sent is not None:
            decoded[name] = sent
        new_residual[name] = left
    return Feedback(encoded, decoded if keep_decoded else None, new_residual)


class ErrorFeedback:
    """A sender's error feedback across updates: :meth:`encode` sends ``Q(x + e)`` and keeps the new ``e``
    (:func:`encode_with_feedback`). The residual lives in this object's memory only: one float32 copy of
    the tensors for a lossy encoding, nothing for float32."""

    def __init__(self, encoding: Encoding) -> None:
        self.encoding = encoding
        self.residual: StateDict = {}

    def encode(self, tensors: Mapping[str, torch.Tensor]) -> StateDict:
        """The wire tensors of ``tensors`` plus the residual; the residual of their names is replaced only on
        success, that of names not sent this time is kept (Streaming DiLoCo sends one fragment a round)."""
        result = encode_with_feedback(tensors, self.residual, self.encoding)
        self.residual = {**self.residual, **result.residual}
        return result.encoded

    def metadata(self) -> dict[str, str]:
        """The header metadata of a file holding what :meth:`encode` returned."""
        return self.encoding.metadata()
