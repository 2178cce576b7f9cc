"""What daemons report about their tasks: ownership, exits and output."""

from __future__ import annotations

import logging
import re

from django.db import transaction

from apps.jobs import observers
from apps.jobs.exceptions import TaskRefused
from apps.jobs.models import PARAMETER_SERVER, Job, Task
from apps.jobs.training import problems, task_logs
from worker_daemon import protocol

logger = logging.getLogger(__name__)

# --- what daemons report about their tasks ----------------------------------------------------------------------


def own_task(worker, task_id, *, lock: bool = False) -> Task:
    """The task ``task_id`` if it runs on ``worker``'s lease; :class:`TaskRefused` otherwise."""
    tasks = Task.objects.select_related("job", "lease")
    if lock:
        tasks = tasks.select_for_update(of=("self",))
    task = tasks.filter(pk=task_id, lease__worker_id=worker.pk).first()
    if task is None:
        raise TaskRefused(f"task {task_id} is not a task of this worker")
    return task


def task_role(worker, task_id) -> tuple[str, object]:
    """(role, job id) of the task ``task_id`` if it runs on ``worker``'s lease (one light query, no lock);
    :class:`TaskRefused` otherwise."""
    found = Task.objects.filter(pk=task_id, lease__worker_id=worker.pk).values_list("role", "job_id").first()
    if found is None:
        raise TaskRefused(f"task {task_id} is not a task of this worker")
    return found


def record_exit(worker, message: protocol.JobExited) -> Task | None:
    """End the task as the daemon reports; returns it if this report ended it (``None`` for a repeat)."""
    task = own_task(worker, message.task_id)
    if message.cancelled or lease_not_held(task, message):
        status = Task.Status.CANCELLED
    elif message.exit_code == 0:
        status = Task.Status.EXITED
    else:
        status = Task.Status.FAILED
    tail = _storable(message.log_tail)
    ended = task.finish(
        status,
        exit_code=message.exit_code,
        signal=message.signal,
        reason=message.reason[:2000],
        log_tail=tail,
    )
    if ended and message.log_tail and not task_logs.has_log(task.job_id, task.pk):
        # It ended before any of its output was forwarded (or its daemon forwards none): its last lines are
        # all of its log there is.
        _keep_log(task, tail.splitlines())
    if ended:  # the page's task and trainer tables show the end at once, also while the job runs on
        observers.job_changed(task.job)
    return task if ended else None


def lease_not_held(task: Task, message: protocol.JobExited) -> bool:
    """The daemon refused the task's dispatch because it does not hold the task's lease (it was restarted, or
    the lease ended there first): no process ran, so the task is CANCELLED as for a lost lease, not FAILED as
    for a crash (``worker_daemon/jobs.py`` answers such a dispatch with this reason and no exit status)."""
    return (
        task.started_at is None
        and message.exit_code is None
        and message.signal is None
        and message.reason.startswith(f"lease {task.lease_id} is not held")
    )


#: Lines of a task's output the control plane keeps (``Task.log_tail``).
LOG_TAIL_LINES = 100


def append_output(worker, task_id, lines: list[str]) -> None:
    """Add a running task's new output lines to its log tail (the last :data:`LOG_TAIL_LINES` are kept) and
    to its full log (:mod:`.task_logs`)."""
    with transaction.atomic():
        task = own_task(worker, task_id, lock=True)
        if not task.is_live or not lines:
            return
        lines = [_storable(line) for line in lines]
        _keep_log(task, lines)
        kept = (task.log_tail.splitlines() + lines)[-LOG_TAIL_LINES:]
        task.log_tail = "\n".join(kept)
        Task.objects.filter(pk=task.pk).update(log_tail=task.log_tail)
        observers.job_changed(task.job)


def _storable(text: str) -> str:
    """``text`` without NUL, which PostgreSQL cannot store (the protocol already refuses lone surrogates)."""
    return text.replace("\x00", "\ufffd")


def _keep_log(task: Task, lines: list[str]) -> None:
    """Add ``lines`` to the task's full log; a failed write (a full disk) loses them there, nothing else."""
    try:
        task_logs.append(task.job_id, task.pk, lines)
    except OSError as error:
        logger.warning("cannot keep the log of task %s: %s", task.pk, error)


#: What a daemon says when it knows nothing more of a failure than its exit (older daemons always did).
_BARE_REASON = re.compile(r"^(exited with code -?\d+|killed by signal \d+)$")
#: Output lines that say nothing of a failure's cause: a launcher re-raising its child's failure
#: (``accelerate launch``: ``subprocess.CalledProcessError: Command '[…]' returned non-zero exit status 3.``),
#: and a traceback's header, frames, source lines and carets.
_NOISE = re.compile(
    r"^(Traceback \(most recent call last\):|\s.*|(\w+\.)*(CalledProcessError|ChildFailedError)\b.*)$"
)


def describe_exit(task: Task) -> str:
    """Why the ended ``task`` failed, in one sentence for its job's status: how it ended, then its root cause —
    a transfer problem reported shortly before the end (:func:`.problems.failure_cause`), else the reason its
    daemon found in the output (``worker_daemon.failures``), else its last output line that is not a
    launcher's wrapper or traceback noise."""
    how = f"exit code {task.exit_code}" if task.exit_code is not None else f"signal {task.signal}"
    label = "parameter server" if task.role == PARAMETER_SERVER else "trainer"
    said = task.reason if task.reason and not _BARE_REASON.match(task.reason) else ""
    cause = problems.failure_cause(task) or said
    detail = f": {cause}" if cause else ""
    last_line = next(
        (line for line in reversed(task.log_tail.splitlines()) if line.strip() and not _NOISE.match(line)), ""
    )
    tail = f" — last output: {last_line[:200]}" if last_line and not said else ""
    return f"the {label} on {task.lease.worker.name} failed with {how}{detail}{tail}"


def cancel_tasks(job: Job, *, reason: str) -> None:
    """Mark every live task of the job cancelled (their daemons stop them when their leases end)."""
    for task in job.tasks.filter(status__in=Task.LIVE):
        task.finish(Task.Status.CANCELLED, reason=reason[:2000])
