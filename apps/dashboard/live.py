"""Live updates for browsers: what :mod:`apps.jobs.observers` calls when something a dashboard shows changed.

Each function is called inside the transaction that made the change and only schedules work after commit
(``hypha_site.runtime.send_on_commit``): a rolled-back change tells no browser anything, and the event is read
from the committed rows. Events are JSON text sent to channel-layer groups; :mod:`apps.dashboard.consumers`
relays them to the browsers that joined (docs/dashboard.md lists their shapes):

* ``dashboard.job.<job id>`` — the job page: ``job``, ``round`` and ``progress`` events;
* ``dashboard.owner.<user id>`` and ``dashboard.staff`` — the overview of the job's owner and of staff: a
  compact ``job`` event (id, name, status, reason).

Trainer progress arrives once per optimizer step of every trainer; it is sent at most once per
:data:`PROGRESS_INTERVAL` per job (a leading-edge throttle, per process), except a report that changed a task's
status or sync state, which is always sent; every ``round`` and ``job`` event carries the trainers' progress too,
so a page shows every state a trainer reaches and its step counters are never behind by more than a round.
"""

from __future__ import annotations

import threading
import time

from hypha_site.runtime import group_send, send_on_commit

#: Seconds between two progress events of one job (at most 2 per second).
PROGRESS_INTERVAL = 0.5
#: The throttle forgets jobs it has not heard of for this long (it is a per-process dict).
_FORGET_AFTER = 300.0

STAFF_GROUP = "dashboard.staff"
MESSAGE_TYPE = "dashboard.event"

_last_progress: dict[str, float] = {}
_throttle_lock = threading.Lock()


def job_group(job_id) -> str:
    return f"dashboard.job.{job_id}"


def owner_group(user_id) -> str:
    return f"dashboard.owner.{user_id}"


def job_changed(job) -> None:
    """The job's status, reason, leases or tasks changed."""
    job_id, owner_id = job.pk, job.owner_id
    send_on_commit(lambda: _send_job(job_id, owner_id))


def round_recorded(round_) -> None:
    """A round's record changed: the parameter server's report or a trainer's metrics arrived."""
    job_id, round_id = round_.job_id, round_.pk
    send_on_commit(lambda: _send_round(job_id, round_id))


def task_progress(task, *, state_changed: bool = False) -> None:
    """A trainer reported a step (called once per optimizer step: throttled to one event per interval).

    ``state_changed``: the report moved the task's status or sync state (running, scheduled, updating, done).
    Such a change is always sent — it also restarts the interval — so that the throttle only ever drops step
    counters, never a state the page would otherwise show until the next event."""
    job_id = str(task.job_id)
    if not _due(job_id, time.monotonic(), force=state_changed):
        return
    send_on_commit(lambda: _send_progress(job_id))


def _due(job_id: str, now: float, *, force: bool = False) -> bool:
    with _throttle_lock:
        if not force and now - _last_progress.get(job_id, float("-inf")) < PROGRESS_INTERVAL:
            return False
        _last_progress[job_id] = now
        if len(_last_progress) > 1000:
            for stale in [key for key, at in _last_progress.items() if now - at > _FORGET_AFTER]:
                del _last_progress[stale]
        return True


# --- after commit: read the committed rows and send --------------------------------------------------------


def _publish(group: str, event: dict) -> None:
    from apps.dashboard.snapshots import to_json

    group_send(group, {"type": MESSAGE_TYPE, "text": to_json(event)})


def _send_job(job_id, owner_id) -> None:
    from apps.dashboard import snapshots
    from apps.dashboard.progress import run_progress
    from apps.datasets import services as dataset_services
    from apps.jobs.models import Job

    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return
    state = snapshots.job_state(job)
    _publish(
        job_group(job_id),
        {
            "type": "job",
            "job": state,
            "leases": snapshots.job_leases(job),
            "tasks": snapshots.job_tasks(job),
            # The trainers' table and the status history too: a task's end or several transitions committed
            # together reach the page with the next job event, whatever came before (issue 16).
            "trainers": snapshots.trainer_progress(job_id),
            "events": snapshots.job_events(job),
            "workers": snapshots.worker_names(job),
            "data": dataset_services.progress(job),
            "progress": run_progress(job),
            "cost": snapshots.job_cost(job),
            "inference": snapshots.inference_section(job),
        },
    )
    summary = {"type": "job", "job": {key: state[key] for key in ("id", "name", "status", "status_reason")}}
    _publish(owner_group(owner_id), summary)
    _publish(STAFF_GROUP, summary)


def _send_round(job_id, round_id) -> None:
    from apps.dashboard import snapshots
    from apps.dashboard.progress import run_progress
    from apps.datasets import services as dataset_services
    from apps.jobs.api.serializers import RoundSerializer
    from apps.jobs.models import Job, Round

    round_ = Round.objects.filter(pk=round_id).first()
    job = Job.objects.filter(pk=job_id).first()
    if round_ is None or job is None:
        return
    _publish(
        job_group(job_id),
        {
            "type": "round",
            "round": RoundSerializer(round_).data,
            "trainers": snapshots.trainer_progress(job_id),
            "data": dataset_services.progress(job),
            "progress": run_progress(job),
            "cost": snapshots.job_cost(job),
        },
    )


def _send_progress(job_id) -> None:
    from apps.dashboard import snapshots
    from apps.dashboard.progress import run_progress
    from apps.datasets import services as dataset_services
    from apps.jobs.models import Job

    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return
    _publish(
        job_group(job_id),
        {
            "type": "progress",
            "trainers": snapshots.trainer_progress(job_id),
            "data": dataset_services.progress(job),
            "progress": run_progress(job),
            "cost": snapshots.job_cost(job),
            # An inference job's workers and newest results: a stored result sends this event (not throttled).
            "inference": snapshots.inference_section(job),
        },
    )
