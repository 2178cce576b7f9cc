"""The trainer applies the training knobs (docs/configuration.md, "Training knobs"): ``training_function`` in
this process (a subprocess costs seconds of imports) against our real bridge and a scripted backend, its
numbers checked against a replay in plain torch that does by hand what each knob means."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from .conftest import (
    LEARNING_RATE,
    ScriptedTrainerBackend,
    TinyModel,
    make_update,
    running_bridge,
    train_job,
    update_bytes,
)
from .test_training import STEPS_PER_ROUND, batches, kind

KNOBS = {"max_grad_norm": 0.05, "gradient_accumulation_steps": 2, "gradient_checkpointing": True}
WEIGHT_DECAY = 0.1


@pytest.fixture(autouse=True)
def fresh_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def knobbed_job(**training: object) -> dict:
    job = train_job()
    config = job["executor"]["config"]
    config["training"] = training
    config["optimizer"] = {**config["optimizer"], "weight-decay": WEIGHT_DECAY}
    return job


def replay(
    tiny_model: TinyModel, *, clip: float | None = KNOBS["max_grad_norm"], decay: float = WEIGHT_DECAY
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Round 1's losses and pseudo-gradient with the knobs done by hand: 2 micro-batches of 2 per step, each
    loss halved, the summed gradient clipped to ``clip``, AdamW with weight decay ``decay``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model.directory)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=decay)
    start = {
        name: tensor.clone() for name, tensor in model.state_dict().items() if tensor.dtype.is_floating_point
    }
    stream = batches()
    losses = []
    for _ in range(STEPS_PER_ROUND):
        batch = next(stream)
        micro_losses = []
        for half in range(2):
            micro = {name: tensor[half * 2 : half * 2 + 2] for name, tensor in batch.items()}
            loss = model(**micro).loss
            (loss / 2).backward()
            micro_losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(micro_losses) / 2)
    state = model.state_dict()
    return losses, {name: state[name] - start[name] for name in start}


async def run_in_process(short_dir: Path, backend: ScriptedTrainerBackend, job: dict) -> None:
    from worker_daemon.executors.job import parse_job
    from worker_daemon.executors.training import parse_arguments, training_function

    job_json = json.dumps(job)
    arguments = parse_arguments(
        ["--socket", str(short_dir / "bridge.sock"), "--work-dir", str(short_dir), "--job", job_json]
    )
    async with running_bridge(short_dir, backend):
        await asyncio.to_thread(training_function, arguments, parse_job(job_json))


async def test_a_round_with_the_knobs_is_the_round_they_describe(
    tiny_model: TinyModel, short_dir: Path
) -> None:
    backend = ScriptedTrainerBackend(
        model_dir=tiny_model.directory,
        updates=[update_bytes(make_update(tiny_model.state, seed=1))],
        rounds=1,
    )

    await run_in_process(short_dir, backend, knobbed_job(**KNOBS))

    statuses = [progress["status"] for progress in backend.progress if kind(progress) == "status"]
    statuses = statuses[:STEPS_PER_ROUND]  # round 1
    expected_losses, expected_delta = replay(tiny_model)
    # One status per batch of 4 (not per micro-batch), its loss the mean of the micro-batches'.
    assert [status["batch_size"] for status in statuses] == [4] * STEPS_PER_ROUND
    assert [status["loss"] for status in statuses] == pytest.approx(expected_losses, rel=1e-4)
    sent = backend.sent[0]
    for name, delta in expected_delta.items():
        torch.testing.assert_close(sent.tensors[name], delta, rtol=1e-3, atol=2e-6)
    # and the check can tell: without the clipping, or without the decay, the update is another
    for other in (replay(tiny_model, clip=None)[1], replay(tiny_model, decay=0.0)[1]):
        differences = [float((sent.tensors[name] - other[name]).abs().max()) for name in other]
        assert max(differences) > 1e-5


async def test_fp16_on_a_machine_without_cuda_fails_the_task_with_the_reason(
    tiny_model: TinyModel, short_dir: Path
) -> None:
    from worker_daemon.executors.exceptions import JobConfigError

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: fp16 runs")
    backend = ScriptedTrainerBackend(model_dir=tiny_model.directory, updates=[])

    with pytest.raises(JobConfigError, match="fp16 needs a CUDA GPU and this worker has none"):
        await run_in_process(short_dir, backend, knobbed_job(mixed_precision="fp16"))
    assert backend.progress == []
