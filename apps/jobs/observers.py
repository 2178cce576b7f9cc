"""Who hears about training progress: the one place the jobs workflows tell the outside world.

The workflows (``apps.jobs.services``, ``apps.jobs.training``, ``Job.transition``) call these inside their
transaction; each listener schedules its own work after commit. No Django signals: the calls are explicit
and the listeners are listed here.
"""

from __future__ import annotations


def job_changed(job) -> None:
    from apps.dashboard import live

    live.job_changed(job)


def round_recorded(round_) -> None:
    from apps.dashboard import live

    live.round_recorded(round_)


def round_reported(round_) -> None:
    """The parameter server's report of the round arrived: its verdicts move the trainers' records."""
    from apps.workers import reputation

    reputation.round_reported(round_)


def trainer_metrics(task, *, round_number: int, metrics: dict[str, float]) -> None:
    from apps.jobs import status_bridge

    status_bridge.trainer_metrics(
        worker_id=str(task.lease.worker_id), round_number=round_number, metrics=metrics
    )


def task_progress(task, *, state_changed: bool = False) -> None:
    from apps.dashboard import live

    live.task_progress(task, state_changed=state_changed)
