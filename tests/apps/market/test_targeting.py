"""Which daemons an advert attempt goes to (apps.market.targeting): pure functions, no database."""

from __future__ import annotations

import random
import uuid

import pytest

from apps.market import targeting
from worker_daemon.protocol import Resources

BIG = Resources(cpu=8, memory=32, storage=100, gpu=24)
SMALL = Resources(cpu=4, memory=16, storage=50, gpu=16)
ASKED = Resources(cpu=4, memory=16, storage=50, gpu=16)
TRAIN = ("train", "diloco-transformer")


def candidate(
    name: str,
    *,
    capacity: Resources = BIG,
    free: Resources | None = None,
    executors=(TRAIN,),
    floor: float = 50.0,
    strategy: str = "whole",
) -> targeting.Candidate:
    return targeting.Candidate(
        worker_id=uuid.uuid5(uuid.NAMESPACE_DNS, name),
        capacity=capacity,
        free=capacity if free is None else free,
        executors=frozenset(executors),
        price_floor=floor,
        strategy=strategy,
    )


def could(candidate: targeting.Candidate, *, bid: float = 100.0, resources: Resources = ASKED) -> bool:
    return targeting.could_offer(candidate, resources=resources, executors=[TRAIN], bid=bid)


def test_a_free_worker_with_the_executor_capacity_and_floor_could_offer():
    assert could(candidate("free")) is True


@pytest.mark.parametrize(
    "worker",
    [
        candidate("no executor", executors=[("train", "other")]),
        candidate("floor above the bid", floor=100.5),
        candidate("too small", capacity=Resources(cpu=2, memory=64, storage=100, gpu=24)),
        # whole: it offers all it has, so any lease at all keeps it out
        candidate("whole, partly leased", free=BIG - Resources(cpu=1)),
        candidate("flexible, too little left", strategy="flexible", free=Resources(cpu=8, memory=8, gpu=24)),
    ],
    ids=lambda worker: str(worker.worker_id)[:8],
)
def test_a_worker_its_daemon_or_the_market_would_refuse_is_left_out(worker):
    assert could(worker) is False


def test_a_flexible_worker_with_the_asked_resources_free_could_offer_beside_its_leases():
    partly_leased = candidate("flexible", strategy="flexible", free=ASKED)

    assert could(partly_leased) is True


def test_the_bid_may_equal_the_floor():
    assert could(candidate("at the floor", floor=100.0), bid=100.0) is True


def test_the_best_score_is_the_bid_per_weighted_offered_capacity():
    whole, flexible = candidate("whole"), candidate("flexible", strategy="flexible")

    assert targeting.best_score(whole, resources=ASKED, bid=100.0) == pytest.approx(100 / BIG.weighted())
    assert targeting.best_score(flexible, resources=ASKED, bid=100.0) == pytest.approx(100 / ASKED.weighted())


@pytest.mark.parametrize(
    ("wanted", "factor", "minimum", "expected"),
    [(1, 4, 8, 8), (2, 4, 8, 8), (3, 4, 8, 12), (10, 4, 8, 40), (0, 4, 8, 8), (5, 0, 8, None)],
)
def test_fanout_is_a_multiple_of_the_wanted_count_with_a_floor(wanted, factor, minimum, expected):
    assert targeting.fanout(wanted=wanted, factor=factor, minimum=minimum) == expected


def test_targets_are_the_eligible_workers_best_score_first_up_to_the_limit():
    # given: two big and two small eligible rigs, and one that may not offer
    big = [candidate(f"big-{index}") for index in range(2)]
    small = [candidate(f"small-{index}", capacity=SMALL) for index in range(2)]
    busy = candidate("busy", free=Resources())

    # when
    chosen = targeting.choose_targets(
        [small[0], busy, big[0], small[1], big[1]],
        resources=ASKED,
        executors=[TRAIN],
        bid=100.0,
        limit=3,
        rng=random.Random(7),
    )

    # then: both big ones (the lower price per capacity) before one of the small ones; never the busy one
    assert set(chosen[:2]) == {worker.worker_id for worker in big}
    assert len(chosen) == 3 and chosen[2] in {worker.worker_id for worker in small}


def test_equal_workers_are_chosen_in_random_order_so_concurrent_adverts_spread():
    equals = [candidate(f"rig-{index}") for index in range(20)]

    first = targeting.choose_targets(
        equals, resources=ASKED, executors=[TRAIN], bid=100.0, limit=4, rng=random.Random(1)
    )
    second = targeting.choose_targets(
        equals, resources=ASKED, executors=[TRAIN], bid=100.0, limit=4, rng=random.Random(2)
    )

    assert len(first) == len(second) == 4
    assert first != second


def test_without_a_limit_every_eligible_worker_is_a_target():
    workers = [candidate(f"rig-{index}") for index in range(30)] + [candidate("busy", free=Resources())]

    chosen = targeting.choose_targets(workers, resources=ASKED, executors=[TRAIN], bid=100.0, limit=None)

    assert sorted(chosen) == sorted(worker.worker_id for worker in workers[:30])


def test_workers_asked_by_fewer_earlier_attempts_come_first_whatever_their_score():
    # given: the big rig (the best score) was asked by the advert's first attempt; one small rig twice
    big, small, smaller = (
        candidate("big"),
        candidate("small", capacity=SMALL),
        candidate("twice", capacity=SMALL),
    )
    asked = targeting.count_asked({}, [big.worker_id, smaller.worker_id])
    asked = targeting.count_asked(asked, [smaller.worker_id])

    # when
    chosen = targeting.choose_targets(
        [big, small, smaller], resources=ASKED, executors=[TRAIN], bid=100.0, limit=None, asked=asked
    )

    # then
    assert asked == {str(big.worker_id): 1, str(smaller.worker_id): 2}
    assert chosen == [small.worker_id, big.worker_id, smaller.worker_id]
