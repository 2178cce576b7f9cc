"""Who hears of an advertisement: each attempt goes to the connected workers that could take it (at most
HYPHA_ADVERT_FANOUT per wanted worker), its close to the same workers, and a connecting daemon's welcome
lists the open adverts it could take (apps.market.targeting, apps.market.services)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.jobs.models import PARAMETER_SERVER, TRAINER
from apps.leases import services as lease_services
from apps.market import services as market
from apps.market.models import Advertisement
from tests.apps.conftest import TRAIN, advert, connect, offer_on, submit_job
from worker_daemon import protocol

pytestmark = pytest.mark.django_db


def online(*rigs, **hello_fields) -> None:
    """Connect each rig as its daemon would, and refresh it (its executors and capacity come from the hello)."""
    for rig in rigs:
        connect(rig, **hello_fields)
        rig.refresh_from_db()


def adverts_sent(sent, ad: Advertisement) -> dict:
    """Worker id → attempts of ``ad`` it was sent, in order."""
    told: dict = {}
    for worker_id, message in sent:
        if isinstance(message, protocol.Advertisement) and message.advertisement_id == ad.pk:
            told.setdefault(str(worker_id), []).append(message.attempt)
    return told


def closes_sent(sent, ad: Advertisement) -> list[str]:
    return sorted(
        str(worker_id)
        for worker_id, message in sent
        if isinstance(message, protocol.AdvertisementClosed) and message.advertisement_id == ad.pk
    )


def test_an_advert_goes_only_to_the_connected_workers_that_could_take_it(
    job_owner, rig_a, rig_b, rig_c, sent
):
    # given: rig-a can run both roles, rig-b only trains, rig-c is offline
    online(rig_a)
    online(rig_b, executors=(TRAIN,))

    # when
    job = submit_job(job_owner, name="tiny-gpt")

    # then
    trainer_ad, ps_ad = advert(job, TRAINER), advert(job, PARAMETER_SERVER)
    assert adverts_sent(sent, trainer_ad) == {str(rig_a.pk): [0], str(rig_b.pk): [0]}
    assert adverts_sent(sent, ps_ad) == {str(rig_a.pk): [0]}
    assert sorted(trainer_ad.targets) == sorted([str(rig_a.pk), str(rig_b.pk)])
    assert ps_ad.targets == [str(rig_a.pk)]


def test_a_busy_or_revoked_worker_hears_of_no_advert(job_owner, rig_a, rig_b, rig_c, sent):
    # given: rig-a holds a lease of another job (it offers its whole capacity), rig-b's token is revoked
    online(rig_a, rig_b, rig_c)
    other = submit_job(job_owner, name="other")
    market.record_offer(worker=rig_a, message=offer_on(advert(other, PARAMETER_SERVER), price=100.0))
    rig_b.revoke_token()
    sent.clear()

    # when
    job = submit_job(job_owner, name="tiny-gpt")

    # then: only rig-c hears of it
    assert adverts_sent(sent, advert(job, TRAINER)) == {str(rig_c.pk): [0]}
    assert adverts_sent(sent, advert(job, PARAMETER_SERVER)) == {str(rig_c.pk): [0]}


def test_an_attempt_goes_to_at_most_the_fanout_per_wanted_worker(
    job_owner, rig_a, rig_b, rig_c, settings, sent
):
    # given: one daemon per wanted worker
    settings.HYPHA_ADVERT_FANOUT, settings.HYPHA_ADVERT_MIN_TARGETS = 1, 1
    online(rig_a, rig_b, rig_c)

    # when
    job = submit_job(job_owner, name="tiny-gpt")

    # then: 2 of the 3 rigs for the 2 trainers, 1 for the parameter server
    trainer_ad, ps_ad = advert(job, TRAINER), advert(job, PARAMETER_SERVER)
    assert len(adverts_sent(sent, trainer_ad)) == len(trainer_ad.targets) == 2
    assert len(adverts_sent(sent, ps_ad)) == len(ps_ad.targets) == 1


def test_a_fanout_of_zero_sends_to_every_worker_that_could_take_it(
    job_owner, rig_a, rig_b, rig_c, settings, sent
):
    settings.HYPHA_ADVERT_FANOUT, settings.HYPHA_ADVERT_MIN_TARGETS = 0, 1
    online(rig_a, rig_b, rig_c)

    job = submit_job(job_owner, name="tiny-gpt")

    assert set(adverts_sent(sent, advert(job, PARAMETER_SERVER))) == {
        str(rig.pk) for rig in (rig_a, rig_b, rig_c)
    }


def test_the_close_of_a_filled_advert_goes_to_the_workers_its_attempt_went_to(
    job_owner, rig_a, rig_b, rig_c, sent
):
    # given: rig-a and rig-b heard of the parameter-server advert; rig-c connected after it
    online(rig_a)
    online(rig_b)
    job = submit_job(job_owner, name="tiny-gpt")
    online(rig_c)
    ps_ad = advert(job, PARAMETER_SERVER)

    # when: rig-a's offer fills it
    market.record_offer(worker=rig_a, message=offer_on(ps_ad, price=100.0))
    market.settle(ps_ad.pk, closing=False)

    # then
    ps_ad.refresh_from_db()
    assert ps_ad.status == Advertisement.Status.FILLED
    assert closes_sent(sent, ps_ad) == sorted([str(rig_a.pk), str(rig_b.pk)])


def test_each_attempt_is_sent_to_the_workers_that_could_take_it_then(
    job_owner, rig_a, rig_b, rig_c, frozen_now, sent
):
    # given: attempt 0 of the trainer advert went to rig-a and rig-b; rig-a's offer won one of the two trainers
    online(rig_a)
    online(rig_b)
    job = submit_job(job_owner, name="tiny-gpt")
    trainer_ad = advert(job, TRAINER)
    market.record_offer(worker=rig_a, message=offer_on(trainer_ad, price=120.0))
    market.settle(trainer_ad.pk, closing=True)
    assert closes_sent(sent, trainer_ad) == sorted([str(rig_a.pk), str(rig_b.pk)])

    # when: rig-c connects, and the backoff passes
    online(rig_c)
    Advertisement.objects.filter(pk=trainer_ad.pk).update(next_attempt_at=frozen_now - timedelta(seconds=1))
    market.readvertise(trainer_ad.pk)

    # then: attempt 1 goes to rig-b and rig-c, not to rig-a, which holds a lease of this advert
    assert adverts_sent(sent, trainer_ad) == {str(rig_a.pk): [0], str(rig_b.pk): [0, 1], str(rig_c.pk): [1]}
    trainer_ad.refresh_from_db()
    assert sorted(trainer_ad.targets) == sorted([str(rig_b.pk), str(rig_c.pk)])


def test_a_flexible_worker_holding_a_lease_of_the_advert_is_not_asked_again(
    job_owner, rig_a, frozen_now, sent
):
    # given: rig-a offers flexibly; its offer won one of the two trainers and the attempt closed short
    online(rig_a)
    rig_a.strategy = "flexible"
    rig_a.save(update_fields=["strategy"])
    job = submit_job(job_owner, name="tiny-gpt")
    trainer_ad = advert(job, TRAINER)
    market.record_offer(
        worker=rig_a, message=offer_on(trainer_ad, price=100.0, resources=trainer_ad.resources)
    )
    market.settle(trainer_ad.pk, closing=True)

    # when
    Advertisement.objects.filter(pk=trainer_ad.pk).update(next_attempt_at=frozen_now - timedelta(seconds=1))
    market.readvertise(trainer_ad.pk)

    # then: it has room for a second trainer, but serves the role once
    assert lease_services.live_usage(rig_a.pk) == trainer_ad.resources
    assert adverts_sent(sent, trainer_ad) == {str(rig_a.pk): [0]}


def test_a_connecting_daemon_is_welcomed_with_the_open_adverts_it_could_take(job, rig_a, rig_b):
    # when: rig-a (both executors) and rig-b (training only) connect to a job's open adverts
    welcome_a = connect(rig_a)
    welcome_b = connect(rig_b, executors=(TRAIN,))

    # then
    trainer_ad, ps_ad = advert(job, TRAINER), advert(job, PARAMETER_SERVER)
    assert {message.advertisement_id for message in welcome_a.advertisements} == {trainer_ad.pk, ps_ad.pk}
    assert [message.advertisement_id for message in welcome_b.advertisements] == [trainer_ad.pk]


def test_an_attempt_that_closed_short_asks_the_workers_not_asked_yet_first(
    job_owner, rig_a, rig_b, rig_c, settings, frozen_now, sent
):
    # given: one daemon per attempt; the parameter-server advert's first attempt went to one rig, whose
    # offer was above the job's maximum (a daemon asking too much must not keep the others from being asked)
    settings.HYPHA_ADVERT_FANOUT, settings.HYPHA_ADVERT_MIN_TARGETS = 1, 1
    online(rig_a, rig_b, rig_c)
    rigs = {str(rig.pk): rig for rig in (rig_a, rig_b, rig_c)}
    ps_ad = advert(submit_job(job_owner, name="tiny-gpt"), PARAMETER_SERVER)
    asked = []
    for _ in range(3):
        ps_ad.refresh_from_db()
        [target] = ps_ad.targets
        asked.append(target)
        market.record_offer(worker=rigs[target], message=offer_on(ps_ad, price=500.0))
        market.settle(ps_ad.pk, closing=True)
        Advertisement.objects.filter(pk=ps_ad.pk).update(next_attempt_at=frozen_now - timedelta(seconds=1))
        market.readvertise(ps_ad.pk)

    # then: each attempt asked a rig not asked before, until every rig was asked once
    assert sorted(asked) == sorted(rigs)
    ps_ad.refresh_from_db()
    assert ps_ad.attempt == 3
    assert sorted(ps_ad.asked.values()) == [1, 1, 2]
