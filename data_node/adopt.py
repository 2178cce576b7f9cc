"""``hypha-data import``: adopt safetensors slices that already exist, under any names, as a dataset directory.

Hypha's own data node serves every file of a directory, whatever it is called; ours serves
``DATASET/00000.safetensors``, … (:mod:`data_node.slices`). :func:`import_slices` bridges the two without copying
a byte: it checks the files and creates ``INTO/NAME/00000.safetensors``, … as symbolic links to them (absolute
targets, so the dataset directory may live anywhere). Symbolic links, not hard links: they work across file
systems, and the data node follows them (it opens the path; a dangling link is refused at start-up by name).

Which files, in which order: the regular files of ``DIR`` (not recursive) whose names end in ``.safetensors``
and do not start with ``.``, in natural order (``part-2`` before ``part-10``); other files are ignored and
counted. Slice ``i`` is the ``i``-th of them; :func:`import_slices` returns the mapping.

What is checked, from each file's safetensors header only (no tensor bytes are read): the header is valid and
the file is exactly as long as it says; every tensor has at least one dimension and all tensors of a file the
same length along dimension 0 (its samples: Hypha's executor zips the tensors along it); and every file has the
same tensor names, each with the same dtype and the same per-sample shape (all but dimension 0) as in the first
file. The first file that breaks a rule is named in the :class:`SliceCheckError`.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from data_node.slices import DATASET_NAME, SLICE_NAME, slice_file_name

MAX_HEADER = 100 << 20
"""Largest safetensors header accepted (safetensors itself refuses larger ones)."""


class SliceCheckError(Exception):
    """A file to import is no usable slice, or does not match the others. The message names the file."""


class ImportTargetError(Exception):
    """The dataset directory cannot be created, its name is no slug, or it already holds slices."""


@dataclass(frozen=True)
class TensorLayout:
    dtype: str
    sample_shape: tuple[int, ...]


@dataclass(frozen=True)
class SliceHeader:
    samples: int
    tensors: dict[str, TensorLayout]


def _natural_key(name: str) -> list[object]:
    return [(0, int(part), part) if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def source_files(directory: Path) -> tuple[list[Path], int]:
    """The files to import from ``directory`` in slice order, and how many other entries were ignored."""
    if not directory.is_dir():
        raise SliceCheckError(f"{directory} is not a directory")
    chosen, ignored = [], 0
    for entry in directory.iterdir():
        if entry.name.startswith("."):
            continue
        if entry.name.endswith(".safetensors") and entry.is_file():
            chosen.append(entry)
        else:
            ignored += 1
    if not chosen:
        raise SliceCheckError(f"{directory} holds no *.safetensors files")
    return sorted(chosen, key=lambda path: _natural_key(path.name)), ignored


def read_header(path: Path) -> SliceHeader:
    """The layout of the safetensors file ``path``, from its header; :class:`SliceCheckError` naming ``path``
    if it is not a well-formed safetensors file of per-sample tensors."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            prefix = file.read(8)
            if len(prefix) < 8:
                raise SliceCheckError(f"{path}: not a safetensors file ({size} bytes, no header length)")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER or 8 + length > size:
                raise SliceCheckError(
                    f"{path}: not a safetensors file (header length {length} of {size} bytes)"
                )
            raw = file.read(length)
    except OSError as error:
        raise SliceCheckError(f"{path}: cannot read: {error}") from error
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SliceCheckError(f"{path}: not a safetensors file (header is not JSON: {error})") from error
    if not isinstance(header, dict):
        raise SliceCheckError(f"{path}: not a safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)
    if not header:
        raise SliceCheckError(f"{path}: holds no tensors")
    tensors: dict[str, TensorLayout] = {}
    lengths: dict[str, int] = {}
    data_end = 0
    for name, entry in sorted(header.items()):
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            valid = (
                isinstance(dtype, str)
                and all(isinstance(d, int) and d >= 0 for d in shape)
                and 0 <= start <= end
            )
        except (TypeError, KeyError, ValueError):
            valid = False
        if not valid:
            raise SliceCheckError(f"{path}: not a safetensors file (bad header entry for tensor {name!r})")
        if not shape:
            raise SliceCheckError(
                f"{path}: tensor {name!r} is a scalar; a slice's tensors hold one row per sample (dimension 0)"
            )
        data_end = max(data_end, end)
        lengths[name] = shape[0]
        tensors[name] = TensorLayout(dtype=dtype, sample_shape=tuple(shape[1:]))
    if 8 + length + data_end != size:
        raise SliceCheckError(
            f"{path}: not a safetensors file (header describes {8 + length + data_end} bytes, the file has {size})"
        )
    if len(set(lengths.values())) != 1:
        raise SliceCheckError(
            f"{path}: tensors have different lengths along dimension 0 (samples): {lengths}"
        )
    return SliceHeader(samples=next(iter(lengths.values())), tensors=tensors)


def _layout(layout: TensorLayout) -> str:
    return f"{layout.dtype}[{', '.join(['N', *map(str, layout.sample_shape)])}]"


def _describe(tensors: Mapping[str, TensorLayout]) -> str:
    return ", ".join(f"{name} {_layout(layout)}" for name, layout in tensors.items())


def check_slices(files: list[Path]) -> list[SliceHeader]:
    """Each file's header; :class:`SliceCheckError` naming the first file that differs from the first one."""
    headers = [read_header(files[0])]
    expected = headers[0].tensors
    for path in files[1:]:
        header = read_header(path)
        if set(header.tensors) != set(expected):
            missing = sorted(set(expected) - set(header.tensors))
            extra = sorted(set(header.tensors) - set(expected))
            raise SliceCheckError(
                f"{path}: tensor names differ from {files[0].name}'s (missing {missing}, extra {extra})"
            )
        for name, layout in header.tensors.items():
            if layout != expected[name]:
                raise SliceCheckError(
                    f"{path}: tensor {name!r} is {_layout(layout)}, but in {files[0].name} it is "
                    f"{_layout(expected[name])} (dtype and per-sample shape must match)"
                )
        headers.append(header)
    return headers


def import_slices(*, source: Path, name: str, into: Path) -> dict[str, object]:
    """Check the slices of ``source`` and link them as ``into/name/00000.safetensors``, ….

    Returns ``{directory, slices: [(index, source file)], samples, ignored, tensors}``. Raises
    :class:`SliceCheckError` (nothing is created then) or :class:`ImportTargetError`. If linking fails midway,
    the links made so far are removed."""
    if not DATASET_NAME.match(name) or len(name) > 200:
        raise ImportTargetError(
            f"dataset name {name!r} must be a slug (letters, digits, '-', '_'; ≤ 200 chars)"
        )
    files, ignored = source_files(source)
    headers = check_slices(files)
    target = into / name
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ImportTargetError(f"cannot create {target}: {error}") from error
    existing = sorted(entry.name for entry in target.iterdir() if SLICE_NAME.match(entry.name))
    if existing:
        raise ImportTargetError(
            f"{target} already holds slices ({existing[0]}, …); use another --into or --name"
        )
    made: list[Path] = []
    try:
        for index, path in enumerate(files):
            link = target / slice_file_name(index)
            os.symlink(path.resolve(), link)
            made.append(link)
    except OSError as error:
        for link in made:
            link.unlink(missing_ok=True)
        raise ImportTargetError(f"cannot link slices into {target}: {error}") from error
    return {
        "directory": target,
        "slices": list(enumerate(files)),
        "samples": sum(header.samples for header in headers),
        "ignored": ignored,
        "tensors": _describe(headers[0].tensors),
    }
