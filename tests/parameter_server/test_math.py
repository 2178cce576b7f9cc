"""The parameter server's math against hand-computed values (parameter_server/math.py)."""

from __future__ import annotations

import math

import pytest
import torch

from parameter_server.exceptions import NoUpdatesError, TensorRefused
from parameter_server.math import (
    StreamingMean,
    largest_magnitude,
    mean,
    nesterov_step,
    norm_limit,
    update_norm,
)


def clones(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in state.items()}


def assert_states_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        assert torch.equal(actual[name], expected[name]), name


# ---------------------------------------------------------------------------------------------- mean


def test_three_way_mean_is_the_true_mean_not_the_original_pairwise_running_average():
    # given three updates f1, f2, f3 of one tensor
    updates = [{"w": torch.tensor([3.0])}, {"w": torch.tensor([6.0])}, {"w": torch.tensor([12.0])}]

    # when
    result = mean(updates)

    # then the true mean: (3 + 6 + 12) / 3 = 21 / 3 = 7
    assert torch.equal(result["w"], torch.tensor([7.0]))
    # The original's running average acc_k = (f_k + acc_{k-1}) / 2 gives acc_2 = (6 + 3) / 2 = 4.5 and
    # acc_3 = (12 + 4.5) / 2 = 8.25 = 3/4 + 6/4 + 12/2: the last update counts double. We do not copy it.
    pairwise = updates[0]["w"]
    for update in updates[1:]:
        pairwise = (update["w"] + pairwise) / 2
    assert torch.equal(pairwise, torch.tensor([8.25]))
    assert not torch.equal(result["w"], pairwise)


def test_weighted_mean_weights_by_samples():
    # given a = [2, -4] from 100 samples and b = [6, 8] from 300 samples
    a = {"w": torch.tensor([2.0, -4.0])}
    b = {"w": torch.tensor([6.0, 8.0])}

    # when
    result = mean([a, b], weights=[100, 300])

    # then (100·2 + 300·6) / 400 = 2000 / 400 = 5 and (100·(−4) + 300·8) / 400 = 2000 / 400 = 5
    assert torch.equal(result["w"], torch.tensor([5.0, 5.0]))


def test_streaming_mean_with_weights_equals_mean_and_reports_count_and_weight():
    streaming = StreamingMean()
    streaming.add({"w": torch.tensor([1.0, 2.0])}, weight=1)
    streaming.add({"w": torch.tensor([4.0, 8.0])}, weight=2)
    # (1·1 + 2·4) / 3 = 9 / 3 = 3 and (1·2 + 2·8) / 3 = 18 / 3 = 6
    assert torch.equal(streaming.result()["w"], torch.tensor([3.0, 6.0]))
    assert streaming.count == 2
    assert streaming.total_weight == 3.0
    # result() does not reset: a third update (weight 1) gives (9 + 0) / 4 and (18 + 6) / 4
    streaming.add({"w": torch.tensor([0.0, 6.0])})
    assert torch.equal(streaming.result()["w"], torch.tensor([2.25, 6.0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_mean_keeps_the_input_dtype(dtype):
    updates = [{"w": torch.tensor([1.0, 0.5], dtype=dtype)}, {"w": torch.tensor([2.0, 0.25], dtype=dtype)}]
    updates.append({"w": torch.tensor([4.0, 0.125], dtype=dtype)})

    result = mean(updates)

    # (1 + 2 + 4) / 3 = 7/3, (0.5 + 0.25 + 0.125) / 3 = 0.875 / 3, rounded once to the input dtype
    assert result["w"].dtype == dtype
    assert torch.equal(result["w"], torch.tensor([7 / 3, 0.875 / 3], dtype=torch.float64).to(dtype))


def test_float16_updates_are_accumulated_in_float32():
    # 2048 + 1 is not representable in float16 (spacing 2 above 2048): a float16 accumulator would lose
    # the 1s. Mean of [2048, 1, 1, 1, 1, 2] = 2054 / 6 = 342.33..., which float16 rounds to 342.25.
    values = [2048.0, 1.0, 1.0, 1.0, 1.0, 2.0]
    result = mean({"w": torch.tensor([value], dtype=torch.float16)} for value in values)
    assert torch.equal(result["w"], torch.tensor([2054 / 6]).to(torch.float16))
    assert result["w"].item() == 342.25


def test_mean_does_not_mutate_or_alias_its_inputs():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0)}
    b = {"w": torch.tensor([5.0, 6.0]), "b": torch.tensor(7.0)}
    before = [clones(a), clones(b)]

    result = mean([a, b])

    assert_states_equal(a, before[0])
    assert_states_equal(b, before[1])
    assert result["w"].data_ptr() not in {a["w"].data_ptr(), b["w"].data_ptr()}
    assert torch.equal(result["b"], torch.tensor(5.0))


def update_like(**changes):
    update = {"layer.weight": torch.ones(2, 3), "layer.bias": torch.zeros(3)}
    update.update(changes)
    return {name: tensor for name, tensor in update.items() if tensor is not None}


@pytest.mark.parametrize(
    ("bad_update", "name", "reason"),
    [
        (
            update_like(**{"layer.weight": torch.ones(3, 2)}),
            "layer.weight",
            "has shape (3, 2), expected (2, 3)",
        ),
        (
            update_like(**{"layer.bias": torch.zeros(3, dtype=torch.float16)}),
            "layer.bias",
            "has dtype torch.float16, expected torch.float32",
        ),
        (update_like(**{"layer.bias": None}), "layer.bias", "missing"),
        (update_like(extra=torch.zeros(1)), "extra", "unknown name"),
    ],
    ids=["shape", "dtype", "missing", "extra"],
)
def test_streaming_mean_refuses_a_different_update_and_keeps_its_state(bad_update, name, reason):
    # given a mean of one good update
    streaming = StreamingMean()
    streaming.add(update_like(**{"layer.weight": torch.full((2, 3), 4.0)}))
    before = streaming.result()

    # when a different update is added
    with pytest.raises(TensorRefused) as refused:
        streaming.add(bad_update)

    # then it is refused by name and nothing changed
    assert refused.value.name == name
    assert reason in str(refused.value)
    assert name in str(refused.value)
    assert_states_equal(streaming.result(), before)
    assert streaming.count == 1


def test_streaming_mean_refuses_integer_tensors_and_bad_weights_and_empty_means():
    with pytest.raises(TensorRefused, match="'steps'.*not floating point"):
        StreamingMean().add({"steps": torch.tensor([1, 2])})
    with pytest.raises(ValueError, match="weight"):
        StreamingMean().add({"w": torch.ones(1)}, weight=-1)
    with pytest.raises(ValueError, match="weight"):
        StreamingMean().add({"w": torch.ones(1)}, weight=float("nan"))
    with pytest.raises(NoUpdatesError):
        StreamingMean().result()
    with pytest.raises(NoUpdatesError):
        mean([{"w": torch.ones(1)}], weights=[0])
    with pytest.raises(ValueError, match="more weights"):
        mean([{"w": torch.ones(1)}], weights=[1, 2])
    with pytest.raises(ValueError, match="weight"):
        mean([{"w": torch.ones(1)}, {"w": torch.ones(1)}], weights=[1])


# ------------------------------------------------------------------------------------- nesterov_step


def test_nesterov_step_reference_check():
    # lr 0.1, μ 0.7 (hypha-protocols.md §4, "Reference check")
    learning_rate, momentum_factor = 0.1, 0.7

    # First round, g = 0.5: m ← g = 0.5; u = lr·(μ·m + g) = 0.1·(0.35 + 0.5) = 0.1·0.85 = 0.085
    first_gradient = {"w": torch.full((5,), 0.5)}
    update, momentum = nesterov_step(
        gradient=first_gradient, momentum=None, learning_rate=learning_rate, momentum_factor=momentum_factor
    )
    torch.testing.assert_close(update["w"], torch.full((5,), 0.085), rtol=1e-6, atol=0)
    assert torch.equal(momentum["w"], torch.full((5,), 0.5))

    # Second round: m ← μ·m + g = 0.35 + g; u = lr·(μ·(0.35 + g) + g) = 0.1·(0.245 + 1.7·g) = 0.0245 + 0.17·g
    #   g = 0.1 → 0.0245 + 0.017 = 0.0415      g = 0.2 → 0.0245 + 0.034 = 0.0585
    #   g = 0.3 → 0.0245 + 0.051 = 0.0755      g = 0.4 → 0.0245 + 0.068 = 0.0925
    #   g = 0.5 → 0.0245 + 0.085 = 0.1095
    # and the new momentum 0.35 + g = [0.45, 0.55, 0.65, 0.75, 0.85].
    second_gradient = {"w": torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])}
    update, momentum = nesterov_step(
        gradient=second_gradient,
        momentum=momentum,
        learning_rate=learning_rate,
        momentum_factor=momentum_factor,
    )
    torch.testing.assert_close(
        update["w"], torch.tensor([0.0415, 0.0585, 0.0755, 0.0925, 0.1095]), rtol=1e-6, atol=0
    )
    torch.testing.assert_close(momentum["w"], torch.tensor([0.45, 0.55, 0.65, 0.75, 0.85]), rtol=1e-6, atol=0)


def test_nesterov_step_matches_pytorch_sgd_nesterov_on_the_negated_gradient():
    # The original's claim: the step is SGD(nesterov=True, dampening=0) applied to −g, and trainers apply
    # θ_new = θ_prev + u. Check it over three rounds on float64.
    generator = torch.Generator().manual_seed(0)
    theta = torch.randn(4, dtype=torch.float64, generator=generator)
    parameter = torch.nn.Parameter(theta.clone())
    optimizer = torch.optim.SGD([parameter], lr=0.7, momentum=0.9, nesterov=True, dampening=0)
    momentum = None
    for _ in range(3):
        gradient = torch.randn(4, dtype=torch.float64, generator=generator)
        update, momentum = nesterov_step(
            gradient={"p": gradient}, momentum=momentum, learning_rate=0.7, momentum_factor=0.9
        )
        theta = theta + update["p"]
        parameter.grad = -gradient
        optimizer.step()
        torch.testing.assert_close(theta, parameter.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_nesterov_step_keeps_dtypes_and_does_not_mutate_or_alias_its_inputs(dtype):
    gradient = {"w": torch.tensor([0.5, -0.25], dtype=dtype)}
    momentum = {"w": torch.tensor([1.0, 2.0], dtype=dtype)}
    before = (clones(gradient), clones(momentum))

    update, new_momentum = nesterov_step(
        gradient=gradient, momentum=momentum, learning_rate=0.5, momentum_factor=0.5
    )

    assert update["w"].dtype == dtype
    assert new_momentum["w"].dtype == dtype
    # m = 0.5·[1, 2] + [0.5, −0.25] = [1, 0.75]; u = 0.5·(0.5·[1, 0.75] + [0.5, −0.25]) = [0.5, 0.0625]
    # (all exact in every dtype)
    assert torch.equal(new_momentum["w"], torch.tensor([1.0, 0.75], dtype=dtype))
    assert torch.equal(update["w"], torch.tensor([0.5, 0.0625], dtype=dtype))
    assert_states_equal(gradient, before[0])
    assert_states_equal(momentum, before[1])
    # the first round's m ← g is a copy, not the gradient itself
    _, first_momentum = nesterov_step(
        gradient=gradient, momentum=None, learning_rate=0.5, momentum_factor=0.5
    )
    assert first_momentum["w"].data_ptr() != gradient["w"].data_ptr()
    first_momentum["w"].add_(1)
    assert_states_equal(gradient, before[0])


def test_nesterov_step_refuses_a_momentum_that_does_not_match_and_bad_hyperparameters():
    gradient = {"a": torch.zeros(2), "b": torch.zeros(3)}
    with pytest.raises(TensorRefused, match="'b'.*shape"):
        nesterov_step(
            gradient=gradient,
            momentum={"a": torch.zeros(2), "b": torch.zeros(4)},
            learning_rate=0.1,
            momentum_factor=0.7,
        )
    with pytest.raises(TensorRefused, match="'a'.*dtype"):
        nesterov_step(
            gradient=gradient,
            momentum={"a": torch.zeros(2, dtype=torch.float64), "b": torch.zeros(3)},
            learning_rate=0.1,
            momentum_factor=0.7,
        )
    with pytest.raises(TensorRefused, match="'b'.*missing"):
        nesterov_step(
            gradient=gradient, momentum={"a": torch.zeros(2)}, learning_rate=0.1, momentum_factor=0.7
        )
    with pytest.raises(ValueError, match="learning_rate"):
        nesterov_step(gradient=gradient, momentum=None, learning_rate=float("inf"), momentum_factor=0.7)
    with pytest.raises(ValueError, match="momentum_factor"):
        nesterov_step(gradient=gradient, momentum=None, learning_rate=0.1, momentum_factor=1.0)


def test_take_gives_the_mean_once_computed_in_the_accumulator():
    mean = StreamingMean()
    mean.add({"w": torch.tensor([1.0, 2.0]), "h": torch.tensor([2.0], dtype=torch.float16)}, 1.0)
    mean.add({"w": torch.tensor([3.0, 6.0]), "h": torch.tensor([4.0], dtype=torch.float16)}, 3.0)
    expected = mean.result()

    taken = mean.take()

    assert torch.equal(taken["w"], expected["w"]) and taken["h"].dtype == torch.float16
    assert torch.equal(taken["h"], expected["h"])
    with pytest.raises(NoUpdatesError):
        mean.take()


# ---------------------------------------------------------------------------------- bounds on updates


def test_update_norm_is_the_l2_norm_of_all_floating_point_tensors_together():
    # sqrt(3² + 4² + 12²) = sqrt(169) = 13; the integer buffer is not part of it
    update = {
        "w": torch.tensor([3.0, 4.0]),
        "b": torch.tensor([12.0], dtype=torch.float64),
        "steps": torch.tensor([100], dtype=torch.int64),
        "empty": torch.zeros(0),
    }
    assert update_norm(update) == 13.0


def test_update_norm_is_summed_in_float64_so_finite_inputs_stay_finite():
    # float16 squares of 60000 overflow float16 (3.6e9 > 65504) but not float64: sqrt(2)·60000
    assert update_norm({"w": torch.tensor([6e4, 6e4], dtype=torch.float16)}) == pytest.approx(
        math.sqrt(2) * 60000, rel=1e-12
    )
    # float32's 1e38 squared is 1e76: sqrt(2)·1e38 (1e38 rounds to 9.99999968e37 in float32)
    one_e38 = float(torch.tensor(1e38))
    assert update_norm({"w": torch.tensor([1e38, 1e38])}) == pytest.approx(math.sqrt(2) * one_e38, rel=1e-12)
    # float64 1e200 squared is past float64's range
    assert update_norm({"w": torch.tensor([1e200, 1e200], dtype=torch.float64)}) == math.inf


def test_largest_magnitude():
    assert largest_magnitude(torch.tensor([-3.0, 2.0])) == 3.0
    assert largest_magnitude(torch.zeros(0)) == 0.0
    assert largest_magnitude(torch.tensor([-0.5, 0.25], dtype=torch.bfloat16)) == 0.5


@pytest.mark.parametrize(
    ("round_norms", "previous_norms", "fallback", "ratio", "expected"),
    [
        # medians 2 and 3.5: the larger, 3.5 · 10
        ([1.0, 2.0, 10.0], [3.0, 4.0], 99.0, 10.0, 35.0),
        # the round's median (6) is larger than the previous round's (1)
        ([5.0, 7.0], [1.0], 99.0, 2.0, 12.0),
        # one update so far: its norm is the round's median; no previous round
        ([0.5], [], 99.0, 10.0, 5.0),
        # a round with nothing accepted yet: the previous round's median
        ([], [1.0, 2.0, 4.0], 99.0, 3.0, 6.0),
        # nothing to compare with (the job's first update): the fallback (the global weights' norm)
        ([], [], 2.5, 10.0, 25.0),
        # a zero median is no reference
        ([0.0], [0.0, 0.0], 2.0, 4.0, 8.0),
        # nothing at all to measure against (an all-zero model's first update): no bound
        ([0.0], [], 0.0, 10.0, math.inf),
    ],
)
def test_norm_limit(round_norms, previous_norms, fallback, ratio, expected):
    assert norm_limit(round_norms, previous_norms, fallback=fallback, ratio=ratio) == expected


@pytest.mark.parametrize(("fallback", "ratio"), [(1.0, 1.0), (1.0, math.inf), (-1.0, 2.0), (math.nan, 2.0)])
def test_norm_limit_refuses_bad_arguments(fallback, ratio):
    with pytest.raises(ValueError):
        norm_limit([1.0], [], fallback=fallback, ratio=ratio)


def test_an_update_that_would_overflow_the_sum_is_refused_and_changes_nothing():
    # given: 1e38 with weight 1; float32's largest value is 3.4e38
    streaming = StreamingMean()
    streaming.add({"w": torch.tensor([1e38, 1.0])}, weight=1)

    # when: 1e38 with weight 3 would make the sum 4e38
    with pytest.raises(TensorRefused, match="'w' refused: weight 3 × its largest value .* float32 sum"):
        streaming.add({"w": torch.tensor([1e38, 1.0])}, weight=3)

    # then: the accumulator is as it was; 2e38 more (weight 2) still fits: (1e38 + 2e38) / 3 = 1e38
    assert (streaming.count, streaming.total_weight) == (1, 1.0)
    streaming.add({"w": torch.tensor([1e38, 4.0])}, weight=2)
    assert torch.equal(streaming.result()["w"], torch.tensor([1e38, 3.0]))


def test_a_refused_first_update_fixes_no_signature():
    streaming = StreamingMean()
    with pytest.raises(TensorRefused, match="overflow"):
        streaming.add({"w": torch.tensor([1e38])}, weight=1e9)

    streaming.add({"w": torch.tensor([1.0, 2.0])}, weight=2)  # another shape: the first one was not taken
    assert (streaming.count, streaming.total_weight) == (1, 2.0)
    assert torch.equal(streaming.result()["w"], torch.tensor([1.0, 2.0]))
