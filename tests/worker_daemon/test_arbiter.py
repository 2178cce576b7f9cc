"""The arbiter's pure rules: filter, score, order, and the terms of whole and flexible offers."""

from __future__ import annotations

import pytest

from worker_daemon import arbiter
from worker_daemon.protocol import Resources

CAPACITY = Resources(cpu=8, memory=32, storage=100, gpu=24)
EXECUTORS = frozenset({("train", "diloco-transformer"), ("aggregate", "parameter-server")})


def plan(advertisements, *, strategy="whole", price=120.0, floor=100.0, tie_breaker=lambda: 0.0):
    return arbiter.plan_offers(
        advertisements,
        executors=EXECUTORS,
        capacity=CAPACITY,
        floor=floor,
        price=price,
        strategy=strategy,
        tie_breaker=tie_breaker,
    )


# --- filter -------------------------------------------------------------------------------------------------


def test_an_advert_that_fits_passes(make):
    assert (
        arbiter.rejection_reason(make.advertisement(), executors=EXECUTORS, floor=100.0, capacity=CAPACITY)
        is None
    )


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        (
            {
                "executors": [
                    {"class": "train", "name": "diloco-transformer"},
                    {"class": "infer", "name": "llm"},
                ]
            },
            "executor not configured: infer/llm",
        ),
        (
            {"executors": [{"class": "aggregate", "name": "diloco-transformer"}]},
            "executor not configured: aggregate/diloco-transformer",
        ),
        ({"bid": 99.99}, "bid 99.99 is below the floor 100"),
        ({"resources": {"gpu": 24.5}}, "needs more resources than this worker has"),
        # incomparable with the capacity (less gpu, more cpu): the original let it through, we drop it
        ({"resources": {"gpu": 1, "cpu": 9}}, "needs more resources than this worker has"),
    ],
)
def test_filter_rules(make, changes, reason):
    advertisement = make.advertisement(**changes)
    assert (
        arbiter.rejection_reason(advertisement, executors=EXECUTORS, floor=100.0, capacity=CAPACITY) == reason
    )
    assert plan([advertisement]) == []


def test_bid_equal_to_floor_and_resources_equal_to_capacity_pass(make):
    advertisement = make.advertisement(
        bid=100.0, resources={"cpu": 8, "memory": 32, "storage": 100, "gpu": 24}
    )
    assert (
        arbiter.rejection_reason(advertisement, executors=EXECUTORS, floor=100.0, capacity=CAPACITY) is None
    )


def test_an_advert_without_executors_needs_none(make):
    assert (
        arbiter.rejection_reason(
            make.advertisement(executors=[]), executors=EXECUTORS, floor=0.0, capacity=CAPACITY
        )
        is None
    )


# --- score and order ----------------------------------------------------------------------------------------


def test_score_is_bid_per_weighted_unit(make):
    # 25·10 + 1·2 + 0.1·10 + 0.01·100 = 254
    advertisement = make.advertisement(
        bid=254.0, resources={"gpu": 10, "cpu": 2, "memory": 10, "storage": 100}
    )
    assert arbiter.score(advertisement) == pytest.approx(1.0)
    assert arbiter.score(make.advertisement(bid=150.0, resources={"cpu": 3})) == 50.0


def test_score_of_an_advert_that_asks_for_nothing_is_zero(make):
    assert arbiter.score(make.advertisement(bid=500.0, resources={})) == 0.0


def test_order_is_highest_score_first_then_arrival(make):
    cheap = make.advertisement(bid=100.0, resources={"gpu": 10})  # 0.4 per unit
    rich = make.advertisement(bid=300.0, resources={"gpu": 10})  # 1.2 per unit
    small = make.advertisement(bid=120.0, resources={"cpu": 1})  # 120 per unit
    free = make.advertisement(bid=100.0, resources={})  # 0
    cheap_twin = make.advertisement(bid=100.0, resources={"gpu": 10})  # 0.4, arrived after cheap

    offers = plan([cheap, rich, free, small, cheap_twin])

    assert [o.advertisement for o in offers] == [small, rich, cheap, cheap_twin, free]
    assert [o.score for o in offers] == pytest.approx([120.0, 1.2, 0.4, 0.4, 0.0])


def test_equal_scores_are_ordered_by_the_tie_breaker(make):
    # given three adverts of the same score and a tie breaker that ranks the last one first
    first, second, third = (make.advertisement(bid=100.0, resources={"gpu": 10}) for _ in range(3))
    ranks = iter([0.9, 0.5, 0.1])

    # when
    offers = plan([first, second, third], tie_breaker=lambda: next(ranks))

    # then
    assert [o.advertisement for o in offers] == [third, second, first]


def test_by_default_equal_scores_are_spread_at_random(make):
    # given two adverts of the same score
    adverts = [make.advertisement(bid=100.0, resources={"gpu": 10}) for _ in range(2)]

    # when many daemons plan on them
    firsts = {
        arbiter.plan_offers(
            adverts, executors=EXECUTORS, capacity=CAPACITY, floor=100.0, price=120.0, strategy="whole"
        )[0].advertisement.advertisement_id
        for _ in range(200)
    }

    # then both come first for some of them (the chance that one never does is 2 * 2**-200)
    assert firsts == {advert.advertisement_id for advert in adverts}


# --- terms --------------------------------------------------------------------------------------------------


def test_whole_offers_everything_at_the_higher_of_price_and_bid(make):
    below_price = make.advertisement(bid=110.0)
    above_price = make.advertisement(bid=150.0)

    offers = plan([below_price, above_price], strategy="whole", price=120.0)

    assert [(o.advertisement, o.price, o.resources) for o in offers] == [
        (above_price, 150.0, CAPACITY),
        (below_price, 120.0, CAPACITY),
    ]


def test_flexible_offers_what_is_asked_at_the_bid(make):
    advertisement = make.advertisement(bid=110.0, resources={"gpu": 10, "cpu": 1, "memory": 4})

    [offer] = plan([advertisement], strategy="flexible", price=500.0)

    assert (offer.price, offer.resources) == (110.0, Resources(gpu=10, cpu=1, memory=4))


def test_offer_terms_directly(make):
    advertisement = make.advertisement(bid=130.0, resources={"cpu": 2})
    assert arbiter.offer_terms(advertisement, strategy="whole", capacity=CAPACITY, price=140.0) == (
        140.0,
        CAPACITY,
    )
    assert arbiter.offer_terms(advertisement, strategy="flexible", capacity=CAPACITY, price=140.0) == (
        130.0,
        Resources(cpu=2),
    )
