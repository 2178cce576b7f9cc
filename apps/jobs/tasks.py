"""Celery tasks of the market and lease clocks. Thin: each takes ids, is idempotent, and calls a service.

Beat runs ``tick_leases`` and ``tick_market`` every ``HYPHA_TICK_INTERVAL`` seconds (in the embedded
default the in-process runner does, with the same functions).
"""

from __future__ import annotations

from celery import shared_task

from apps.jobs import services, status_bridge


@shared_task(name="apps.jobs.tasks.allocate_job")
def allocate_job(job_id: str) -> None:
    services.allocate(job_id)


@shared_task(name="apps.jobs.tasks.tick_leases")
def tick_leases() -> dict:
    result = services.tick_leases()
    # The same clock completes jobs whose trainers never reported their exit after the last round.
    services.tick_training()
    # And it accrues what running leases cost, ending the jobs that reached their max_cost (apps/accounting).
    services.tick_accounting()
    return {"expired": result.expired, "renewals_requested": result.renewals_requested}


@shared_task(name="apps.jobs.tasks.tick_market")
def tick_market() -> None:
    services.tick_market()


@shared_task(name="apps.jobs.tasks.post_to_status_bridge")
def post_to_status_bridge(address: str, posts: list[dict]) -> dict:
    """One trainer's metrics of a round to the AIM status bridge (services mode); never raises, never retries
    (a metric that missed the bridge is in the round's record all the same)."""
    return status_bridge.post(address, posts)


@shared_task(name="apps.jobs.tasks.sweep_task_logs")
def sweep_task_logs() -> int:
    """Delete the task logs of jobs ended longer ago than ``HYPHA_TASK_LOG_RETENTION_DAYS``."""
    from apps.jobs.training import task_logs

    return task_logs.sweep()
