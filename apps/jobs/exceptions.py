"""Errors of the jobs app.

JobError
├── JobTransitionRefused    the job's state machine does not allow this transition now
└── JobNotCancellable       the job has already ended
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
