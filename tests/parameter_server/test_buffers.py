"""Floating-point buffers (BatchNorm's running statistics) are averaged, never stepped (issue 13, finding 2),
and an eval loss that is not finite is reported as such, not as a silent null."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch
from torch.testing import assert_close

from parameter_server.evaluation import Evaluator
from parameter_server.exceptions import EvalNotFinite, TensorRefused
from parameter_server.job import EvalConfig, JobConfig, parse_job
from parameter_server.math import nesterov_step
from parameter_server.model import prepare_model
from parameter_server.rounds import RoundCoordinator
from tests.parameter_server.conftest import ALICE, BOB, aggregate_job

RUNNING_VAR = "bn.running_var"
STEPS = "bn.num_batches_tracked"

#: A ResNet of two stages of width 8 and 16 (BatchNorm after every convolution): 6k parameters.
TINY_RESNET = {
    "model_type": "resnet",
    "num_channels": 3,
    "embedding_size": 8,
    "hidden_sizes": [8, 16],
    "depths": [1, 1],
    "layer_type": "basic",
    "num_labels": 3,
}


def resnet_job() -> JobConfig:
    job = parse_job(aggregate_job(peers=[ALICE, BOB], source={"type": "config", "config": dict(TINY_RESNET)}))
    return dataclasses.replace(job, task="image-classification", input_names=("pixel_values", "labels"))


def coordinator(**overrides) -> RoundCoordinator:
    arguments = {
        "expected": [ALICE, BOB],
        "weights": {
            "w": torch.tensor([1.0, 2.0]),
            RUNNING_VAR: torch.tensor([1.0, 1.0]),
            STEPS: torch.tensor(5, dtype=torch.int64),
        },
        "momentum": None,
        "rounds_completed": 0,
        "update_rounds": 3,
        "round_timeout": 30.0,
        "weighted": True,
        # The defaults of a job: at these, Nesterov turns running_var 1.0 → mean 0.008 into −0.32.
        "learning_rate": 0.7,
        "momentum_factor": 0.9,
        "buffers": {RUNNING_VAR},
    }
    arguments.update(overrides)
    return RoundCoordinator(**arguments)


def sent(w: list[float], running_var: list[float], previous_var: list[float]) -> dict[str, torch.Tensor]:
    """A trainer's delta whose local running_var is ``running_var`` (the global one was ``previous_var``)."""
    return {
        "w": torch.tensor(w),
        RUNNING_VAR: torch.tensor(running_var) - torch.tensor(previous_var),
        STEPS: torch.tensor(9, dtype=torch.int64),
    }


async def next_published(rounds: RoundCoordinator):
    return await asyncio.wait_for(rounds.published.get(), 5)


def test_nesterov_step_averages_buffers_and_gives_them_no_momentum():
    gradient = {"w": torch.tensor([0.5]), RUNNING_VAR: torch.tensor([-0.992])}

    update, momentum = nesterov_step(
        gradient=gradient, momentum=None, learning_rate=0.7, momentum_factor=0.9, averaged={RUNNING_VAR}
    )

    # w: u = lr·(1 + μ)·g = 1.33·0.5; running_var: u = g, θ ← θ + mean(delta) = the trainers' mean
    assert_close(update["w"], torch.tensor([0.665]))
    assert_close(update[RUNNING_VAR], torch.tensor([-0.992]))
    assert sorted(momentum) == ["w"]

    # a later round: momentum for w only; a momentum naming a buffer (a checkpoint of an older server) is
    # ignored for it rather than refused
    update, momentum = nesterov_step(
        gradient={"w": torch.tensor([0.1]), RUNNING_VAR: torch.tensor([0.25])},
        momentum={"w": torch.tensor([0.5]), RUNNING_VAR: torch.tensor([-0.992])},
        learning_rate=0.7,
        momentum_factor=0.9,
        averaged={RUNNING_VAR},
    )
    assert_close(update[RUNNING_VAR], torch.tensor([0.25]))
    assert_close(momentum["w"], torch.tensor([0.55]))
    assert_close(update["w"], torch.tensor([0.7 * (0.9 * 0.55 + 0.1)]))
    assert sorted(momentum) == ["w"]


def test_nesterov_step_still_refuses_a_momentum_without_a_parameter():
    with pytest.raises(TensorRefused, match="'w'"):
        nesterov_step(
            gradient={"w": torch.tensor([0.1]), RUNNING_VAR: torch.tensor([0.25])},
            momentum={RUNNING_VAR: torch.tensor([0.0])},
            learning_rate=0.7,
            momentum_factor=0.9,
            averaged={RUNNING_VAR},
        )


async def test_a_round_sets_running_statistics_to_the_trainers_sample_weighted_mean():
    # given: the numbers, running_var 1.0 and trainers whose local running_var is ≈ 0.008
    rounds = coordinator()

    # when
    await rounds.submit(ALICE, 1, sent([0.2, -0.4], [0.004, 0.010], [1.0, 1.0]), samples=1)
    await rounds.submit(BOB, 1, sent([0.6, 0.0], [0.0093, 0.002], [1.0, 1.0]), samples=3)
    result = await next_published(rounds)

    # then: running_var = (1·alice + 3·bob)/4, positive; w takes the Nesterov step; no buffer momentum
    expected_var = torch.tensor([(0.004 + 3 * 0.0093) / 4, (0.010 + 3 * 0.002) / 4])
    assert_close(rounds.weights[RUNNING_VAR], expected_var)
    assert bool((rounds.weights[RUNNING_VAR] > 0).all())
    assert_close(result.update[RUNNING_VAR], expected_var - 1.0)
    assert_close(rounds.weights["w"], torch.tensor([1.0, 2.0]) + 1.33 * torch.tensor([0.5, -0.1]))
    assert sorted(rounds.momentum) == ["w"]
    assert torch.equal(rounds.weights[STEPS], torch.tensor(5))

    # when: round 2, both trainers end at running_var 0.02 (from the global value they merged)
    previous = rounds.weights[RUNNING_VAR].tolist()
    await rounds.submit(ALICE, 2, sent([0.1, 0.1], [0.02, 0.02], previous), samples=2)
    await rounds.submit(BOB, 2, sent([0.1, 0.1], [0.02, 0.02], previous), samples=2)
    await next_published(rounds)

    # then: exactly their value, no momentum carried over from round 1's big change
    assert_close(rounds.weights[RUNNING_VAR], torch.tensor([0.02, 0.02]))


def test_the_initial_model_names_its_floating_point_buffers(tmp_path):
    initial = prepare_model(resnet_job(), tmp_path)

    buffers = {name for name in initial.weights if name.endswith((".running_mean", ".running_var"))}
    assert len(buffers) == 12  # 6 BatchNorms (one in the shortcut of the second stage)
    assert initial.buffers == frozenset(buffers)  # num_batches_tracked is an integer buffer: not averaged
    assert all(initial.weights[name].dtype == torch.float32 for name in buffers)


def test_a_model_with_negative_running_variance_has_a_non_finite_eval_loss(tmp_path):
    # given: the tiny ResNet after the round (running_var 1.0 → −0.32) and an eval set
    initial = prepare_model(resnet_job(), tmp_path)
    weights = dict(initial.weights)
    for name in initial.buffers:
        if name.endswith("running_var"):
            weights[name] = torch.full_like(weights[name], -0.32)
    evaluator = Evaluator(
        config=EvalConfig(dataset="images", batch_size=4, slices=()),
        input_names=("pixel_values", "labels"),
        cache_dir=tmp_path / "eval",
    )
    generator = torch.Generator().manual_seed(0)
    evaluator._data = {
        "pixel_values": torch.randn(6, 3, 8, 8, generator=generator),
        "labels": torch.tensor([0, 1, 2, 0, 1, 2]),
    }

    # when / then: said, not returned as None
    with pytest.raises(EvalNotFinite, match="nan"):
        evaluator.loss(initial.model, weights)
    # and the healthy weights give a finite loss
    assert math.isfinite(evaluator.loss(initial.model, initial.weights))
