"""Errors of the datasets app.

DatasetError
├── InvalidDataset            the announced slices are not indices 0..n-1 with sizes and SHA-256 digests
├── DatasetConflict           a dataset of that name is already registered with different slices
├── DatasetNotFound           no dataset of that name is registered
├── JobDataError              the job's slice bookkeeping cannot do this
│   ├── JobNotPrepared        the job has no slices yet (call ``prepare_job`` first)
│   └── JobAlreadyPrepared    the job was already prepared for another dataset
├── LeaseNotEligible          the lease is not a live (ACTIVE) lease of this job
├── SliceNotFound             the job has no slice of that index in its current epoch
├── SliceTransitionRefused    the job slice's state machine does not allow this transition now
└── PublicationRefused        a data node's publication of a slice to the store (or a download of the
    │                         published copy) is refused; ``status`` is the HTTP answer (400 bad input, 404
    │                         missing, 409 state, 413 too large, 422 content mismatch, 503 not published yet)
    └── PublicationPartsMissing   complete asked while parts are missing (400, ``missing`` their numbers)

The store's own failures are :mod:`apps.relay.exceptions`' ``StoreError`` (the store is the relay's).
"""

from __future__ import annotations

from apps.relay.exceptions import PartsMissing, RelayRefused


class DatasetError(Exception):
    """Base class of dataset errors."""


class InvalidDataset(DatasetError):
    """The slices a data node announced are malformed; nothing was registered."""


class DatasetConflict(DatasetError):
    """Another registration of the same name announced different slices; nothing was registered."""


class DatasetNotFound(DatasetError):
    """No dataset of that name is registered."""


class JobDataError(DatasetError):
    """Base class of errors of a job's slice bookkeeping."""


class JobNotPrepared(JobDataError):
    """The job has no slices: ``prepare_job`` was not called for it."""


class JobAlreadyPrepared(JobDataError):
    """The job's slices belong to another dataset."""


class LeaseNotEligible(DatasetError):
    """Only an ACTIVE lease of the job itself may claim or acknowledge its slices."""


class SliceNotFound(DatasetError):
    """The job has no slice of that index in its current epoch."""


class SliceTransitionRefused(DatasetError):
    def __init__(self, job_slice, transition: str, message: str) -> None:
        super().__init__(f"job slice {job_slice.pk}: {transition} refused: {message}")
        self.job_slice = job_slice
        self.transition = transition


class PublicationRefused(DatasetError, RelayRefused):
    """The publication (or download) of a published slice is refused: ``status`` is the HTTP answer and
    ``field`` names the bad input field of a 400 (the relay's refusal, whose ``body()`` it answers with)."""


class PublicationPartsMissing(PublicationRefused, PartsMissing):
    """Parts of a published slice are not uploaded yet (``missing``: their numbers), as the relay says it."""
