"""The parameter server's only file I/O on tensors: safetensors files, read with ``safetensors.safe_open``.

File format: plain safetensors (readable by ``safetensors.torch.load_file``), plus two entries in the header's
``__metadata__`` when written by ``save``:

* ``hypha.format`` = ``"1"``;
* ``hypha.aliases`` = a JSON object ``{alias name: stored name}`` for tied weights (e.g. GPT-2's
  ``lm_head.weight`` → ``transformer.wte.weight``): a tensor reachable under several names is stored once,
  under the lexicographically smallest of them, and ``load`` gives it back under every name.

The parameter server also writes, in the files it publishes (the global model, each round's result):

* ``hypha.round`` = the rounds completed when the weights were θ (the round the result closed);
* ``hypha.digest`` = :func:`digest` of those global weights θ, which a trainer compares with its own after
  merging (docs/training.md, "What a trainer's weights equal after each round").

Files written by others (the trainers' ``save_file`` of a full ``state_dict``, ``save_model``) have no Hypha
metadata and load as they are.

``save`` is atomic: it writes a temporary file in the target's directory, fsyncs it, ``os.replace``s it
over the target and fsyncs the directory; whatever fails, the target is either the old file or the new one
and no temporary file is left behind.

Writing goes through ``safetensors.serialize_file`` with ``TensorSpec`` pointers rather than
``safetensors.torch.save_file``, because the latter needs numpy, which a GPU host does not have.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, TensorSpec, safe_open, serialize_file

from hypha_tensors.exceptions import TensorRefused, WeightsFileError
from hypha_tensors.formats import METADATA_KEYS as ENCODING_METADATA_KEYS

Signature = tuple[tuple[int, ...], torch.dtype]
"""(shape, dtype) of one tensor, as ``load(expected=...)`` and ``validate(reference=...)`` take it."""

FORMAT_KEY = "hypha.format"
ALIASES_KEY = "hypha.aliases"
FORMAT_VERSION = "1"
ROUND_KEY = "hypha.round"
DIGEST_KEY = "hypha.digest"

# safetensors header dtype codes → torch dtypes (those torch has).
_DTYPES_BY_CODE: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def signature(tensors: Mapping[str, torch.Tensor]) -> dict[str, Signature]:
    """Name → (shape, dtype) of a state dict, suitable for ``load(expected=...)``."""
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in tensors.items()}


def _as_signature(reference: torch.Tensor | Signature) -> Signature:
    if isinstance(reference, torch.Tensor):
        return tuple(reference.shape), reference.dtype
    shape, dtype = reference
    return tuple(shape), dtype


def _check_names(names: set[str], reference_names: set[str]) -> None:
    missing = sorted(reference_names - names)
    if missing:
        raise TensorRefused(missing[0], "missing")
    unknown = sorted(names - reference_names)
    if unknown:
        raise TensorRefused(unknown[0], "unknown name")


def _check_signature(name: str, shape: tuple[int, ...], dtype: torch.dtype, expected: Signature) -> None:
    expected_shape, expected_dtype = expected
    if shape != expected_shape:
        raise TensorRefused(name, f"shape {shape}, expected {expected_shape}")
    if dtype != expected_dtype:
        raise TensorRefused(name, f"dtype {dtype}, expected {expected_dtype}")


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        if tensor.element_size() == 1:
            # torch has no isfinite for float8; float16 holds every float8 value, NaN and Inf exactly.
            tensor = tensor.to(torch.float16)
        # A sum is finite only if every element is (NaN and ±Inf propagate; +Inf + −Inf is NaN): one pass
        # without temporary memory, 15–30× faster than isfinite at 25 M elements. A sum that overflowed
        # from finite values is told apart by the exact check.
        if bool(torch.isfinite(tensor.sum())):
            return
        if not bool(torch.isfinite(tensor).all()):
            if bool(torch.isnan(tensor).any()):
                raise TensorRefused(name, "contains NaN")
            raise TensorRefused(name, "contains Inf")


def validate(
    tensors: Mapping[str, torch.Tensor],
    *,
    reference: Mapping[str, torch.Tensor | Signature] | None = None,
    check_finite: bool = True,
) -> None:
    """Raise ``TensorRefused`` unless ``tensors`` is a clean state dict like ``reference``.

    Refused, in this order (the first problem found is reported, names in sorted order): a value that is not a
    tensor; with a reference, a missing name, then an unknown name, then a wrong shape or dtype; a NaN or
    Inf in a floating-point tensor (unless ``check_finite`` is False: the tensors came from :func:`load`,
    which checked them). ``reference`` maps each name to a tensor or to its ``(shape, dtype)``; without one
    only the values are checked. Nothing is mutated.
    """
    for name in sorted(tensors):
        if not isinstance(tensors[name], torch.Tensor):
            raise TensorRefused(name, f"is a {type(tensors[name]).__name__}, not a tensor")
    if reference is not None:
        _check_names(set(tensors), set(reference))
        for name in sorted(tensors):
            tensor = tensors[name]
            _check_signature(name, tuple(tensor.shape), tensor.dtype, _as_signature(reference[name]))
    if check_finite:
        for name in sorted(tensors):
            _check_finite(name, tensors[name])


def view_key(tensor: torch.Tensor) -> tuple[object, ...]:
    """Identifies the exact view: two names with equal keys are the same tensor (tied weights)."""
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _deduplicate(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Split a state dict into (stored name → tensor, alias name → stored name).

    Names are aliases only when they are the very same view (same storage, offset, shape, strides, dtype).
    Distinct views of one storage (slices, transposes) are stored as separate contiguous copies: they
    come back with the right values but no longer share memory. Empty tensors are never aliased (their
    storage pointers may coincide by accident).
    """
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name_by_key: dict[tuple[object, ...], str] = {}
    for name in sorted(tensors):
        tensor = tensors[name]
        key = view_key(tensor) if tensor.numel() > 0 else None
        if key is not None and key in first_name_by_key:
            aliases[name] = first_name_by_key[key]
            continue
        if key is not None:
            first_name_by_key[key] = name
        stored[name] = tensor
    return stored, aliases


def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """``sha256:<hex>`` of the floating-point tensors of a state dict: what the parameter server publishes of
    its global weights and a trainer checks its own against, bit for bit.

    Tied names (the same view) count once, under the name :func:`save` stores them by (the smallest); the
    stored names are hashed in sorted order, each as a JSON line ``[name, dtype, shape, bytes]`` followed by
    its raw contiguous little-endian CPU bytes. Integer and bool tensors are left out (not synchronised).
    """
    if sys.byteorder != "little":  # the raw bytes would differ from a little-endian host's
        raise NotImplementedError("a digest on a big-endian host")
    floating = {name: tensor for name, tensor in tensors.items() if tensor.dtype.is_floating_point}
    stored, _ = _deduplicate(floating)
    hasher = hashlib.sha256()
    for name in sorted(stored):
        tensor = stored[name].detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        hasher.update(json.dumps([name, dtype, list(tensor.shape), size]).encode() + b"\n")
        if size:
            # The tensor's memory itself (no numpy on a GPU host, no copy): alive while it is hashed.
            hasher.update((ctypes.c_char * size).from_address(tensor.data_ptr()))
    return "sha256:" + hasher.hexdigest()


def read_metadata(path: str | Path) -> dict[str, str]:
    """The header's ``__metadata__`` of a safetensors file (no tensor is read); ``WeightsFileError`` if the
    file is not safetensors."""
    try:
        with safe_open(str(path), framework="pt") as file:
            return dict(file.metadata() or {})
    except (SafetensorError, OSError) as error:
        raise WeightsFileError(Path(path), str(error)) from error


def header_dtypes(path: str | Path) -> dict[str, torch.dtype]:
    """Name → dtype of every tensor of a safetensors file (aliases included), from its header alone;
    ``WeightsFileError`` if it is not safetensors, ``TensorRefused`` for a dtype torch does not have."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as file:
            stored = set(file.keys())
            aliases = _read_aliases(path, file.metadata() or {}, stored)
            dtypes = {}
            for name in sorted(stored):
                code = file.get_slice(name).get_dtype()
                if code not in _DTYPES_BY_CODE:
                    raise TensorRefused(name, f"unsupported dtype {code}")
                dtypes[name] = _DTYPES_BY_CODE[code]
    except (SafetensorError, OSError) as error:
        raise WeightsFileError(path, str(error)) from error
    return {**dtypes, **{alias: dtypes[target] for alias, target in aliases.items()}}


def publication(path: str | Path) -> tuple[int | None, str | None]:
    """(``hypha.round``, ``hypha.digest``) of a file the parameter server published; ``None`` for what it
    does not say (a file of another server). ``WeightsFileError`` if it is not safetensors."""
    metadata = read_metadata(path)
    text = metadata.get(ROUND_KEY, "")
    round_number = int(text) if text.isascii() and text.isdigit() else None
    return round_number, metadata.get(DIGEST_KEY) or None


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable. Not every platform can open a directory; then it is skipped."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def save(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
    round_number: int | None = None,
    weights_digest: str | None = None,
) -> None:
    """Write ``tensors`` to ``path`` as safetensors, atomically and durably.

    * Every value must be a tensor with no NaN or Inf, else ``TensorRefused`` and nothing is written (the
      old file at ``path``, if any, is untouched). Tensors are copied to the CPU and made contiguous as needed.
    * Tied weights (several names for the same tensor) are stored once; see the module docstring.
    * ``metadata`` adds string entries to the header (keys starting with ``hypha.`` are reserved but for
      the encoding's, ``hypha.encoding`` and ``hypha.block_size``: :mod:`hypha_tensors.formats`;
      ``ValueError``); ``round_number`` and ``weights_digest`` write ``hypha.round`` and ``hypha.digest``
      (a published file: the rounds completed, the global weights' :func:`digest`).
    * I/O errors raise ``OSError``; no temporary file is left behind either way.
    """
    if sys.byteorder != "little":  # safetensors is little-endian and we write raw memory
        raise NotImplementedError("saving on a big-endian host")
    path = Path(path)
    extra = dict(metadata or {})
    reserved = sorted(key for key in extra if key.startswith("hypha.") and key not in ENCODING_METADATA_KEYS)
    if reserved:
        raise ValueError(f"metadata key {reserved[0]!r} is reserved")
    validate(tensors)
    stored, aliases = _deduplicate(tensors)
    header_metadata = {**extra, FORMAT_KEY: FORMAT_VERSION}
    if round_number is not None:
        header_metadata[ROUND_KEY] = str(round_number)
    if weights_digest is not None:
        header_metadata[DIGEST_KEY] = weights_digest
    if aliases:
        header_metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)

    # The specs hold raw pointers: keep every (possibly copied) tensor alive until serialize_file returns.
    keep_alive: list[torch.Tensor] = []
    specs: dict[str, TensorSpec] = {}
    for name, tensor in stored.items():
        contiguous = tensor.detach().to("cpu").contiguous()
        keep_alive.append(contiguous)
        specs[name] = TensorSpec(
            dtype=str(contiguous.dtype).removeprefix("torch."),
            shape=contiguous.shape,
            data_ptr=contiguous.data_ptr(),
            data_len=contiguous.numel() * contiguous.element_size(),
        )

    descriptor, temporary_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    temporary = Path(temporary_name)
    try:
        os.close(descriptor)
        serialize_file(specs, str(temporary), metadata=header_metadata)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    finally:
        del keep_alive
    _fsync_directory(path.parent)


def load(
    path: str | Path, *, expected: Mapping[str, torch.Tensor | Signature] | None = None, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Read a safetensors file into a state dict (names include tied-weight aliases).

    * A file that cannot be opened or is not complete, valid safetensors (random bytes, truncated, empty,
      inconsistent Hypha alias metadata) raises ``WeightsFileError`` naming the path and the reason.
    * With ``expected`` (name → tensor or ``(shape, dtype)``), names, shapes and dtypes are checked from
      the header *before* any tensor data is read: ``TensorRefused`` for a missing or unknown name, a wrong
      shape or dtype. Every floating-point tensor is checked for NaN and Inf (``TensorRefused``), with or
      without ``expected``.
    * An alias comes back as the *same tensor object* as its stored name (re-tying parameters in a model is
      the caller's business). The file is never modified or deleted.
    """
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device=device) as file:
            header_metadata = file.metadata() or {}
            stored_names = set(file.keys())
            aliases = _read_aliases(path, header_metadata, stored_names)
            if expected is not None:
                _check_names(stored_names | set(aliases), set(expected))
                for name in sorted(stored_names | set(aliases)):
                    tensor_slice = file.get_slice(aliases.get(name, name))
                    code = tensor_slice.get_dtype()
                    if code not in _DTYPES_BY_CODE:
                        raise TensorRefused(name, f"unsupported dtype {code}")
                    shape = tuple(tensor_slice.get_shape())
                    _check_signature(name, shape, _DTYPES_BY_CODE[code], _as_signature(expected[name]))
            tensors: dict[str, torch.Tensor] = {}
            for name in sorted(stored_names):
                tensor = file.get_tensor(name)
                _check_finite(name, tensor)
                tensors[name] = tensor
    except (SafetensorError, OSError) as error:
        raise WeightsFileError(path, str(error)) from error
    for alias, target in sorted(aliases.items()):
        tensors[alias] = tensors[target]
    return tensors


def _read_aliases(path: Path, header_metadata: Mapping[str, str], stored_names: set[str]) -> dict[str, str]:
    raw = header_metadata.get(ALIASES_KEY)
    if raw is None:
        return {}
    try:
        aliases = json.loads(raw)
    except json.JSONDecodeError as error:
        raise WeightsFileError(path, f"{ALIASES_KEY} is not JSON: {error}") from error
    if not isinstance(aliases, dict) or not all(
        isinstance(alias, str) and isinstance(target, str) for alias, target in aliases.items()
    ):
        raise WeightsFileError(path, f"{ALIASES_KEY} is not an object of names")
    for alias, target in sorted(aliases.items()):
        if target not in stored_names:
            raise WeightsFileError(path, f"alias {alias!r} points to {target!r}, which is not in the file")
        if alias in stored_names:
            raise WeightsFileError(path, f"alias {alias!r} is also a stored tensor")
    return aliases
