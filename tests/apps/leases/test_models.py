"""The state machines of the market's models: Lease (with its event log), Job, and Offer/Advertisement as
driven by the market services.

Refused transitions must raise and leave the row and its events exactly as they were.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.jobs import services as job_services
from apps.jobs.exceptions import JobTransitionRefused
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job, JobEvent
from apps.leases import services as lease_services
from apps.leases.exceptions import LeaseTransitionRefused
from apps.leases.models import Lease, LeaseEvent
from apps.market import services as market
from apps.market.exceptions import AdvertisementClosed
from apps.market.models import Advertisement, Offer
from tests.apps.conftest import CAPACITY, REQUIREMENTS, TRAINER_MINIMUM, advert, connect, offer_on

TTL = timedelta(seconds=10)

pytestmark = pytest.mark.django_db


@pytest.fixture
def temporary_lease(job, rig_a) -> Lease:
    """A TEMPORARY trainer lease of rig-a on tiny-gpt, as an offer makes it: expires in HYPHA_OFFER_TTL (3 s)."""
    connect(rig_a)
    return lease_services.reserve(
        worker_id=rig_a.pk, job=job, role=TRAINER, resources=TRAINER_MINIMUM, price=120.0
    )


def run_out(lease: Lease) -> None:
    """Make time pass: the lease's expires_at is now a second ago."""
    Lease.objects.filter(pk=lease.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    lease.refresh_from_db()


def events_of(lease: Lease) -> list[tuple[str, str, str]]:
    return list(LeaseEvent.objects.filter(lease=lease).values_list("kind", "from_status", "to_status"))


def snapshot(lease: Lease) -> tuple[dict, list[tuple]]:
    """The lease's row and its whole event log, to compare before and after a refused transition."""
    row = Lease.objects.filter(pk=lease.pk).values().get()
    events = list(
        LeaseEvent.objects.filter(lease=lease).values_list(
            "id", "kind", "from_status", "to_status", "expires_at"
        )
    )
    return row, events


# --- Lease: allowed transitions -------------------------------------------------------------------------------


def test_reserve_creates_a_temporary_lease_with_a_created_event(frozen_now, temporary_lease):
    # then
    lease = Lease.objects.get(pk=temporary_lease.pk)
    assert (lease.status, lease.expires_at, lease.activated_at) == (
        Lease.Status.TEMPORARY,
        frozen_now + timedelta(seconds=3),
        None,
    )
    assert events_of(lease) == [("created", "", "temporary")]
    assert LeaseEvent.objects.get(lease=lease).detail == "offer made"


def test_activate_turns_a_temporary_lease_active_for_one_ttl(temporary_lease, frozen_now):
    # when
    temporary_lease.activate(ttl=TTL)

    # then
    lease = Lease.objects.get(pk=temporary_lease.pk)
    assert lease.status == Lease.Status.ACTIVE
    assert lease.expires_at == frozen_now + TTL
    assert lease.activated_at == frozen_now
    assert lease.ended_at is None
    assert events_of(lease) == [("created", "", "temporary"), ("activated", "temporary", "active")]
    assert LeaseEvent.objects.filter(lease=lease).last().expires_at == frozen_now + TTL


def test_renew_extends_an_active_lease_and_counts_the_renewal(temporary_lease, frozen_now):
    # given: an active lease whose renewal was requested
    temporary_lease.activate(ttl=timedelta(seconds=2))
    Lease.objects.filter(pk=temporary_lease.pk).update(renewal_requested_at=frozen_now)

    # when
    temporary_lease.renew(ttl=TTL)

    # then
    lease = Lease.objects.get(pk=temporary_lease.pk)
    assert (lease.status, lease.renewals, lease.renewal_requested_at) == (Lease.Status.ACTIVE, 1, None)
    assert lease.expires_at == frozen_now + TTL
    assert events_of(lease) == [
        ("created", "", "temporary"),
        ("activated", "temporary", "active"),
        ("renewed", "active", "active"),
    ]


@pytest.mark.parametrize("activated", [False, True], ids=["temporary", "active"])
def test_expire_ends_a_live_lease_past_its_expiry(temporary_lease, frozen_now, activated):
    # given
    if activated:
        temporary_lease.activate(ttl=TTL)
    run_out(temporary_lease)
    before = temporary_lease.status

    # when
    temporary_lease.expire(reason="not renewed before it ran out")

    # then
    lease = Lease.objects.get(pk=temporary_lease.pk)
    assert lease.status == Lease.Status.EXPIRED
    assert lease.status_reason == "not renewed before it ran out"
    assert lease.ended_at == frozen_now
    assert events_of(lease)[-1] == ("expired", before, "expired")
    assert LeaseEvent.objects.filter(lease=lease).last().detail == "not renewed before it ran out"


@pytest.mark.parametrize("activated", [False, True], ids=["temporary", "active"])
def test_release_ends_a_live_lease_at_any_time(temporary_lease, frozen_now, activated):
    # given
    if activated:
        temporary_lease.activate(ttl=TTL)
    before = temporary_lease.status

    # when
    temporary_lease.release(reason="job cancelled")

    # then
    lease = Lease.objects.get(pk=temporary_lease.pk)
    assert (lease.status, lease.status_reason, lease.ended_at) == (
        Lease.Status.RELEASED,
        "job cancelled",
        frozen_now,
    )
    assert events_of(lease)[-1] == ("released", before, "released")
    assert len(events_of(lease)) == (3 if activated else 2)


# --- Lease: refused transitions --------------------------------------------------------------------------------


def _activate(lease: Lease) -> None:
    lease.activate(ttl=TTL)


def _run_out_active(lease: Lease) -> None:
    lease.activate(ttl=TTL)
    run_out(lease)


def _expired(lease: Lease) -> None:
    run_out(lease)
    lease.expire()


def _released(lease: Lease) -> None:
    lease.release(reason="given back")


STATES = {
    "temporary": lambda lease: None,
    "run-out temporary": run_out,
    "active": _activate,
    "run-out active": _run_out_active,
    "expired": _expired,
    "released": _released,
}
TRANSITIONS = {
    "activated": lambda lease: lease.activate(ttl=TTL),
    "renewed": lambda lease: lease.renew(ttl=TTL),
    "expired": lambda lease: lease.expire(reason="clock"),
    "released": lambda lease: lease.release(reason="owner"),
}
REFUSED = [
    ("activated", "active"),
    ("activated", "expired"),
    ("activated", "released"),
    ("activated", "run-out temporary"),
    ("renewed", "temporary"),
    ("renewed", "expired"),
    ("renewed", "released"),
    ("renewed", "run-out active"),
    ("expired", "temporary"),  # before its expires_at
    ("expired", "active"),  # before its expires_at
    ("expired", "expired"),
    ("expired", "released"),
    ("released", "expired"),
    ("released", "released"),
]


@pytest.mark.parametrize(("transition", "state"), REFUSED, ids=[f"{t}-from-{s}" for t, s in REFUSED])
def test_refused_lease_transition_changes_nothing(temporary_lease, transition, state):
    # given
    STATES[state](temporary_lease)
    before = snapshot(temporary_lease)

    # when
    with pytest.raises(LeaseTransitionRefused) as refused:
        TRANSITIONS[transition](temporary_lease)

    # then
    assert refused.value.transition == transition
    assert refused.value.lease.pk == temporary_lease.pk
    assert snapshot(temporary_lease) == before


def test_a_refusal_names_the_status_the_lease_really_has(temporary_lease):
    # given: another process released the lease; this copy still says temporary
    stale = Lease.objects.get(pk=temporary_lease.pk)
    temporary_lease.release(reason="elsewhere")

    # when
    with pytest.raises(LeaseTransitionRefused) as refused:
        stale.release(reason="here")

    # then
    assert str(refused.value) == (
        f"lease {stale.pk}: released refused: only a live lease can be released (lease is released)"
    )
    assert stale.status == Lease.Status.RELEASED


# --- Job ---------------------------------------------------------------------------------------------------

S = Job.Status
ALLOWED_JOB_TRANSITIONS = [
    (S.PENDING, S.ALLOCATING),
    (S.PENDING, S.CANCELLED),
    (S.PENDING, S.FAILED),
    (S.ALLOCATING, S.ALLOCATING),
    (S.ALLOCATING, S.ALLOCATED),
    (S.ALLOCATING, S.CANCELLED),
    (S.ALLOCATING, S.FAILED),
    (S.ALLOCATED, S.ALLOCATED),
    (S.ALLOCATED, S.ALLOCATING),
    (S.ALLOCATED, S.RUNNING),
    (S.ALLOCATED, S.CANCELLED),
    (S.ALLOCATED, S.FAILED),
    (S.RUNNING, S.RUNNING),
    (S.RUNNING, S.ALLOCATING),
    (S.RUNNING, S.COMPLETED),
    (S.RUNNING, S.CANCELLED),
    (S.RUNNING, S.FAILED),
]
REFUSED_JOB_TRANSITIONS = [
    pair for pair in itertools.product(S.values, repeat=2) if pair not in ALLOWED_JOB_TRANSITIONS
]


@pytest.fixture
def plain_job(job_owner) -> Job:
    return Job.objects.create(
        owner=job_owner, name="plain", num_trainers=2, requirements=REQUIREMENTS, status_reason="created"
    )


def _put(job: Job, status: str) -> None:
    Job.objects.filter(pk=job.pk).update(status=status, status_reason=f"{status.upper()}: set up")
    job.refresh_from_db()


@pytest.mark.parametrize(
    ("current", "target"), ALLOWED_JOB_TRANSITIONS, ids=[f"{a}-{b}" for a, b in ALLOWED_JOB_TRANSITIONS]
)
def test_allowed_job_transition_records_an_event(plain_job, frozen_now, current, target):
    # given
    _put(plain_job, current)

    # when
    plain_job.transition(target, reason="because the test says so")

    # then
    job = Job.objects.get(pk=plain_job.pk)
    assert (job.status, job.status_reason) == (target, "because the test says so")
    assert job.allocated_at == (frozen_now if target == S.ALLOCATED else None)
    assert job.ended_at == (frozen_now if target in Job.FINAL else None)
    assert list(JobEvent.objects.filter(job=job).values_list("from_status", "to_status", "reason")) == [
        (current, target, "because the test says so")
    ]


def test_repeating_a_status_with_the_same_reason_records_one_event(plain_job):
    # given
    _put(plain_job, S.ALLOCATING)
    plain_job.transition(S.ALLOCATING, reason="ALLOCATING: 0 of 2 trainers")

    # when
    plain_job.transition(S.ALLOCATING, reason="ALLOCATING: 0 of 2 trainers")
    plain_job.transition(S.ALLOCATING, reason="ALLOCATING: 1 of 2 trainers")

    # then
    assert list(JobEvent.objects.filter(job=plain_job).values_list("reason", flat=True)) == [
        "ALLOCATING: 0 of 2 trainers",
        "ALLOCATING: 1 of 2 trainers",
    ]


@pytest.mark.parametrize(
    ("current", "target"), REFUSED_JOB_TRANSITIONS, ids=[f"{a}-{b}" for a, b in REFUSED_JOB_TRANSITIONS]
)
def test_refused_job_transition_changes_nothing(plain_job, current, target):
    # given
    _put(plain_job, current)
    before = Job.objects.filter(pk=plain_job.pk).values().get()

    # when
    with pytest.raises(JobTransitionRefused) as refused:
        plain_job.transition(target, reason="should not happen")

    # then
    assert (refused.value.current, refused.value.to) == (current, target)
    assert Job.objects.filter(pk=plain_job.pk).values().get() == before
    assert JobEvent.objects.filter(job=plain_job).count() == 0


# --- Offer and Advertisement, through the market services ---------------------------------------------------


@pytest.fixture
def trainer_ad(job) -> Advertisement:
    return advert(job, TRAINER)


def test_winning_offers_are_accepted_and_fill_the_advertisement(trainer_ad, online_rigs, frozen_now):
    # given
    rig_a, rig_b, _ = online_rigs
    first = market.record_offer(worker=rig_a, message=offer_on(trainer_ad, price=110.0)).offer
    second = market.record_offer(worker=rig_b, message=offer_on(trainer_ad, price=120.0)).offer

    # when
    market.settle(trainer_ad.pk, closing=False)

    # then
    for offer in (first, second):
        offer.refresh_from_db()
        assert (offer.status, offer.reason, offer.decided_at) == (Offer.Status.ACCEPTED, "", frozen_now)
        assert offer.lease.status == Lease.Status.ACTIVE
    trainer_ad.refresh_from_db()
    assert (trainer_ad.status, trainer_ad.wanted, trainer_ad.closed_at) == (
        Advertisement.Status.FILLED,
        0,
        frozen_now,
    )


def test_an_offer_above_the_private_maximum_is_declined_on_arrival(trainer_ad, online_rigs, frozen_now):
    # when
    outcome = market.record_offer(worker=online_rigs[0], message=offer_on(trainer_ad, price=150.01))

    # then
    offer = Offer.objects.get(pk=outcome.offer.pk)
    assert (offer.status, offer.reason, offer.decided_at, offer.lease) == (
        Offer.Status.DECLINED,
        "price above what the job pays",
        frozen_now,
        None,
    )
    assert outcome.ready is False
    assert Lease.objects.count() == 0


def test_a_losing_offer_is_declined_and_its_lease_released(job, online_rigs):
    # given: the parameter server wants one worker and gets two offers
    ad = advert(job, PARAMETER_SERVER)
    rig_a, rig_b, _ = online_rigs
    cheaper = market.record_offer(worker=rig_a, message=offer_on(ad, price=90.0)).offer
    dearer = market.record_offer(worker=rig_b, message=offer_on(ad, price=100.0)).offer

    # when
    market.settle(ad.pk, closing=False)

    # then
    cheaper.refresh_from_db()
    dearer.refresh_from_db()
    assert cheaper.status == Offer.Status.ACCEPTED
    assert (dearer.status, dearer.reason) == (Offer.Status.DECLINED, "another offer won")
    assert (dearer.lease.status, dearer.lease.status_reason) == (
        Lease.Status.RELEASED,
        "offer declined: another offer won",
    )


def test_an_offer_whose_temporary_lease_runs_out_expires(trainer_ad, online_rigs):
    # given
    offer = market.record_offer(worker=online_rigs[0], message=offer_on(trainer_ad, price=110.0)).offer
    run_out(offer.lease)

    # when: the lease clock runs
    job_services.tick_leases()

    # then
    offer.refresh_from_db()
    assert (offer.status, offer.reason) == (
        Offer.Status.EXPIRED,
        "the offer was not accepted before its temporary lease ran out",
    )
    assert offer.lease.status == Lease.Status.EXPIRED


def test_an_advertisement_closing_short_opens_its_next_attempt_after_the_backoff(
    trainer_ad, online_rigs, frozen_now, settings
):
    # given: one offer of the two wanted, and the window closed
    market.record_offer(worker=online_rigs[0], message=offer_on(trainer_ad, price=110.0))

    # when
    settlement = market.settle(trainer_ad.pk, closing=True)

    # then: still OPEN, waiting for its next attempt
    trainer_ad.refresh_from_db()
    assert (trainer_ad.status, trainer_ad.attempt, trainer_ad.wanted) == (Advertisement.Status.OPEN, 0, 1)
    assert trainer_ad.next_attempt_at == frozen_now + timedelta(seconds=1)
    assert settlement.readvertise_in == 1.0

    # when: the backoff has passed
    Advertisement.objects.filter(pk=trainer_ad.pk).update(next_attempt_at=frozen_now - timedelta(seconds=1))
    market.readvertise(trainer_ad.pk)

    # then
    trainer_ad.refresh_from_db()
    assert (trainer_ad.status, trainer_ad.attempt, trainer_ad.next_attempt_at) == (
        Advertisement.Status.OPEN,
        1,
        None,
    )
    assert trainer_ad.window_closes_at == frozen_now + timedelta(seconds=settings.HYPHA_OFFER_WINDOW)


def test_cancelling_an_advertisement_declines_its_open_offers(trainer_ad, online_rigs, frozen_now):
    # given
    offer = market.record_offer(worker=online_rigs[0], message=offer_on(trainer_ad, price=110.0)).offer

    # when
    market.cancel(trainer_ad, reason="job cancelled")

    # then
    trainer_ad.refresh_from_db()
    offer.refresh_from_db()
    assert (trainer_ad.status, trainer_ad.closed_at) == (Advertisement.Status.CANCELLED, frozen_now)
    assert (offer.status, offer.reason) == (Offer.Status.DECLINED, "job cancelled")
    assert offer.lease.status == Lease.Status.RELEASED


@pytest.mark.parametrize("final", [Advertisement.Status.FILLED, Advertisement.Status.CANCELLED])
def test_a_closed_advertisement_stays_closed(trainer_ad, online_rigs, final):
    # given
    Advertisement.objects.filter(pk=trainer_ad.pk).update(status=final)
    before = Advertisement.objects.filter(pk=trainer_ad.pk).values().get()

    # when
    settlement = market.settle(trainer_ad.pk, closing=True)
    market.cancel(trainer_ad, reason="again")
    readvertised = market.readvertise(trainer_ad.pk)
    with pytest.raises(AdvertisementClosed):
        market.record_offer(
            worker=online_rigs[0], message=offer_on(trainer_ad, price=100.0, resources=CAPACITY)
        )

    # then
    assert (settlement.accepted, settlement.declined, settlement.filled, readvertised) == (
        [],
        [],
        False,
        None,
    )
    assert Advertisement.objects.filter(pk=trainer_ad.pk).values().get() == before
    assert Offer.objects.count() == 0
