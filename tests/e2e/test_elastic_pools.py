"""An elastic trainer pool with real processes (docs/training.md, "Elastic pools").

A job of ``trainers = {min = 2, target = 3}`` is submitted while only two trainer daemons are up: it starts
training with those two and goes on advertising for a third. A third daemon connects: it takes the role,
fetches the current global weights and the job's step, and trains in the following rounds. One of the first
two is then killed: the job goes on with two (its min) and completes every round; no round counts a trainer's
update twice.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import only_in_mode, services_mode, small_training_job

pytestmark = pytest.mark.timeout(300)

ROUNDS = 6
INNER_STEPS = 10


def wait_for(cluster, job_id: str, condition, what: str, *, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    job = cluster.job(job_id)
    while not condition(job):
        alive = job["status"] not in ("completed", "failed", "cancelled")
        assert time.monotonic() < deadline and alive, (what, job["status_reason"], cluster.logs())
        time.sleep(0.3)
        job = cluster.job(job_id)
    return job


def trainer_tasks(job: dict) -> list[dict]:
    return [task for task in job["tasks"] if task["role"] == "trainer"]


@only_in_mode("embedded", "the pool is the control plane's allocation logic, the same in both modes")
def test_a_pool_starts_at_min_grows_when_a_daemon_connects_and_survives_losing_one(tmp_path: Path) -> None:
    from bench.cluster import training_cluster, worker_toml

    dataset, spec = small_training_job(
        tmp_path,
        trainers=3,
        rounds=ROUNDS,
        inner_steps=INNER_STEPS,
        round_timeout=120.0,
        dedicated_parameter_server=True,
    )
    del spec["num_trainers"]
    spec["trainers"] = {"min": 2, "target": 3}
    with training_cluster(
        root=tmp_path / "cluster",
        dataset_dir=dataset,
        workers=4,
        mode="services" if services_mode() else "embedded",
        # A short TTL notices the death soon; a short backoff re-advertises to the late daemon soon.
        settings={"HYPHA_LEASE_TTL": "5", "HYPHA_READVERTISE_MAX": "2"},
        worker_tomls=[worker_toml(parameter_server_only=True, benchmark=False)]
        + [worker_toml(benchmark=False)] * 3,
    ) as cluster:
        # given: the third trainer daemon is not up when the job is submitted
        late = "worker-4"
        cluster.daemons[late].signal(signal.SIGTERM)
        cluster.daemons[late].popen.wait(60)
        job_id = cluster.submit(spec, name="e2e-elastic-pool")

        # then: it trains with two
        job = wait_for(
            cluster,
            job_id,
            lambda job: any(task["steps_total"] > 0 for task in trainer_tasks(job)),
            "two trainers training",
        )
        first = {task["worker"]: str(task["worker_id"]) for task in trainer_tasks(job)}
        assert len(first) == 2 and late not in first, first

        # when: the third daemon connects
        cluster.restart_daemon(late)

        # then: it joins and is counted in a closed round with the other two
        job = wait_for(
            cluster,
            job_id,
            lambda job: any(
                len(set(round_["participants"])) == 3 and round_["closed"] for round_ in job["rounds"]
            ),
            "a round with three trainers",
            timeout=150.0,
        )
        newcomer = next(str(task["worker_id"]) for task in trainer_tasks(job) if task["worker"] == late)
        joined_at = max(round_["number"] for round_ in job["rounds"] if round_["closed"])
        assert joined_at < ROUNDS, "the job ended before a trainer could be lost"

        # when: one of the first two is killed
        victim = sorted(first)[0]
        os.killpg(cluster.daemons[victim].popen.pid, signal.SIGKILL)

        # then: the job goes on with two and completes
        job = cluster.follow(job_id, timeout=240)
        assert job["status"] == "completed", f"{job['status_reason']}\n{cluster.logs()}"

    rounds = job["rounds"]
    assert [round_["number"] for round_ in rounds] == list(range(1, ROUNDS + 1))
    assert all(round_["closed"] for round_ in rounds)
    # no round counts a trainer's update twice
    for round_ in rounds:
        assert len(round_["participants"]) == len(set(round_["participants"])), round_
    survivor = next(worker_id for name, worker_id in first.items() if name != victim)
    assert sorted(rounds[-1]["participants"]) == sorted([survivor, newcomer]), rounds[-1]
    assert set(rounds[0]["participants"]) <= set(first.values()), rounds[0]
    lost = next(task for task in trainer_tasks(job) if task["worker"] == victim)
    assert lost["status"] == "cancelled", lost
