"""The daemon's side of a control-plane restart: while cut off it keeps its ACTIVE leases past their local expiry
(for ``disconnected_lease_grace`` seconds), and while it holds leases it retries at least every quarter TTL, so
it is back within the TTL a restarted control plane gives every lease (docs/architecture.md, "A control-plane
restart"). On a fake clock, without a network."""

from __future__ import annotations

import logging
import uuid

import pytest

from worker_daemon import protocol
from worker_daemon.connection import DISCONNECTED_LEASE_GRACE, WorkerDaemon, WorkerSession
from worker_daemon.leases import LeaseBook

CAPACITY = protocol.Resources(cpu=8, memory=32, storage=100, gpu=24)
LEASE = uuid.UUID(int=1)
JOB = uuid.UUID(int=2)


@pytest.fixture
def session(worker_config, clock) -> WorkerSession:
    return WorkerSession(
        config=worker_config, daemon_version="9.9", clock=clock, disconnected_lease_grace=20.0
    )


def hold_a_lease(session: WorkerSession, make, *, ttl: float = 4.0) -> None:
    """Welcomed, holding one ACTIVE lease that expires locally in ``ttl`` seconds."""
    session.handle(make.welcome(lease_ttl=ttl))
    session.book.activate(lease_id=LEASE, job_id=JOB, role="trainer", resources=CAPACITY, price=1, ttl=ttl)


def test_the_book_prunes_a_lease_only_after_its_grace(clock):
    book = LeaseBook(capacity=CAPACITY, clock=clock)
    book.activate(lease_id=LEASE, job_id=JOB, role="trainer", resources=CAPACITY, price=1, ttl=4)
    clock.now += 4

    assert book.prune(lease_grace=20.0) == ([], [])
    clock.now += 19.9
    assert book.prune(lease_grace=20.0) == ([], [])
    clock.now += 0.1
    reservations, leases = book.prune(lease_grace=20.0)
    assert (reservations, [lease.lease_id for lease in leases]) == ([], [LEASE])


def test_a_cut_off_daemon_keeps_its_lease_past_its_local_expiry(session, make, clock):
    # given: a lease with 4 s left, and the connection lost
    hold_a_lease(session, make)
    session.disconnected()

    # when: its local expiry passes, and 19 s more
    clock.now += 4 + 19

    # then: still held (its task keeps running), and claimed in the next hello
    assert session.prune() is False
    assert session.book.lease_ids() == [LEASE]
    assert session.hello().leases == [LEASE]


def test_a_cut_off_daemon_drops_its_lease_after_the_grace_and_says_why(session, make, clock, caplog):
    # given
    hold_a_lease(session, make)
    session.disconnected()
    clock.now += 4 + 20

    # when
    with caplog.at_level(logging.WARNING, logger="worker_daemon.connection"):
        assert session.prune() is True

    # then
    assert session.book.leases == []
    assert session.book.free() == CAPACITY
    assert caplog.messages == [
        f"lease {LEASE} not renewed, dropped: the control plane was unreachable for its TTL and 20s more "
        f"(job {JOB}, role trainer)"
    ]


def test_the_welcome_after_a_reconnect_ends_the_grace(session, make, clock):
    # given: cut off past the local expiry, then welcomed back with the lease (one TTL from the restart)
    hold_a_lease(session, make)
    session.disconnected()
    clock.now += 10
    session.handle(make.welcome(leases=[make.lease_info(LEASE, expires_in=4.0)], lease_ttl=4.0))

    # when: the control plane's TTL runs out with no renewal, while connected
    clock.now += 3.9
    assert session.prune() is False
    clock.now += 0.1

    # then: dropped at once, no grace while connected
    assert session.prune() is True
    assert session.book.leases == []


def test_a_connected_daemon_gets_no_grace(session, make, clock):
    hold_a_lease(session, make)
    clock.now += 4

    assert session.prune() is True
    assert session.book.leases == []


def test_the_default_grace_covers_a_restart_of_the_control_plane():
    assert DISCONNECTED_LEASE_GRACE == 60.0


def test_backoff_is_capped_at_a_quarter_ttl_while_leases_are_held(worker_config, make):
    ceilings = []

    def uniform(low, high):
        ceilings.append(high)
        return high

    daemon = WorkerDaemon(config=worker_config, server_url="http://h", token="t", uniform=uniform)
    daemon.session.handle(make.welcome(lease_ttl=4.0))

    # without leases: the usual exponential backoff up to 30 s
    assert [daemon.backoff_delay(attempt) for attempt in (0, 3, 10)] == [0.5, 4.0, 30.0]

    # holding a lease: at most a quarter of its TTL
    daemon.session.book.activate(
        lease_id=LEASE, job_id=JOB, role="trainer", resources=CAPACITY, price=1, ttl=4.0
    )
    assert [daemon.backoff_delay(attempt) for attempt in (0, 3, 10)] == [0.5, 1.0, 1.0]
    assert ceilings == [0.5, 4.0, 30.0, 0.5, 1.0, 1.0]
