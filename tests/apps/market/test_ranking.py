"""Declared capacity counts only as far as the worker's benchmark supports it (apps.market.targeting.Yardstick):
a daemon that declares the most the protocol accepts, with an ordinary benchmark, does not beat honest ones."""

from __future__ import annotations

import uuid

import pytest

from apps.jobs.models import TRAINER
from apps.market import services as market
from apps.market import targeting
from apps.market.models import Offer
from tests.apps.conftest import CAPACITY, advert, benchmark, connect, offer_on
from worker_daemon.protocol import Resources

#: The most a hello may declare (worker_daemon.protocol.MAX_DECLARED).
MAXIMA = Resources(cpu=4096, memory=16384, storage=10_000_000, gpu=65536)
TRAIN = ("train", "diloco-transformer")


def candidate(name: str, capacity: Resources, score: float | None) -> targeting.Candidate:
    return targeting.Candidate(
        worker_id=uuid.uuid5(uuid.NAMESPACE_DNS, name),
        capacity=capacity,
        free=capacity,
        executors=frozenset({TRAIN}),
        price_floor=50.0,
        strategy="whole",
        benchmark_score=score,
    )


# --- the yardstick (pure) -----------------------------------------------------------------------------------


def test_the_yardstick_is_the_low_median_capacity_per_measured_speed():
    # given: capacity per sample/s of 612.2/400 = 1.5305, 612.2/200 = 3.061 and a liar's 2.6e8
    fleet = [(CAPACITY, 400.0), (CAPACITY, 200.0), (MAXIMA, 400.0), (Resources(cpu=2), None)]

    # when
    yardstick = targeting.yardstick(fleet)

    # then: the low median of the three measured ratios; unmeasured workers do not count
    assert yardstick == targeting.Yardstick(
        capacity_per_score=pytest.approx(612.2 / 200), slowest_score=200.0
    )


def test_without_any_benchmark_there_is_no_yardstick_and_declared_capacity_counts_in_full():
    assert targeting.yardstick([(CAPACITY, None), (MAXIMA, None)]) is None
    assert targeting.supported_share(MAXIMA, None, None) == 1.0


def test_a_worker_counts_its_capacity_up_to_what_its_speed_is_worth_at_the_fleets_rate():
    yardstick = targeting.Yardstick(capacity_per_score=612.2 / 400, slowest_score=100.0)

    # an honest worker at the rate: all of it
    assert targeting.supported_share(CAPACITY, 400.0, yardstick) == 1.0
    # twice as fast for its size: still all of it, never more
    assert targeting.supported_share(CAPACITY, 800.0, yardstick) == 1.0
    # the maxima at the same speed: the share the honest worker's capacity is of the maxima
    assert targeting.supported_share(MAXIMA, 400.0, yardstick) == pytest.approx(612.2 / MAXIMA.weighted())
    # no benchmark: as fast as the slowest measured worker
    assert targeting.supported_share(MAXIMA, None, yardstick) == pytest.approx(612.2 / 4 / MAXIMA.weighted())


def test_an_advert_goes_to_honest_workers_before_one_declaring_the_maxima():
    # given: fanout 2 of three workers that benchmark alike
    liar = candidate("liar", MAXIMA, 400.0)
    honest = [candidate("honest-a", CAPACITY, 400.0), candidate("honest-b", CAPACITY, 400.0)]

    # when
    targets = targeting.choose_targets(
        [liar, *honest], resources=CAPACITY, executors=[TRAIN], bid=100.0, limit=2
    )

    # then
    assert sorted(targets) == sorted(worker.worker_id for worker in honest)


# --- settlement -----------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_worker_declaring_the_maxima_with_an_ordinary_benchmark_loses_to_honest_ones(
    job, rig_a, rig_b, rig_c
):
    # given: rig-a declares the most a hello may; all three benchmark alike and offer at the same price,
    # rig-a first (on today's order, the earliest offer wins a tie too)
    connect(rig_a, resources=MAXIMA, benchmark=benchmark(400.0))
    connect(rig_b, benchmark=benchmark(400.0))
    connect(rig_c, benchmark=benchmark(400.0))
    ad = advert(job, TRAINER)  # 2 wanted
    for rig in (rig_a, rig_b, rig_c):
        rig.refresh_from_db()
    liar = market.record_offer(worker=rig_a, message=offer_on(ad, price=120.0, resources=MAXIMA)).offer
    honest = [
        market.record_offer(worker=rig, message=offer_on(ad, price=120.0)).offer for rig in (rig_b, rig_c)
    ]

    # when
    settlement = market.settle(ad.pk, closing=True)

    # then: the honest workers win; the scores kept are the ones ranked (the liar's per supported capacity)
    assert sorted(offer.worker.name for offer in settlement.accepted) == ["rig-b", "rig-c"]
    assert [offer.worker.name for offer in settlement.declined] == ["rig-a"]
    scores = dict(Offer.objects.values_list("worker__name", "score"))
    assert scores == pytest.approx({"rig-a": 120 / 612.2, "rig-b": 120 / 612.2, "rig-c": 120 / 612.2})
    assert Offer.objects.get(pk=liar.pk).status == Offer.Status.DECLINED
    assert {offer.pk for offer in honest} == set(
        Offer.objects.filter(status=Offer.Status.ACCEPTED).values_list("pk", flat=True)
    )


@pytest.mark.django_db
def test_a_liar_that_skips_its_benchmark_counts_as_the_slowest_measured_worker(job, rig_a, rig_b, rig_c):
    # given: rig-a declares the maxima and sends no benchmark; rig-b and rig-c are measured
    connect(rig_a, resources=MAXIMA)
    connect(rig_b, benchmark=benchmark(400.0))
    connect(rig_c, benchmark=benchmark(200.0))
    ad = advert(job, TRAINER)
    for rig in (rig_a, rig_b, rig_c):
        rig.refresh_from_db()
    market.record_offer(worker=rig_a, message=offer_on(ad, price=120.0, resources=MAXIMA))
    market.record_offer(worker=rig_b, message=offer_on(ad, price=120.0))
    market.record_offer(worker=rig_c, message=offer_on(ad, price=120.0))

    # when
    settlement = market.settle(ad.pk, closing=True)

    # then: the yardstick is 612.2 / 400 capacity per sample/s (the low median); rig-c's 200 samples/s support
    # 306.1 of its 612.2, and rig-a counts as the slowest measured worker: 306.1 of its maxima. rig-a ties
    # rig-c and loses the tie: at equal scores the offer whose declared capacity is better supported wins.
    assert sorted(offer.worker.name for offer in settlement.accepted) == ["rig-b", "rig-c"]
    scores = dict(Offer.objects.values_list("worker__name", "score"))
    assert scores == pytest.approx({"rig-a": 120 / 306.1, "rig-b": 120 / 612.2, "rig-c": 120 / 306.1})
