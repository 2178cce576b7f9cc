"""A dataset directory on disk: slice files ``00000.safetensors``, ``00001.safetensors``, … and their digests.

The original counted every directory entry in ``read_dir`` order (unsorted, and including stray files); here a
slice is a file whose name is its index (digits, zero-padded to at least 5) plus ``.safetensors``, the indices
must be exactly ``0..n-1``, and anything else in the directory (hidden files, ``*.partial``) is ignored.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

SLICE_NAME = re.compile(r"^(\d{5,})\.safetensors$")
DATASET_NAME = re.compile(r"^[-a-zA-Z0-9_]+$")
CHUNK = 1 << 20


class InvalidDatasetDirectory(Exception):
    """The directory is not a dataset: missing, no slices, a gap in the indices, or a name that is no slug."""


@dataclass(frozen=True)
class SliceFile:
    index: int
    path: Path
    size: int
    sha256: str


def slice_file_name(index: int) -> str:
    return f"{index:05d}.safetensors"


def sha256_of(path: Path) -> str:
    """SHA-256 (lowercase hex) of a file, read in 1 MiB chunks so a large slice is never held in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def dataset_name(directory: Path) -> str:
    """The dataset's name: the directory's basename, which must be a slug (≤ 200 characters)."""
    name = directory.resolve().name
    if not DATASET_NAME.match(name) or len(name) > 200:
        raise InvalidDatasetDirectory(
            f"dataset directory name {name!r} must be a slug (letters, digits, '-', '_'; ≤ 200 chars)"
        )
    return name


def scan(directory: Path) -> list[SliceFile]:
    """The slices of ``directory`` in index order, each with its size and SHA-256."""
    if not directory.is_dir():
        raise InvalidDatasetDirectory(f"{directory} is not a directory")
    found: dict[int, Path] = {}
    for entry in directory.iterdir():
        match = SLICE_NAME.match(entry.name)
        if match and entry.is_symlink() and not entry.exists():  # a slice ``hypha-data import`` linked
            raise InvalidDatasetDirectory(f"{entry} links to {entry.readlink()}, which does not exist")
        if match and entry.is_file():
            index = int(match.group(1))
            if index in found:
                raise InvalidDatasetDirectory(
                    f"{directory}: slice {index} is both {found[index].name} and {entry.name}"
                )
            found[index] = entry
    if not found:
        raise InvalidDatasetDirectory(f"{directory} holds no slice files (00000.safetensors, …)")
    indices = sorted(found)
    if indices != list(range(len(indices))):
        missing = sorted(set(range(indices[-1] + 1)) - set(indices))
        raise InvalidDatasetDirectory(f"{directory}: slices must be numbered 0..n-1; missing {missing[:10]}")
    slices = []
    for index in indices:
        path = found[index]
        size = path.stat().st_size
        if size == 0:
            raise InvalidDatasetDirectory(f"{path} is empty")
        slices.append(SliceFile(index=index, path=path, size=size, sha256=sha256_of(path)))
    return slices
