"""Per-slice results of an inference job: what its workers upload, and what its owner downloads.

A worker sends the result of slice ``index`` with its task's transfer token (``PUT
/api/jobs/{id}/results/{index}/``, docs/inference.md). :func:`receive` checks who sends it and writes the body
to a partial file, outside any transaction (a result may be large); :func:`accept` then, under the job's lock
(``apps.jobs.services.result_uploaded``), moves it into place, records the :class:`InferenceResult` and marks
the slice USED, all in one transaction: a slice is USED exactly when its one result is stored.
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
from apps.jobs.exceptions import TransferRefused
from apps.jobs.inference.dispatch import EPOCH, slice_counts
from apps.jobs.models import INFERENCE, InferenceResult, Job, Task
from apps.jobs.training.storage import write_stream
from apps.jobs.training.tokens import transfer_key
from apps.leases.models import Lease
from worker_daemon import protocol

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

    @property
    def entry(self) -> dict:
        return {"index": self.index, "sha256": self.sha256, "size": self.size}


def inference_task(job: Job, token: str | None) -> Task:
    """The inference task of ``job`` whose transfer token ``token`` is; :class:`TransferRefused` otherwise
    (401 for a missing or bad token, 403 for another role's)."""
    if not token:
        raise TransferRefused("a transfer token is required (Authorization: Bearer …)", status=401)
    try:
        claims = protocol.verify_transfer_token(transfer_key(job.pk), token, job_id=str(job.pk))
    except protocol.TransferTokenError as error:
        raise TransferRefused(str(error), status=401) from None
    task = (
        Task.objects.select_related("lease")
        .filter(job=job, role=INFERENCE, lease_id=claims.get("lease"))
        .first()
    )
    if claims.get("role") != INFERENCE or task is None:
        raise TransferRefused("only the job's inference workers upload results")
    return task


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
    stored = InferenceResult.objects.filter(job=job, index=index).first()
    if stored is not None:
        if stored.lease_id == task.lease_id and stored.sha256 == sha256:
            return Received(task, index, sha256, stored.size, stored.format, partial=None)
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


def accept(job: Job, received: Received) -> tuple[dict, bool]:
    """Store a received result (the caller holds the job's lock, in a transaction): ``(entry, created)``.

    Checked again here: another upload of the slice may have been accepted while this one was written."""
    if received.partial is None:
        return received.entry, False
    try:
        job_slice = (
            JobSlice.objects.select_for_update(of=("self",))
            .filter(job=job, epoch=EPOCH, slice__index=received.index)
            .first()
        )
        stored = InferenceResult.objects.filter(job=job, index=received.index).first()
        lease = received.task.lease
        if stored is not None:
            if stored.lease_id == lease.pk and stored.sha256 == received.sha256:
                return received.entry, False
            raise TransferRefused(f"slice {received.index} has a stored result already", status=409)
        if (
            job_slice is None
            or job_slice.status != JobSlice.Status.ASSIGNED
            or job_slice.assigned_lease_id != lease.pk
        ):
            raise TransferRefused(f"slice {received.index} is not assigned to this worker", status=409)
        name = f"{received.index}.{received.format}"
        received.partial.replace(results_directory(job.pk) / name)
        job_slice.ack(lease)
        InferenceResult.objects.create(
            job=job,
            job_slice=job_slice,
            index=received.index,
            lease=lease,
            worker_id=lease.worker_id,
            sha256=received.sha256,
            size=received.size,
            format=received.format,
            path=f"results/{job.pk}/{name}",
        )
    finally:
        received.partial.unlink(missing_ok=True)
    return received.entry, True


def all_done(job: Job) -> bool:
    """Every slice of the job has its result (and there is at least one slice)."""
    done, total = slice_counts(job)
    return total > 0 and done == total


def completion_reason(job: Job) -> str:
    done, total = slice_counts(job)
    return f"COMPLETED: {done} of {total} slices processed"


def result_file(job: Job, index: int) -> tuple[Path, str] | None:
    """(path, download name) of slice ``index``'s stored result, or ``None``."""
    stored = InferenceResult.objects.filter(job=job, index=index).first()
    if stored is None:
        return None
    return Path(settings.HYPHA_DATA_DIR) / stored.path, f"{stored.index}.{stored.format}"


def archive(job: Job) -> Path:
    """A zip of every stored result of ``job`` (``<index>.<format>``) and a ``manifest.json`` of them.

    Results are only ever added, so their count names the archive: it is built once per count (a download of
    an older one goes on from its open file)."""
    results = list(InferenceResult.objects.filter(job=job).select_related("worker").order_by("index"))
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
