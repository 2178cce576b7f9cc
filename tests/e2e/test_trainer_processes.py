"""One trainer, several processes, end to end (docs/training.md, "One trainer, several processes"): a DiLoCo
job whose one trainer runs as two processes (``training.processes = 2``, gloo on the CPU), on real processes:
control plane, data node, daemons, parameter server. The job must complete with the trainer's one update a
round, its two ranks both training (rank 1's lines in the daemon's log), and the task exiting 0."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.e2e.conftest import only_in_mode, services_mode, small_training_job

pytestmark = [
    pytest.mark.timeout(300),
    only_in_mode(
        "embedded", "the trainer's processes are the executor's; the control plane sees one trainer"
    ),
]

ROUNDS = 2


def test_a_job_with_one_trainer_of_two_processes_completes(tmp_path: Path) -> None:
    from bench.cluster import training_cluster

    # given: one trainer of two processes, each 4 of every batch of 8
    dataset, spec = small_training_job(tmp_path, trainers=1, rounds=ROUNDS, round_timeout=60.0, inner_steps=4)
    spec["training"] = {"processes": 2, "process_timeout": 60}
    with training_cluster(
        root=tmp_path / "cluster",
        dataset_dir=dataset,
        workers=2,
        mode="services" if services_mode() else "embedded",
        benchmark=False,
    ) as cluster:
        # when
        job_id = cluster.submit(spec, name="e2e-two-processes")
        job = cluster.follow(job_id, timeout=240)
        logs = "\n".join(child.log.read_text(errors="replace") for child in cluster.daemons.values())

        # then: completed, the one trainer in every round, learning visible
        assert job["status"] == "completed", f"{job['status_reason']}\n{cluster.logs()}"
        rounds = job["rounds"]
        assert [round_["number"] for round_ in rounds] == list(range(1, ROUNDS + 1))
        assert all(round_["closed"] and len(round_["participants"]) == 1 for round_ in rounds), rounds
        assert all(round_["eval_loss"] < math.log(256) for round_ in rounds), rounds
        trainers = [task for task in job["tasks"] if task["role"] == "trainer"]
        assert [(task["status"], task["exit_code"]) for task in trainers] == [("exited", 0)]
        # both ranks ran, rank 0 led: one update a round, from the trainer of two processes
        assert "starting a trainer of 2 processes" in logs
        assert "on 2 processes (cpu), batch size 8 (4 a process)" in logs
        assert "rank 1 of 2 joined the process group (gloo" in logs
        assert logs.count("round 1: 4 steps") == 1 and logs.count("round 2: 4 steps") == 1, logs[-5000:]
