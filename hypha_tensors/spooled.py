"""A safetensors file read one tensor at a time: the parameter server's update bodies, spooled to disk.

:func:`hypha_tensors.weights.load` reads a whole file into memory (and safetensors maps the file while it
does, so its pages count in the process's memory too): two 500 MB updates arriving at once cost four times
their size. A :class:`SpooledFile` instead checks the file's header with ``safetensors.safe_open`` (what
``load`` refuses as not safetensors, it refuses the same way: :class:`~hypha_tensors.exceptions.WeightsFileError`),
then reads each tensor with ``pread`` into a tensor of its own only when asked (:meth:`SpooledFile.read`), and
checks NaN/Inf a slice at a time (:meth:`SpooledFile.check_finite`). Nothing is cached and the file is never
mapped: a reader that takes one tensor at a time holds one tensor at a time.

:class:`SpooledView` is a :class:`~hypha_tensors.encoding.DecodedView` whose wire tensors are read from such
a file at every access (signatures from the header): the parameter server measures an update, then adds it
to the round's sum, reading (and decoding) one tensor at a time.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hypha_tensors.encoding import DecodedView, EncodedTensor
from hypha_tensors.exceptions import TensorRefused, WeightsFileError
from hypha_tensors.formats import FLOAT32, Encoding
from hypha_tensors.weights import _DTYPES_BY_CODE, _check_finite, _read_aliases

#: Bytes read at a time when checking a tensor for NaN and Inf.
FINITE_SLICE = 8 << 20


class SpooledFile:
    """A safetensors file's header, checked, and its tensors on demand. ``names`` are every name (aliases of
    tied weights included: an alias reads its stored tensor). Closed by :meth:`close`, ``with``, or when
    the last reference goes (a reader in another thread may still hold it)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with safe_open(str(self.path), framework="pt") as file:  # the header's checks, safetensors' own
                self.metadata: dict[str, str] = dict(file.metadata() or {})
                stored = set(file.keys())
            self.aliases = _read_aliases(self.path, self.metadata, stored)
            self._descriptor = os.open(self.path, os.O_RDONLY)
        except (SafetensorError, OSError) as error:
            raise WeightsFileError(self.path, str(error)) from error
        try:
            self._entries = self._read_header(stored)
        except BaseException:
            os.close(self._descriptor)
            raise

    def _read_header(self, stored: set[str]) -> dict[str, tuple[tuple[int, ...], torch.dtype, int, int]]:
        """Stored name → (shape, dtype, offset in the file, bytes); safe_open checked the offsets already."""
        try:
            (length,) = struct.unpack("<Q", os.pread(self._descriptor, 8, 0))
            header = json.loads(os.pread(self._descriptor, length, 8))
        except (OSError, struct.error, ValueError) as error:
            raise WeightsFileError(self.path, f"the header cannot be read again: {error}") from error
        entries = {}
        for name in sorted(stored):
            entry = header[name]
            code = entry["dtype"]
            if code not in _DTYPES_BY_CODE:
                raise TensorRefused(name, f"unsupported dtype {code}")
            begin, end = entry["data_offsets"]
            entries[name] = (tuple(entry["shape"]), _DTYPES_BY_CODE[code], 8 + length + begin, end - begin)
        return entries

    @property
    def names(self) -> list[str]:
        return sorted([*self._entries, *self.aliases])

    def _stored(self, name: str) -> tuple[tuple[int, ...], torch.dtype, int, int]:
        return self._entries[self.aliases.get(name, name)]

    def signature(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        shape, dtype, _, _ = self._stored(name)
        return shape, dtype

    def meta(self, name: str) -> torch.Tensor:
        """A tensor of ``name``'s shape and dtype that holds no memory (``device="meta"``): for checks."""
        shape, dtype = self.signature(name)
        return torch.empty(shape, dtype=dtype, device="meta")

    def _read_into(self, target: torch.Tensor, offset: int, size: int) -> None:
        if size == 0:
            return
        buffer = memoryview((ctypes.c_char * size).from_address(target.data_ptr())).cast("B")
        done = 0
        try:
            while done < size:
                count = os.preadv(self._descriptor, [buffer[done:]], offset + done)
                if count == 0:
                    raise WeightsFileError(self.path, "the file ends before its tensors do")
                done += count
        except OSError as error:
            raise WeightsFileError(self.path, str(error)) from error

    def read(self, name: str) -> torch.Tensor:
        """``name``'s tensor, read from the file now into memory of its own (NaN/Inf not checked here)."""
        shape, dtype, offset, size = self._stored(name)
        tensor = torch.empty(shape, dtype=dtype)
        self._read_into(tensor, offset, size)
        return tensor

    def check_finite(self) -> None:
        """``TensorRefused`` for the first floating-point stored tensor (sorted names) holding a NaN or Inf,
        as :func:`~hypha_tensors.weights.load` refuses it; read :data:`FINITE_SLICE` bytes at a time."""
        for name in sorted(self._entries):
            shape, dtype, offset, size = self._entries[name]
            if not (dtype.is_floating_point or dtype.is_complex) or size == 0:
                continue
            step = max(1, FINITE_SLICE // dtype.itemsize)
            count = math.prod(shape)
            scratch = torch.empty(min(step, count), dtype=dtype)
            for start in range(0, count, step):
                part = scratch[: min(step, count - start)]
                self._read_into(part, offset + start * dtype.itemsize, part.numel() * dtype.itemsize)
                _check_finite(name, part)

    def close(self) -> None:
        if getattr(self, "_descriptor", -1) >= 0:
            os.close(self._descriptor)
            self._descriptor = -1

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> SpooledFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Entries(Mapping[str, EncodedTensor]):
    """Name → its wire tensors, read from the file at every access."""

    def __init__(self, file: SpooledFile, grouped: Mapping[str, EncodedTensor]) -> None:
        self.file = file
        self.grouped = dict(grouped)

    def __getitem__(self, name: str) -> EncodedTensor:
        values, scales = self.grouped[name]
        return EncodedTensor(self.file.read(values), None if scales is None else self.file.read(scales))

    def __iter__(self) -> Iterator[str]:
        return iter(self.grouped)

    def __len__(self) -> int:
        return len(self.grouped)


class SpooledView(DecodedView):
    """A :class:`DecodedView` of a spooled file: ``grouped`` maps each name to the *file's names* of its
    values and scales (:func:`hypha_tensors.encoding.group` of ``{name: name}``), read at every access."""

    def __init__(
        self,
        file: SpooledFile,
        grouped: Mapping[str, EncodedTensor],
        encoding: Encoding,
        *,
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        self.file = file
        self.entries = _Entries(file, grouped)  # type: ignore[assignment]
        self.encoding = encoding
        self._dtypes = dict(dtypes or {})

    def signature(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        shape, dtype = self.file.signature(self.entries.grouped[name].values)
        if self.encoding.name == FLOAT32:
            return shape, dtype
        return shape, self._dtypes.get(name, torch.float32)

    def restrict(self, names: list[str] | tuple[str, ...]) -> SpooledView:
        grouped = self.entries.grouped
        return SpooledView(
            self.file, {name: grouped[name] for name in names}, self.encoding, dtypes=self._dtypes
        )
