"""Errors of the parameter server.

Hierarchy::

    ParameterServerError           base of everything the parameter server raises on purpose
    ├── TensorRefused              one named tensor is wrong: missing, unknown, wrong shape or dtype,
    │                              NaN/Inf, not floating point; ``name`` and ``reason`` say which and why
    ├── WeightsFileError           a file is not usable safetensors: unreadable, random bytes, truncated,
    │                              bad alias metadata; ``path`` and ``reason``
    ├── NoUpdatesError             a mean was asked of zero updates (or of weights summing to zero)
    └── CheckpointError            a round directory cannot be written, or the latest one cannot be read

Programming errors in arguments that never come from the network (a negative learning rate, a non-finite
sample weight) raise ``ValueError``; I/O failures of the operating system while *writing* surface as
``OSError`` unless a module says otherwise.
"""

from __future__ import annotations

from pathlib import Path


class ParameterServerError(Exception):
    """Base class of the parameter server's own errors."""


class TensorRefused(ParameterServerError):
    """A tensor was refused. ``name`` is the tensor's name in the state dict, ``reason`` a short phrase."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"tensor {name!r} refused: {reason}")
        self.name = name
        self.reason = reason


class WeightsFileError(ParameterServerError):
    """A weights file cannot be read as safetensors (or its Hypha metadata is inconsistent)."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


class NoUpdatesError(ParameterServerError):
    """A mean of nothing: no update was added, or their weights sum to zero."""


class CheckpointError(ParameterServerError):
    """A round checkpoint cannot be written (e.g. the round already exists) or the latest one cannot be read."""
