"""The trainer's LR schedule starts at the job's step (issue 13, finding 4): a replacement that joins after
some rounds does not warm up again from step 0.

The control plane dispatches every trainer with ``progress`` (``rounds`` closed, the job's ``steps``, and the
``steps_per_round``); a trainer whose fetched weights are from a later round (``hypha.round`` of the model
file) starts ``steps_per_round`` further per round. The real ``training_function`` runs in process against the
real bridge and a scripted backend, and reports the lr of each round's first step with the round's metrics.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .conftest import LEARNING_RATE, ScriptedTrainerBackend, running_bridge, train_job, update_bytes

SCHEDULES = [
    {"type": "cosine-with-warmup", "warmup_steps": 4, "training_steps": 30},
    {"type": "linear-with-warmup", "warmup_steps": 4, "training_steps": 30},
    {"type": "wsd", "warmup_steps": 4, "decay_steps": 10, "stable_steps": 8},
]


def with_schedule(schedule: dict[str, Any], progress: dict[str, Any] | None = None) -> dict[str, Any]:
    job = train_job()
    job["executor"]["config"]["scheduler"] = schedule
    if progress is not None:
        job["executor"]["config"]["progress"] = progress
    return job


def parsed(job: dict[str, Any]):
    from worker_daemon.executors.job import parse_job

    return parse_job(json.dumps(job))


def lrs_from_zero(schedule: dict[str, Any], steps: int) -> list[float]:
    """The lr of each of the first ``steps`` optimizer steps of a schedule started at step 0."""
    from worker_daemon.executors.training import make_lr_schedule

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LEARNING_RATE)
    lr_schedule = make_lr_schedule(optimizer, parsed(with_schedule(schedule)).config)
    values = []
    for _ in range(steps):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        lr_schedule.step()
    return values


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda schedule: schedule["type"])
@pytest.mark.parametrize("start", [0, 1, 5, 17])
def test_a_schedule_started_at_a_step_gives_what_the_schedule_gives_there(
    schedule: dict[str, Any], start: int
) -> None:
    from worker_daemon.executors.training import make_lr_schedule

    # given
    expected = lrs_from_zero(schedule, start + 6)[start:]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LEARNING_RATE)

    # when: the schedule starts at step ``start``
    lr_schedule = make_lr_schedule(optimizer, parsed(with_schedule(schedule)).config, start_step=start)
    values = []
    for _ in range(6):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        lr_schedule.step()

    # then: its steps' lrs are those of the schedule from step ``start`` on
    assert values == pytest.approx(expected, rel=1e-12, abs=0.0)


@pytest.mark.parametrize(
    ("progress", "rounds_completed", "expected"),
    [
        (None, None, 0),
        (None, 3, 0),
        ({"rounds": 2, "steps": 6, "steps_per_round": 3}, None, 6),
        ({"rounds": 2, "steps": 6, "steps_per_round": 3}, 2, 6),
        # the weights it fetched are a round newer than the rounds it was dispatched with
        ({"rounds": 2, "steps": 6, "steps_per_round": 3}, 3, 9),
        ({"rounds": 4, "steps": 27, "steps_per_round": 6.5}, 6, 40),
    ],
)
def test_the_job_step_a_trainer_starts_at(
    progress: dict[str, Any] | None, rounds_completed: int | None, expected: int
) -> None:
    from worker_daemon.executors.training import job_step

    config = parsed(with_schedule(SCHEDULES[0], progress)).config
    assert job_step(config, rounds_completed=rounds_completed) == expected


def test_a_malformed_progress_is_refused() -> None:
    from worker_daemon.executors.exceptions import JobConfigError

    with pytest.raises(JobConfigError, match="progress"):
        parsed(with_schedule(SCHEDULES[0], {"rounds": -1, "steps": 0, "steps_per_round": 3}))


def with_round_metadata(source: Path, target: Path, rounds_completed: int) -> Path:
    """A copy of the model directory ``source`` whose weights file says ``hypha.round`` like the parameter
    server's (no digest)."""
    shutil.copytree(source, target)
    path = target / "model.safetensors"
    with safe_open(str(path), framework="pt") as file:
        tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (safe_open is no dict)
        metadata = dict(file.metadata() or {})
    save_file(tensors, str(path), metadata={**metadata, "hypha.round": str(rounds_completed)})
    return target


@pytest.mark.parametrize(("model_round", "start"), [(None, 6), (3, 9)])
async def test_the_trainer_reports_the_lr_of_its_rounds_from_the_jobs_step(
    model_round: int | None, start: int, tiny_model, short_dir: Path, tmp_path: Path
) -> None:
    from worker_daemon.executors.training import EXIT_OK, parse_arguments, training_function

    # given: a job two rounds in (3 steps each), and the parameter server's model file after round 2 or 3
    schedule = SCHEDULES[0]
    job = with_schedule(schedule, {"rounds": 2, "steps": 6, "steps_per_round": 3})
    model_dir = tiny_model.directory
    if model_round is not None:
        model_dir = with_round_metadata(model_dir, tmp_path / "published", model_round)
    zero = {name: torch.zeros_like(tensor) for name, tensor in tiny_model.state.items()}
    backend = ScriptedTrainerBackend(model_dir=model_dir, updates=[update_bytes(zero)])
    job_json = json.dumps(job)
    arguments = parse_arguments(
        ["--socket", str(short_dir / "bridge.sock"), "--work-dir", str(short_dir), "--job", job_json]
    )

    # when
    async with running_bridge(short_dir, backend):
        code = await asyncio.to_thread(training_function, arguments, parsed(copy.deepcopy(job)))

    # then: round by round, the lr of its first step is the schedule's at the job's step
    assert code == EXIT_OK
    metrics = [progress["metrics"]["metrics"] for progress in backend.progress if "metrics" in progress]
    expected = lrs_from_zero(schedule, start + 4)
    assert [entry["lr"] for entry in metrics] == pytest.approx(
        [expected[start], expected[start + 3]], rel=1e-12
    )
    # and every step report carries the lr that step used (the job page's lr chart)
    steps = [progress["status"] for progress in backend.progress if "status" in progress]
    assert [step["lr"] for step in steps] == pytest.approx(
        lrs_from_zero(schedule, start + 6)[start:], rel=1e-12
    )
