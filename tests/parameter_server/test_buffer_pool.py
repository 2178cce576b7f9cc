"""The round's model-sized tensors come from a buffer pool (issue 15): weights a reader holds are never
mutated, buffers nobody holds are reused, and the arithmetic is bit for bit that of the pure functions."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch

from hypha_tensors import encoding
from hypha_tensors.encoding import DecodedView, add_scaled_, encode, group
from hypha_tensors.formats import Encoding, EncodingError
from parameter_server.buffers import BufferPool
from parameter_server.exceptions import TensorRefused
from parameter_server.math import (
    StreamingMean,
    check_finite,
    mean,
    nesterov_step,
    nesterov_step_,
    norm_limit,
    step_bounds,
)
from parameter_server.rounds import RoundCoordinator

ALICE, BOB = "alice", "bob"
SIGNATURE = {"w": ((64, 32), torch.float32), "b": ((32,), torch.float32)}
LR, MU = 0.7, 0.9


def storage_of(tensors: dict[str, torch.Tensor]) -> int:
    """Where a set's memory is (all of a pool set's tensors are on one storage)."""
    pointers = {tensor.untyped_storage().data_ptr() for tensor in tensors.values()}
    assert len(pointers) == 1
    return pointers.pop()


# --- the pool --------------------------------------------------------------------------------------------------


def test_a_set_is_reused_once_nothing_holds_it():
    pool = BufferPool()
    first = pool.take(SIGNATURE)
    where = storage_of(first)
    assert {name: (tuple(t.shape), t.dtype) for name, t in first.items()} == SIGNATURE
    assert all(t.is_contiguous() for t in first.values())

    # while it is held, a second take gets new memory
    second = pool.take(SIGNATURE)
    assert storage_of(second) != where and pool.allocated == 2

    # dropped: its memory is handed out again (the same storage, new tensor objects)
    del first
    third = pool.take(SIGNATURE)
    assert storage_of(third) == where
    assert (pool.allocated, pool.reused) == (2, 1)
    # another signature never gets it
    other = pool.take({"w": ((64, 32), torch.float32)})
    assert storage_of(other) not in (where, storage_of(second))


@pytest.mark.parametrize(
    "hold",
    [
        lambda tensors: tensors["b"],  # one tensor of the set
        lambda tensors: tensors["w"][3:5],  # a view
        lambda tensors: tensors["w"].detach(),  # an alias
        lambda tensors: tensors["b"].numpy(),  # a NumPy array on its memory
        lambda tensors: tensors["w"].untyped_storage(),  # the storage itself
        lambda tensors: dict(
            tensors
        ),  # a copy of the dict (the eval thread's load_state_dict(dict(weights)))
    ],
    ids=["tensor", "view", "alias", "numpy", "storage", "dict"],
)
def test_any_holder_keeps_a_set_from_being_reused(hold):
    pool = BufferPool()
    tensors = pool.take(SIGNATURE)
    where = storage_of(tensors)
    held = hold(tensors)
    del tensors

    again = pool.take(SIGNATURE)

    assert storage_of(again) != where
    del held, again
    assert storage_of(pool.take(SIGNATURE)) == where


def test_held_elsewhere_counts_other_tensor_objects_not_references():
    pool = BufferPool()
    tensors = pool.take(SIGNATURE)
    assert pool.owns(tensors) and not pool.held_elsewhere(tensors)

    same_objects = dict(tensors)  # references to the owner's own tensor objects
    assert not pool.held_elsewhere(tensors)
    alias = tensors["w"].detach()
    assert pool.held_elsewhere(tensors)
    del alias, same_objects
    assert not pool.held_elsewhere(tensors)

    # not the pool's: held elsewhere, never owned
    foreign = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in SIGNATURE.items()}
    assert not pool.owns(foreign) and pool.held_elsewhere(foreign)
    assert not pool.owns({"w": tensors["w"]})  # part of a set is not a set


def test_trim_keeps_only_spare_free_sets():
    pool = BufferPool()
    held = pool.take(SIGNATURE)
    dropped = [pool.take(SIGNATURE) for _ in range(3)]
    del dropped
    assert (pool.sets, pool.free_sets) == (4, 3)

    pool.trim(1)

    assert (pool.sets, pool.free_sets) == (2, 1)
    assert pool.owns(held)
    assert pool.nbytes == 2 * (64 * 32 * 4 + 128)  # the bias starts 64-byte aligned


# --- the round -------------------------------------------------------------------------------------------------


def coordinator(**overrides) -> RoundCoordinator:
    generator = torch.Generator().manual_seed(1)
    arguments = {
        "expected": [ALICE, BOB],
        "weights": {
            "w": torch.randn(64, 32, generator=generator),
            "bn.running_var": torch.rand(32, generator=generator) + 0.5,
            "steps": torch.tensor(3),
        },
        "momentum": None,
        "rounds_completed": 0,
        "update_rounds": 20,
        "round_timeout": 30.0,
        "weighted": True,
        "learning_rate": LR,
        "momentum_factor": MU,
        "buffers": {"bn.running_var"},
    }
    arguments.update(overrides)
    return RoundCoordinator(**arguments)


def updates_of(round_number: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + round_number)
    return [
        {
            "w": torch.randn(64, 32, generator=generator) * 0.01,
            "bn.running_var": torch.randn(32, generator=generator) * 0.01,
        }
        for _ in range(2)
    ]


async def run_round(rounds: RoundCoordinator, round_number: int):
    for peer, update, samples in zip((ALICE, BOB), updates_of(round_number), (3, 5), strict=True):
        await rounds.submit(peer, round_number, update, samples=samples)
    return await asyncio.wait_for(rounds.published.get(), 10)


def floating(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in weights.items() if tensor.dtype.is_floating_point}


async def test_weights_a_reader_holds_stay_bit_identical_while_later_rounds_run():
    # given: a persist hook that keeps each round's weights for the eval thread, as the service does
    kept: dict[int, dict[str, torch.Tensor]] = {}

    async def persist(result, weights, momentum):
        kept[result.round_number] = weights

    rounds = coordinator(persist=persist)
    await run_round(rounds, 1)
    await run_round(rounds, 2)
    eval_weights = kept.pop(2)  # the eval thread takes round 2's weights and is slow about it
    snapshot = {name: tensor.clone() for name, tensor in eval_weights.items()}
    one_tensor = kept.pop(1)["w"]  # a reader of one tensor of round 1's weights
    one_snapshot = one_tensor.clone()
    held_memory = {storage_of(floating(eval_weights)), one_tensor.untyped_storage().data_ptr()}

    # when: the eval thread reads them while six more rounds close (their steps run in threads too)
    stop = threading.Event()
    reads: list[bool] = []

    def eval_thread() -> None:
        while not stop.is_set():
            reads.append(all(torch.equal(eval_weights[name], snapshot[name]) for name in snapshot))

    reader = threading.Thread(target=eval_thread)
    reader.start()
    try:
        later = []
        for round_number in range(3, 9):
            await run_round(rounds, round_number)
            later.append(storage_of(floating(rounds.weights)))
            kept.clear()  # the service pops each round's weights once reported
    finally:
        stop.set()
        reader.join()

    # then: never changed, and no later round's weights were written into their memory
    assert reads and all(reads)
    assert all(torch.equal(eval_weights[name], snapshot[name]) for name in snapshot)
    assert torch.equal(one_tensor, one_snapshot)
    assert held_memory.isdisjoint(later)
    # while the rounds nobody held recycled their memory: at most the two held sets on top of the pool's, and
    # one more on a loaded machine (a step's worker thread may not have dropped its arguments yet when the next
    # round looks for a free set: reuse goes by reference counts); without reuse, six
    assert len(set(later)) <= 4
    assert rounds.pool.sets <= 6


async def test_without_readers_the_rounds_reuse_their_memory_and_update_the_momentum_in_place():
    rounds = coordinator()
    weights_memory, momentum_memory, allocated = [], [], []
    for round_number in range(1, 8):
        result = await run_round(rounds, round_number)
        assert result.stepped
        del result  # the service drops a round's result once it reported it
        weights_memory.append(storage_of(floating(rounds.weights)))
        momentum = rounds.momentum
        momentum_memory.append(storage_of(momentum))
        del momentum  # a held alias would keep the next round from writing in place
        allocated.append(rounds.pool.allocated)

    # the accumulator (→ u), the weights, the momentum and one spare: four sets, none allocated after round 2
    assert rounds.pool.sets == 4
    assert allocated[1:] == [4] * 6
    # θ takes a free set of the pool's four: two alternate, or a third when a step's worker thread has not yet
    # dropped its reference as the next round looks (reuse goes by reference counts; CI hit it under load); never
    # a new one (allocated above)
    assert len(set(weights_memory[1:])) in (2, 3)
    assert len(set(momentum_memory)) == 1  # updated in place after round 1


async def test_a_held_momentum_is_not_updated_in_place():
    rounds = coordinator()
    await run_round(rounds, 1)
    await run_round(rounds, 2)
    held = rounds.momentum  # e.g. a checkpoint writer still holding what persist gave it
    snapshot = {name: tensor.clone() for name, tensor in held.items()}

    await run_round(rounds, 3)

    assert all(torch.equal(held[name], snapshot[name]) for name in snapshot)
    assert storage_of(rounds.momentum) != storage_of(held)
    assert not torch.equal(rounds.momentum["w"], held["w"])


async def test_the_pooled_rounds_compute_the_pure_functions_bit_for_bit():
    # given: the same rounds through the coordinator and through mean / nesterov_step / θ + u
    rounds = coordinator()
    weights = dict(rounds.weights)
    momentum = None
    for round_number in range(1, 6):
        # when
        result = await run_round(rounds, round_number)

        # then
        gradient = mean(updates_of(round_number), [3, 5])
        update, momentum = nesterov_step(
            gradient=gradient,
            momentum=momentum,
            learning_rate=LR,
            momentum_factor=MU,
            averaged={"bn.running_var"},
        )
        weights = {
            name: tensor + update[name] if name in update else tensor for name, tensor in weights.items()
        }
        assert result.stepped
        assert all(torch.equal(result.update[name], update[name]) for name in update)
        assert all(torch.equal(rounds.weights[name], weights[name]) for name in weights)
        assert sorted(rounds.momentum) == ["w"]
        assert torch.equal(rounds.momentum["w"], momentum["w"])
        assert rounds.weights["steps"] is weights["steps"]


async def test_a_step_not_proven_finite_is_checked_and_its_discard_leaves_the_momentum_as_it_was():
    # given: a weight near float32's largest value (the bounds cannot prove any step finite) and a
    # momentum from round 1 that the pool made
    rounds = coordinator(
        expected=[ALICE],
        weights={"w": torch.tensor([3.0e38, 1.0])},
        buffers=(),
        learning_rate=0.5,
        momentum_factor=0.5,
        update_norm_ratio=1e39,
    )
    await rounds.submit(ALICE, 1, {"w": torch.tensor([1.0, 1.0])}, samples=1)
    first = await asyncio.wait_for(rounds.published.get(), 5)
    assert first.stepped
    weights = {name: tensor.clone() for name, tensor in rounds.weights.items()}
    momentum = {name: tensor.clone() for name, tensor in rounds.momentum.items()}

    # when: u = 0.5·(1e38 + 0.5·(0.5 + 1e38)) fits, θ + u = 3.75e38 does not
    await rounds.submit(ALICE, 2, {"w": torch.tensor([1.0e38, 0.0])}, samples=1)
    second = await asyncio.wait_for(rounds.published.get(), 5)

    # then: discarded, and the momentum was not written in place
    assert (second.stepped, second.discarded) == (False, "the new weights are not finite ('w' contains Inf)")
    assert torch.equal(rounds.momentum["w"], momentum["w"])
    assert torch.equal(rounds.weights["w"], weights["w"])


async def test_the_coordinator_keeps_no_tensors_of_a_published_round(tmp_path):
    async def persist(result, weights, momentum):
        result.path = tmp_path / f"{result.round_number}.safetensors"

    rounds = coordinator(persist=persist)
    published = await run_round(rounds, 1)

    record = await rounds.wait_result(1, 0)
    assert record.path == published.path and record.participants == (ALICE, BOB)
    assert (record.update, record.encoded) == ({}, None)
    assert sorted(published.update) == ["bn.running_var", "w"]  # the published result has them


# --- the arithmetic in place -----------------------------------------------------------------------------------


def test_a_pooled_accumulator_is_zeroed_before_the_first_update():
    dirty = {"w": torch.full((3,), float("nan")), "b": torch.full((2,), 7.0)}
    streaming = StreamingMean(lambda signature: dirty)
    streaming.add({"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([1.0, 1.0])}, 1.0)
    streaming.add({"w": torch.tensor([3.0, 2.0, 1.0]), "b": torch.tensor([0.0, 2.0])}, 3.0)

    assert streaming.bound() == (1 * 3.0 + 3 * 3.0) / 4
    result = streaming.take()
    assert torch.equal(result["w"], torch.tensor([2.5, 2.0, 1.5]))
    assert result["w"] is dirty["w"]  # the mean is computed in the accumulator itself


@pytest.mark.parametrize(
    "wire",
    [Encoding("int8", 64), Encoding("int8", 100), Encoding("float16"), Encoding("bfloat16")],
    ids=str,
)
def test_an_encoded_update_is_decoded_straight_into_the_sum_with_the_same_bits(monkeypatch, wire):
    # given: slices of 1000 values, so that a tensor spans several (and int8's last block is short)
    monkeypatch.setattr(encoding, "SLICE", 1000)
    generator = torch.Generator().manual_seed(3)
    tensors = {"w": torch.randn(37, 113, generator=generator), "b": torch.randn(7, generator=generator)}
    view = DecodedView(group(encode(tensors, wire), wire), wire)
    start = {name: torch.randn(tensor.shape, generator=generator) for name, tensor in tensors.items()}

    for name in tensors:
        # when
        expected = start[name].clone().add_(view[name].to(torch.float32), alpha=1031.0)
        actual = view.add_into(name, start[name].clone(), alpha=1031.0)

        # then
        assert torch.equal(actual, expected)

    # and a StreamingMean of views is that of the decoded tensors
    decoded = {name: view[name] for name in view}
    by_view, by_tensors = StreamingMean(), StreamingMean()
    by_view.add(view, 3.0)
    by_tensors.add(decoded, 3.0)
    by_view.add(view, 5.0)
    by_tensors.add(decoded, 5.0)
    assert all(torch.equal(by_view.result()[name], by_tensors.result()[name]) for name in tensors)


def test_a_half_precision_tensor_is_widened_by_slices_with_the_same_bits(monkeypatch):
    monkeypatch.setattr(encoding, "SLICE", 1000)
    half = torch.randn(4321, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    target = torch.randn(4321, generator=torch.Generator().manual_seed(5))

    expected = target.clone().add_(half.to(torch.float32), alpha=3.0)

    assert torch.equal(add_scaled_(target, half, alpha=3.0), expected)


def test_a_decoded_view_refuses_a_bad_tensor_before_touching_the_sum():
    wire = Encoding("float16")
    view = DecodedView(
        {"w": encoding.EncodedTensor(torch.tensor([1.0, float("inf")], dtype=torch.float16))}, wire
    )
    target = torch.zeros(2)

    with pytest.raises(EncodingError, match="NaN or Inf"):
        view.add_into("w", target, alpha=1.0)
    assert torch.equal(target, torch.zeros(2))


@pytest.mark.parametrize("in_place", [True, False])
def test_nesterov_step_in_place_gives_the_bits_of_nesterov_step(in_place):
    generator = torch.Generator().manual_seed(6)
    gradient = {
        "w": torch.randn(300, generator=generator),
        "half": torch.randn(5, generator=generator).to(torch.float16),
        "bn": torch.randn(4, generator=generator),
    }
    momentum = {"w": torch.randn(300, generator=generator), "half": torch.randn(5).to(torch.float16)}
    arguments = {"learning_rate": LR, "momentum_factor": MU, "averaged": {"bn"}}
    expected_update, expected_momentum = nesterov_step(gradient=gradient, momentum=momentum, **arguments)
    consumed = {name: tensor.clone() for name, tensor in gradient.items()}
    old = {name: tensor.clone() for name, tensor in momentum.items()}
    out = old if in_place else {"w": torch.empty(300)}

    update, new_momentum = nesterov_step_(gradient=consumed, momentum=old, momentum_out=out, **arguments)

    assert all(torch.equal(update[name], expected_update[name]) for name in expected_update)
    assert all(torch.equal(new_momentum[name], expected_momentum[name]) for name in expected_momentum)
    assert sorted(new_momentum) == ["half", "w"]
    assert update["w"] is consumed["w"] and update["bn"] is consumed["bn"]  # u is the gradient's memory
    assert new_momentum["w"] is out["w"]
    if not in_place:
        assert torch.equal(old["w"], momentum["w"])  # only momentum_out is written
    # the first round: m ← g, into momentum_out
    first_update, first_momentum = nesterov_step(gradient=gradient, momentum=None, **arguments)
    consumed = {name: tensor.clone() for name, tensor in gradient.items()}
    update, new_momentum = nesterov_step_(
        gradient=consumed, momentum=None, momentum_out={"w": torch.empty(300)}, **arguments
    )
    assert all(torch.equal(update[name], first_update[name]) for name in first_update)
    assert all(torch.equal(new_momentum[name], first_momentum[name]) for name in first_momentum)


def test_nesterov_step_in_place_refuses_before_writing_anything():
    gradient = {"w": torch.ones(3), "b": torch.ones(2)}
    momentum = {"w": torch.ones(3)}  # no "b"

    with pytest.raises(TensorRefused, match="'b'"):
        nesterov_step_(gradient=gradient, momentum=momentum, learning_rate=0.5, momentum_factor=0.5)

    assert torch.equal(gradient["w"], torch.ones(3)) and torch.equal(momentum["w"], torch.ones(3))


def test_check_finite_says_what_weights_validate_says():
    check_finite({"a": torch.ones(2), "steps": torch.tensor([1])})
    with pytest.raises(TensorRefused, match="'b' refused: contains NaN"):
        check_finite({"a": torch.ones(2), "b": torch.tensor([float("inf"), float("nan")])})
    with pytest.raises(TensorRefused, match="'a' refused: contains Inf"):
        check_finite({"a": torch.tensor([1.0, -float("inf")], dtype=torch.float16), "b": torch.ones(1)})


def test_norm_limit_measures_the_fallback_only_when_it_is_needed():
    asked = []

    def fallback() -> float:
        asked.append(True)
        return 4.0

    assert norm_limit([2.0], [], fallback=fallback, ratio=10) == 20.0
    assert asked == []
    assert norm_limit([], [0.0], fallback=fallback, ratio=10) == 40.0
    assert asked == [True]
    with pytest.raises(ValueError, match="fallback"):
        norm_limit([], [], fallback=lambda: float("nan"), ratio=10)


def test_step_bounds_follow_the_step():
    bounds = step_bounds(gradient=1.0, momentum=2.0, weights=10.0, learning_rate=0.5, momentum_factor=0.5)

    # m' = 0.5·2 + 1 = 2, u = 0.5·(1 + 0.5·2) = 1, θ' = 10 + 1, each grown by the rounding allowance
    assert bounds == pytest.approx((1.0, 2.0, 1.0, 11.0), rel=1e-5)
    assert all(bound >= exact for bound, exact in zip(bounds, (1.0, 2.0, 1.0, 11.0), strict=True))
    first = step_bounds(gradient=1.0, momentum=None, weights=0.0, learning_rate=0.1, momentum_factor=0.5)
    assert first.momentum == first.gradient  # m' = g
    assert step_bounds(
        gradient=3.0, momentum=0.0, weights=0.0, learning_rate=0.1, momentum_factor=0.0, averaged=True
    ).update == pytest.approx(3.0)  # a buffer's u is g


def test_a_large_tensors_norm_is_taken_by_slices_in_float64(monkeypatch):
    from parameter_server import math as server_math

    monkeypatch.setattr(server_math, "NORM_SLICE", 1000)
    values = torch.randn(4321, generator=torch.Generator().manual_seed(7)) * 1e19  # squares past float32
    whole = float(torch.linalg.vector_norm(values, dtype=torch.float64))

    assert server_math.update_norm({"w": values}) == pytest.approx(whole, rel=1e-12)
    with_inf, with_nan = values.clone(), values.clone()
    with_inf[10] = float("inf")
    with_nan[10], with_nan[4000] = float("inf"), float("nan")  # NaN in a later slice than the Inf
    assert server_math.update_norm({"w": with_inf}) == float("inf")
    assert math.isnan(server_math.update_norm({"w": with_nan}))
