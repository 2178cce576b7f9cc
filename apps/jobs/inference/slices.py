"""Slices for inference workers: each slice of the job's one epoch is processed once.

Unlike a trainer's, an inference worker's slice is not acknowledged when it is fetched: it becomes USED only
when its result is stored (:mod:`.results`), so a worker lost before that gives it back (its lease's ASSIGNED
slices return to AVAILABLE) and another worker computes it. When nothing is AVAILABLE the answer says whether
to ask again (slices are held by other live leases: one may be lost) or that the worker is ``done``. A slice
this worker has computed already (it waits for another worker's computation to verify it) is never handed to
it again: it asks again while such slices are left.
"""

from __future__ import annotations

from apps.datasets.models import JobSlice
from apps.jobs.inference.dispatch import EPOCH, spec_of
from apps.jobs.models import INFERENCE, Job, Task
from apps.jobs.training.dispatch import slice_urls
from apps.jobs.training.slices import answer_slice_request
from apps.leases.models import Lease
from worker_daemon import protocol

#: Seconds an inference worker waits before asking again while every slice left is held by another worker.
SLICE_RETRY_SECONDS = 1.0


def is_inference_task(worker, task_id) -> bool:
    """Whether ``task_id`` is an inference task on ``worker``'s lease (one light query)."""
    return Task.objects.filter(pk=task_id, lease__worker_id=worker.pk, role=INFERENCE).exists()


def assign_slice(worker, message: protocol.FetchSlice) -> protocol.SliceAssigned:
    """Claim the next slice for the inference task, or say when to ask again, or that it is done (never
    raises for a bad request). A repeated request (same id, after a reconnect) gets the same answer."""
    return answer_slice_request(worker, message, _assign_slice)


def _assign_slice(task: Task, message: protocol.FetchSlice, refused) -> protocol.SliceAssigned:
    job = task.job
    if task.role == INFERENCE and job.status == Job.Status.COMPLETED:
        # Another worker stored the last result while this one asked: nothing is left, which is no error (its
        # executor exits 0 on it).
        return protocol.SliceAssigned(request_id=message.request_id, dataset=message.dataset, done=True)
    if task.role != INFERENCE or not task.is_live or job.status != Job.Status.RUNNING:
        return refused(f"task {task.pk} is not a running inference task")
    name = spec_of(job).dataset.name
    if message.dataset != name:
        return refused(f"job {job.pk} runs on dataset {name!r}, not {message.dataset!r}")
    # Held until commit: the lease cannot end between this check and the assignment (a lease that ends after
    # the commit finds the slice ASSIGNED to it and gives it back).
    lease = Lease.objects.select_for_update().filter(pk=task.lease_id, status=Lease.Status.ACTIVE).first()
    if lease is None:
        return refused(f"the lease of task {task.pk} is not active")
    rows = JobSlice.objects.filter(job=job, epoch=EPOCH)
    candidate = (
        rows.filter(status=JobSlice.Status.AVAILABLE)
        # A slice waiting for its verification's second (or third) computation goes to another worker.
        .exclude(inference_results__worker_id=lease.worker_id)
        .select_for_update(skip_locked=True, of=("self",))
        .select_related("slice__dataset")
        .order_by("slice__index")
        .first()
    )
    if candidate is not None:
        candidate.assign(lease)
        index = candidate.slice.index
        return protocol.SliceAssigned(
            request_id=message.request_id,
            dataset=name,
            index=index,
            size=candidate.slice.size_bytes,
            sha256=candidate.slice.sha256,
            urls=slice_urls(candidate.slice.dataset, index, job_id=job.pk, peer=str(lease.worker_id)),
        )
    held_elsewhere = (
        rows.filter(status=JobSlice.Status.ASSIGNED, assigned_lease__status__in=Lease.LIVE)
        .exclude(assigned_lease=lease)
        .exists()
    )
    # AVAILABLE rows that other claimers hold locked this instant are not done either.
    if held_elsewhere or rows.filter(status=JobSlice.Status.AVAILABLE).exists():
        return protocol.SliceAssigned(
            request_id=message.request_id, dataset=name, retry_in=SLICE_RETRY_SECONDS
        )
    # Every slice is USED or this worker's own (their results are on their way): nothing is left for it.
    return protocol.SliceAssigned(request_id=message.request_id, dataset=name, done=True)
