"""The round logic (parameter_server/rounds.py): who may send, when rounds close, the outer step."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch.testing import assert_close

from parameter_server.exceptions import RoundConflict, RoundPruned, UnknownRound, UpdateRefused
from parameter_server.rounds import RoundCoordinator

ALICE, BOB, CAROL = "alice", "bob", "carol"


def global_weights() -> dict[str, torch.Tensor]:
    return {
        "w": torch.tensor([1.0, 2.0]),
        "b": torch.tensor([0.5]),
        "steps": torch.tensor([3], dtype=torch.int64),  # an integer buffer: never averaged
    }


def delta(w: list[float], b: list[float], steps: int = 0) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(w), "b": torch.tensor(b), "steps": torch.tensor([steps], dtype=torch.int64)}


def coordinator(**overrides) -> RoundCoordinator:
    arguments = {
        "expected": [ALICE, BOB],
        "weights": global_weights(),
        "momentum": None,
        "rounds_completed": 0,
        "update_rounds": 3,
        "round_timeout": 30.0,
        "weighted": True,
        "learning_rate": 0.5,
        "momentum_factor": 0.5,
    }
    arguments.update(overrides)
    return RoundCoordinator(**arguments)


async def next_published(rounds: RoundCoordinator):
    return await asyncio.wait_for(rounds.published.get(), 5)


async def test_two_trainers_close_the_round_with_the_weighted_nesterov_step():
    # given
    persisted = []

    async def persist(result, weights, momentum):
        persisted.append((result.round_number, weights, momentum))

    rounds = coordinator(persist=persist)

    # when
    await rounds.submit(ALICE, 1, delta([0.2, -0.4], [0.1], steps=7), samples=1)
    await rounds.submit(BOB, 1, delta([0.6, 0.0], [-0.3]), samples=3)
    result = await next_published(rounds)

    # then: g = (1·a + 3·b)/4 = w [0.5, -0.1], b [-0.2]; first round m = g, u = lr·(μ·m + g) = 0.75·g
    assert result.round_number == 1
    assert result.participants == (ALICE, BOB)
    assert result.left_out == ()
    assert result.samples == 4
    assert result.stepped is True
    assert_close(result.update["w"], torch.tensor([0.375, -0.075]))
    assert_close(result.update["b"], torch.tensor([-0.15]))
    assert sorted(result.update) == ["b", "w"]  # no integer buffer in u
    assert_close(rounds.weights["w"], torch.tensor([1.375, 1.925]))
    assert_close(rounds.weights["b"], torch.tensor([0.35]))
    assert torch.equal(rounds.weights["steps"], torch.tensor([3]))
    assert_close(rounds.momentum, {"w": torch.tensor([0.5, -0.1]), "b": torch.tensor([-0.2])})
    assert [number for number, _, _ in persisted] == [1]
    assert rounds.rounds_completed == 1
    assert rounds.open_round == 2

    # when: round 2, g = w [0.1, 0.1], b [0.0] → m = 0.5·m + g, u = 0.5·(0.5·m + g)
    await rounds.submit(ALICE, 2, delta([0.1, 0.1], [0.0]), samples=2)
    await rounds.submit(BOB, 2, delta([0.1, 0.1], [0.0]), samples=2)
    second = await next_published(rounds)

    # then: m = [0.35, 0.05], [-0.1]; u = 0.5·([0.175, 0.025] + [0.1, 0.1]) = [0.1375, 0.0625], b [-0.025]
    assert_close(second.update["w"], torch.tensor([0.1375, 0.0625]))
    assert_close(second.update["b"], torch.tensor([-0.025]))
    assert_close(rounds.momentum["w"], torch.tensor([0.35, 0.05]))
    assert_close(rounds.weights["w"], torch.tensor([1.5125, 1.9875]))


async def test_unweighted_rounds_ignore_the_sample_counts():
    rounds = coordinator(weighted=False)

    await rounds.submit(ALICE, 1, delta([0.2, -0.4], [0.1]), samples=1)
    await rounds.submit(BOB, 1, delta([0.6, 0.0], [-0.3]), samples=3)
    result = await next_published(rounds)

    # g = plain mean = w [0.4, -0.2], b [-0.1]; u = 0.75·g
    assert_close(result.update["w"], torch.tensor([0.3, -0.15]))
    assert_close(result.update["b"], torch.tensor([-0.075]))
    assert result.samples == 4


async def test_a_missing_sample_count_weighs_one():
    rounds = coordinator()

    await rounds.submit(ALICE, 1, delta([0.2, -0.4], [0.1]), samples=None)
    await rounds.submit(BOB, 1, delta([0.6, 0.0], [-0.3]), samples=3)
    result = await next_published(rounds)

    assert_close(result.update["w"], torch.tensor([0.375, -0.075]))
    assert result.samples == 3


async def test_the_timeout_after_the_first_update_leaves_out_the_silent_trainer():
    # given
    rounds = coordinator(expected=[ALICE, BOB, CAROL], round_timeout=0.2)
    await asyncio.sleep(0.3)  # no update yet: the round waits, however long
    assert rounds.open_round == 1 and rounds.published.empty()

    # when
    await rounds.submit(ALICE, 1, delta([0.2, -0.4], [0.1]), samples=5)
    await rounds.submit(CAROL, 1, delta([0.2, -0.4], [0.1]), samples=5)
    result = await next_published(rounds)

    # then
    assert result.participants == (ALICE, CAROL)
    assert result.left_out == (BOB,)
    assert_close(result.update["w"], torch.tensor([0.15, -0.3]))
    with pytest.raises(RoundConflict, match="round 1 is closed"):
        await rounds.submit(BOB, 1, delta([9.0, 9.0], [9.0]), samples=1)
    assert rounds.received == []


async def test_a_duplicate_or_misdirected_update_is_refused_and_not_counted():
    # given
    rounds = coordinator(expected=[ALICE, BOB, CAROL])
    await rounds.submit(ALICE, 1, delta([0.2, -0.4], [0.1]), samples=1)

    # when / then
    with pytest.raises(RoundConflict, match="already sent"):
        await rounds.submit(ALICE, 1, delta([5.0, 5.0], [5.0]), samples=1)
    with pytest.raises(RoundConflict, match="not open yet"):
        await rounds.submit(BOB, 2, delta([5.0, 5.0], [5.0]), samples=1)
    with pytest.raises(UnknownRound):
        await rounds.submit(BOB, 4, delta([5.0, 5.0], [5.0]), samples=1)
    assert rounds.received == [ALICE]

    await rounds.submit(BOB, 1, delta([0.2, -0.4], [0.1]), samples=1)
    await rounds.submit(CAROL, 1, delta([0.2, -0.4], [0.1]), samples=1)
    result = await next_published(rounds)
    assert_close(result.update["w"], torch.tensor([0.15, -0.3]))


async def test_a_round_whose_updates_all_weigh_zero_takes_no_step():
    rounds = coordinator()

    await rounds.submit(ALICE, 1, delta([0.2, -0.4], [0.1]), samples=0)
    await rounds.submit(BOB, 1, delta([0.6, 0.0], [-0.3]), samples=0)
    result = await next_published(rounds)

    assert result.stepped is False
    assert torch.equal(result.update["w"], torch.zeros(2))
    assert torch.equal(rounds.weights["w"], torch.tensor([1.0, 2.0]))
    assert rounds.momentum is None


async def test_results_of_the_last_two_rounds_are_kept():
    # given
    rounds = coordinator(expected=[ALICE])
    for number in (1, 2, 3):
        await rounds.submit(ALICE, number, delta([0.1, 0.1], [0.1]), samples=1)
        await next_published(rounds)

    # then
    assert rounds.finished is True and rounds.open_round is None
    assert (await rounds.wait_result(3, 0)).round_number == 3
    assert (await rounds.wait_result(2, 0)).round_number == 2
    with pytest.raises(RoundPruned):
        await rounds.wait_result(1, 0)
    with pytest.raises(UnknownRound):
        await rounds.wait_result(4, 0)


async def test_wait_result_long_polls_until_the_round_closes():
    rounds = coordinator(expected=[ALICE])

    assert await rounds.wait_result(1, 0.05) is None
    waiter = asyncio.create_task(rounds.wait_result(1, 5))
    await asyncio.sleep(0.05)
    await rounds.submit(ALICE, 1, delta([0.1, 0.1], [0.1]), samples=1)

    result = await asyncio.wait_for(waiter, 5)
    assert result.round_number == 1
    assert await rounds.wait_last_result_fetched(0.05) is False
    await rounds.mark_fetched(ALICE, 1)
    assert await rounds.wait_last_result_fetched(0.05) is True


async def test_finish_closes_the_open_round_to_updates():
    rounds = coordinator()

    rounds.finish()

    assert rounds.finished is True and rounds.open_round is None
    with pytest.raises(RoundConflict):
        await rounds.submit(ALICE, 1, delta([0.1, 0.1], [0.1]), samples=1)


async def test_a_failing_persist_publishes_nothing():
    async def persist(result, weights, momentum):
        raise OSError("disk full")

    rounds = coordinator(expected=[ALICE], persist=persist)

    await rounds.submit(ALICE, 1, delta([0.1, 0.1], [0.1]), samples=1)
    error = await asyncio.wait_for(rounds.failure, 5)

    assert isinstance(error, OSError)
    assert rounds.published.empty()
    assert rounds.rounds_completed == 0
    assert torch.equal(rounds.weights["w"], torch.tensor([1.0, 2.0]))


async def test_the_first_update_asks_whom_to_expect_and_a_dead_trainer_is_not_waited_for():
    # given: three expected trainers; the hook records the question
    asked = []
    rounds = coordinator(
        expected=[ALICE, BOB, CAROL], on_first_update=lambda number, peer: asked.append((number, peer))
    )

    # when: alice sends; the control plane says carol is no longer training
    await rounds.submit(ALICE, 1, delta([0.2, 0.2], [0.0]), samples=1)
    assert asked == [(1, ALICE)]
    rounds.expect(1, [ALICE, BOB], timeout=None)
    assert rounds.open_round == 1  # bob is still due
    await rounds.submit(BOB, 1, delta([0.4, 0.4], [0.0]), samples=1)
    result = await next_published(rounds)

    # then: closed as soon as the two still training sent, carol reported as left out
    assert result.participants == (ALICE, BOB)
    assert result.left_out == (CAROL,)
    assert set(result.arrivals) == {ALICE, BOB} and result.arrivals[ALICE] == 0.0
    assert asked == [(1, ALICE)]


async def test_expect_shortens_the_timeout_but_never_lengthens_it():
    # given
    rounds = coordinator(round_timeout=30.0)
    await rounds.submit(ALICE, 1, delta([0.2, 0.2], [0.0]), samples=1)

    # when: bob is due within 0.2 s, and does not come
    rounds.expect(1, [ALICE, BOB], timeout=60.0)  # longer than round_timeout: ignored
    rounds.expect(1, [ALICE, BOB], timeout=0.2)
    result = await next_published(rounds)

    # then
    assert result.participants == (ALICE,) and result.left_out == (BOB,)


async def test_expect_for_another_round_or_only_the_senders_closes_or_changes_nothing():
    rounds = coordinator()
    rounds.expect(1, [ALICE], timeout=0.0)  # no update yet: nothing to close
    rounds.expect(2, [ALICE], timeout=0.0)  # not the open round
    assert rounds.open_round == 1
    await rounds.submit(ALICE, 1, delta([0.2, 0.2], [0.0]), samples=1)
    rounds.expect(1, [ALICE], timeout=None)  # bob is gone: alice's update closes the round
    result = await next_published(rounds)
    assert result.participants == (ALICE,) and result.left_out == (BOB,)


async def test_with_one_trainer_the_norm_is_bounded_by_the_previous_rounds():
    # given: round 1's only update has norm sqrt(0.375² + 0.5²) = 0.625; the bound is 10x that: 6.25
    rounds = coordinator(expected=[ALICE])
    await rounds.submit(ALICE, 1, delta([0.375, 0.5], [0.0]), samples=1)
    await next_published(rounds)

    # when: round 2's update has norm sqrt(6² + 8²) = 10
    with pytest.raises(UpdateRefused) as refused:
        await rounds.submit(ALICE, 2, delta([6.0, 8.0], [0.0]), samples=1)

    # then: refused with the reason, the round unchanged; one of norm sqrt(3.75² + 5²) = 6.25 is taken
    assert (
        str(refused.value)
        == "the update's L2 norm 10 is over this round's bound 6.25 (10x the reference norm)"
    )
    assert rounds._round.refused == {ALICE: str(refused.value)}
    assert (rounds._round.mean.count, rounds.received) == (0, [])
    await rounds.submit(ALICE, 2, delta([3.75, 5.0], [0.0]), samples=1)
    assert (await next_published(rounds)).participants == (ALICE,)


async def test_a_step_past_a_float16_models_range_is_discarded_and_the_next_round_opens():
    # given: a float16 weight near float16's largest value (65504)
    persisted = []

    async def persist(result, weights, momentum):
        persisted.append((result.round_number, weights, momentum))

    weights = {"w": torch.tensor([60000.0], dtype=torch.float16)}
    rounds = coordinator(expected=[ALICE], weights=weights, persist=persist)

    # when: u = 0.75 · 60000 = 45000 (fits), but θ + u = 105000 does not
    await rounds.submit(ALICE, 1, {"w": torch.tensor([60000.0], dtype=torch.float16)}, samples=1)
    result = await next_published(rounds)

    # then: the step is thrown away, the round is published with u = 0 and the job goes on
    assert (result.stepped, result.discarded) == (False, "the new weights are not finite ('w' contains Inf)")
    assert torch.equal(result.update["w"], torch.zeros(1, dtype=torch.float16))
    assert torch.equal(rounds.weights["w"], weights["w"]) and rounds.momentum is None
    assert [(number, saved["w"].item(), momentum) for number, saved, momentum in persisted] == [
        (1, 60000.0, None)
    ]
    assert (rounds.rounds_completed, rounds.open_round, rounds.failure.done()) == (1, 2, False)


@pytest.mark.parametrize("refused_first", [True, False])
async def test_a_refused_update_counts_as_its_trainers_answer_and_the_round_closes_without_waiting(
    refused_first,
):
    # A trainer whose update is refused does not send another for the round (its bridge logs the 4xx);
    # the round closed only at its timeout (bench/robustness.py: a 30 s timeout made 3 rounds take 2 min).
    rounds = coordinator(round_timeout=3600.0)
    if refused_first:
        rounds.record_refusal(BOB, 1, "not safetensors: header too large")  # the server's refusals
        await rounds.submit(ALICE, 1, delta([0.2, 0.2], [0.0]), samples=1)
    else:
        await rounds.submit(ALICE, 1, delta([0.2, 0.2], [0.0]), samples=1)
        rounds.record_refusal(BOB, 1, "not safetensors: header too large")
    result = await next_published(rounds)
    assert result.participants == (ALICE,)
    assert BOB in result.refused
