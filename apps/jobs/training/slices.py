"""Data slices for trainers: claims and acknowledgements."""

from __future__ import annotations

from django.db import transaction

from apps.datasets import services as dataset_services
from apps.datasets.exceptions import DatasetError
from apps.jobs.exceptions import TaskRefused
from apps.jobs.models import TRAINER, Job, Task
from apps.jobs.training import pools
from apps.jobs.training.dispatch import slice_urls
from apps.jobs.training.plans import plan
from apps.jobs.training.reports import own_task
from worker_daemon import protocol

#: Seconds a trainer waits before asking again when every slice of the epoch is assigned to someone.
SLICE_RETRY_SECONDS = 1.0

# --- data slices -------------------------------------------------------------------------------------------------


def assign_slice(worker, message: protocol.FetchSlice) -> protocol.SliceAssigned:
    """Claim the next slice for the trainer task, or say when to ask again (never raises for a bad request)."""
    return answer_slice_request(worker, message, _assign_slice)


def answer_slice_request(worker, message: protocol.FetchSlice, assign) -> protocol.SliceAssigned:
    """``assign(task, message, refused)``'s answer for the worker's own task, under the task's lock, or a
    refusal; a repeated request (same id, after a reconnect) gets the same answer, not a second claim."""

    def refused(text: str) -> protocol.SliceAssigned:
        return protocol.SliceAssigned(request_id=message.request_id, dataset=message.dataset, error=text)

    with transaction.atomic():
        try:
            task = own_task(worker, message.task_id, lock=True)
        except TaskRefused as error:
            return refused(str(error))
        if task.last_slice_request == message.request_id and task.last_slice_reply:
            # A repeat after a reconnect: the same answer, not a second claim.
            return protocol.SliceAssigned.model_validate(task.last_slice_reply)
        reply = assign(task, message, refused)
        Task.objects.filter(pk=task.pk).update(
            last_slice_request=message.request_id, last_slice_reply=reply.model_dump(mode="json")
        )
        return reply


def _assign_slice(task: Task, message: protocol.FetchSlice, refused) -> protocol.SliceAssigned:
    if task.role != TRAINER or not task.is_live or task.job.status != Job.Status.RUNNING:
        return refused(f"task {task.pk} is not a running trainer")
    name = plan(task.job).spec.dataset.name
    if message.dataset != name:
        return refused(f"job {task.job_id} trains on dataset {name!r}, not {message.dataset!r}")
    if pools.is_paused(task.job):
        # A pool paused below its min holds its trainers: no new data until it resumes (the bridge asks again).
        return protocol.SliceAssigned(
            request_id=message.request_id, dataset=name, retry_in=SLICE_RETRY_SECONDS
        )
    try:
        job_slice = dataset_services.claim_next(task.job, task.lease)
    except DatasetError as error:
        return refused(str(error))
    if job_slice is None:
        return protocol.SliceAssigned(
            request_id=message.request_id, dataset=name, retry_in=SLICE_RETRY_SECONDS
        )
    dataset = job_slice.slice.dataset
    return protocol.SliceAssigned(
        request_id=message.request_id,
        dataset=name,
        index=job_slice.slice.index,
        size=job_slice.slice.size_bytes,
        sha256=job_slice.slice.sha256,
        urls=slice_urls(dataset, job_slice.slice.index, job_id=task.job_id, peer=str(task.lease.worker_id)),
    )


def acknowledge_slice(worker, message: protocol.SliceAck) -> None:
    """The trainer has slice ``index``: it is USED (raises TaskRefused/DatasetError when refused)."""
    task = own_task(worker, message.task_id)
    if task.role != TRAINER:
        raise TaskRefused(f"task {task.pk} is not a trainer")
    dataset_services.acknowledge(task.job, task.lease, message.index)
