"""Errors of the parameter server.

Hierarchy::

    ParameterServerError           base of everything the parameter server raises on purpose
    ├── NoUpdatesError             a mean was asked of zero updates (or of weights summing to zero)
    ├── CheckpointError            a round directory cannot be written, or the latest one cannot be read
    ├── JobConfigError             the job JSON (or a command-line argument) is unusable: exit code 2
    ├── ModelSourceError           the initial model cannot be built or fetched from its source
    ├── EvalDataError              an eval slice cannot be downloaded or does not match its size/SHA-256
    ├── EvalNotFinite              the global model's eval loss is NaN or Inf (e.g. broken running statistics)
    ├── UploadError                the final model could not be uploaded to the control plane
    ├── UpdateRefused              422: a well-formed update the round will not take (its norm is out of
    │                              bounds for the round, or its weighted values would overflow the sum)
    └── RoundError                 an update or a result asked of the wrong round (HTTP status in ``status``)
        ├── RoundConflict          409: the round is not open, already closed, or this peer already sent
        ├── RoundPruned            410: the round's result is no longer kept
        └── UnknownRound           404: no such round in this job (< 1 or > update_rounds)

The errors about tensors and tensor files (``TensorRefused``, ``WeightsFileError``) are
:mod:`hypha_tensors.exceptions`' (the executor shares those helpers), re-exported here; catch
:data:`ERRORS` where any of the parameter server's own errors is meant.

Programming errors in arguments that never come from the network (a negative learning rate, a non-finite
sample weight) raise ``ValueError``; I/O failures of the operating system while *writing* surface as
``OSError`` unless a module says otherwise.
"""

from __future__ import annotations

from hypha_tensors.exceptions import TensorError, TensorRefused, WeightsFileError


class ParameterServerError(Exception):
    """Base class of the parameter server's own errors."""


class NoUpdatesError(ParameterServerError):
    """A mean of nothing: no update was added, or their weights sum to zero."""


class CheckpointError(ParameterServerError):
    """A round checkpoint cannot be written (e.g. the round already exists) or the latest one cannot be read."""


class JobConfigError(ParameterServerError):
    """The job JSON or a command-line argument is unusable (the process exits with code 2)."""


class ModelSourceError(ParameterServerError):
    """The initial model cannot be built from its config or fetched from its source."""


class EvalDataError(ParameterServerError):
    """An eval slice cannot be downloaded, or its size or SHA-256 is not the announced one."""


class EvalNotFinite(ParameterServerError):
    """The global model's eval loss is NaN or Inf: the model is broken (reported with the round)."""


class UploadError(ParameterServerError):
    """The final model could not be uploaded to the control plane."""


class UpdateRefused(ParameterServerError):
    """A well-formed update the round will not take: ``kind`` is the HTTP error kind (``refused_update``), the
    message says why. The round is left exactly as it was; the refusal is noted in its report."""

    status = 422

    def __init__(self, detail: str, *, kind: str = "refused_update") -> None:
        super().__init__(detail)
        self.kind = kind


class RoundError(ParameterServerError):
    """A request names a round it cannot have. ``status`` is the HTTP status the server answers with."""

    status = 409
    kind = "round_conflict"


class RoundConflict(RoundError):
    """The round is not open (closed, or not open yet), or this peer already sent its update for it."""

    status = 409
    kind = "round_conflict"


class RoundPruned(RoundError):
    """The round's result was dropped: only the last two rounds' results are kept."""

    status = 410
    kind = "round_pruned"


class UnknownRound(RoundError):
    """The round number is outside ``1..update_rounds``."""

    status = 404
    kind = "unknown_round"


#: Everything the parameter server raises on purpose, its own errors and the tensor helpers'.
ERRORS = (ParameterServerError, TensorError)

__all__ = [
    "ERRORS",
    "TensorError",
    "TensorRefused",
    "WeightsFileError",
    "ParameterServerError",
    "NoUpdatesError",
    "CheckpointError",
    "JobConfigError",
    "ModelSourceError",
    "EvalDataError",
    "EvalNotFinite",
    "UploadError",
    "UpdateRefused",
    "RoundError",
    "RoundConflict",
    "RoundPruned",
    "UnknownRound",
]
