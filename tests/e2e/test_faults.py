"""Faults during training, with real processes on loopback and ``kill -9``.

A trainer's daemon is killed in the middle of a job: its lease expires within its TTL, the parameter server
stops waiting for it, the job advertises the role again, a spare daemon takes it, fetches the current global
weights and trains the remaining rounds; the job completes with the configured number of rounds. The
replacement is in step with the job (issue 13, finding 4): the job has a warm-up + cosine LR schedule and every
trainer reports the lr of each round's first step with the round's metrics — the replacement's must be what the
schedule gives at the job's step, not a fresh warm-up; its metrics land in the rounds it trained (no round's
mean loss gets another round's values); it is told ``Done`` after the last round (exit 0).

The parameter server's daemon is killed in the middle of a job: its lease expires, a spare daemon is leased
as the new parameter server, fetches the round the lost one saved last from the control plane, and the
trainers send it their updates (again, for the round that was open); every round is applied exactly once.
It is killed the moment it has published round 1: the server, told to stop by its daemon's death, may still
answer a round 2 update that was in flight when the replacement's address came, and the trainer must send it
again to the replacement (in CI, a round once waited for ever for updates the lost server had taken).

The only data node is killed while trainers download from it, and restarted at the same address: the trainers
wait (and say so on the job's page) instead of failing, and the job completes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import only_in_mode, services_mode, small_training_job

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

pytestmark = pytest.mark.timeout(600)

ROUNDS = 4
INNER_STEPS = 20
LEARNING_RATE = 3e-3  # bench.cluster.diloco_spec's default
SCHEDULE = {"type": "cosine", "warmup_steps": 30, "training_steps": ROUNDS * INNER_STEPS}


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


@contextlib.contextmanager
def fault_cluster(tmp_path: Path, *, parameter_servers: int, trainers: int) -> Iterator[tuple[Any, dict]]:
    """A cluster of daemons that run only parameter servers, then trainer daemons; and the spec of a job of
    two trainers and :data:`ROUNDS` rounds. Lease TTL 5 s: short, so that a death is noticed soon, yet long
    enough for renewals to come in time on a loaded 2-core machine."""
    from bench.cluster import training_cluster, worker_toml

    dataset, spec = small_training_job(
        tmp_path,
        trainers=2,
        rounds=ROUNDS,
        inner_steps=INNER_STEPS,
        round_timeout=300.0,
        dedicated_parameter_server=True,
    )
    assert spec["inner_optimizer"]["learning_rate"] == LEARNING_RATE
    spec["inner_optimizer"]["schedule"] = SCHEDULE
    with training_cluster(
        root=tmp_path / "cluster",
        dataset_dir=dataset,
        workers=parameter_servers + trainers,
        mode="services" if services_mode() else "embedded",
        settings={"HYPHA_LEASE_TTL": "5"},
        worker_tomls=[worker_toml(parameter_server_only=True, benchmark=False)] * parameter_servers
        + [worker_toml(benchmark=False)] * trainers,
    ) as cluster:
        yield cluster, spec


def after_round_one(cluster: Any, job_id: str) -> dict:
    """The job once its first round is applied (it must get there within 240 s)."""
    deadline = time.monotonic() + 240
    job = cluster.job(job_id)
    while not any(round_["closed"] for round_ in job["rounds"]):
        alive = job["status"] not in ("completed", "failed", "cancelled")
        assert time.monotonic() < deadline and alive, (job["status_reason"], cluster.logs())
        time.sleep(0.5)
        job = cluster.job(job_id)
    return job


def publisher_of_round_one(cluster: Any) -> str:
    """The daemon whose parameter server logged that it published round 1 (within 240 s)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for name, daemon in cluster.daemons.items():
            if "round 1 published" in daemon.log.read_text(errors="replace"):
                return name
        time.sleep(0.02)
    raise AssertionError(f"no parameter server published round 1 within 240 s\n{cluster.logs()}")


def test_a_trainer_killed_mid_job_is_replaced_and_the_job_completes(tmp_path: Path) -> None:
    # given: a parameter-server daemon and three trainer daemons for a job of two trainers (one spare)
    with fault_cluster(tmp_path, parameter_servers=1, trainers=3) as (cluster, spec):
        job_id = cluster.submit(spec, name="e2e-trainer-killed")

        # when: round 1 is done, one trainer's daemon is killed (its executor dies with it)
        job = after_round_one(cluster, job_id)
        trainers = {task["worker"]: task["worker_id"] for task in job["tasks"] if task["role"] == "trainer"}
        victim = sorted(trainers)[0]
        killed_at = time.monotonic()
        os.killpg(cluster.daemons[victim].popen.pid, signal.SIGKILL)

        # then: the job completes all its rounds
        job = cluster.follow(job_id, timeout=420)
        assert job["status"] == "completed", f"{job['status_reason']}\n{cluster.logs()}"

    rounds = job["rounds"]
    assert [round_["number"] for round_ in rounds] == list(range(1, ROUNDS + 1))
    assert all(round_["closed"] for round_ in rounds)
    tasks = [task for task in job["tasks"] if task["role"] == "trainer"]
    lost = next(task for task in tasks if task["worker"] == victim)
    assert lost["status"] == "cancelled" and "expired" in lost["reason"], lost
    spare = [task for task in tasks if task["worker"] not in trainers]
    assert len(spare) == 1, tasks
    # it was told Done after the last round: it exited by itself (0), counting every round of the job
    assert (spare[0]["status"], spare[0]["exit_code"], spare[0]["round"]) == ("exited", 0, ROUNDS), spare[0]
    # the replacement trained in the last rounds; the victim in none after its death
    assert str(spare[0]["worker_id"]) in rounds[-1]["participants"], rounds[-1]
    assert trainers[victim] not in rounds[-1]["participants"]
    # the job said so while it went on, and no round waited for its timeout
    assert any("expired while training" in event["reason"] for event in job["events"]), job["events"]
    assert all(round_["duration"] < 120 for round_ in rounds), [round_["duration"] for round_ in rounds]
    assert time.monotonic() - killed_at < 400

    # the replacement is in step with the job
    spare_id = str(spare[0]["worker_id"])
    survivor_id = next(str(worker_id) for name, worker_id in trainers.items() if name != victim)
    joined = [round_["number"] for round_ in rounds if spare_id in round_["participants"]]
    assert joined and joined == list(range(joined[0], ROUNDS + 1)), [r["participants"] for r in rounds]
    for round_ in rounds:
        metrics = round_["trainer_metrics"]
        # a round holds the metrics of the trainers that trained it, and its mean loss is theirs
        assert set(metrics) <= set(round_["participants"]) | {str(trainers[victim])}, round_
        assert (spare_id in metrics) == (round_["number"] in joined), round_
        assert survivor_id in metrics, round_
        losses = [entry["loss"] for entry in metrics.values()]
        assert round_["mean_loss"] == pytest.approx(sum(losses) / len(losses)), round_
        # every trainer's lr at the round's first step is the schedule's at the job's step, the replacement's
        # too (a fresh schedule would give it the warm-up's first lr)
        expected = scheduled_lr((round_["number"] - 1) * INNER_STEPS)
        for peer, entry in metrics.items():
            assert entry["steps"] == INNER_STEPS, (round_["number"], peer, entry)
            assert entry["lr"] == pytest.approx(expected, rel=1e-6), (round_["number"], peer, entry)
    assert rounds[-1]["trainer_metrics"][spare_id]["lr"] != pytest.approx(scheduled_lr(0), rel=1e-6)


def test_a_parameter_server_killed_mid_job_is_restarted_from_its_last_round(tmp_path: Path) -> None:
    # given: two daemons that run parameter servers only (one spare) and two trainer daemons
    with fault_cluster(tmp_path, parameter_servers=2, trainers=2) as (cluster, spec):
        job_id = cluster.submit(spec, name="e2e-parameter-server-killed")

        # when: the moment the parameter server has published round 1 (its checkpoint saved; the trainers may
        # not have its result, nor the control plane its report, yet), its daemon is killed: the server, told
        # to stop, may still answer the round 2 updates in flight, which its replacement must get again
        victim = publisher_of_round_one(cluster)
        os.killpg(cluster.daemons[victim].popen.pid, signal.SIGKILL)

        # then: the job completes all its rounds
        job = cluster.follow(job_id, timeout=420)
        assert job["status"] == "completed", f"{job['status_reason']}\n{cluster.logs()}"

    # each round applied once, by one server or the other
    rounds = job["rounds"]
    assert [round_["number"] for round_ in rounds] == list(range(1, ROUNDS + 1))
    assert all(round_["closed"] for round_ in rounds)
    servers = [task for task in job["tasks"] if task["role"] == "parameter_server"]
    assert [task["status"] for task in servers] == ["cancelled", "exited"], [
        (task["worker"], task["status"], task["reason"]) for task in servers
    ]
    assert "expired" in servers[0]["reason"], servers[0]
    assert (servers[0]["worker"] == victim, servers[1]["worker"] != victim) == (True, True), servers
    # the new one resumed from the control plane's copy of the last round the lost one saved
    resumed = [line for line in servers[1]["log_tail"].splitlines() if "resuming after round" in line]
    assert resumed, servers[1]["log_tail"][-3000:]
    assert any("a new one is advertised to resume after round" in event["reason"] for event in job["events"])
    # both trainers trained to the end, in the last round too
    trainers = [task for task in job["tasks"] if task["role"] == "trainer"]
    assert [task["status"] for task in trainers] == ["exited", "exited"], [
        (task["status"], task["reason"], task["log_tail"][-2000:]) for task in trainers
    ]
    assert sorted(rounds[-1]["participants"]) == sorted(str(task["worker_id"]) for task in trainers)


@only_in_mode("embedded", "the waiting is the bridge's, whatever transport the control plane uses")
def test_a_data_node_that_goes_away_is_waited_for_and_the_job_completes(tmp_path: Path) -> None:
    from bench.cluster import training_cluster

    # given: a job whose trainers download a slice every few steps from the one data node
    dataset, spec = small_training_job(
        tmp_path, trainers=2, rounds=ROUNDS, inner_steps=20, round_timeout=300.0
    )
    with training_cluster(
        root=tmp_path / "cluster",
        dataset_dir=dataset,
        workers=3,
        mode="services" if services_mode() else "embedded",
        settings={"HYPHA_LEASE_TTL": "10"},
        benchmark=False,
    ) as cluster:
        job_id = cluster.submit(spec, name="e2e-data-node-away")
        deadline = time.monotonic() + 240
        job = cluster.job(job_id)
        while not any(task["role"] == "trainer" and task["steps_total"] > 0 for task in job["tasks"]):
            alive = job["status"] not in ("completed", "failed", "cancelled")
            assert time.monotonic() < deadline and alive, (job["status_reason"], cluster.logs())
            time.sleep(0.3)
            job = cluster.job(job_id)

        # when: the data node is killed, and comes back at the same address 8 s later
        os.killpg(cluster.data_node.popen.pid, signal.SIGKILL)
        time.sleep(8)
        waiting = cluster.job(job_id)
        cluster.restart_data_node()
        job = cluster.follow(job_id, timeout=420)

    # then: the trainers said they were waiting for data (on the job's page), and the job completed
    tails = "\n".join(task["log_tail"] for task in waiting["tasks"] if task["role"] == "trainer")
    assert "waiting for data: slice" in tails, tails[-3000:]
    assert job["status"] == "completed", job["status_reason"]
    assert [round_["number"] for round_ in job["rounds"]] == list(range(1, ROUNDS + 1))
