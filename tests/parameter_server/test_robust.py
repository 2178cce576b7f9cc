"""Robust aggregation and verification (parameter_server/rounds/robust.py, parameter_server/aggregation.py):
each rule against values written out by hand, the verdicts, and the round coordinator that applies them."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from torch.testing import assert_close

from parameter_server.aggregation import (
    CLIPPED_MEAN,
    MEAN,
    MEDIAN,
    TRIMMED_MEAN,
    AggregationRule,
    Verification,
)
from parameter_server.exceptions import JobConfigError
from parameter_server.job import parse_job
from parameter_server.rounds import RoundCoordinator
from parameter_server.rounds.robust import HeldUpdate, aggregate, cosines_to_others, judge, trim_count
from tests.parameter_server.conftest import ALICE, aggregate_job

# Five updates of one tensor of three values (unweighted), and their order statistics per coordinate:
#   column 0: 1 2 3 4 50     column 1: -50 10 20 30 40     column 2: -3 -1 0 2 9
FIVE = [[1.0, 10.0, -3.0], [2.0, 20.0, -1.0], [3.0, 30.0, 0.0], [4.0, 40.0, 2.0], [50.0, -50.0, 9.0]]


def held(rows: list[list[float]], weights: list[float] | None = None) -> list[HeldUpdate]:
    weights = weights or [1.0] * len(rows)
    updates = []
    for index, (row, weight) in enumerate(zip(rows, weights, strict=True)):
        tensor = torch.tensor(row)
        updates.append(
            HeldUpdate(
                f"peer-{index}",
                {"x": tensor},
                weight,
                float(torch.linalg.vector_norm(tensor.double())),
                {"x": float(tensor.abs().max())},
            )
        )
    return updates


def combine(rows, rule: AggregationRule, weights=None) -> torch.Tensor:
    updates = held(rows, weights)
    median = sorted(update.norm for update in updates)
    middle = len(median) // 2
    median_norm = median[middle] if len(median) % 2 else (median[middle - 1] + median[middle]) / 2
    result = aggregate(updates, rule, names=["x"], dtypes={"x": torch.float32}, median=median_norm)
    return result.take()["x"]


def test_the_coordinate_wise_median_of_an_odd_and_an_even_count():
    assert_close(combine(FIVE, AggregationRule(MEDIAN)), torch.tensor([3.0, 20.0, 0.0]))
    # four: the mean of the two middle values (2, 3 | 20, 30 | -1, 0)
    assert_close(combine(FIVE[:4], AggregationRule(MEDIAN)), torch.tensor([2.5, 25.0, -0.5]))


def test_the_trimmed_mean_drops_the_fraction_on_each_side_and_at_least_one_from_three():
    # five at 0.25: ⌊1.25⌋ = 1 each side → the mean of the middle three
    assert_close(combine(FIVE, AggregationRule(TRIMMED_MEAN)), torch.tensor([3.0, 20.0, 1.0 / 3.0]))
    # three at 0.1: ⌊0.3⌋ = 0, but at least one each side → the median
    assert_close(
        combine(FIVE[:3], AggregationRule(TRIMMED_MEAN, trim_fraction=0.1)), torch.tensor([2.0, 20.0, -1.0])
    )
    # two: nothing can be dropped → the plain mean
    assert_close(combine(FIVE[:2], AggregationRule(TRIMMED_MEAN)), torch.tensor([1.5, 15.0, -2.0]))


@pytest.mark.parametrize(
    ("count", "fraction", "trimmed"),
    [
        (1, 0.25, 0),
        (2, 0.4, 0),
        (3, 0.0, 1),
        (3, 0.25, 1),
        (4, 0.25, 1),
        (5, 0.25, 1),
        (8, 0.25, 2),
        (10, 0.45, 4),
    ],
)
def test_trim_count(count, fraction, trimmed):
    assert trim_count(count, fraction) == trimmed


def test_the_clipped_mean_scales_an_update_over_k_times_the_median_norm_down_to_it():
    # norms 5, 5, 10, 50: median 7.5, k = 2 → at most 15: [30, 40] becomes 0.3 · [30, 40] = [9, 12]
    rows = [[3.0, 4.0], [0.0, 5.0], [6.0, 8.0], [30.0, 40.0]]
    assert_close(combine(rows, AggregationRule(CLIPPED_MEAN)), torch.tensor([4.5, 7.25]))
    # sample-weighted 1, 2, 1, 4: (1·[3, 4] + 2·[0, 5] + 1·[6, 8] + 4·[9, 12]) / 8
    assert_close(
        combine(rows, AggregationRule(CLIPPED_MEAN), weights=[1, 2, 1, 4]), torch.tensor([5.625, 8.75])
    )


def test_cosines_are_to_the_mean_of_the_others():
    updates = held([[1.0, 0.0], [1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]])
    cosines = cosines_to_others([u.update for u in updates], ["x"], [u.norm for u in updates])
    # others of the first: [1, 0] + [-1, 0] + [0, 1] = [0, 1] → 0; of the third: [2, 1] → -2/√5; of the
    # fourth: [1, 0] → 0
    assert cosines == pytest.approx([0.0, 0.0, -2 / math.sqrt(5), 0.0])
    assert cosines_to_others([updates[0].update], ["x"], [1.0]) == [None]
    zero = held([[0.0, 0.0], [1.0, 0.0]])
    assert cosines_to_others([u.update for u in zero], ["x"], [u.norm for u in zero]) == [None, None]


def test_verdicts_reject_a_scaled_and_a_sign_flipped_update_and_say_why():
    rows = [[1.0, 1.0], [1.0, 0.9], [0.9, 1.0], [100.0, 100.0], [-1.0, -0.9]]
    updates = held(rows)
    cosines = cosines_to_others([u.update for u in updates], ["x"], [u.norm for u in updates])
    verdicts = judge(updates, cosines, AggregationRule(CLIPPED_MEAN))
    assert [verdicts[u.peer].verdict for u in updates] == [
        "accepted",
        "accepted",
        "accepted",
        "rejected",
        "rejected",
    ]
    assert "median norm (more than 10x)" in verdicts["peer-3"].reason
    assert verdicts["peer-3"].norm_ratio == pytest.approx(100 * math.sqrt(2) / math.hypot(1.0, 0.9))
    assert "cosine similarity to the mean of the others" in verdicts["peer-4"].reason
    assert verdicts["peer-4"].cosine < -0.9
    assert verdicts["peer-4"].as_json()["verdict"] == "rejected"
    # verification off: scores and clipping only, nobody rejected
    unverified = AggregationRule(CLIPPED_MEAN, verification=Verification(enabled=False))
    assert [v.verdict for v in judge(updates, cosines, unverified).values()] == [
        "accepted",
        "accepted",
        "accepted",
        "down-weighted",
        "accepted",
    ]
    # with two updates the cosine rule does not apply (each is the other's "others")
    pair = held([[1.0, 0.0], [-1.0, 0.0]])
    pair_cosines = cosines_to_others([u.update for u in pair], ["x"], [u.norm for u in pair])
    assert [v.verdict for v in judge(pair, pair_cosines, AggregationRule(MEDIAN)).values()] == [
        "accepted",
        "accepted",
    ]


def test_verification_is_on_by_default_for_the_robust_rules_only():
    assert not AggregationRule(MEAN).verifies and not AggregationRule(MEAN).holds_updates
    assert AggregationRule(MEAN, verification=Verification(enabled=True)).holds_updates
    for name in (CLIPPED_MEAN, TRIMMED_MEAN, MEDIAN):
        assert AggregationRule(name).verifies
        assert AggregationRule(name, verification=Verification(enabled=False)).holds_updates


# --- the job JSON -------------------------------------------------------------------------------------------


def job_with(**rounds) -> dict:
    document = aggregate_job(peers=[ALICE])
    document["executor"]["config"]["rounds"].update(rounds)
    return document


def test_the_job_json_carries_the_rule_and_defaults_to_the_unverified_mean():
    assert parse_job(aggregate_job(peers=[ALICE])).aggregation == AggregationRule()
    rule = parse_job(
        job_with(aggregation="trimmed_mean", trim_fraction=0.1, verification={"min_cosine": -0.2})
    ).aggregation
    assert rule == AggregationRule(
        TRIMMED_MEAN, trim_fraction=0.1, verification=Verification(enabled=None, min_cosine=-0.2)
    )
    assert rule.verifies


@pytest.mark.parametrize(
    ("rounds", "message"),
    [
        ({"aggregation": "krum"}, "rounds.aggregation must be one of mean, clipped_mean"),
        ({"aggregation": "clipped_mean", "clip_factor": 0.5}, "rounds.clip_factor must be >= 1"),
        ({"aggregation": "trimmed_mean", "trim_fraction": 0.5}, "rounds.trim_fraction must be < 0.5"),
        ({"verification": {"enabled": "yes"}}, "rounds.verification.enabled must be true, false or null"),
        ({"verification": {"max_norm_ratio": 1}}, "rounds.verification.max_norm_ratio must be > 1"),
        ({"verification": {"min_cosine": 2}}, "rounds.verification.min_cosine must be <= 1"),
        ({"verification": []}, "rounds.verification must be an object"),
    ],
)
def test_bad_rules_in_the_job_json_are_refused(rounds, message):
    with pytest.raises(JobConfigError, match=message.replace(".", r"\.")):
        parse_job(job_with(**rounds))


# --- the round coordinator -----------------------------------------------------------------------------------

PEERS = ["alice", "bob", "carol", "dave", "erin"]


def coordinator(**overrides) -> RoundCoordinator:
    arguments = {
        "expected": PEERS,
        "weights": {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])},
        "momentum": None,
        "rounds_completed": 0,
        "update_rounds": 2,
        "round_timeout": 30.0,
        "weighted": True,
        "learning_rate": 0.5,
        "momentum_factor": 0.5,
        "update_norm_ratio": 1000.0,  # the bound at arrival is another test's: here, the verdicts
    }
    arguments.update(overrides)
    return RoundCoordinator(**arguments)


def update(w: list[float], b: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(w), "b": torch.tensor([b])}


HONEST = [update([1.0, 1.0], 0.0), update([1.0, 0.9], 0.1), update([0.9, 1.0], 0.0)]
SCALED = update([100.0, 100.0], 0.0)  # alice's × 100
FLIPPED = update([-1.0, -0.9], -0.1)  # bob's, sign-flipped


async def run_round(rounds: RoundCoordinator, updates: list[dict[str, torch.Tensor]], samples: list[int]):
    for peer, tensors, count in zip(PEERS, updates, samples, strict=True):
        await rounds.submit(peer, 1, tensors, samples=count)
    return await asyncio.wait_for(rounds.published.get(), 5)


@pytest.mark.parametrize("name", [MEAN, CLIPPED_MEAN])
async def test_a_round_leaves_out_the_rejected_updates_and_steps_on_the_honest_mean(name):
    # given: a verifying rule; dave sends alice's update × 100, erin bob's sign-flipped
    rule = AggregationRule(name, verification=Verification(enabled=True))
    rounds = coordinator(aggregation=rule)

    # when
    result = await run_round(rounds, [*HONEST, SCALED, FLIPPED], samples=[1, 2, 1, 5, 5])

    # then: g = (1·A + 2·B + 1·C) / 4 (sample-weighted; nobody honest is clipped), u = 0.75·g
    g_w = (torch.tensor([1.0, 1.0]) + 2 * torch.tensor([1.0, 0.9]) + torch.tensor([0.9, 1.0])) / 4
    g_b = torch.tensor([2 * 0.1 / 4])
    assert_close(result.update["w"], 0.75 * g_w)
    assert_close(result.update["b"], 0.75 * g_b)
    assert result.participants == ("alice", "bob", "carol")
    assert result.left_out == ()
    assert result.samples == 4
    assert {peer: verdict["verdict"] for peer, verdict in result.verdicts.items()} == {
        "alice": "accepted",
        "bob": "accepted",
        "carol": "accepted",
        "dave": "rejected",
        "erin": "rejected",
    }
    assert "median norm" in result.verdicts["dave"]["reason"]
    assert result.verdicts["dave"]["norm_ratio"] > 90
    assert "cosine" in result.verdicts["erin"]["reason"] and result.verdicts["erin"]["cosine"] < -0.5


async def test_the_median_rule_steps_on_the_coordinate_wise_median():
    rounds = coordinator(aggregation=AggregationRule(MEDIAN, verification=Verification(enabled=False)))
    result = await run_round(rounds, [*HONEST, SCALED, FLIPPED], samples=[1, 1, 1, 1, 1])
    # w: [1, 1, 0.9, 100, -1] → 1 and [1, 0.9, 1, 100, -0.9] → 1; b: [0, 0.1, 0, 0, -0.1] → 0
    assert_close(result.update["w"], 0.75 * torch.tensor([1.0, 1.0]))
    assert_close(result.update["b"], torch.tensor([0.0]))
    assert result.participants == tuple(PEERS)  # nobody rejected: verification is off


async def test_a_verified_mean_without_outliers_is_the_plain_mean_bit_for_bit():
    plain = coordinator(expected=PEERS[:3])
    verified = coordinator(
        expected=PEERS[:3], aggregation=AggregationRule(MEAN, verification=Verification(enabled=True))
    )
    results = []
    for rounds in (plain, verified):
        for peer, tensors, count in zip(PEERS, HONEST, [3, 1, 2], strict=False):
            await rounds.submit(peer, 1, tensors, samples=count)
        results.append(await asyncio.wait_for(rounds.published.get(), 5))
    assert results[0].verdicts == {}
    assert all(torch.equal(results[0].update[name], results[1].update[name]) for name in ("w", "b"))
    assert all(torch.equal(plain.weights[name], verified.weights[name]) for name in ("w", "b"))
    assert set(results[1].verdicts) == set(PEERS[:3])


def test_a_reversed_update_five_times_as_large_does_not_make_the_honest_updates_look_reversed():
    # Three honest updates sharing a direction (pairwise cosines about 0.5) and one trainer sending its own
    # update reversed and 5x: under the norm limit, so only the cosine can catch it. Against the plain mean of
    # the others, every honest update's "others" held the -5x one and pointed away from it (the
    # bench/robustness.py finding: honest updates rejected with it); each update now counts in the reference
    # with its norm clipped to the round's median.
    generator = torch.Generator().manual_seed(7)
    shared = torch.randn(256, generator=generator)
    honest = [shared + torch.randn(256, generator=generator) for _ in range(4)]
    rows = [row.tolist() for row in honest[:3]] + [(-5.0 * honest[3]).tolist()]
    updates = held(rows)
    cosines = cosines_to_others([u.update for u in updates], ["x"], [u.norm for u in updates])
    assert all(cosine is not None and cosine > 0.2 for cosine in cosines[:3]), cosines
    assert cosines[3] is not None and cosines[3] < -0.4, cosines
    strict = AggregationRule(CLIPPED_MEAN, verification=Verification(min_cosine=-0.3))
    verdicts = judge(updates, cosines, strict)
    assert [verdicts[u.peer].verdict for u in updates] == ["accepted", "accepted", "accepted", "rejected"]
    assert "cosine similarity to the mean of the others" in verdicts["peer-3"].reason
