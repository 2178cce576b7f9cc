"""The market: taking offers (record_offer), choosing winners (settle), and re-advertising with backoff.

Refused offers must leave no trace: no Offer, no Lease, no LeaseEvent.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.jobs import services as job_services
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job
from apps.leases.models import Lease, LeaseEvent
from apps.market import services as market
from apps.market.exceptions import AdvertisementClosed, OfferRefused, UnknownAdvertisement
from apps.market.models import Advertisement, Offer
from tests.apps.conftest import (
    CAPACITY,
    PARAMETER_SERVER_MINIMUM,
    TRAIN,
    TRAINER_MINIMUM,
    advert,
    connect,
    offer_on,
    submit_job,
)
from worker_daemon import protocol

pytestmark = pytest.mark.django_db


@pytest.fixture
def trainer_ad(job) -> Advertisement:
    """tiny-gpt's trainer advert: 2 wanted, at least TRAINER_MINIMUM, max price 150."""
    return advert(job, TRAINER)


@pytest.fixture
def ps_ad(job) -> Advertisement:
    """tiny-gpt's parameter-server advert: 1 wanted, at least PARAMETER_SERVER_MINIMUM, max price 120."""
    return advert(job, PARAMETER_SERVER)


def market_rows() -> dict[str, list]:
    """Everything an offer could have written, to show that a refused one wrote nothing."""
    return {
        "offers": list(Offer.objects.values()),
        "leases": list(Lease.objects.values()),
        "events": list(LeaseEvent.objects.values()),
        "adverts": list(Advertisement.objects.values()),
    }


# --- record_offer --------------------------------------------------------------------------------------


def test_an_acceptable_offer_holds_the_worker_with_a_temporary_lease(trainer_ad, online_rigs, frozen_now):
    # given
    rig_a = online_rigs[0]

    # when
    outcome = market.record_offer(worker=rig_a, message=offer_on(trainer_ad, price=120.0))

    # then
    offer = Offer.objects.get()
    assert outcome.offer == offer
    assert outcome.ready is False  # 1 open offer of the 2 wanted
    assert (offer.status, offer.attempt, offer.price, offer.worker, offer.advertisement) == (
        Offer.Status.OPEN,
        0,
        120.0,
        rig_a,
        trainer_ad,
    )
    assert offer.resources == CAPACITY
    assert offer.score == pytest.approx(120 / (25 * 24 + 8 + 0.1 * 32 + 0.01 * 100))
    lease = offer.lease
    assert (lease.status, lease.worker, lease.job_id, lease.role, lease.price) == (
        Lease.Status.TEMPORARY,
        rig_a,
        trainer_ad.job_id,
        TRAINER,
        120.0,
    )
    assert lease.resources == CAPACITY
    assert lease.expires_at == offer.expires_at == frozen_now + timedelta(seconds=3)


def test_the_offer_that_completes_the_wanted_count_is_ready(trainer_ad, online_rigs):
    # given
    rig_a, rig_b, _ = online_rigs
    market.record_offer(worker=rig_a, message=offer_on(trainer_ad, price=120.0))

    # when
    outcome = market.record_offer(worker=rig_b, message=offer_on(trainer_ad, price=130.0))

    # then
    assert outcome.ready is True
    assert Offer.objects.filter(status=Offer.Status.OPEN).count() == 2


def test_an_offer_above_the_maximum_is_recorded_declined_without_a_lease(trainer_ad, online_rigs, frozen_now):
    # when
    outcome = market.record_offer(worker=online_rigs[0], message=offer_on(trainer_ad, price=151.0))

    # then
    offer = Offer.objects.get()
    assert outcome.offer == offer
    assert (offer.status, offer.reason, offer.lease, offer.price) == (
        Offer.Status.DECLINED,
        "price above what the job pays",
        None,
        151.0,
    )
    assert offer.expires_at == offer.decided_at == frozen_now
    assert Lease.objects.count() == 0
    assert LeaseEvent.objects.count() == 0


def _unknown_advertisement(ad: Advertisement, job: Job) -> protocol.Offer:
    return offer_on(ad, price=120.0).model_copy(update={"advertisement_id": uuid.uuid4()})


def _filled_advertisement(ad: Advertisement, job: Job) -> protocol.Offer:
    Advertisement.objects.filter(pk=ad.pk).update(status=Advertisement.Status.FILLED)
    return offer_on(ad, price=120.0)


def _failed_job(ad: Advertisement, job: Job) -> protocol.Offer:
    Job.objects.filter(pk=job.pk).update(status=Job.Status.FAILED)
    return offer_on(ad, price=120.0)


def _stale_attempt(ad: Advertisement, job: Job) -> protocol.Offer:
    return offer_on(ad, price=120.0, attempt=ad.attempt + 1)


def _window_closed(ad: Advertisement, job: Job) -> protocol.Offer:
    Advertisement.objects.filter(pk=ad.pk).update(window_closes_at=timezone.now() - timedelta(seconds=1))
    return offer_on(ad, price=120.0)


def _waiting_to_readvertise(ad: Advertisement, job: Job) -> protocol.Offer:
    Advertisement.objects.filter(pk=ad.pk).update(next_attempt_at=ad.window_closes_at)
    return offer_on(ad, price=120.0)


def _below_the_minimum(ad: Advertisement, job: Job) -> protocol.Offer:
    return offer_on(ad, price=120.0, resources=TRAINER_MINIMUM.model_copy(update={"gpu": 15.5}))


def _above_the_capacity(ad: Advertisement, job: Job) -> protocol.Offer:
    return offer_on(ad, price=120.0, resources=CAPACITY.model_copy(update={"memory": 64.0}))


#: case → (how to build the offer, the exception, its reason with {ad} and {job} for the ids)
REFUSALS = {
    "unknown advertisement": (_unknown_advertisement, UnknownAdvertisement, "no advertisement {offer}"),
    "filled advertisement": (_filled_advertisement, AdvertisementClosed, "advertisement {ad} is filled"),
    "failed job": (_failed_job, AdvertisementClosed, "job {job} is failed"),
    "stale attempt": (_stale_attempt, AdvertisementClosed, "the offer window of attempt 1 is closed"),
    "window closed": (_window_closed, AdvertisementClosed, "the offer window of attempt 0 is closed"),
    "waiting to re-advertise": (
        _waiting_to_readvertise,
        AdvertisementClosed,
        "the offer window of attempt 0 is closed",
    ),
    "below the advertised minimum": (
        _below_the_minimum,
        OfferRefused,
        "offered resources are below the advertised minimum",
    ),
    "above the declared capacity": (
        _above_the_capacity,
        OfferRefused,
        "offered resources exceed the worker's declared capacity",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_offer_records_nothing(trainer_ad, job, online_rigs, case):
    # given
    build, error, reason = REFUSALS[case]
    message = build(trainer_ad, job)
    before = market_rows()

    # when
    with pytest.raises(error) as refused:
        market.record_offer(worker=online_rigs[0], message=message)

    # then
    assert type(refused.value) is error
    assert refused.value.reason == reason.format(offer=message.advertisement_id, ad=trainer_ad.pk, job=job.pk)
    assert market_rows() == before


def test_an_offer_without_the_advertised_executor_is_refused(ps_ad, rig_a):
    # given: rig-a only offers the training executor
    connect(rig_a, executors=(TRAIN,))
    rig_a.refresh_from_db()
    before = market_rows()

    # when
    with pytest.raises(OfferRefused) as refused:
        market.record_offer(worker=rig_a, message=offer_on(ps_ad, price=100.0))

    # then
    assert refused.value.reason == "worker does not offer executor(s) [('aggregate', 'parameter-server')]"
    assert market_rows() == before


def test_a_second_open_offer_of_the_same_worker_is_refused(ps_ad, online_rigs):
    # given: a flexible-sized offer, so a second one would still fit the capacity; only the duplicate rule stops it
    rig_a = online_rigs[0]
    market.record_offer(
        worker=rig_a, message=offer_on(ps_ad, price=100.0, resources=PARAMETER_SERVER_MINIMUM)
    )
    before = market_rows()

    # when
    with pytest.raises(OfferRefused) as refused:
        market.record_offer(
            worker=rig_a, message=offer_on(ps_ad, price=90.0, resources=PARAMETER_SERVER_MINIMUM)
        )

    # then
    assert refused.value.reason == "this worker already has an open offer on the advertisement"
    assert market_rows() == before


def test_a_worker_leased_to_capacity_cannot_offer_to_another_job(trainer_ad, job_owner, online_rigs):
    # given: rig-a holds its whole capacity for tiny-gpt (the whole strategy)
    rig_a = online_rigs[0]
    market.record_offer(worker=rig_a, message=offer_on(trainer_ad, price=120.0))
    other_ad = advert(submit_job(job_owner, name="other-gpt"), TRAINER)
    before = market_rows()

    # when
    with pytest.raises(OfferRefused) as refused:
        market.record_offer(worker=rig_a, message=offer_on(other_ad, price=100.0))

    # then
    assert refused.value.reason.startswith("worker is leased to capacity: worker rig-a holds ")
    assert market_rows() == before


def test_a_run_out_temporary_lease_no_longer_counts_against_capacity(trainer_ad, job_owner, online_rigs):
    # given: rig-a's offer on tiny-gpt ran out (the clock has not expired it yet)
    rig_a = online_rigs[0]
    held = market.record_offer(worker=rig_a, message=offer_on(trainer_ad, price=120.0)).offer
    Lease.objects.filter(pk=held.lease_id).update(expires_at=held.expires_at - timedelta(seconds=10))
    other_ad = advert(submit_job(job_owner, name="other-gpt"), TRAINER)

    # when
    outcome = market.record_offer(worker=rig_a, message=offer_on(other_ad, price=100.0))

    # then
    assert outcome.offer.lease.status == Lease.Status.TEMPORARY


# --- settle ---------------------------------------------------------------------------------------------------

SMALL = protocol.Resources(cpu=4, memory=16, storage=50, gpu=16)  # weighted: 400 + 4 + 1.6 + 0.5 = 406.1


def test_offers_are_ranked_by_price_per_weighted_capacity(trainer_ad, online_rigs, frozen_now):
    # given: the dearest offer brings the most capacity and is the best value
    rig_a, rig_b, rig_c = online_rigs
    whole = market.record_offer(worker=rig_a, message=offer_on(trainer_ad, price=130.0)).offer
    small_dear = market.record_offer(
        worker=rig_b, message=offer_on(trainer_ad, price=100.0, resources=SMALL)
    ).offer
    small_cheap = market.record_offer(
        worker=rig_c, message=offer_on(trainer_ad, price=90.0, resources=SMALL)
    ).offer
    # whole: 130 / (25·24 + 8 + 0.1·32 + 0.01·100) = 130 / 612.2 = 0.2123
    # small: 90 / 406.1 = 0.2216 and 100 / 406.1 = 0.2462
    assert [whole.score, small_cheap.score, small_dear.score] == pytest.approx(
        [130 / 612.2, 90 / 406.1, 100 / 406.1]
    )

    # when
    settlement = market.settle(trainer_ad.pk, closing=False)

    # then: the two best scores win, exactly as many as wanted
    assert [offer.pk for offer in settlement.accepted] == [whole.pk, small_cheap.pk]
    assert [offer.pk for offer in settlement.declined] == [small_dear.pk]
    assert settlement.filled is True
    assert settlement.readvertise_in is None
    statuses = {
        offer.worker.name: (offer.status, offer.lease.status)
        for offer in Offer.objects.select_related("lease", "worker")
    }
    assert statuses == {
        "rig-a": (Offer.Status.ACCEPTED, Lease.Status.ACTIVE),
        "rig-b": (Offer.Status.DECLINED, Lease.Status.RELEASED),
        "rig-c": (Offer.Status.ACCEPTED, Lease.Status.ACTIVE),
    }
    assert Lease.objects.get(worker=rig_a).expires_at == frozen_now + timedelta(seconds=10)
    trainer_ad.refresh_from_db()
    assert (trainer_ad.status, trainer_ad.wanted, trainer_ad.closed_at) == (
        Advertisement.Status.FILLED,
        0,
        frozen_now,
    )


def test_for_the_same_resources_the_cheaper_offer_wins(ps_ad, online_rigs):
    # given
    rig_a, rig_b, rig_c = online_rigs
    market.record_offer(worker=rig_a, message=offer_on(ps_ad, price=110.0))
    market.record_offer(worker=rig_b, message=offer_on(ps_ad, price=95.0))
    market.record_offer(worker=rig_c, message=offer_on(ps_ad, price=105.0))

    # when
    settlement = market.settle(ps_ad.pk, closing=False)

    # then
    assert [offer.worker.name for offer in settlement.accepted] == ["rig-b"]
    assert sorted(offer.worker.name for offer in settlement.declined) == ["rig-a", "rig-c"]
    assert Lease.objects.filter(status=Lease.Status.ACTIVE).count() == 1
    assert Lease.objects.filter(status=Lease.Status.RELEASED).count() == 2
    assert set(
        Lease.objects.filter(status=Lease.Status.RELEASED).values_list("status_reason", flat=True)
    ) == {"offer declined: another offer won"}


def test_settling_before_enough_offers_and_before_the_window_closes_changes_nothing(trainer_ad, online_rigs):
    # given
    market.record_offer(worker=online_rigs[0], message=offer_on(trainer_ad, price=120.0))
    before = market_rows()

    # when
    settlement = market.settle(trainer_ad.pk, closing=False)

    # then
    assert (settlement.accepted, settlement.declined, settlement.filled) == ([], [], False)
    assert market_rows() == before


def test_closing_short_accepts_what_there_is_and_schedules_the_next_attempt(
    trainer_ad, online_rigs, frozen_now
):
    # given: two offers for the two trainers, but rig-b's temporary lease ran out before the window closed
    rig_a, rig_b, _ = online_rigs
    good = market.record_offer(worker=rig_a, message=offer_on(trainer_ad, price=120.0)).offer
    late = market.record_offer(worker=rig_b, message=offer_on(trainer_ad, price=110.0)).offer
    Lease.objects.filter(pk=late.lease_id).update(expires_at=frozen_now - timedelta(seconds=1))

    # when
    settlement = market.settle(trainer_ad.pk, closing=True)

    # then: rig-a's offer is accepted; rig-b's is skipped, declined and its worker freed
    assert [offer.pk for offer in settlement.accepted] == [good.pk]
    assert [offer.pk for offer in settlement.declined] == [late.pk]
    assert (settlement.filled, settlement.readvertise_in) == (False, 1.0)
    good.refresh_from_db()
    late.refresh_from_db()
    assert (good.status, good.lease.status) == (Offer.Status.ACCEPTED, Lease.Status.ACTIVE)
    assert (late.status, late.reason) == (Offer.Status.DECLINED, "the offer window closed")
    assert (late.lease.status, late.lease.activated_at) == (Lease.Status.RELEASED, None)
    trainer_ad.refresh_from_db()
    assert (trainer_ad.status, trainer_ad.wanted, trainer_ad.attempt) == (Advertisement.Status.OPEN, 1, 0)
    assert trainer_ad.next_attempt_at == frozen_now + timedelta(seconds=1)


def test_an_expired_temporary_lease_is_skipped_at_settlement(ps_ad, online_rigs):
    # given: the cheapest offer's temporary lease has run out
    rig_a, rig_b, _ = online_rigs
    cheapest = market.record_offer(worker=rig_a, message=offer_on(ps_ad, price=60.0)).offer
    Lease.objects.filter(pk=cheapest.lease_id).update(expires_at=cheapest.expires_at - timedelta(seconds=10))
    other = market.record_offer(worker=rig_b, message=offer_on(ps_ad, price=100.0)).offer

    # when
    settlement = market.settle(ps_ad.pk, closing=False)

    # then: rig-b wins; rig-a's offer is left to the lease clock
    assert [offer.pk for offer in settlement.accepted] == [other.pk]
    cheapest.refresh_from_db()
    assert (cheapest.status, cheapest.lease.status, cheapest.lease.activated_at) == (
        Offer.Status.OPEN,
        Lease.Status.TEMPORARY,
        None,
    )

    # when: the lease clock runs
    job_services.tick_leases()

    # then
    cheapest.refresh_from_db()
    assert (cheapest.status, cheapest.lease.status) == (Offer.Status.EXPIRED, Lease.Status.EXPIRED)


def test_settle_is_idempotent_once_filled(ps_ad, online_rigs):
    # given
    market.record_offer(worker=online_rigs[0], message=offer_on(ps_ad, price=100.0))
    market.settle(ps_ad.pk, closing=False)
    before = market_rows()

    # when
    again = market.settle(ps_ad.pk, closing=True)

    # then
    assert (again.accepted, again.declined, again.filled) == ([], [], False)
    assert market_rows() == before


# --- re-advertising ---------------------------------------------------------------------------------------------


def test_readvertise_starts_the_next_attempt_once_the_backoff_has_passed(
    trainer_ad, online_rigs, frozen_now, settings
):
    # given: closed short at attempt 0
    market.settle(trainer_ad.pk, closing=True)
    trainer_ad.refresh_from_db()
    assert trainer_ad.next_attempt_at == frozen_now + timedelta(seconds=1)

    # when: too early
    assert market.readvertise(trainer_ad.pk) is None

    # then: nothing changed
    trainer_ad.refresh_from_db()
    assert (trainer_ad.attempt, trainer_ad.next_attempt_at) == (0, frozen_now + timedelta(seconds=1))

    # when: the backoff has passed
    Advertisement.objects.filter(pk=trainer_ad.pk).update(next_attempt_at=frozen_now - timedelta(seconds=1))
    readvertised = market.readvertise(trainer_ad.pk)

    # then
    assert readvertised.pk == trainer_ad.pk
    trainer_ad.refresh_from_db()
    assert (trainer_ad.attempt, trainer_ad.next_attempt_at, trainer_ad.wanted) == (1, None, 2)
    assert trainer_ad.window_closes_at == frozen_now + timedelta(seconds=settings.HYPHA_OFFER_WINDOW)

    # and: an offer for the old attempt is stale, one for the new attempt is taken
    with pytest.raises(AdvertisementClosed):
        market.record_offer(worker=online_rigs[0], message=offer_on(trainer_ad, price=120.0, attempt=0))
    assert (
        market.record_offer(worker=online_rigs[0], message=offer_on(trainer_ad, price=120.0)).offer.attempt
        == 1
    )


def test_the_second_short_close_backs_off_twice_as_long(trainer_ad, frozen_now):
    # given: attempt 1
    Advertisement.objects.filter(pk=trainer_ad.pk).update(attempt=1)

    # when
    settlement = market.settle(trainer_ad.pk, closing=True)

    # then
    trainer_ad.refresh_from_db()
    assert settlement.readvertise_in == 2.0
    assert trainer_ad.next_attempt_at == frozen_now + timedelta(seconds=2)


@pytest.mark.parametrize(
    ("attempt", "delay"),
    [(0, 1.0), (1, 2.0), (2, 4.0), (3, 8.0), (4, 16.0), (5, 30.0), (6, 30.0), (30, 30.0), (10_000, 30.0)],
)
def test_readvertise_delay_doubles_up_to_its_bound(attempt, delay):
    assert market.readvertise_delay(attempt) == delay


def test_readvertise_delay_follows_the_settings(settings):
    # given
    settings.HYPHA_READVERTISE_BASE = 0.25
    settings.HYPHA_READVERTISE_MAX = 1.5

    # then
    assert [market.readvertise_delay(attempt) for attempt in range(5)] == [0.25, 0.5, 1.0, 1.5, 1.5]


def test_offer_score_of_no_capacity_never_wins():
    assert market.offer_score(price=0.0, resources=protocol.ZERO) == float("inf")
    assert market.offer_score(price=50.0, resources=protocol.Resources(cpu=2)) == 25.0
