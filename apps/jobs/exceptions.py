"""Errors of the jobs app.

JobError
├── JobTransitionRefused    the job's state machine does not allow this transition now
├── JobNotCancellable       the job has already ended
├── RoundNotDiscardable     the owner cannot discard this round now
├── SpecError               the submitted specification is invalid (every mistake, by field path)
│   └── SpecUnreadable      …because its document cannot be read at all (a TOML syntax error)
└── TaskRefused             a daemon spoke about a task that is not its own, or not running
    └── TransferRefused     a transfer token or upload the control plane does not accept
"""

from __future__ import annotations


class JobError(Exception):
    """Base class of job errors."""


class JobTransitionRefused(JobError):
    def __init__(self, job, current: str, to: str) -> None:
        super().__init__(f"job {job.pk}: {current} → {to} is not allowed")
        self.job = job
        self.current = current
        self.to = to


class JobNotCancellable(JobError):
    """The job is already completed, cancelled or failed."""


class RoundNotDiscardable(JobError):
    """The round is not the running job's last closed round, or it cannot be discarded (see the message)."""


class SpecError(JobError, ValueError):
    """The specification is invalid; ``errors`` lists every mistake as ``{"field": dotted path, "message"}``.

    ``field`` is ``""`` for a mistake of the document as a whole (a TOML syntax error).
    """

    def __init__(self, errors: list[dict[str, str]]) -> None:
        self.errors = errors
        summary = "; ".join(f"{error['field'] or '(document)'}: {error['message']}" for error in errors)
        super().__init__(f"invalid DiLoCo specification: {summary}")


class SpecUnreadable(SpecError):
    """The specification's document cannot be read at all (a TOML syntax error, too large, nested too deep):
    one mistake of the whole document, answered by the API as ``{"detail": ...}`` like malformed JSON."""

    def __init__(self, message: str) -> None:
        super().__init__([{"field": "", "message": message}])
        self.message = message


class TaskRefused(JobError):
    """A daemon's message about a task it does not run (another worker's, unknown, or already ended)."""


class TransferRefused(JobError):
    """An upload to the control plane that is refused: ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, *, status: int = 403) -> None:
        super().__init__(message)
        self.status = status
