"""Errors of the built-in executors.

Hierarchy::

    ExecutorError                  base of everything an executor raises on purpose; ``exit_code`` is the
    │                              process exit status :func:`worker_daemon.executors.training.main` maps it to
    ├── BridgeCallError            a bridge call failed: transport error, non-2xx reply (the body is in the
    │                              message), a reply that is not the documented JSON, or the receive stream
    │                              ended (exit 3)
    ├── JobConfigError             the JOB_JSON is malformed or asks for something unsupported (exit 4)
    └── TrainingError              training cannot go on (exit 5):
        ├── DataError              a data slice is unusable (not safetensors, missing input names, ragged)
        ├── UpdateError            a received update cannot be merged (names, shapes, NaN/Inf); the model
        │                          and the previous global weights are left untouched
        └── DivergedError          the training loss is NaN or Inf
"""

from __future__ import annotations


class ExecutorError(Exception):
    """Base class of the executors' own errors."""

    exit_code = 1


class BridgeCallError(ExecutorError):
    """A call to the job bridge failed; the message names the endpoint and, for a reply, status and body."""

    exit_code = 3

    def __init__(self, endpoint: str, message: str, *, status_code: int | None = None) -> None:
        super().__init__(f"{endpoint}: {message}")
        self.endpoint = endpoint
        self.status_code = status_code


class JobConfigError(ExecutorError):
    """The job's JSON is not a usable train config."""

    exit_code = 4


class TrainingError(ExecutorError):
    """Training cannot go on."""

    exit_code = 5


class DataError(TrainingError):
    """A data slice the bridge delivered is unusable."""


class UpdateError(TrainingError):
    """A received update cannot be merged into the global weights."""


class DivergedError(TrainingError):
    """The training loss is not finite."""
