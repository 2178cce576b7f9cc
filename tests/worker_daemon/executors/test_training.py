"""The trainer as a real subprocess against our real bridge (``serve_bridge``) and a scripted backend.

The run is replayed in this process (same model file, same slices, same AdamW, one thread, no dropout), so
the test can assert the executor's numbers, not just its shape: each reported loss, each pseudo-gradient
``θ_local − θ_global_prev``, and, through the first loss of round 2, that the merge loaded ``θ_prev + u``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from .conftest import (
    BATCH_SIZE,
    LEARNING_RATE,
    REPOSITORY,
    SEQUENCE_LENGTH,
    ScriptedTrainerBackend,
    TinyModel,
    executor_environment,
    huggingface_model,
    make_slice,
    make_update,
    run_executor,
    running_bridge,
    train_job,
    update_bytes,
)

STEPS_PER_ROUND = 3
ROUND_SEQUENCE = ["status"] * STEPS_PER_ROUND + ["update", "metrics", "update-received"]
TIED = "transformer.wte.weight"
"""Stored under ``lm_head.weight`` (the smaller name), listed as an alias."""


def kind(progress: object) -> str:
    if isinstance(progress, dict):
        return next(iter(progress))
    return str(progress)


def batches() -> Iterator[dict[str, torch.Tensor]]:
    """The batches the executor sees: samples of slices 0, 1, 2, … in order, BATCH_SIZE at a time."""
    samples: list[dict[str, torch.Tensor]] = []
    index = 0
    while True:
        columns = make_slice(index)
        index += 1
        samples.extend(
            {name: tensor[i] for name, tensor in columns.items()} for i in range(len(columns["labels"]))
        )
        while len(samples) >= BATCH_SIZE:
            batch, samples = samples[:BATCH_SIZE], samples[BATCH_SIZE:]
            yield {name: torch.stack([sample[name] for sample in batch]) for name in batch[0]}


def replay(
    tiny_model: TinyModel, updates: list[dict[str, torch.Tensor]]
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """The losses and pseudo-gradients a correct trainer produces over ``len(updates)`` rounds."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the executor runs with OMP_NUM_THREADS=1: same reduction order
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_model.directory)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        stream = batches()
        floats = lambda: {n: t for n, t in model.state_dict().items() if t.dtype.is_floating_point}  # noqa: E731
        global_previous = {name: tensor.clone() for name, tensor in floats().items()}
        losses: list[float] = []
        deltas: list[dict[str, torch.Tensor]] = []
        for update in updates:
            for _ in range(STEPS_PER_ROUND):
                batch = next(stream)
                loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            deltas.append({name: tensor - global_previous[name] for name, tensor in floats().items()})
            global_previous = {name: global_previous[name] + update[name] for name in global_previous}
            with torch.no_grad():
                for name, tensor in floats().items():
                    tensor.copy_(global_previous[name])
        return losses, deltas
    finally:
        torch.set_num_threads(threads)


def known_updates(tiny_model: TinyModel) -> list[dict[str, torch.Tensor]]:
    return [make_update(tiny_model.state, seed=1), make_update(tiny_model.state, seed=2)]


async def test_two_rounds_against_the_real_bridge(tiny_model: TinyModel, short_dir: Path) -> None:
    # given
    updates = known_updates(tiny_model)
    backend = ScriptedTrainerBackend(
        model_dir=tiny_model.directory, updates=[update_bytes(u) for u in updates]
    )
    job = train_job()

    # when
    async with running_bridge(short_dir, backend):
        run = await run_executor(work_dir=short_dir, job=job)

    # then: a clean exit after exactly the scripted protocol
    assert run.returncode == 0, run.stdout + run.stderr
    assert [kind(progress) for progress in backend.progress] == ROUND_SEQUENCE * 2
    assert backend.receive_calls == 1
    assert backend.fetches[0] == job["executor"]["config"]["model"]["artifact"]
    assert {fetch["type"] for fetch in backend.fetches[1:]} == {"scheduler"}
    assert len(backend.slices_served) >= 5  # 24 samples from slices of 5: batches spanned slices

    statuses = [progress["status"] for progress in backend.progress if kind(progress) == "status"]
    assert [status["batch_size"] for status in statuses] == [BATCH_SIZE] * 6
    assert all(math.isfinite(status["loss"]) and status["step_time"] > 0 for status in statuses)
    assert [status["tokens"] for status in statuses] == [BATCH_SIZE * SEQUENCE_LENGTH] * 6
    assert [status["lr"] for status in statuses] == [LEARNING_RATE] * 6  # no schedule: constant

    # the numbers: losses and pseudo-gradients of a correct trainer, replayed here
    expected_losses, expected_deltas = replay(tiny_model, updates)
    assert [status["loss"] for status in statuses] == pytest.approx(expected_losses, rel=1e-5)
    # round 2's first loss is computed before its first optimizer step: on exactly θ_0 + u_1
    assert statuses[3]["loss"] == pytest.approx(expected_losses[3], rel=1e-6)

    float_names = sorted(name for name, tensor in tiny_model.state.items() if tensor.dtype.is_floating_point)
    assert len(backend.sent) == 2
    for sent, expected in zip(backend.sent, expected_deltas, strict=True):
        assert sent.stored_names == [name for name in float_names if name != TIED]
        assert sent.metadata["hypha.aliases"] == '{"transformer.wte.weight": "lm_head.weight"}'
        assert sorted(sent.tensors) == float_names
        assert sent.tensors[TIED] is sent.tensors["lm_head.weight"]
        for name in float_names:
            torch.testing.assert_close(sent.tensors[name], expected[name], rtol=0, atol=1e-6)
    assert [path.name for path in (short_dir / "updates").iterdir()] == ["2.safetensors"]

    metrics = [progress["metrics"] for progress in backend.progress if kind(progress) == "metrics"]
    assert [m["round"] for m in metrics] == [1, 2]
    for number, m in enumerate(metrics):
        round_losses = [status["loss"] for status in statuses[number * 3 : number * 3 + 3]]
        assert m["metrics"]["loss"] == pytest.approx(sum(round_losses) / 3, rel=1e-9)
        assert m["metrics"]["steps"] == 3.0
        assert m["metrics"]["samples"] == 12.0
        assert m["metrics"]["samples_per_second"] > 0
        round_step_times = [status["step_time"] for status in statuses[number * 3 : number * 3 + 3]]
        assert m["metrics"]["train_seconds"] == pytest.approx(sum(round_step_times), rel=1e-9)
        # throughput (issue 17): the round's tokens and tokens/s of train time; on CPU no peak device memory,
        # and no MFU (a CPU's peak FLOPS is unknown)
        assert m["metrics"]["tokens"] == 3.0 * BATCH_SIZE * SEQUENCE_LENGTH
        assert m["metrics"]["tokens_per_second"] == pytest.approx(
            m["metrics"]["tokens"] / m["metrics"]["train_seconds"], rel=1e-9
        )
        assert "peak_memory_bytes" not in m["metrics"] and "mfu" not in m["metrics"]

    assert "round 1: 3 steps" in run.stdout
    assert "round 2: 3 steps" in run.stdout
    assert "done after 2 rounds" in run.stdout
    # no warning of transformers' about the loss fills every trainer's log (issue 16, item 8)
    assert "loss_type=" not in run.stdout + run.stderr


@pytest.mark.skipif(
    os.environ.get("HYPHA_ACCELERATE_TESTS") != "1",
    reason="accelerate launch starts two interpreters that each import torch: 18-28 s on 2 cores; "
    "set HYPHA_ACCELERATE_TESTS=1 to run it",
)
async def test_runs_under_accelerate_launch(tiny_model: TinyModel, short_dir: Path) -> None:
    # given
    updates = known_updates(tiny_model)
    backend = ScriptedTrainerBackend(
        model_dir=tiny_model.directory, updates=[update_bytes(u) for u in updates]
    )

    # when
    async with running_bridge(short_dir, backend):
        run = await run_executor(
            work_dir=short_dir, job=train_job(model_reference=huggingface_model()), launcher="accelerate"
        )

    # then
    assert run.returncode == 0, run.stdout + run.stderr
    assert [kind(progress) for progress in backend.progress] == ROUND_SEQUENCE * 2
    assert len(backend.sent) == 2
    # every value accelerate would otherwise warn about was passed (issue 16, item 8)
    assert "were not passed to `accelerate launch`" not in run.stdout + run.stderr


async def test_a_refused_update_stops_training_before_update_received(
    tiny_model: TinyModel, short_dir: Path, tmp_path: Path
) -> None:
    """In process (a subprocess costs seconds of imports): the same ``training_function`` ``main`` runs."""
    from worker_daemon.executors.exceptions import UpdateError
    from worker_daemon.executors.job import parse_job
    from worker_daemon.executors.training import parse_arguments, training_function

    # given: the parameter server's answer has a tensor of the wrong shape (and no alias table)
    bad = {
        name: torch.zeros_like(tensor)
        for name, tensor in tiny_model.state.items()
        if tensor.dtype.is_floating_point
    }
    bad["transformer.ln_f.weight"] = torch.zeros(3)
    save_file(bad, str(tmp_path / "bad.safetensors"))
    backend = ScriptedTrainerBackend(
        model_dir=tiny_model.directory, updates=[(tmp_path / "bad.safetensors").read_bytes()]
    )
    job_json = json.dumps(train_job())
    arguments = parse_arguments(
        ["--socket", str(short_dir / "bridge.sock"), "--work-dir", str(short_dir), "--job", job_json]
    )

    # when / then: it says which tensor, and never claims to have merged
    async with running_bridge(short_dir, backend):
        with pytest.raises(UpdateError, match="transformer.ln_f.weight") as raised:
            await asyncio.to_thread(training_function, arguments, parse_job(job_json))
    assert raised.value.exit_code == 5
    assert [kind(progress) for progress in backend.progress] == ROUND_SEQUENCE[:-1]


def test_a_malformed_job_exits_4_without_importing_torch(tmp_path: Path) -> None:
    # given a job that is not a train envelope
    job = json.dumps({"job_id": "x", "executor": {"class": "aggregate", "config": {}}})
    probe = (
        "import sys, runpy\n"
        "try:\n"
        "    runpy.run_module('worker_daemon.executors.training', run_name='__main__')\n"
        "except SystemExit as exit_request:\n"
        "    print('torch imported:', 'torch' in sys.modules)\n"
        "    raise\n"
    )

    # when
    run = subprocess.run(
        [sys.executable, "-c", probe, "--socket", "s", "--work-dir", str(tmp_path), "--job", job],
        capture_output=True,
        text=True,
        timeout=30,
        env=executor_environment(),
        cwd=REPOSITORY,
    )

    # then
    assert run.returncode == 4, run.stdout + run.stderr
    assert "this executor runs train jobs, not 'aggregate'" in run.stdout
    assert "torch imported: False" in run.stdout


def test_help_is_fast() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "worker_daemon.executors.training", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env=executor_environment(),
        cwd=REPOSITORY,
    )
    assert run.returncode == 0
    assert "--socket" in run.stdout and "SOCKET_PATH" in run.stdout


def test_the_loaded_model_does_not_share_memory_with_its_file(tiny_model: TinyModel, tmp_path: Path) -> None:
    """``from_pretrained`` maps the safetensors file privately; rewriting that file in place (truncate, write)
    would otherwise replace even weights training already changed with the file's new contents."""
    import shutil

    from transformers import AutoModelForCausalLM

    from worker_daemon.executors.training import _own_memory

    # given: a model loaded from a file, then changed (as an optimizer step changes it)
    directory = tmp_path / "artifacts"
    shutil.copytree(tiny_model.directory, directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    _own_memory(model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5)
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}

    # when: the file is rewritten in place with other weights
    other = tmp_path / "other"
    shutil.copytree(tiny_model.directory, other)
    shifted = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
    with torch.no_grad():
        for parameter in shifted.parameters():
            parameter.add_(3.0)
    shifted.save_pretrained(other)
    shutil.copyfile(other / "model.safetensors", directory / "model.safetensors")

    # then: the live weights are what training made them, and tied weights are still tied
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert model.lm_head.weight is model.transformer.wte.weight


def transformers_warnings(action) -> list[str]:
    """The warnings transformers logs while ``action()`` runs (its once-only warnings included)."""
    import logging

    import transformers

    transformers.utils.logging.warning_once.cache_clear()
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    try:
        action()
    finally:
        library.removeHandler(handler)
    return records


def test_a_model_loaded_as_the_trainer_does_trains_without_a_loss_type_warning(tiny_model: TinyModel) -> None:
    """GPT-2's class name matches none of transformers' loss names: unnamed, every forward with labels warns
    "`loss_type=None` was set in the config but it is unrecognized" (issue 16, item 8)."""
    from transformers import AutoModelForCausalLM

    from worker_daemon.executors.job import set_loss_type

    batch = torch.randint(0, 16, (2, 8))

    def forward(model) -> None:
        model(input_ids=batch, labels=batch).loss.backward()

    # given: the model as transformers loads it warns (the capture sees the warning)
    bare = AutoModelForCausalLM.from_pretrained(tiny_model.directory, dtype=torch.float32)
    assert any("loss_type=None" in message for message in transformers_warnings(lambda: forward(bare)))

    # when: it is loaded as the trainer loads it
    model = AutoModelForCausalLM.from_pretrained(tiny_model.directory, dtype=torch.float32)
    set_loss_type(model, "AutoModelForCausalLM")

    # then: the loss is the same and nothing is warned
    assert model.loss_type == "ForCausalLM"
    assert not [m for m in transformers_warnings(lambda: forward(model)) if "loss_type" in m]
    assert torch.equal(model(input_ids=batch, labels=batch).loss, bare(input_ids=batch, labels=batch).loss)
    # a task transformers has no loss of its own for is left as it is
    other = AutoModelForCausalLM.from_pretrained(tiny_model.directory, dtype=torch.float32)
    set_loss_type(other, "AutoModelForTextEncoding")
    assert other.loss_type is None
