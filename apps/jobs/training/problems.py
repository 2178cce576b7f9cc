"""Transfer problems: a task whose transfers cannot reach a peer says so (``transfer_problem``: the parameter
server or a data node, the URL without its query, the operation, the cause, how many attempts since when), and
says when the peer answers again (``transfer_ok``). Each live task keeps the latest report per peer in
``Task.transfer_problems`` (``{peer: {role, url, operation, cause, attempts, since, updated_at}}``); the job
shows those of its live and failed tasks (``GET /api/jobs/<id>/`` ``transfer_problems``, the job page), and a
task that fails while one is fresh is said to have failed of it (:func:`failure_cause`).

These functions run inside the caller's transaction, the task row locked (``own_task(…, lock=True)``).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.utils import timezone

from apps.jobs import observers
from apps.jobs.models import Job, Task
from worker_daemon import protocol

#: Peers remembered per task (the least recently reported go first): a trainer talks to one parameter server
#: and a few data nodes; a daemon cannot grow a row without bound by naming made-up peers.
MAX_PEERS = 16
#: A problem is named as its task's failure when it was last reported at most this long before the task
#: ended: a task that keeps failing to reach a peer reports it every few seconds until it gives up.
CAUSE_WINDOW = timedelta(seconds=60)
#: Whom each peer role names, in sentences.
PEER_LABELS = {"parameter_server": "the parameter server", "data_node": "the data node"}


def record(task: Task, message: protocol.TransferProblem, *, now: datetime | None = None) -> bool:
    """Keep ``message`` as the task's problem with its peer; False (nothing kept) once the task has ended."""
    if not task.is_live:
        return False
    now = now or timezone.now()
    problems = dict(task.transfer_problems or {})
    since = min(message.since, now)  # a daemon's clock ahead of ours must not put it in the future
    previous = problems.get(message.peer)
    if previous is not None:
        # The same peer failing for another operation: the problem began with the first report.
        since = min(since, _parsed(previous.get("since")) or since)
    problems[message.peer] = {
        "role": message.role,
        "url": message.url,
        "operation": message.operation,
        "cause": message.cause,
        "attempts": message.attempts,
        "since": since.isoformat(),
        "updated_at": now.isoformat(),
    }
    # jsonb keeps no key order: the stalest report goes by its time.
    stalest_first = sorted(problems, key=lambda name: problems[name]["updated_at"])
    for peer in stalest_first[: max(0, len(problems) - MAX_PEERS)]:
        del problems[peer]
    _save(task, problems)
    return True


def clear(task: Task, peer: str) -> bool:
    """Drop the task's problem with ``peer`` (it answers again); False when there was none."""
    problems = dict(task.transfer_problems or {})
    if problems.pop(peer, None) is None:
        return False
    _save(task, problems)
    return True


def _save(task: Task, problems: dict) -> None:
    Task.objects.filter(pk=task.pk).update(transfer_problems=problems)
    task.transfer_problems = problems
    observers.job_changed(task.job)


def entries(task: Task) -> list[dict]:
    """The task's problems, the oldest first: ``{peer, role, url, operation, cause, attempts, since,
    updated_at}`` (the times as datetimes)."""
    problems = task.transfer_problems or {}
    found = [
        {
            "peer": peer,
            **problem,
            "since": _parsed(problem.get("since")) or _EPOCH,
            "updated_at": _parsed(problem.get("updated_at")) or _EPOCH,
        }
        for peer, problem in problems.items()
    ]
    return sorted(found, key=lambda entry: (entry["since"], entry["peer"]))


def shown(task: Task) -> bool:
    """Whether the job shows the task's problems: while it runs, and after it failed (they may say why)."""
    return task.is_live or task.status == Task.Status.FAILED


def of_job(job: Job) -> list[dict]:
    """The problems of the job's live and failed tasks, the oldest first, each with its ``task`` (id),
    ``task_status`` and ``worker`` (name). Reads ``job.tasks.all()`` (prefetch them with their workers)."""
    found = []
    for task in job.tasks.all():
        if task.transfer_problems and shown(task):
            found.extend(
                {"task": str(task.pk), "task_status": task.status, "worker": task.lease.worker.name, **entry}
                for entry in entries(task)
            )
    return sorted(found, key=lambda entry: (entry["since"], entry["task"], entry["peer"]))


def failure_cause(task: Task) -> str:
    """Why the ended ``task`` failed if a transfer problem says so: the latest one reported within
    :data:`CAUSE_WINDOW` of its end, as a sentence; "" otherwise."""
    ended = task.ended_at or timezone.now()
    fresh = [entry for entry in entries(task) if entry["updated_at"] >= ended - CAUSE_WINDOW]
    if not fresh:
        return ""
    latest = max(fresh, key=lambda entry: entry["updated_at"])
    lasted = f" for {max(0, round((ended - latest['since']).total_seconds()))} s"
    where = PEER_LABELS.get(latest.get("role"), "a peer")
    return (
        f"could not reach {where} at {latest.get('url') or latest['peer']}{lasted} "
        f"({latest.get('operation')}, {latest.get('attempts')} attempts): {latest.get('cause')}"
    )


_EPOCH = datetime.fromtimestamp(0, UTC)


def _parsed(value) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
