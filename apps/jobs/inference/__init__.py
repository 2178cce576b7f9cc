"""Batch inference jobs (docs/inference.md): a model run over every slice of a registered dataset by N
workers leased on the same market as training (role ``inference``, executor class ``inference``).

The path of a job: submitted (its slices, one epoch, all AVAILABLE) → allocated → each worker dispatched with
the inference job JSON → workers claim slice after slice (:mod:`.slices`) and upload one result per slice
(:mod:`.results`: the slice is USED once its result is stored) → the job completes when every slice is USED.
A lost worker's unfinished slices go back to AVAILABLE with its lease, and a replacement is advertised and
dispatched while the others go on.

These functions run inside the caller's transaction; ``apps.jobs.services`` owns the workflows that end
leases or jobs (``result_uploaded`` completes the job). The package, by concern:

* :mod:`.dispatch` — the job JSON, dispatch and replacements, progress
* :mod:`.slices` — slice claims of inference tasks
* :mod:`.reports` — their progress reports (informative: counted on the task)
* :mod:`.results` — per-slice result uploads, downloads and the archive
* :mod:`.submission` — submitting a job (imported on its own: it builds on ``apps.jobs.services``)
"""

from __future__ import annotations

from apps.jobs.inference.dispatch import (
    dispatch_replacements,
    is_inference_job,
    job_json,
    model_artifact,
    progress,
    start,
)
from apps.jobs.inference.reports import handle_status
from apps.jobs.inference.results import (
    Received,
    accept,
    all_done,
    archive,
    completion_reason,
    receive,
    result_file,
    results_directory,
)
from apps.jobs.inference.slices import SLICE_RETRY_SECONDS, assign_slice, is_inference_task

__all__ = [
    "SLICE_RETRY_SECONDS",
    "Received",
    "accept",
    "all_done",
    "archive",
    "assign_slice",
    "completion_reason",
    "dispatch_replacements",
    "handle_status",
    "is_inference_job",
    "is_inference_task",
    "job_json",
    "model_artifact",
    "progress",
    "receive",
    "result_file",
    "results_directory",
    "start",
]
