"""The trainer run by a warm spare (``python -m worker_daemon.warm``, the daemon's pre-started interpreter) trains
exactly as the trainer in a cold interpreter: the same two scripted rounds against the real bridge give the same
losses, the same pseudo-gradients (bit for bit) and the same protocol — the spare's imports and its tiny model
leave no trace in torch's RNG or the trainer's numbers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from .conftest import (
    EXECUTOR_TIMEOUT,
    REPOSITORY,
    ExecutorRun,
    ScriptedTrainerBackend,
    TinyModel,
    executor_environment,
    make_update,
    run_executor,
    running_bridge,
    train_job,
    update_bytes,
)

#: A spare's imports on 2 shared cores: 5-15 s.
WARM_TIMEOUT = 180.0
#: What differs between two correct runs: the clock.
TIMING_KEYS = {"step_time", "samples_per_second", "tokens_per_second", "train_seconds"}


async def run_in_a_warm_spare(*, work_dir: Path, job: dict) -> ExecutorRun:
    """Start a spare, wait until its imports are done, hand it the trainer's command; always reaped."""
    read_end, write_end = os.pipe()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "worker_daemon.warm", "--ready-fd", str(write_end), "--runtime", "trainer"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=executor_environment(),
        cwd=str(REPOSITORY),
        pass_fds=(write_end,),
        start_new_session=True,
    )
    os.close(write_end)
    argv = [
        sys.executable,
        "-m",
        "worker_daemon.executors.training",
        "--socket",
        str(work_dir / "bridge.sock"),
    ]
    argv += ["--work-dir", str(work_dir), "--job", json.dumps(job, separators=(",", ":"))]
    task = {"argv": argv, "env": executor_environment(), "cwd": str(REPOSITORY)}
    try:
        ready = await asyncio.wait_for(asyncio.to_thread(os.read, read_end, 65536), WARM_TIMEOUT)
        assert json.loads(ready)["failed"] is None, ready
        started = time.perf_counter()
        stdout, stderr = await asyncio.wait_for(
            process.communicate((json.dumps(task) + "\n").encode()), EXECUTOR_TIMEOUT
        )
    finally:
        os.close(read_end)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
    return ExecutorRun(
        returncode=process.returncode,
        stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace"),
        seconds=time.perf_counter() - started,
    )


def without_timings(value: object) -> object:
    if isinstance(value, dict):
        return {key: without_timings(item) for key, item in value.items() if key not in TIMING_KEYS}
    if isinstance(value, list):
        return [without_timings(item) for item in value]
    return value


async def test_a_warm_spare_trains_exactly_as_a_cold_interpreter(
    tiny_model: TinyModel, short_dir: Path
) -> None:
    # given: the same two scripted rounds for a cold trainer and a warm one
    updates = [make_update(tiny_model.state, seed=1), make_update(tiny_model.state, seed=2)]
    job = train_job()
    backends: dict[str, ScriptedTrainerBackend] = {}
    runs: dict[str, ExecutorRun] = {}

    # when
    for how in ("cold", "warm"):
        work_dir = short_dir / how
        work_dir.mkdir()
        backends[how] = ScriptedTrainerBackend(
            model_dir=tiny_model.directory, updates=[update_bytes(update) for update in updates]
        )
        async with running_bridge(work_dir, backends[how]):
            if how == "cold":
                runs[how] = await run_executor(work_dir=work_dir, job=job)
            else:
                runs[how] = await run_in_a_warm_spare(work_dir=work_dir, job=job)

    # then: both finished, with the same reports (losses, steps, samples) and the same pseudo-gradients
    cold, warm = backends["cold"], backends["warm"]
    assert runs["cold"].returncode == 0, runs["cold"].stdout + runs["cold"].stderr
    assert runs["warm"].returncode == 0, runs["warm"].stdout + runs["warm"].stderr
    assert len(cold.progress) > 6 and without_timings(warm.progress) == without_timings(cold.progress)
    assert len(warm.sent) == len(cold.sent) == 2
    for warm_sent, cold_sent in zip(warm.sent, cold.sent, strict=True):
        assert warm_sent.stored_names == cold_sent.stored_names
        assert sorted(warm_sent.tensors) == sorted(cold_sent.tensors)
        for name, tensor in cold_sent.tensors.items():
            assert torch.equal(warm_sent.tensors[name], tensor), name
