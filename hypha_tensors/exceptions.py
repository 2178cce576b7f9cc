"""Errors of the tensor helpers the executor and the parameter server share.

Hierarchy::

    TensorError            base of everything hypha_tensors raises about a tensor or a file of tensors
    ├── TensorRefused      one named tensor is wrong: missing, unknown, wrong shape or dtype, NaN/Inf, not
    │                      floating point; ``name`` and ``reason`` say which and why
    └── WeightsFileError   a file is not usable safetensors: unreadable, random bytes, truncated, bad alias
                           metadata; ``path`` and ``reason``

An encoded body that is not in the job's encoding raises :class:`hypha_tensors.formats.EncodingError` (a
``ValueError``).
"""

from __future__ import annotations

from pathlib import Path


class TensorError(Exception):
    """Base class of the errors about tensors and tensor files."""


class TensorRefused(TensorError):
    """A tensor was refused. ``name`` is the tensor's name in the state dict, ``reason`` a short phrase."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"tensor {name!r} refused: {reason}")
        self.name = name
        self.reason = reason


class WeightsFileError(TensorError):
    """A weights file cannot be read as safetensors (or its Hypha metadata is inconsistent)."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason
