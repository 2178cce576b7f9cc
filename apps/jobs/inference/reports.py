"""Progress reports of inference tasks: informative only (the stored results are the work), so a report is
counted on the task and answered ``Ok``, and nothing in it moves the job."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from apps.jobs.models import INFERENCE, Job, Task
from apps.jobs.training.reports import own_task
from worker_daemon import protocol

OK = {"type": "Ok"}
ERROR = {"type": "Error"}
#: At most this many rows in one slice's report (a hostile count would only skew the task's own totals).
MAX_ROWS_PER_REPORT = 10**9


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return None
    return max(0, min(int(value), MAX_ROWS_PER_REPORT)) if abs(value) < 1e18 else None


def handle_status(worker, message: protocol.StatusReport) -> dict:
    """The reply to an inference task's progress value: ``{"metrics": {"round": k, "metrics": {"slices_done",
    "samples", "seconds"}}}`` after each slice (the executor's, docs/inference.md) counts the slice's rows in
    the task's ``samples_total`` and its slices in ``steps_total``; any other value is only taken as a sign of
    life. ``{"type": "Error"}`` for a task that is not live or a job that is not running."""
    with transaction.atomic():
        task = own_task(worker, message.task_id, lock=True)
        if task.last_status_request == message.request_id:
            return task.last_status_reply  # a repeat after a reconnect: already counted
        reply = OK
        changes: dict[str, Any] = {"last_status_at": timezone.now().timestamp()}
        if task.role != INFERENCE or not task.is_live or task.job.status != Job.Status.RUNNING:
            reply, changes = ERROR, {}
        else:
            if task.status == Task.Status.DISPATCHED:
                changes["status"] = Task.Status.RUNNING
            progress = message.progress
            body = progress.get("metrics") if isinstance(progress, dict) else None
            if isinstance(body, dict):
                metrics = body.get("metrics") if isinstance(body.get("metrics"), dict) else {}
                rows = _count(metrics.get("samples"))
                done = _count(body.get("round"))
                if rows is not None:
                    changes["samples_total"] = task.samples_total + rows
                if done is not None:
                    changes["steps_total"] = max(task.steps_total, done)
        Task.objects.filter(pk=task.pk).update(
            **changes, last_status_request=message.request_id, last_status_reply=reply
        )
        return reply
