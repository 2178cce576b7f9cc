"""A replacement trainer is in step with the job (issue 13, finding 4), with real processes on loopback.

A trainer's daemon is killed after round 1; a spare daemon takes the role and trains the remaining rounds.
The job has a warm-up + cosine LR schedule: every trainer reports the lr of each round's first step with the
round's metrics, and the replacement's must be what the schedule gives at the job's step — not a fresh
warm-up. Its metrics land in the rounds it trained (no round's mean loss gets another round's values), the
control plane counts its rounds like the others', and it is told ``Done`` after the last round (exit 0).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import services_mode, small_training_job

pytestmark = pytest.mark.timeout(300)

ROUNDS = 5
INNER_STEPS = 6
LEARNING_RATE = 3e-3
SCHEDULE = {"type": "cosine", "warmup_steps": 8, "training_steps": ROUNDS * INNER_STEPS}


def scheduled_lr(step: int) -> float:
    """What the job's schedule gives at optimizer step ``step`` (0-based), computed as the executor does."""
    import torch
    import transformers

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LEARNING_RATE)
    schedule = transformers.get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps=SCHEDULE["warmup_steps"], num_training_steps=SCHEDULE["training_steps"]
    )
    for _ in range(step):
        optimizer.step()
        schedule.step()
    return optimizer.param_groups[0]["lr"]


def test_a_replacement_trainer_is_in_step_with_the_job(tmp_path: Path) -> None:
    from bench.cluster import training_cluster, worker_toml

    # given: a parameter-server daemon and three trainer daemons for a job of two trainers (one spare)
    dataset, spec = small_training_job(
        tmp_path,
        trainers=2,
        rounds=ROUNDS,
        inner_steps=INNER_STEPS,
        learning_rate=LEARNING_RATE,
        round_timeout=300.0,
        dedicated_parameter_server=True,
    )
    spec["inner_optimizer"]["schedule"] = SCHEDULE
    with training_cluster(
        root=tmp_path / "cluster",
        dataset_dir=dataset,
        workers=4,
        mode="services" if services_mode() else "embedded",
        settings={"HYPHA_LEASE_TTL": "5"},
        worker_tomls=[worker_toml(parameter_server_only=True, benchmark=False)]
        + [worker_toml(benchmark=False)] * 3,
    ) as cluster:
        job_id = cluster.submit(spec, name="e2e-replacement-in-step")

        # when: round 1 is done, one trainer's daemon is killed (its executor dies with it)
        deadline = time.monotonic() + 180
        job = cluster.job(job_id)
        while not any(round_["closed"] for round_ in job["rounds"]):
            alive = job["status"] not in ("completed", "failed", "cancelled")
            assert time.monotonic() < deadline and alive, (job["status_reason"], cluster.logs())
            time.sleep(0.3)
            job = cluster.job(job_id)
        trainers = {task["worker"]: task["worker_id"] for task in job["tasks"] if task["role"] == "trainer"}
        victim = sorted(trainers)[0]
        os.killpg(cluster.daemons[victim].popen.pid, signal.SIGKILL)

        # then: the job completes all its rounds
        job = cluster.follow(job_id, timeout=240)
        assert job["status"] == "completed", f"{job['status_reason']}\n{cluster.logs()}"

    rounds = job["rounds"]
    assert [round_["number"] for round_ in rounds] == list(range(1, ROUNDS + 1))
    tasks = [task for task in job["tasks"] if task["role"] == "trainer"]
    (spare,) = [task for task in tasks if task["worker"] not in trainers]
    spare_id = str(spare["worker_id"])
    survivor_id = next(str(worker_id) for name, worker_id in trainers.items() if name != victim)
    joined = [round_["number"] for round_ in rounds if spare_id in round_["participants"]]
    assert joined and joined == list(range(joined[0], ROUNDS + 1)), [r["participants"] for r in rounds]

    # (c) it was told Done after the last round: it exited by itself (0), counting every round of the job
    assert (spare["status"], spare["exit_code"], spare["round"]) == ("exited", 0, ROUNDS), spare

    for round_ in rounds:
        metrics = round_["trainer_metrics"]
        # (b) a round holds the metrics of the trainers that trained it, and its mean loss is theirs
        assert set(metrics) <= set(round_["participants"]) | {str(trainers[victim])}, round_
        assert (spare_id in metrics) == (round_["number"] in joined), round_
        assert survivor_id in metrics, round_
        losses = [entry["loss"] for entry in metrics.values()]
        assert round_["mean_loss"] == pytest.approx(sum(losses) / len(losses)), round_
        # (a) every trainer's lr at the round's first step is the schedule's at the job's step, the
        # replacement's too (a fresh schedule would give it the warm-up's first lr)
        expected = scheduled_lr((round_["number"] - 1) * INNER_STEPS)
        for peer, entry in metrics.items():
            assert entry["steps"] == INNER_STEPS, (round_["number"], peer, entry)
            assert entry["lr"] == pytest.approx(expected, rel=1e-6), (round_["number"], peer, entry)
    assert metrics[spare_id]["lr"] != pytest.approx(scheduled_lr(0), rel=1e-6)
