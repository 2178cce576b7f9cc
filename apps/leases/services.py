"""Lease workflows: reserving a worker's capacity, and finding leases that are due for renewal or expiry.

Capacity rule: the resources of a worker's live leases (TEMPORARY or ACTIVE, not yet past ``expires_at``)
never add up to more than the worker's capacity. :func:`reserve` checks it while holding the worker's row
lock, so concurrent offers for the same worker (two jobs competing for it) are serialised and at most one
fits under the ``whole`` strategy.

The lease clock (:func:`run_clock`, first thing of every lease tick, through :func:`due_for_expiry`) records
when it last ran in the :class:`~apps.leases.models.LeaseClock` row. Daemons can renew a lease only while
the control plane runs (its clock asks, its gateway answers), so time it stood still must not expire
leases: when the clock has not run for longer than :func:`clock_stall` (a restart of daphne and Celery, a
beat that was down), it *resumes* (:func:`resume_clock`) — every ACTIVE lease alive when the clock last
ran gets ``expires_at = max(expires_at, resume + TTL)`` and its daemon is asked to confirm it as soon as
it is connected again. A lease whose daemon really went away is still expired, one TTL after the resume.
The gateway resumes a stopped clock too (:func:`live_leases`), since after a restart a daemon may say
``hello`` before the clock's first tick, and must be welcomed with its leases.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Q, Sum
from django.utils import timezone

from apps.leases.exceptions import CapacityExceeded
from apps.leases.models import Lease, LeaseClock, LeaseEvent
from apps.workers.models import Worker
from worker_daemon.protocol import Resources

logger = logging.getLogger(__name__)


def lease_ttl() -> timedelta:
    return timedelta(seconds=settings.HYPHA_LEASE_TTL)


def offer_ttl() -> timedelta:
    return timedelta(seconds=settings.HYPHA_OFFER_TTL)


def live_leases(worker_id, *, now: datetime | None = None):
    """The worker's leases that are TEMPORARY or ACTIVE and not past ``expires_at``.

    Resumes a stopped lease clock first (:func:`resume_clock_if_stopped`): the gateway reconciles a
    reconnecting daemon's leases with this, and after a restart it may run before the clock's first tick.
    """
    now = now or timezone.now()
    resume_clock_if_stopped(now=now)
    return Lease.objects.filter(worker_id=worker_id, status__in=Lease.LIVE, expires_at__gt=now)


_USAGE = {"cpu": Sum("cpu"), "memory": Sum("memory"), "storage": Sum("storage"), "gpu": Sum("gpu")}


def _resources(totals: dict) -> Resources:
    return Resources(**{name: totals[name] or 0.0 for name in _USAGE})


def live_usage(worker_id, *, now: datetime | None = None) -> Resources:
    """The resources held by the worker's live leases."""
    return _resources(live_leases(worker_id, now=now).aggregate(**_USAGE))


def held_devices(worker_id, *, now: datetime | None = None) -> set[int]:
    """The device indices the worker's live leases hold."""
    return {
        index
        for devices in live_leases(worker_id, now=now).values_list("devices", flat=True)
        for index in devices
    }


def held_devices_by_worker(workers, *, now: datetime) -> dict:
    """Worker id → the device indices its live leases hold, for the workers of the queryset ``workers`` that
    hold any (one query; like :func:`live_usage_by_worker` it does not resume a stopped lease clock)."""
    held: dict = {}
    rows = Lease.objects.filter(status__in=Lease.LIVE, expires_at__gt=now, worker__in=workers).values_list(
        "worker_id", "devices"
    )
    for worker_id, devices in rows:
        if devices:
            held.setdefault(worker_id, set()).update(devices)
    return held


def live_usage_by_worker(workers, *, now: datetime) -> dict:
    """Worker id → the resources held by its live leases, for the workers of the queryset ``workers`` that
    hold any (one query; unlike :func:`live_usage` it does not resume a stopped lease clock)."""
    rows = (
        Lease.objects.filter(status__in=Lease.LIVE, expires_at__gt=now, worker__in=workers)
        .values("worker_id")
        .annotate(**_USAGE)
    )
    return {row["worker_id"]: _resources(row) for row in rows}


def reserve(
    *, worker_id, job, role: str, resources: Resources, price: float, devices: Sequence[int] = ()
) -> Lease:
    """Create a TEMPORARY lease for an open offer, if the worker has room; :class:`CapacityExceeded` if not.

    ``devices`` (device indices of the worker) must be held by none of the worker's live leases: the leases of
    one worker hold disjoint devices."""
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker_id)
        now = timezone.now()
        in_use = live_usage(worker_id, now=now)
        if not (in_use + resources).fits_within(worker.capacity):
            raise CapacityExceeded(
                f"worker {worker.name} holds {in_use.model_dump()} of {worker.capacity.model_dump()}; "
                f"{resources.model_dump()} more does not fit"
            )
        held = held_devices(worker_id, now=now)
        taken = sorted(held.intersection(devices))
        if taken:
            raise CapacityExceeded(f"device(s) {taken} of worker {worker.name} are held by another lease")
        lease = Lease.objects.create(
            worker=worker,
            job=job,
            role=role,
            status=Lease.Status.TEMPORARY,
            price=price,
            **resources.model_dump(),
            devices=sorted(devices),
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
    """Live leases past their expiry, oldest first (a bounded batch).

    This is the lease tick's first step, so it runs the lease clock first (:func:`run_clock`): after a stop,
    the leases the stop would have cost are given their grace before anything is found due.
    """
    run_clock()
    return list(
        Lease.objects.filter(status__in=Lease.LIVE, expires_at__lte=timezone.now())
        .select_related("worker")
        .order_by("expires_at")[:limit]
    )


def claim_due_renewals(*, limit: int = 1000) -> list[Lease]:
    """ACTIVE leases of online workers that should be renewed now; marks them as requested.

    A lease is due once less than ``HYPHA_RENEW_AT_REMAINING`` of its TTL is left. A request is repeated
    at most every quarter TTL, so a lost request is retried well before the lease runs out.

    After the lease clock resumed from a stop, a lease it extended (not renewed since) is due at once —
    and again as soon as its daemon has reconnected, when the request went to a connection that died with
    the old control plane — so that a daemon's own clock hears of the lease before it runs out there.
    """
    now = timezone.now()
    ttl = lease_ttl()
    threshold = now + ttl * settings.HYPHA_RENEW_AT_REMAINING
    retry_before = now - ttl / 4
    due_now = Q(expires_at__lte=threshold) & (
        Q(renewal_requested_at__isnull=True) | Q(renewal_requested_at__lte=retry_before)
    )
    resumed_at = (
        LeaseClock.objects.filter(pk=LeaseClock.SINGLETON).values_list("resumed_at", flat=True).first()
    )
    if resumed_at is not None:
        # Extended by the resume and not renewed since (a renewal or activation moves expires_at past this),
        # and not yet asked on the daemon's current connection since the resume.
        due_now |= Q(expires_at__lte=resumed_at + ttl) & (
            Q(renewal_requested_at__isnull=True)
            | Q(renewal_requested_at__lt=resumed_at)
            | Q(renewal_requested_at__lt=F("worker__connected_at"))
        )
    with transaction.atomic():
        due = list(
            Lease.objects.select_for_update(skip_locked=True, of=("self",))
            .filter(status=Lease.Status.ACTIVE, expires_at__gt=now, worker__status=Worker.Status.ONLINE)
            .filter(due_now)
            .order_by("expires_at")[:limit]
        )
        Lease.objects.filter(pk__in=[lease.pk for lease in due]).update(renewal_requested_at=now)
    return due


# --- the lease clock ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resumption:
    """What a resume of the lease clock did: how long the clock had stood still, and the leases it extended."""

    stopped_for: float
    extended: int
    expires_at: datetime


def clock_stall() -> timedelta:
    """How long the lease clock may go without running before it counts as stopped: four ticks, or a quarter
    TTL when that is longer.

    Below a quarter TTL a pause delays at most one renewal request (they are repeated every quarter TTL, the
    first with two thirds of the TTL left), which costs no lease; a longer one may, so its time is forgiven.
    """
    return timedelta(seconds=max(4 * settings.HYPHA_TICK_INTERVAL, settings.HYPHA_LEASE_TTL / 4))


def run_clock(*, now: datetime | None = None) -> Resumption | None:
    """Record that the lease clock runs now (every lease tick); resume it first if it had stopped.

    Safe with several Celery workers: the clock row is locked for the check-and-write, so one tick resumes
    and the others find the clock running.
    """
    now = now or timezone.now()
    with transaction.atomic():
        clock = LeaseClock.objects.select_for_update().filter(pk=LeaseClock.SINGLETON).first()
        if clock is None:
            _create_clock(now)  # the first tick ever: nothing ran before, so nothing to forgive
            return None
        if now - clock.ticked_at > clock_stall():
            return _resume(clock, now=now)
        if clock.ticked_at < now:
            LeaseClock.objects.filter(pk=clock.pk).update(ticked_at=now)
    return None


def resume_clock_if_stopped(*, now: datetime | None = None) -> Resumption | None:
    """Resume the lease clock if it has stopped (see :func:`resume_clock`); one read when it runs."""
    now = now or timezone.now()
    ticked_at = LeaseClock.objects.filter(pk=LeaseClock.SINGLETON).values_list("ticked_at", flat=True).first()
    if ticked_at is None or now - ticked_at <= clock_stall():
        return None
    return resume_clock(now=now)


def resume_clock(*, now: datetime | None = None) -> Resumption | None:
    """Forgive the time the lease clock stood still: every ACTIVE lease alive when it last ran gets at least
    one TTL from ``now``. Does nothing when the clock has run within :func:`clock_stall`.

    The clock row is locked, so concurrent resumes (two Celery workers, a tick and the gateway) extend once
    and the others find the clock running again. A lease that ran out before the clock stopped was due at
    its last run, and is not extended.
    """
    now = now or timezone.now()
    with transaction.atomic():
        clock = LeaseClock.objects.select_for_update().filter(pk=LeaseClock.SINGLETON).first()
        if clock is None or now - clock.ticked_at <= clock_stall():
            return None
        return _resume(clock, now=now)


def _resume(clock: LeaseClock, *, now: datetime) -> Resumption:
    """Extend the leases the stop would have cost and record the resume; the caller holds the clock's lock."""
    stopped_for = (now - clock.ticked_at).total_seconds()
    expires_at = now + lease_ttl()
    # Resumes are serialised on the clock row. A renewal or an expiry racing this one waits for the lease's
    # row lock and then re-checks its condition (expires_at > now, expires_at <= now) on the new expires_at.
    extended = list(
        Lease.objects.select_for_update(of=("self",))
        .filter(status=Lease.Status.ACTIVE, expires_at__gt=clock.ticked_at, expires_at__lt=expires_at)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    Lease.objects.filter(pk__in=extended).update(expires_at=expires_at, renewal_requested_at=None)
    detail = (
        f"the control plane's lease clock stood still for {stopped_for:.1f}s (restart or outage): "
        f"one TTL from its resume"
    )
    LeaseEvent.objects.bulk_create(
        LeaseEvent(
            lease_id=lease_id,
            kind=LeaseEvent.Kind.EXTENDED,
            from_status=Lease.Status.ACTIVE,
            to_status=Lease.Status.ACTIVE,
            expires_at=expires_at,
            detail=detail,
        )
        for lease_id in extended
    )
    LeaseClock.objects.filter(pk=clock.pk).update(
        ticked_at=now, resumed_at=now, stopped_for=stopped_for, resumptions=F("resumptions") + 1
    )
    logger.warning(
        "lease clock resumed after standing still for %.1fs: %d active lease(s) extended to %s",
        stopped_for,
        len(extended),
        expires_at.isoformat(),
    )
    return Resumption(stopped_for=stopped_for, extended=len(extended), expires_at=expires_at)


def _create_clock(now: datetime) -> None:
    try:
        with transaction.atomic():  # a savepoint: another worker's first tick may have created it meanwhile
            LeaseClock.objects.create(pk=LeaseClock.SINGLETON, ticked_at=now)
    except IntegrityError:
        LeaseClock.objects.filter(pk=LeaseClock.SINGLETON, ticked_at__lt=now).update(ticked_at=now)
