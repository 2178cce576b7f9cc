"""The daemon's protocol state machine (:class:`WorkerSession`), without a network, on a fake clock."""

from __future__ import annotations

import json
import logging
import uuid

import pytest

from worker_daemon import protocol
from worker_daemon.connection import OFFER_SAFETY_MARGIN, WorkerSession

CAPACITY = protocol.Resources(cpu=8, memory=32, storage=100, gpu=24)
CAPACITY_FRAME = {"cpu": 8.0, "memory": 32.0, "storage": 100.0, "gpu": 24.0}


@pytest.fixture
def session(worker_config, clock) -> WorkerSession:
    return WorkerSession(config=worker_config, daemon_version="9.9", clock=clock)


@pytest.fixture
def flexible_session(flexible_config, clock) -> WorkerSession:
    return WorkerSession(config=flexible_config, daemon_version="9.9", clock=clock)


def test_hello_claims_only_active_leases(session, make):
    advertisement = make.advertisement()
    session.handle(make.welcome(advertisements=[advertisement]))
    session.evaluate()  # a reservation, not a lease
    session.book.activate(
        lease_id=uuid.UUID(int=7),
        job_id=uuid.UUID(int=8),
        role="ps",
        resources=protocol.Resources(),
        price=1,
        ttl=5,
    )

    assert make.frame(session.hello()) == {
        "type": "hello",
        "protocol_version": protocol.PROTOCOL_VERSION,
        "daemon_version": "9.9",
        "resources": CAPACITY_FRAME,
        "devices": [],
        "executors": [
            {"class": "train", "name": "diloco-transformer"},
            {"class": "aggregate", "name": "parameter-server"},
            {"class": "inference", "name": "batch-inference"},
        ],
        "price_floor": 100.0,
        "strategy": "whole",
        "leases": [str(uuid.UUID(int=7))],
        "benchmark": None,
        "reachable": "auto",
    }


def test_welcome_keeps_exactly_the_leases_the_control_plane_lists(session, make, clock):
    kept, gone = uuid.UUID(int=1), uuid.UUID(int=2)
    small = protocol.Resources(cpu=1)
    for lease_id in (kept, gone):
        session.book.activate(
            lease_id=lease_id, job_id=lease_id, role="trainer", resources=small, price=1, ttl=3
        )
    clock.now += 2

    outcome = session.handle(make.welcome(leases=[make.lease_info(kept, resources=small, expires_in=7.0)]))

    assert outcome.replies == ()
    assert session.book.lease_ids() == [kept]
    assert session.book.lease(kept).expires_at == 509.0  # refreshed from now, not extended
    assert (session.worker_id, session.worker_name, session.offer_ttl, session.lease_ttl) == (
        uuid.UUID(int=1),
        "gpu-01",
        2.0,
        2.0,
    )


def test_welcome_adopts_a_listed_lease_that_lapsed_locally_or_releases_it(session, make):
    fits, too_big = uuid.UUID(int=1), uuid.UUID(int=2)

    outcome = session.handle(
        make.welcome(
            leases=[
                make.lease_info(fits, resources=protocol.Resources(gpu=20)),
                make.lease_info(too_big, resources=protocol.Resources(gpu=20)),
                make.lease_info(uuid.UUID(int=3), status="temporary"),
            ]
        )
    )

    assert session.book.lease_ids() == [fits]
    assert outcome.replies == (protocol.ReleaseLease(lease_id=too_big, reason="resources no longer free"),)


def test_offer_once_per_advertisement_and_attempt(session, make, clock):
    advertisement = make.advertisement(bid=150.0)
    session.handle(make.welcome(advertisements=[advertisement], offer_ttl=4.0))

    [offer] = session.evaluate()

    assert offer == protocol.Offer(
        advertisement_id=advertisement.advertisement_id, attempt=0, price=150.0, resources=CAPACITY
    )
    assert (
        session.book.reservation(advertisement.advertisement_id).expires_at
        == 500.0 + 4.0 + OFFER_SAFETY_MARGIN
    )
    # same attempt: no second offer, even after the reservation is freed
    session.handle(protocol.OfferDeclined(advertisement_id=advertisement.advertisement_id, reason="lost"))
    assert session.evaluate() == []
    # a stale or repeated attempt changes nothing
    assert session.handle(advertisement).reevaluate is False
    # a new attempt is a new chance
    retry = advertisement.model_copy(update={"attempt": 1})
    assert session.handle(retry).reevaluate is True
    assert [o.attempt for o in session.evaluate()] == [1]


def test_whole_strategy_offers_one_at_a_time_and_moves_on_after_a_decline(session, make):
    worse = make.advertisement(bid=150.0)
    better = make.advertisement(bid=200.0)
    session.handle(make.welcome(advertisements=[worse, better]))

    assert [o.advertisement_id for o in session.evaluate()] == [better.advertisement_id]
    assert session.evaluate() == []  # the whole capacity is reserved for the pending offer

    outcome = session.handle(
        protocol.OfferDeclined(advertisement_id=better.advertisement_id, reason="outbid")
    )

    assert outcome.reevaluate is True
    assert [(o.advertisement_id, o.price) for o in session.evaluate()] == [(worse.advertisement_id, 150.0)]


def test_flexible_strategy_offers_while_resources_last(flexible_session, make):
    first = make.advertisement(bid=200.0, resources={"gpu": 10})
    second = make.advertisement(bid=150.0, resources={"gpu": 10})
    third = make.advertisement(bid=100.0, resources={"gpu": 10})
    flexible_session.handle(make.welcome(advertisements=[third, second, first]))

    offers = flexible_session.evaluate()

    assert [(o.advertisement_id, o.price, o.resources) for o in offers] == [
        (first.advertisement_id, 200.0, protocol.Resources(gpu=10)),
        (second.advertisement_id, 150.0, protocol.Resources(gpu=10)),
    ]
    # the third did not fit (20 of 24 GB reserved); it is tried again once the first lease ends
    flexible_session.handle(make.grant(first, uuid.UUID(int=1), resources=protocol.Resources(gpu=10)))
    assert flexible_session.evaluate() == []
    flexible_session.handle(protocol.LeaseEnded(lease_id=uuid.UUID(int=1), status="expired"))
    assert [o.advertisement_id for o in flexible_session.evaluate()] == [third.advertisement_id]


def test_no_second_offer_on_an_advertisement_whose_lease_is_held(flexible_session, make):
    advertisement = make.advertisement(resources={"gpu": 10})
    flexible_session.handle(make.welcome(advertisements=[advertisement]))
    flexible_session.evaluate()
    flexible_session.handle(make.grant(advertisement, uuid.UUID(int=1), resources=protocol.Resources(gpu=10)))

    flexible_session.handle(advertisement.model_copy(update={"attempt": 1}))

    assert flexible_session.evaluate() == []


def test_grant_after_the_reservation_lapsed_is_kept_if_it_fits(session, make, clock):
    advertisement = make.advertisement()
    session.handle(make.welcome(advertisements=[advertisement], offer_ttl=1.0))
    session.evaluate()
    clock.now += 2.5
    assert session.prune() is True
    assert session.book.reservations == []

    outcome = session.handle(make.grant(advertisement, uuid.UUID(int=5)))

    assert outcome.replies == ()
    assert session.book.lease_ids() == [uuid.UUID(int=5)]


def test_grant_that_no_longer_fits_is_released(session, make, clock):
    session.book.activate(
        lease_id=uuid.UUID(int=1),
        job_id=uuid.UUID(int=1),
        role="ps",
        resources=protocol.Resources(cpu=1),
        price=1,
        ttl=60,
    )
    advertisement = make.advertisement()

    outcome = session.handle(
        make.grant(advertisement, uuid.UUID(int=2))
    )  # the whole capacity, 1 cpu is taken

    assert outcome.replies == (
        protocol.ReleaseLease(lease_id=uuid.UUID(int=2), reason="resources no longer free"),
    )
    assert session.book.lease_ids() == [uuid.UUID(int=1)]


def test_offer_received_extends_the_reservation(session, make, clock):
    advertisement = make.advertisement()
    session.handle(make.welcome(advertisements=[advertisement], offer_ttl=1.0))
    session.evaluate()
    clock.now += 0.5

    session.handle(
        protocol.OfferReceived(
            advertisement_id=advertisement.advertisement_id,
            offer_id=uuid.UUID(int=3),
            lease_id=uuid.UUID(int=4),
            expires_in=3.0,
        )
    )

    reservation = session.book.reservation(advertisement.advertisement_id)
    assert (reservation.lease_id, reservation.expires_at) == (uuid.UUID(int=4), 504.5)


def test_advertisement_closed_forgets_the_advert_but_not_the_reservation(session, make):
    advertisement = make.advertisement()
    session.handle(make.welcome(advertisements=[advertisement]))
    session.evaluate()

    session.handle(
        protocol.AdvertisementClosed(advertisement_id=advertisement.advertisement_id, reason="filled")
    )

    assert session.open_advertisements == []
    assert session.book.reservation(advertisement.advertisement_id) is not None


def test_renew(session, make, clock):
    session.book.activate(
        lease_id=uuid.UUID(int=1), job_id=uuid.UUID(int=1), role="ps", resources=CAPACITY, price=1, ttl=2
    )
    clock.now += 1

    renewed = session.handle(protocol.RenewLease(lease_id=uuid.UUID(int=1), expires_in=10.0))
    refused = session.handle(protocol.RenewLease(lease_id=uuid.UUID(int=2), expires_in=10.0))

    assert renewed.replies == (protocol.LeaseRenewed(lease_id=uuid.UUID(int=1)),)
    assert session.book.lease(uuid.UUID(int=1)).expires_at == 511.0
    assert refused.replies == (
        protocol.RenewRefused(lease_id=uuid.UUID(int=2), reason="lease not held by this daemon"),
    )


def test_prune_drops_an_unrenewed_lease_and_logs_it(session, clock, caplog):
    lease_id = uuid.UUID(int=1)
    session.book.activate(
        lease_id=lease_id, job_id=uuid.UUID(int=2), role="trainer", resources=CAPACITY, price=1, ttl=2
    )
    clock.now += 1.9
    assert session.prune() is False

    clock.now += 0.1
    with caplog.at_level(logging.WARNING, logger="worker_daemon.connection"):
        assert session.prune() is True

    assert session.book.leases == []
    assert session.book.free() == CAPACITY
    assert [r.getMessage() for r in caplog.records] == [
        f"lease {lease_id} not renewed, dropped (job {uuid.UUID(int=2)}, role trainer)"
    ]


def test_disconnect_drops_reservations_and_adverts_and_keeps_leases(session, make):
    advertisement = make.advertisement()
    session.handle(make.welcome(advertisements=[advertisement]))
    session.book.activate(
        lease_id=uuid.UUID(int=1),
        job_id=uuid.UUID(int=1),
        role="ps",
        resources=protocol.Resources(cpu=1),
        price=1,
        ttl=9,
    )
    flexible = session.evaluate()
    assert flexible == []  # whole capacity does not fit next to the lease

    session.disconnected()

    assert (session.open_advertisements, session.book.reservations, session.welcomed) == ([], [], False)
    assert session.book.lease_ids() == [uuid.UUID(int=1)]


def test_shutdown_releases_and_refuses_what_comes_after(session, make):
    held = uuid.UUID(int=1)
    advertisement = make.advertisement(resources={"cpu": 1})
    session.handle(make.welcome(advertisements=[advertisement]))
    session.book.activate(
        lease_id=held, job_id=held, role="ps", resources=protocol.Resources(cpu=1), price=1, ttl=9
    )

    releases = session.begin_shutdown()

    assert releases == [protocol.ReleaseLease(lease_id=held, reason="daemon shutting down")]
    assert session.awaiting_end == {held}
    assert session.evaluate() == []
    assert session.handle(protocol.RenewLease(lease_id=held, expires_in=5)).replies == (
        protocol.RenewRefused(lease_id=held, reason="daemon shutting down"),
    )
    late = session.handle(make.grant(advertisement, uuid.UUID(int=2), resources=protocol.Resources(cpu=1)))
    assert late.replies == (protocol.ReleaseLease(lease_id=uuid.UUID(int=2), reason="daemon shutting down"),)
    assert session.awaiting_end == {held, uuid.UUID(int=2)}
    session.handle(protocol.LeaseEnded(lease_id=held, status="released"))
    assert session.awaiting_end == {uuid.UUID(int=2)}


def test_an_advert_with_a_negative_attempt_is_refused_by_the_protocol(session, make):
    # given an advert frame an offer could not answer (Offer.attempt >= 0)
    frame = make.advertisement(attempt=0).model_dump(mode="json", by_alias=True) | {"attempt": -1}
    # when / then it never parses, so it never reaches the session
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.parse_server_message(json.dumps(frame))
    assert refused.value.code == protocol.ErrorCode.MALFORMED
    assert session.open_advertisements == []
    assert session.evaluate() == []


def test_no_offer_on_an_advert_whose_window_has_closed(session, make, clock):
    # given an advert whose offer window closes in 0.5 s
    session.handle(make.welcome())
    advertisement = make.advertisement().model_copy(update={"window_closes_in": 0.5})
    session.handle(advertisement)

    # when the daemon evaluates only after the window closed
    clock.now += 0.6
    offers = session.evaluate()

    # then it does not offer (the control plane would decline it), and reserves nothing
    assert offers == []
    assert session.book.used() == protocol.Resources()


def test_a_new_attempt_of_the_advert_opens_a_new_window(session, make, clock):
    # given an advert whose window closed before the daemon could offer
    session.handle(make.welcome())
    first = make.advertisement().model_copy(update={"window_closes_in": 0.5})
    session.handle(first)
    clock.now += 0.6
    assert session.evaluate() == []

    # when the next attempt arrives with a fresh window
    session.handle(first.model_copy(update={"attempt": 1, "window_closes_in": 1.0}))

    # then the daemon offers on it
    [offer] = session.evaluate()
    assert (offer.advertisement_id, offer.attempt) == (first.advertisement_id, 1)


def test_prune_forgets_adverts_whose_window_has_passed_but_keeps_their_reservations(session, make, clock):
    # given: adverts whose windows close in 0.5 s and 5 s, one without a window; an offer on one of them
    session.handle(make.welcome())
    short = make.advertisement().model_copy(update={"window_closes_in": 0.5})
    later = make.advertisement().model_copy(update={"window_closes_in": 5.0})
    unbounded = make.advertisement().model_copy(update={"window_closes_in": None})
    for advertisement in (short, later, unbounded):
        session.handle(advertisement)
    [offer] = session.evaluate()

    # when: the first window has passed (the control plane tells only the daemons it sent an attempt to
    # when it closes, so a daemon must not keep adverts it heard of in its welcome forever)
    clock.now += 0.6
    session.prune()

    # then
    assert {advertisement.advertisement_id for advertisement in session.open_advertisements} == {
        later.advertisement_id,
        unbounded.advertisement_id,
    }
    assert session.book.reservation(offer.advertisement_id) is not None
