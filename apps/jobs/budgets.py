"""A job's ``max_cost``: the most credits it may spend (docs/architecture.md, "Accounting").

A running training job stops cleanly first: once its cost so far plus one more round (its leases' price per
second × its mean round's duration so far) reaches ``max_cost``, :func:`last_round` makes the round in progress
its last (``Job.stop_after_round``): the parameter server is told ``Done`` after it and saves the final model.
The hard stop below stays the backstop (a round that runs far longer than the ones before).

The lease clock asks :func:`jobs_over_budget` every tick, and :mod:`apps.jobs.services` ends each job it names
(re-checked with :func:`stop_reason` under the job's lock). The running cost is computed to the instant (see
:func:`apps.accounting.services.running_total`), so a job ends within one tick of reaching its ``max_cost``:
it overshoots by at most ``HYPHA_TICK_INTERVAL`` seconds of its leases' prices.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from django.db.models import Count, Max, Sum
from django.utils import timezone

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


def jobs_to_wind_down(*, limit: int = 100) -> list:
    """Ids of RUNNING training jobs with a ``max_cost`` whose last round is not decided yet."""
    return list(
        Job.objects.filter(
            status=Job.Status.RUNNING, spec__has_key="max_cost", stop_after_round__isnull=True
        ).values_list("pk", flat=True)[:limit]
    )


def last_round(job: Job, *, now: datetime | None = None) -> tuple[int, str] | None:
    """(the round in progress, why it is the last) when one more round would take the (locked) job's cost to
    its ``max_cost``; None when it would not, or the round in progress is its last anyway."""
    from apps.jobs.training.plans import plan

    max_cost = max_cost_of(job)
    if max_cost is None or job.stop_after_round is not None or job.allocated_at is None:
        return None
    now = now or timezone.now()
    closed = job.rounds.filter(closed=True, closed_at__isnull=False).aggregate(
        count=Count("pk"), last=Max("number"), latest=Max("closed_at")
    )
    count, latest = closed["count"], closed["latest"]
    in_progress = (closed["last"] or 0) + 1
    if in_progress >= plan(job).update_rounds:
        return None
    # A round lasts what the closed ones did on average; before any closed, at least what this one has so far.
    seconds = (
        (latest - job.allocated_at).total_seconds() / count
        if count
        else (now - job.allocated_at).total_seconds()
    )
    rate = job.leases.filter(status=Lease.Status.ACTIVE).aggregate(total=Sum("price"))["total"] or 0
    cost = accounting.job_cost(job.pk, now=now)
    projected = cost + accounting.lease_cost(rate, Decimal(repr(max(seconds, 0.0))))
    if projected < max_cost:
        return None
    return in_progress, (
        f"RUNNING: round {in_progress} is the last: the next round would take the cost past max_cost "
        f"({cost} of {max_cost.normalize():f} credits so far, about {projected - cost:.2f} a round)"
    )
