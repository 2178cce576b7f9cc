"""The lease clock: time the control plane stood still (a restart of daphne and Celery) costs no lease.

A fake clock (``timezone.now`` patched, as ``frozen_now`` does, but movable) plays the outage: leases are made
and renewed, the clock ticks, time jumps past their expiry with no tick in between, and then the clock (or the
gateway) runs again. TTL 10 s and a tick of 0.5 s, so the stall is max(4 × 0.5, 10 / 4) = 2.5 s.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from apps.jobs import services as job_services
from apps.jobs.models import TRAINER
from apps.leases import services as lease_services
from apps.leases.models import Lease, LeaseClock, LeaseEvent
from tests.apps.conftest import CAPACITY, connect

TTL = timedelta(seconds=10)

pytestmark = pytest.mark.django_db


@dataclass
class FakeClock:
    now: datetime

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


@pytest.fixture
def clock(monkeypatch, settings) -> FakeClock:
    settings.HYPHA_TICK_INTERVAL = 0.5
    fake = FakeClock(now=timezone.now().replace(microsecond=0))
    monkeypatch.setattr(timezone, "now", lambda: fake.now)
    return fake


def active_lease(worker, job) -> Lease:
    """An ACTIVE whole-capacity lease of the worker."""
    lease = temporary_lease(worker, job)
    lease.activate(ttl=lease_services.lease_ttl())
    return lease


def temporary_lease(worker, job) -> Lease:
    """A TEMPORARY whole-capacity lease; the worker is connected first if it is offline (its capacity comes
    with its hello)."""
    worker.refresh_from_db()
    if worker.status != worker.Status.ONLINE:
        connect(worker)
    return lease_services.reserve(worker_id=worker.pk, job=job, role=TRAINER, resources=CAPACITY, price=120.0)


def state(lease: Lease) -> tuple:
    lease.refresh_from_db()
    return lease.status, lease.expires_at


def event_kinds(lease: Lease) -> list[str]:
    return list(LeaseEvent.objects.filter(lease=lease).values_list("kind", flat=True))


def clock_row() -> tuple:
    row = LeaseClock.objects.get()
    return row.ticked_at, row.resumed_at, row.stopped_for, row.resumptions


# --- the clock's own record ---------------------------------------------------------------------------------


def test_the_first_tick_starts_the_clock_and_resumes_nothing(clock, job, rig_a):
    # given: an ACTIVE lease and no clock yet (a fresh installation)
    lease = active_lease(rig_a, job)

    # when
    resumption = lease_services.run_clock()

    # then
    assert resumption is None
    assert clock_row() == (clock.now, None, 0.0, 0)
    assert state(lease) == (Lease.Status.ACTIVE, clock.now + TTL)


def test_a_tick_within_the_stall_only_records_that_the_clock_ran(clock, job, rig_a):
    # given: the clock ran; a lease was made; 2.5 s pass (the stall, not more)
    lease_services.run_clock()
    lease = active_lease(rig_a, job)
    started = clock.now
    clock.advance(2.5)

    # when
    resumption = lease_services.run_clock()

    # then: no resume, nothing extended
    assert resumption is None
    assert clock_row() == (clock.now, None, 0.0, 0)
    assert state(lease) == (Lease.Status.ACTIVE, started + TTL)
    assert event_kinds(lease) == ["created", "activated"]


def test_the_stall_is_four_ticks_or_a_quarter_ttl(settings):
    settings.HYPHA_TICK_INTERVAL = 0.5
    settings.HYPHA_LEASE_TTL = 10.0
    assert lease_services.clock_stall() == timedelta(seconds=2.5)
    settings.HYPHA_TICK_INTERVAL = 2.0
    assert lease_services.clock_stall() == timedelta(seconds=8.0)


# --- a restart: the tick resumes the clock ------------------------------------------------------------------


def test_after_a_stop_the_tick_gives_every_active_lease_one_ttl_from_the_restart(clock, job, rig_a, rig_b):
    # given: two ACTIVE leases, the clock running; then the control plane stands still for 15 s, longer than
    # what was left of either lease (8 s and 10 s)
    lease_services.run_clock()
    early = active_lease(rig_a, job)
    clock.advance(2)
    late = active_lease(rig_b, job)
    lease_services.run_clock()
    stopped_at = clock.now
    restart = clock.advance(15)

    # when: the lease clock's first tick after the restart
    tick = job_services.tick_leases()

    # then: no lease expired; both run until one TTL after the restart
    assert tick.expired == 0
    assert state(early) == (Lease.Status.ACTIVE, restart + TTL)
    assert state(late) == (Lease.Status.ACTIVE, restart + TTL)
    assert clock_row() == (restart, restart, 15.0, 1)
    assert (restart - stopped_at).total_seconds() == 15.0
    event = LeaseEvent.objects.filter(lease=early).last()
    assert (event.kind, event.from_status, event.to_status, event.expires_at, event.detail) == (
        "extended",
        "active",
        "active",
        restart + TTL,
        "the control plane's lease clock stood still for 15.0s (restart or outage): one TTL from its resume",
    )
    assert event_kinds(late) == ["created", "activated", "extended"]


def test_a_lease_that_ran_out_before_the_clock_stopped_still_expires(clock, job, rig_a, rig_b):
    # given: rig-a's lease ran out a second before the clock's last tick (that tick was due to expire it);
    # rig-b's was alive then
    lease_services.run_clock()
    ran_out = active_lease(rig_a, job)
    alive = active_lease(rig_b, job)
    Lease.objects.filter(pk=ran_out.pk).update(expires_at=clock.now - timedelta(seconds=1))
    restart = clock.advance(20)

    # when
    tick = job_services.tick_leases()

    # then: only the live one is extended
    assert tick.expired == 1
    assert ran_out.__class__.objects.get(pk=ran_out.pk).status == Lease.Status.EXPIRED
    assert event_kinds(ran_out) == ["created", "activated", "expired"]
    assert state(alive) == (Lease.Status.ACTIVE, restart + TTL)


def test_a_temporary_lease_gets_no_grace(clock, job, rig_a):
    # given: an open offer's TEMPORARY lease (3 s) when the control plane stopped; its daemon forgets the
    # offer with the connection
    lease_services.run_clock()
    offer_lease = temporary_lease(rig_a, job)
    clock.advance(20)

    # when
    tick = job_services.tick_leases()

    # then
    assert tick.expired == 1
    assert offer_lease.__class__.objects.get(pk=offer_lease.pk).status == Lease.Status.EXPIRED
    assert "extended" not in event_kinds(offer_lease)


def test_a_lease_nobody_renews_after_the_restart_expires_one_ttl_after_it(clock, job, rig_a):
    # given: the clock resumed after a stop; the lease's daemon never came back
    lease_services.run_clock()
    lease = active_lease(rig_a, job)
    restart = clock.advance(30)
    job_services.tick_leases()

    # when: the clock ticks on, every half second, until just before and just after one TTL
    while clock.now < restart + TTL - timedelta(seconds=0.5):
        clock.advance(0.5)
        assert job_services.tick_leases().expired == 0
    clock.advance(0.5)
    tick = job_services.tick_leases()

    # then: expired, at one TTL after the restart and not later
    assert clock.now == restart + TTL
    assert tick.expired == 1
    lease.refresh_from_db()
    assert (lease.status, lease.status_reason, lease.ended_at) == (
        Lease.Status.EXPIRED,
        "not renewed before it ran out",
        restart + TTL,
    )
    assert LeaseClock.objects.get().resumptions == 1


def test_a_lease_renewed_after_the_restart_lives_on(clock, job, rig_a):
    # given: a resume after a stop
    lease_services.run_clock()
    lease = active_lease(rig_a, job)
    clock.advance(30)
    job_services.tick_leases()

    # when: its daemon confirms the renewal 4 s later
    renewed_at = clock.advance(4)
    assert job_services.renewal_confirmed(worker=rig_a, lease_id=lease.pk)

    # then
    assert state(lease) == (Lease.Status.ACTIVE, renewed_at + TTL)
    assert event_kinds(lease) == ["created", "activated", "extended", "renewed"]


def test_the_clock_resumes_once_and_the_leases_are_extended_once(clock, job, rig_a):
    # given: a stop
    lease_services.run_clock()
    lease = active_lease(rig_a, job)
    restart = clock.advance(30)

    # when: the tick, the gateway, and a second worker's tick all find it
    first = lease_services.run_clock()
    again = lease_services.resume_clock()
    gateway = lease_services.resume_clock_if_stopped()
    clock.advance(0.5)
    later = lease_services.run_clock()

    # then
    assert first == lease_services.Resumption(stopped_for=30.0, extended=1, expires_at=restart + TTL)
    assert (again, gateway, later) == (None, None, None)
    assert event_kinds(lease).count("extended") == 1
    assert clock_row() == (clock.now, restart, 30.0, 1)


# --- a clock that pauses without a restart ------------------------------------------------------------------


def test_a_pause_shorter_than_the_stall_forgives_nothing(clock, job, rig_a):
    # given: a lease with 2 s left when the clock paused for 2.5 s (a busy Celery worker)
    lease_services.run_clock()
    lease = active_lease(rig_a, job)
    Lease.objects.filter(pk=lease.pk).update(expires_at=clock.now + timedelta(seconds=2))
    clock.advance(2.5)

    # when
    tick = job_services.tick_leases()

    # then: it expired as it would have without the pause
    assert tick.expired == 1
    assert Lease.objects.get(pk=lease.pk).status == Lease.Status.EXPIRED
    assert LeaseClock.objects.get().resumptions == 0


# --- the gateway: a daemon that is back before the clock's first tick ---------------------------------------


def test_a_daemon_reconnecting_before_the_first_tick_is_welcomed_with_its_lease(clock, job, rig_a):
    # given: rig-a holds an ACTIVE lease; the control plane stops for 15 s (the lease ran out meanwhile)
    connect(rig_a)
    lease_services.run_clock()
    lease = active_lease(rig_a, job)
    restart = clock.advance(15)

    # when: the daemon's hello claims it, before the lease clock has ticked
    welcome = connect(rig_a, channel_name="test.rig-a.again", leases=(lease.pk,))

    # then: kept, with one TTL from the restart
    assert [(info.lease_id, info.status, info.expires_in) for info in welcome.leases] == [
        (lease.pk, "active", TTL.total_seconds())
    ]
    assert state(lease) == (Lease.Status.ACTIVE, restart + TTL)
    assert clock_row() == (restart, restart, 15.0, 1)


def test_a_reconnecting_daemon_that_lost_its_lease_still_has_it_ended(clock, job, rig_a):
    # given: as above, but the daemon's hello does not claim the lease (it dropped it)
    connect(rig_a)
    lease_services.run_clock()
    lease = active_lease(rig_a, job)
    clock.advance(15)

    # when
    welcome = connect(rig_a, channel_name="test.rig-a.again")

    # then
    assert welcome.leases == []
    lease.refresh_from_db()
    assert (lease.status, lease.status_reason) == (
        Lease.Status.RELEASED,
        "the worker's daemon no longer holds it (reconnected without it)",
    )


def test_the_gateway_resumes_nothing_while_the_clock_runs(clock, job, rig_a):
    # given: the clock ran 2 s ago; rig-a's lease ran out a second ago (its daemon stopped renewing)
    connect(rig_a)
    lease_services.run_clock()
    lease = active_lease(rig_a, job)
    Lease.objects.filter(pk=lease.pk).update(expires_at=clock.now + timedelta(seconds=1))
    clock.advance(2)

    # when
    welcome = connect(rig_a, channel_name="test.rig-a.again", leases=(lease.pk,))

    # then: not kept, not extended
    assert welcome.leases == []
    assert Lease.objects.get(pk=lease.pk).expires_at == clock.now - timedelta(seconds=1)
    assert "extended" not in event_kinds(lease)


# --- renewal requests after a resume -----------------------------------------------------------------------


def test_after_a_resume_the_daemon_is_asked_at_once_and_again_once_it_is_back(clock, job, rig_a, sent):
    # given: an online worker's lease; the control plane stands still for 15 s
    connect(rig_a)
    lease_services.run_clock()
    lease = active_lease(rig_a, job)
    restart = clock.advance(15)

    # when: the first tick after the restart (the daemon's old connection is dead: the request is lost)
    first = job_services.tick_leases()

    # then: asked at once, although one whole TTL is left
    assert first.renewals_requested == 1
    assert [(worker, message.lease_id) for worker, message in sent] == [(rig_a.pk, lease.pk)]
    assert Lease.objects.get(pk=lease.pk).renewal_requested_at == restart

    # when: the next tick, still on the old connection: not asked again yet
    clock.advance(0.5)
    assert job_services.tick_leases().renewals_requested == 0

    # when: the daemon reconnects, and the clock ticks
    clock.advance(0.5)
    connect(rig_a, channel_name="test.rig-a.again", leases=(lease.pk,))
    clock.advance(0.5)
    again = job_services.tick_leases()

    # then: asked again on the new connection, and then not before the usual rule says so
    assert again.renewals_requested == 1
    clock.advance(0.5)
    assert job_services.tick_leases().renewals_requested == 0


def test_a_lease_renewed_after_the_resume_follows_the_usual_rule(clock, job, rig_a):
    # given: a resume, then the daemon renewed the lease
    connect(rig_a)
    lease_services.run_clock()
    lease = active_lease(rig_a, job)
    clock.advance(15)
    lease_services.run_clock()
    clock.advance(1)
    lease.renew(ttl=TTL)
    connect(rig_a, channel_name="test.rig-a.again", leases=(lease.pk,))

    # when: 3 s later (7 s left: not due yet), and at 3.3 s (6.7 s left: due)
    clock.advance(3)
    not_yet = lease_services.claim_due_renewals()
    clock.advance(0.3)
    due = lease_services.claim_due_renewals()

    # then
    assert (not_yet, [lease.pk for lease in due]) == ([], [lease.pk])
