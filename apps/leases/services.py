"""Lease workflows: reserving a worker's capacity, and finding leases that are due for renewal or expiry.

Capacity rule: the resources of a worker's live leases (TEMPORARY or ACTIVE, not yet past ``expires_at``)
never add up to more than the worker's capacity. :func:`reserve` checks it while holding the worker's row
lock, so concurrent offers for the same worker (two jobs competing for it) are serialised and at most one
fits under the ``whole`` strategy.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone

from apps.leases.exceptions import CapacityExceeded
from apps.leases.models import Lease, LeaseEvent
from apps.workers.models import Worker
from worker_daemon.protocol import Resources


def lease_ttl() -> timedelta:
    return timedelta(seconds=settings.HYPHA_LEASE_TTL)


def offer_ttl() -> timedelta:
    return timedelta(seconds=settings.HYPHA_OFFER_TTL)


def live_leases(worker_id, *, now: datetime | None = None):
    now = now or timezone.now()
    return Lease.objects.filter(worker_id=worker_id, status__in=Lease.LIVE, expires_at__gt=now)


def live_usage(worker_id, *, now: datetime | None = None) -> Resources:
    """The resources held by the worker's live leases."""
    totals = live_leases(worker_id, now=now).aggregate(
        cpu=Sum("cpu"), memory=Sum("memory"), storage=Sum("storage"), gpu=Sum("gpu")
    )
    return Resources(**{name: value or 0.0 for name, value in totals.items()})


def reserve(*, worker_id, job, role: str, resources: Resources, price: float) -> Lease:
    """Create a TEMPORARY lease for an open offer, if the worker has room; :class:`CapacityExceeded` if not."""
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker_id)
        now = timezone.now()
        in_use = live_usage(worker_id, now=now)
        if not (in_use + resources).fits_within(worker.capacity):
            raise CapacityExceeded(
                f"worker {worker.name} holds {in_use.model_dump()} of {worker.capacity.model_dump()}; "
                f"{resources.model_dump()} more does not fit"
            )
        lease = Lease.objects.create(
            worker=worker,
            job=job,
            role=role,
            status=Lease.Status.TEMPORARY,
            price=price,
            **resources.model_dump(),
            expires_at=now + offer_ttl(),
        )
        LeaseEvent.objects.create(
            lease=lease,
            kind=LeaseEvent.Kind.CREATED,
            to_status=lease.status,
            expires_at=lease.expires_at,
            detail="offer made",
        )
    return lease


def due_for_expiry(*, limit: int = 500) -> list[Lease]:
    """Live leases past their expiry, oldest first (a bounded batch)."""
    return list(
        Lease.objects.filter(status__in=Lease.LIVE, expires_at__lte=timezone.now())
        .select_related("worker")
        .order_by("expires_at")[:limit]
    )


def claim_due_renewals(*, limit: int = 1000) -> list[Lease]:
    """ACTIVE leases of online workers that should be renewed now; marks them as requested.

    A lease is due once less than ``HYPHA_RENEW_AT_REMAINING`` of its TTL is left. A request is repeated
    at most every quarter TTL, so a lost request is retried well before the lease runs out.
    """
    now = timezone.now()
    ttl = lease_ttl()
    threshold = now + ttl * settings.HYPHA_RENEW_AT_REMAINING
    retry_before = now - ttl / 4
    with transaction.atomic():
        due = list(
            Lease.objects.select_for_update(skip_locked=True, of=("self",))
            .filter(
                status=Lease.Status.ACTIVE,
                expires_at__gt=now,
                expires_at__lte=threshold,
                worker__status=Worker.Status.ONLINE,
            )
            .filter(Q(renewal_requested_at__isnull=True) | Q(renewal_requested_at__lte=retry_before))
            .order_by("expires_at")[:limit]
        )
        Lease.objects.filter(pk__in=[lease.pk for lease in due]).update(renewal_requested_at=now)
    return due
