"""Per-slice results of an inference job: what its workers upload, and what its owner downloads.

A worker sends the result of slice ``index`` with its task's transfer token (``PUT
/api/jobs/{id}/results/{index}/``, docs/inference.md). :func:`receive` checks who sends it and writes the body
to a partial file, outside any transaction (a result may be large); :func:`accept` then, under the job's lock
(``apps.jobs.services.result_uploaded``), moves it into place, records the :class:`InferenceResult` and marks
the slice USED, all in one transaction: a slice is USED exactly when its accepted result is stored. A verified
slice (:mod:`.verification`) is computed by two different workers first: the first computation is PENDING and
the slice goes back to AVAILABLE for another worker; it is USED once two computations agree. Downloads serve
each slice's accepted result only.
"""

from __future__ import annotations

import json
import re
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from apps.datasets.models import JobSlice
from apps.jobs import observers
from apps.jobs.exceptions import TransferRefused
from apps.jobs.inference import verification
from apps.jobs.inference.dispatch import EPOCH, slice_counts, spec_of
from apps.jobs.models import INFERENCE, InferenceResult, Job, Task
from apps.jobs.training.storage import write_stream
from apps.jobs.training.tokens import token_task
from apps.leases.models import Lease
from apps.workers import reputation

FORMATS = tuple(InferenceResult.Format.values)
SHA256 = re.compile(r"^[0-9a-f]{64}$")
MANIFEST = "manifest.json"


def results_directory(job_id) -> Path:
    return Path(settings.HYPHA_DATA_DIR) / "results" / str(job_id)


@dataclass(frozen=True)
class Received:
    """A result received for slice ``index``: written to ``partial`` (None for a repeat of a stored one)."""

    task: Task
    index: int
    sha256: str
    size: int
    format: str
    partial: Path | None
    #: The stored result's status (a repeat's; a new one's is set by :func:`accept`).
    status: str = ""

    @property
    def entry(self) -> dict:
        return {"index": self.index, "sha256": self.sha256, "size": self.size, "status": self.status}


def inference_task(job: Job, token: str | None) -> Task:
    """The inference task of ``job`` whose transfer token ``token`` is; :class:`TransferRefused` otherwise
    (401 for a missing or bad token, 403 for another role's)."""
    return token_task(job, token, role=INFERENCE, refused="only the job's inference workers upload results")


def receive(
    job: Job,
    index: int,
    *,
    token: str | None,
    sha256: str | None,
    result_format: str | None,
    chunks,
    declared_size: int | None,
    limit: int,
) -> Received:
    """Check an upload of slice ``index``'s result and write its body to a partial file; a repeat of the
    stored result is answered without reading the body. :class:`TransferRefused`: 401/403 (the token), 400
    (the headers, or a body whose SHA-256 is not the declared one), 404 (no such slice), 409 (the slice is not
    assigned to the sender, the job is not running), 413 (over ``limit`` bytes); nothing is kept then."""
    task = inference_task(job, token)
    sha256 = (sha256 or "").strip().lower()
    if not SHA256.match(sha256):
        raise TransferRefused("X-Content-SHA256 must be the body's SHA-256, 64 hex digits", status=400)
    if result_format not in FORMATS:
        raise TransferRefused(f"X-Result-Format must be one of {', '.join(FORMATS)}", status=400)
    job_slice = JobSlice.objects.filter(job=job, epoch=EPOCH, slice__index=index).first()
    if job_slice is None:
        raise TransferRefused(f"job {job.pk} has no slice {index}", status=404)
    stored = _own_result(job, index, task.lease)
    if stored is not None:
        if stored.lease_id == task.lease_id and stored.sha256 == sha256:
            return Received(
                task, index, sha256, stored.size, stored.format, partial=None, status=stored.status
            )
        raise TransferRefused(f"slice {index} has a stored result of this worker already", status=409)
    if job_slice.status == JobSlice.Status.USED:
        raise TransferRefused(f"slice {index} has a stored result already", status=409)
    if job.status != Job.Status.RUNNING:
        raise TransferRefused(f"job {job.pk} is {job.status}", status=409)
    # An executor exits once it is told there is no slice left, while its daemon may still be delivering its
    # last results (send answers at once, delivery runs behind): a task that EXITED cleanly on a live lease
    # still uploads; one whose lease ended does not (its slices went back to AVAILABLE).
    if task.status in (Task.Status.CANCELLED, Task.Status.FAILED) or task.lease.status != Lease.Status.ACTIVE:
        raise TransferRefused(f"this inference task is {task.status}; it uploads no more")
    if job_slice.status != JobSlice.Status.ASSIGNED or job_slice.assigned_lease_id != task.lease_id:
        raise TransferRefused(f"slice {index} is not assigned to this worker", status=409)
    if declared_size is not None and declared_size > limit:
        raise TransferRefused(f"the result exceeds {limit} bytes", status=413)
    partial = results_directory(job.pk) / f".incoming-{uuid.uuid4().hex}"
    written = write_stream(partial, chunks, limit=limit)
    if written["sha256"] != sha256:
        partial.unlink(missing_ok=True)
        raise TransferRefused(
            f"the body's SHA-256 is {written['sha256']}, not the declared {sha256}", status=400
        )
    return Received(task, index, sha256, written["size"], result_format, partial=partial)


def _own_result(job: Job, index: int, lease: Lease) -> InferenceResult | None:
    """The result of slice ``index`` this lease's worker computed, if any (a worker computes a slice once)."""
    return (
        InferenceResult.objects.filter(job=job, index=index, worker_id=lease.worker_id).first()
        or InferenceResult.objects.filter(job=job, index=index, lease=lease).first()
    )


def accept(job: Job, received: Received) -> tuple[dict, bool]:
    """Store a received result (the caller holds the job's lock, in a transaction): ``(entry, created)``.

    Checked again here: another upload of the slice may have been accepted while this one was written. An
    unverified slice's result is ACCEPTED and the slice USED; a verified slice's is compared with the other
    workers' (:func:`.verification.settle`): the slice is USED once two agree, else it goes back to AVAILABLE
    for another worker, and the workers whose results lost are counted (once: each result is settled once)."""
    if received.partial is None:
        return received.entry, False
    try:
        job_slice = (
            JobSlice.objects.select_for_update(of=("self",))
            .filter(job=job, epoch=EPOCH, slice__index=received.index)
            .first()
        )
        lease = received.task.lease
        stored = _own_result(job, received.index, lease)
        if stored is not None:
            if stored.lease_id == lease.pk and stored.sha256 == received.sha256:
                return {**received.entry, "status": stored.status}, False
            raise TransferRefused(
                f"slice {received.index} has a stored result of this worker already", status=409
            )
        if (
            job_slice is None
            or job_slice.status != JobSlice.Status.ASSIGNED
            or job_slice.assigned_lease_id != lease.pk
        ):
            raise TransferRefused(f"slice {received.index} is not assigned to this worker", status=409)
        earlier = InferenceResult.objects.filter(job=job, index=received.index).count()
        # A verified slice's later computations get a number of their own: none overwrites another.
        suffix = f".{earlier + 1}" if earlier else ""
        name = f"{received.index}{suffix}.{received.format}"
        received.partial.replace(results_directory(job.pk) / name)
        checks = spec_of(job).verification
        verified = verification.is_verified(job.pk, received.index, checks.fraction)
        result = InferenceResult.objects.create(
            job=job,
            job_slice=job_slice,
            index=received.index,
            status=InferenceResult.Status.PENDING if verified else InferenceResult.Status.ACCEPTED,
            lease=lease,
            worker_id=lease.worker_id,
            sha256=received.sha256,
            size=received.size,
            format=received.format,
            path=f"results/{job.pk}/{name}",
        )
        if verified:
            losers = verification.settle(job, result, checks)
            reputation.results_lost([loser.worker_id for loser in losers if loser.worker_id])
        if result.status == InferenceResult.Status.ACCEPTED:
            job_slice.ack(lease)
        else:
            job_slice.reopen(
                lease, reason=f"computed ({result.status}); another worker computes it for verification"
            )
        observers.task_progress(received.task, state_changed=True)  # the job page's slices done, after commit
    finally:
        received.partial.unlink(missing_ok=True)
    return {**received.entry, "status": result.status}, True


def all_done(job: Job) -> bool:
    """Every slice of the job has its result (and there is at least one slice)."""
    done, total = slice_counts(job)
    return total > 0 and done == total


def completion_reason(job: Job) -> str:
    done, total = slice_counts(job)
    return f"COMPLETED: {done} of {total} slices processed"


def accepted(job: Job):
    """The job's accepted results, the earliest of each slice first (a verified slice has two that agree)."""
    return InferenceResult.objects.filter(job=job, status=InferenceResult.Status.ACCEPTED).order_by(
        "index", "created_at", "pk"
    )


def result_file(job: Job, index: int) -> tuple[Path, str] | None:
    """(path, download name) of slice ``index``'s accepted result, or ``None``."""
    stored = accepted(job).filter(index=index).first()
    if stored is None:
        return None
    return Path(settings.HYPHA_DATA_DIR) / stored.path, f"{stored.index}.{stored.format}"


def archive(job: Job) -> Path:
    """A zip of each slice's accepted result of ``job`` (``<index>.<format>``) and a ``manifest.json`` of them.

    Accepted results are only ever added, so their count names the archive: it is built once per count (a
    download of an older one goes on from its open file)."""
    results: list[InferenceResult] = []
    for result in accepted(job):
        if not results or results[-1].index != result.index:
            results.append(result)
    directory = results_directory(job.pk)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"results-{len(results)}.zip"
    if target.exists():
        return target
    done, total = slice_counts(job)
    manifest = {
        "job": str(job.pk),
        "slices_done": done,
        "slices_total": total,
        "results": [
            {
                "index": result.index,
                "file": f"{result.index}.{result.format}",
                "format": result.format,
                "sha256": result.sha256,
                "size": result.size,
                "worker": str(result.worker_id) if result.worker_id else None,
            }
            for result in results
        ],
    }
    partial = directory / f".results-{uuid.uuid4().hex}.zip.part"
    try:
        # Stored, not deflated: safetensors barely compress, and the archive is rebuilt as results arrive.
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_STORED) as bundle:
            bundle.writestr(MANIFEST, json.dumps(manifest, indent=2))
            for result in results:
                bundle.write(
                    Path(settings.HYPHA_DATA_DIR) / result.path, arcname=f"{result.index}.{result.format}"
                )
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    for older in directory.glob("results-*.zip"):
        if older != target:
            older.unlink(missing_ok=True)
    return target
