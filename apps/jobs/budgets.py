"""A job's ``max_cost``: the most credits it may spend (docs/architecture.md, "Accounting").

The lease clock asks :func:`jobs_over_budget` every tick, and :mod:`apps.jobs.services` ends each job it names
(re-checked with :func:`stop_reason` under the job's lock). The running cost is computed to the instant (see
:func:`apps.accounting.services.running_total`), so a job ends within one tick of reaching its ``max_cost``:
it overshoots by at most ``HYPHA_TICK_INTERVAL`` seconds of its leases' prices.
"""

from __future__ import annotations

from decimal import Decimal

from apps.accounting import services as accounting
from apps.jobs.models import Job
from apps.leases.models import Lease


def max_cost_of(job: Job) -> Decimal | None:
    """The job's ``max_cost`` (credits), None when it has none."""
    value = job.spec.get("max_cost") if isinstance(job.spec, dict) else None
    return _decimal(value)


def _decimal(value) -> Decimal | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return None
    return Decimal(repr(float(value)))


def jobs_over_budget(*, limit: int = 100) -> list:
    """Ids of live jobs whose running cost reached their ``max_cost`` (a bounded batch)."""
    candidates = (
        Job.objects.exclude(status__in=Job.FINAL)
        .filter(spec__has_key="max_cost", leases__status=Lease.Status.ACTIVE)
        .distinct()
        .values_list("pk", "spec__max_cost")
    )
    over = []
    for job_id, value in candidates:
        max_cost = _decimal(value)
        if max_cost is not None and accounting.job_cost(job_id) >= max_cost:
            over.append(job_id)
            if len(over) >= limit:
                break
    return over


def stop_reason(job: Job) -> str | None:
    """Why the (locked) job ends now because of its ``max_cost``; None when it has not reached it."""
    max_cost = max_cost_of(job)
    if job.is_final or max_cost is None:
        return None
    cost = accounting.job_cost(job.pk)
    if cost < max_cost:
        return None
    return f"CANCELLED: max_cost reached: the job has cost {cost} of its max_cost of {max_cost.normalize():f} credits"
