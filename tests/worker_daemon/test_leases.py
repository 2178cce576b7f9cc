"""The local lease book: reservations, activation, renewal, capacity and expiry on an injected clock."""

from __future__ import annotations

import uuid

import pytest

from tests.worker_daemon.conftest import FakeClock
from worker_daemon.leases import Lease, LeaseBook, Reservation
from worker_daemon.protocol import ZERO, Resources

CAPACITY = Resources(cpu=8, memory=32, storage=100, gpu=24)
TRAINER = Resources(cpu=2, memory=8, gpu=10)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(now=1000.0)


@pytest.fixture
def book(clock) -> LeaseBook:
    return LeaseBook(capacity=CAPACITY, clock=clock)


def ids(count: int) -> list[uuid.UUID]:
    return [uuid.UUID(int=number) for number in range(1, count + 1)]


def test_reserve_takes_from_free_capacity(book):
    [advert] = ids(1)

    reservation = book.reserve(advertisement_id=advert, attempt=3, resources=TRAINER, ttl=2.5)

    assert reservation == Reservation(
        advertisement_id=advert, attempt=3, resources=TRAINER, expires_at=1002.5
    )
    assert book.reservations == [reservation]
    assert book.used() == TRAINER
    assert book.free() == Resources(cpu=6, memory=24, storage=100, gpu=14)


def test_reserve_refuses_what_does_not_fit_and_changes_nothing(book):
    first, second, third = ids(3)
    assert book.reserve(advertisement_id=first, attempt=0, resources=TRAINER, ttl=1) is not None
    assert book.reserve(advertisement_id=second, attempt=0, resources=TRAINER, ttl=1) is not None

    # 20 of 24 GB VRAM are promised: a third trainer does not fit
    assert book.reserve(advertisement_id=third, attempt=0, resources=TRAINER, ttl=1) is None

    assert [r.advertisement_id for r in book.reservations] == [first, second]
    assert book.free() == Resources(cpu=4, memory=16, storage=100, gpu=4)


def test_whole_capacity_fits_exactly_once(book):
    first, second = ids(2)
    assert book.reserve(advertisement_id=first, attempt=0, resources=CAPACITY, ttl=1) is not None
    assert book.free() == ZERO
    assert book.reserve(advertisement_id=second, attempt=0, resources=Resources(cpu=0.5), ttl=1) is None


def test_one_pending_reservation_per_advertisement(book):
    [advert] = ids(1)
    book.reserve(advertisement_id=advert, attempt=0, resources=TRAINER, ttl=1)
    assert book.reserve(advertisement_id=advert, attempt=1, resources=Resources(cpu=1), ttl=1) is None
    assert book.used() == TRAINER


def test_free_reservation(book):
    [advert] = ids(1)
    reservation = book.reserve(advertisement_id=advert, attempt=0, resources=TRAINER, ttl=1)
    assert book.free_reservation(advert) == reservation
    assert book.free_reservation(advert) is None
    assert book.used() == ZERO


def test_attach_lease_moves_the_expiry(book, clock):
    advert, lease = ids(2)
    book.reserve(advertisement_id=advert, attempt=0, resources=TRAINER, ttl=1)
    clock.now += 0.5

    reservation = book.attach_lease(advertisement_id=advert, lease_id=lease, ttl=3.0)

    assert (reservation.lease_id, reservation.expires_at) == (lease, 1003.5)
    assert book.attach_lease(advertisement_id=uuid.uuid4(), lease_id=lease, ttl=3.0) is None


def test_activate_turns_the_reservation_into_a_lease(book, clock):
    advert, lease_id, job = ids(3)
    book.reserve(advertisement_id=advert, attempt=0, resources=CAPACITY, ttl=1)
    book.attach_lease(advertisement_id=advert, lease_id=lease_id, ttl=1)

    # the whole capacity was reserved, the grant is for the whole capacity: it fits because the
    # reservation is converted, not added
    lease = book.activate(
        lease_id=lease_id,
        job_id=job,
        role="trainer",
        resources=CAPACITY,
        price=150.0,
        ttl=10.0,
        advertisement_id=advert,
    )

    assert lease == Lease(
        lease_id=lease_id,
        job_id=job,
        role="trainer",
        resources=CAPACITY,
        price=150.0,
        expires_at=1010.0,
        advertisement_id=advert,
    )
    assert book.reservations == []
    assert book.leases == [lease]
    assert book.lease_ids() == [lease_id]
    assert book.used() == CAPACITY


def test_activate_finds_the_reservation_by_lease_id(book):
    advert, lease_id, job = ids(3)
    book.reserve(advertisement_id=advert, attempt=0, resources=CAPACITY, ttl=1)
    book.attach_lease(advertisement_id=advert, lease_id=lease_id, ttl=1)
    lease = book.activate(lease_id=lease_id, job_id=job, role="ps", resources=CAPACITY, price=1.0, ttl=1)
    assert lease is not None
    assert book.reservations == []


def test_activate_without_a_reservation_takes_free_capacity(book):
    lease_id, job = ids(2)
    lease = book.activate(lease_id=lease_id, job_id=job, role="trainer", resources=TRAINER, price=1.0, ttl=5)
    assert lease is not None
    assert book.used() == TRAINER


def test_activate_that_does_not_fit_changes_nothing_but_settles_the_reservation(book):
    advert, other, lease_id, job = ids(4)
    book.reserve(advertisement_id=other, attempt=0, resources=TRAINER, ttl=1)
    book.reserve(advertisement_id=advert, attempt=0, resources=TRAINER, ttl=1)

    # a grant bigger than the reservation and the free rest together
    lease = book.activate(
        lease_id=lease_id,
        job_id=job,
        role="trainer",
        resources=Resources(gpu=20),
        price=1.0,
        ttl=5,
        advertisement_id=advert,
    )

    assert lease is None
    assert book.leases == []
    assert [r.advertisement_id for r in book.reservations] == [other]


def test_activating_twice_only_refreshes(book, clock):
    lease_id, job = ids(2)
    book.activate(lease_id=lease_id, job_id=job, role="trainer", resources=TRAINER, price=1.0, ttl=5)
    clock.now += 3
    again = book.activate(lease_id=lease_id, job_id=job, role="trainer", resources=TRAINER, price=1.0, ttl=5)
    assert again.expires_at == 1008.0
    assert book.used() == TRAINER


def test_renew_restarts_from_now(book, clock):
    lease_id, job, unknown = ids(3)
    book.activate(lease_id=lease_id, job_id=job, role="trainer", resources=TRAINER, price=1.0, ttl=10)
    clock.now += 9

    assert book.renew(lease_id, ttl=10) is True
    assert book.lease(lease_id).expires_at == 1019.0
    assert book.renew(unknown, ttl=10) is False


def test_renew_a_reservation_by_its_lease_id(book):
    advert, lease_id = ids(2)
    book.reserve(advertisement_id=advert, attempt=0, resources=TRAINER, ttl=1)
    book.attach_lease(advertisement_id=advert, lease_id=lease_id, ttl=1)
    assert book.renew(lease_id, ttl=7) is True
    assert book.reservation(advert).expires_at == 1007.0


def test_drop_lease_or_reservation(book):
    advert, pending, lease_id, job = ids(4)
    book.activate(lease_id=lease_id, job_id=job, role="trainer", resources=TRAINER, price=1.0, ttl=10)
    book.reserve(advertisement_id=advert, attempt=0, resources=TRAINER, ttl=1)
    book.attach_lease(advertisement_id=advert, lease_id=pending, ttl=1)

    assert isinstance(book.drop(lease_id), Lease)
    assert isinstance(book.drop(pending), Reservation)
    assert book.drop(lease_id) is None
    assert book.used() == ZERO


def test_prune_drops_exactly_the_expired(book, clock):
    short, long, lease_short, lease_long, job = ids(5)
    book.reserve(advertisement_id=short, attempt=0, resources=Resources(cpu=1), ttl=1)
    book.reserve(advertisement_id=long, attempt=0, resources=Resources(cpu=1), ttl=3)
    book.activate(lease_id=lease_short, job_id=job, role="a", resources=Resources(cpu=1), price=1, ttl=2)
    book.activate(lease_id=lease_long, job_id=job, role="b", resources=Resources(cpu=1), price=1, ttl=4)

    clock.now += 0.999
    assert book.prune() == ([], [])

    clock.now = 1002.0  # expiry is inclusive: at 1002.0 a ttl-2 lease is gone
    reservations, leases = book.prune()

    assert [r.advertisement_id for r in reservations] == [short]
    assert [lease.lease_id for lease in leases] == [lease_short]
    assert [r.advertisement_id for r in book.reservations] == [long]
    assert book.lease_ids() == [lease_long]
    assert book.used() == Resources(cpu=2)


def test_drop_reservations_keeps_leases(book):
    advert, lease_id, job = ids(3)
    book.reserve(advertisement_id=advert, attempt=0, resources=Resources(cpu=1), ttl=1)
    book.activate(lease_id=lease_id, job_id=job, role="a", resources=Resources(cpu=2), price=1, ttl=1)

    dropped = book.drop_reservations()

    assert [r.advertisement_id for r in dropped] == [advert]
    assert book.lease_ids() == [lease_id]
    assert book.used() == Resources(cpu=2)
