"""Accounting workflows: accruing what leases cost, and the running totals of jobs, workers and users.

* :func:`accrue` writes a lease's next accrual row (the period since its last one); the lease's end calls it
  with the lease ended, which writes the ``final`` row. Idempotent: a repeated call finds nothing new to accrue.
* :func:`accrue_due` is the lease clock's step: every ACTIVE lease whose last period ended at least
  ``HYPHA_ACCRUAL_INTERVAL`` seconds ago gets its next row (a bounded batch, oldest first).
* :func:`running_total` is a job's cost, a worker's earnings or a user's spend up to now: the rows of the ended
  leases plus, for each ACTIVE lease, its cost from activation to now (computed, so a running job's cost is
  exact between two accruals, and equal to its rows once its leases ended).

The money rule (docs/architecture.md, "Accounting"): ``price × ACTIVE seconds / 3600`` credits per lease,
rounded to :data:`~apps.accounting.models.QUANTUM` once per lease (see the models' docstring).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import OuterRef, Q, Subquery, Sum
from django.utils import timezone

from apps.accounting.models import QUANTUM, Accrual
from apps.leases.models import Lease

logger = logging.getLogger(__name__)

SECONDS_PER_HOUR = Decimal(3600)


def seconds_between(start: datetime, end: datetime) -> Decimal:
    """Exact seconds (to the microsecond) from ``start`` to ``end``; 0 when ``end`` is not after ``start``."""
    delta = end - start
    if delta <= timedelta(0):
        return Decimal(0)
    micro = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return Decimal(micro) / Decimal(1_000_000)


def lease_cost(price: float, active_seconds: Decimal) -> Decimal:
    """Credits for ``active_seconds`` of a lease at ``price`` credits per hour, rounded to the quantum."""
    # repr() is the shortest decimal that reads back as the same float: a price of 1.1 costs 1.1, not 1.1000…89.
    return (Decimal(repr(float(price))) * active_seconds / SECONDS_PER_HOUR).quantize(
        QUANTUM, rounding=ROUND_HALF_EVEN
    )


def accrual_interval() -> timedelta:
    return timedelta(seconds=settings.HYPHA_ACCRUAL_INTERVAL)


def accrue(lease_id, *, now: datetime | None = None) -> Accrual | None:
    """Write the lease's next accrual: from the end of its last row (or its activation) to ``now`` while it is
    ACTIVE, or to ``ended_at`` (a ``final`` row) once it has ended. None when there is nothing to accrue: a
    TEMPORARY lease, one already accrued up to then, one whose final row exists, or a row another process wrote
    at the same moment (the unique ``(lease, period_start)`` refused this one).

    Runs in the caller's transaction when there is one (the end of a lease calls it right after the lease's
    transition, so the final row commits with it); the lease's row is locked, which serialises two writers on
    PostgreSQL."""
    now = now or timezone.now()
    with transaction.atomic():
        lease = Lease.objects.select_for_update().filter(pk=lease_id).first()
        if lease is None or lease.activated_at is None or lease.status == Lease.Status.TEMPORARY:
            return None
        final = lease.status != Lease.Status.ACTIVE
        last = Accrual.objects.filter(lease_id=lease.pk).order_by("-period_end").first()
        if last is not None and last.final:
            return None
        start = last.period_end if last is not None else lease.activated_at
        # An end read before this lock (a release that waited for an accrual holding it) may lie a moment before
        # that accrual's period end: the lease is then billed to the later instant, never a negative period.
        end = max(lease.ended_at or now, start)
        if end == start and not final:
            return None
        lease_total = lease_cost(lease.price, seconds_between(lease.activated_at, end))
        previous = last.lease_total if last is not None else Decimal(0)
        try:
            with transaction.atomic():  # a savepoint: the unique constraints refuse a racing duplicate
                return Accrual.objects.create(
                    lease=lease,
                    job_id=lease.job_id,
                    worker_id=lease.worker_id,
                    price=lease.price,
                    period_start=start,
                    period_end=end,
                    active_seconds=seconds_between(start, end),
                    amount=lease_total - previous,
                    lease_total=lease_total,
                    final=final,
                )
        except IntegrityError:
            logger.info("lease %s: accrual from %s already written by another process", lease.pk, start)
            return None


def accrue_due(*, now: datetime | None = None, limit: int = 500) -> set:
    """The lease clock's accounting step: accrue every ACTIVE lease not accrued for ``HYPHA_ACCRUAL_INTERVAL``
    (at most ``limit``, the longest-waiting first). Returns the ids of the jobs whose leases accrued."""
    now = now or timezone.now()
    cutoff = now - accrual_interval()
    newest = Accrual.objects.filter(lease_id=OuterRef("pk")).order_by("-period_end")
    due = (
        Lease.objects.filter(status=Lease.Status.ACTIVE, activated_at__isnull=False)
        # The newest row of each lease through the (lease, -period_end) index: one row read per lease, not an
        # aggregate over every period of every running lease at each tick.
        .annotate(accrued_until=Subquery(newest.values("period_end")[:1]))
        .filter(Q(accrued_until__lte=cutoff) | Q(accrued_until__isnull=True, activated_at__lte=cutoff))
        .order_by("accrued_until", "activated_at")
        .values_list("pk", "job_id")[:limit]
    )
    jobs = set()
    for lease_id, job_id in list(due):
        if accrue(lease_id, now=now) is not None:
            jobs.add(job_id)
    return jobs


def running_total(*, now: datetime | None = None, **where) -> Decimal:
    """Credits accrued by the leases that match ``where`` (lookups both a lease and an accrual have: ``job_id``,
    ``worker_id``, ``job__owner``), up to ``now``: the accrual rows of the leases that are no longer ACTIVE, plus
    each ACTIVE lease's cost from its activation to ``now``."""
    now = now or timezone.now()
    ended = (
        Accrual.objects.filter(**where)
        .exclude(lease__status=Lease.Status.ACTIVE)
        .aggregate(total=Sum("amount"))
    )["total"] or Decimal(0)
    live = Lease.objects.filter(status=Lease.Status.ACTIVE, activated_at__isnull=False, **where).values_list(
        "price", "activated_at"
    )
    running = sum(
        (lease_cost(price, seconds_between(activated_at, now)) for price, activated_at in live), Decimal(0)
    )
    return (ended + running).quantize(QUANTUM)


def job_cost(job_id, *, now: datetime | None = None) -> Decimal:
    """What the job has cost so far (its owner's spend on it)."""
    return running_total(now=now, job_id=job_id)


def worker_earnings(worker_id, *, now: datetime | None = None) -> Decimal:
    """What the worker has earned so far, over all its leases."""
    return running_total(now=now, worker_id=worker_id)


def user_spend(user, *, now: datetime | None = None) -> Decimal:
    """What the user's jobs have cost so far."""
    return running_total(now=now, job__owner=user)
