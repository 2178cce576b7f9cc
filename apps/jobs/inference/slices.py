"""Slices for inference workers: each slice of the job's one epoch is processed once.

Unlike a trainer's, an inference worker's slice is not acknowledged when it is fetched: it becomes USED only
when its result is stored (:mod:`.results`), so a worker lost before that gives it back (its lease's ASSIGNED
slices return to AVAILABLE) and another worker computes it. When nothing is AVAILABLE the answer says whether
to ask again (slices are held by other live leases: one may be lost) or that the worker is ``done``.
"""

from __future__ import annotations

from django.db import transaction

from apps.datasets.models import JobSlice
from apps.jobs.exceptions import TaskRefused
from apps.jobs.inference.dispatch import EPOCH, spec_of
from apps.jobs.models import INFERENCE, Job, Task
from apps.jobs.training.dispatch import slice_urls
from apps.jobs.training.reports import own_task
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

    def refused(text: str) -> protocol.SliceAssigned:
        return protocol.SliceAssigned(request_id=message.request_id, dataset=message.dataset, error=text)

    with transaction.atomic():
        try:
            task = own_task(worker, message.task_id, lock=True)
        except TaskRefused as error:
            return refused(str(error))
        if task.last_slice_request == message.request_id and task.last_slice_reply:
            return protocol.SliceAssigned.model_validate(task.last_slice_reply)
        reply = _assign_slice(task, message, refused)
        Task.objects.filter(pk=task.pk).update(
            last_slice_request=message.request_id, last_slice_reply=reply.model_dump(mode="json")
        )
        return reply


def _assign_slice(task: Task, message: protocol.FetchSlice, refused) -> protocol.SliceAssigned:
    job = task.job
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
