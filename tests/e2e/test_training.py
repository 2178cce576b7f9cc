"""DiLoCo end to end with real processes on loopback: control plane, data node, parameter server, trainers.

A tiny GPT-2 (from a config) trains for a few rounds on byte-level text; the job must complete, the last
round's training loss must be below the first's, every round must have its eval loss, the data slices must
have moved to USED, and the model downloaded from the control plane must be the parameter server's last global
weights, tensor for tensor (the parameter server's checkpoint is kept for the comparison with
``HYPHA_KEEP_WORK_DIRS=1``).
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest

from tests.e2e.conftest import services_mode

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

pytestmark = pytest.mark.timeout(600)

ROUNDS = 3
TRAINERS = 2


def test_a_diloco_job_trains_a_tiny_model_and_its_model_is_downloadable(tmp_path: Path) -> None:
    from bench.cluster import SMALL_GPT2, diloco_spec, prepare_stdlib_text, training_cluster
    from parameter_server import weights

    # given: a byte-level dataset and a cluster of three daemons (two trainers and a parameter server)
    dataset = prepare_stdlib_text(tmp_path / "stdlib", max_bytes=250_000, samples_per_slice=32)
    spec = diloco_spec(
        dataset="stdlib",
        trainers=TRAINERS,
        rounds=ROUNDS,
        inner_steps=15,
        batch_size=8,
        model=SMALL_GPT2,
        round_timeout=60.0,
    )
    with training_cluster(
        root=tmp_path / "cluster",
        dataset_dir=dataset,
        workers=TRAINERS + 1,
        mode="services" if services_mode() else "embedded",
        settings={"HYPHA_LEASE_TTL": "10"},
        daemon_env={"HYPHA_KEEP_WORK_DIRS": "1"},
    ) as cluster:
        # when
        job_id = cluster.submit(spec, name="e2e-tiny-gpt2")
        job = cluster.follow(job_id, timeout=420)

        # then: completed, with every round recorded and learning visible
        assert job["status"] == "completed", f"{job['status_reason']}\n{cluster.logs()}"
        rounds = job["rounds"]
        assert [round_["number"] for round_ in rounds] == list(range(1, ROUNDS + 1))
        assert all(round_["closed"] and len(round_["participants"]) == TRAINERS for round_ in rounds)
        assert all(round_["eval_loss"] is not None for round_ in rounds)
        assert rounds[-1]["mean_loss"] < rounds[0]["mean_loss"], rounds
        assert rounds[-1]["eval_loss"] < rounds[0]["eval_loss"], rounds
        assert all(round_["bytes_in"] > 0 and round_["bytes_out"] > 0 for round_ in rounds)
        assert job["data"]["used"] > 0
        trainers = [task for task in job["tasks"] if task["role"] == "trainer"]
        assert [(task["status"], task["round"], task["exit_code"]) for task in trainers] == [
            ("exited", ROUNDS, 0)
        ] * TRAINERS
        # every lease ended with the job
        assert all(lease["status"] == "released" for lease in job["leases"]), job["leases"]

        # and the downloaded model is the parameter server's last global weights
        archive = cluster.download_model(job_id, tmp_path / "model.zip")
        with zipfile.ZipFile(archive) as bundle:
            assert sorted(bundle.namelist()) == ["config.json", "model.safetensors"]
            downloaded = tmp_path / "downloaded.safetensors"
            downloaded.write_bytes(bundle.read("model.safetensors"))
            assert b'"gpt2"' in bundle.read("config.json")
        checkpoints = sorted((tmp_path / "cluster" / "workers").glob("*/hypha-*/checkpoints/round-*"))
        assert checkpoints, "the parameter server's checkpoints were not kept"
        final = max(checkpoints, key=lambda path: path.name)
        global_weights = weights.load(next(final.glob("*weights*.safetensors")))
        model = weights.load(downloaded)
        assert set(model) == set(global_weights)
        for name, tensor in global_weights.items():
            assert model[name].equal(tensor), name


def test_cancelling_a_training_job_stops_every_executor_and_releases_every_lease(tmp_path: Path) -> None:
    import time

    from bench.cluster import diloco_spec, prepare_stdlib_text, training_cluster

    dataset = prepare_stdlib_text(tmp_path / "stdlib", max_bytes=120_000, samples_per_slice=32)
    spec = diloco_spec(
        dataset="stdlib", trainers=TRAINERS, rounds=100, inner_steps=50, batch_size=8, holdout=1
    )
    root = tmp_path / "cluster"
    with training_cluster(
        root=root,
        dataset_dir=dataset,
        workers=TRAINERS + 1,
        mode="services" if services_mode() else "embedded",
    ) as cluster:
        job_id = cluster.submit(spec, name="e2e-cancel")
        # given: training under way (every trainer has taken steps)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            job = cluster.job(job_id)
            trainers = [task for task in job["tasks"] if task["role"] == "trainer"]
            if len(trainers) == TRAINERS and all(task["steps_total"] > 0 for task in trainers):
                break
            assert job["status"] in ("pending", "allocating", "allocated", "running"), job["status_reason"]
            time.sleep(0.5)
        else:
            raise AssertionError(f"training did not start:\n{cluster.logs()}")
        assert any(root.glob("workers/*/hypha-*")), "no task work dir while training"

        # when
        with cluster.api() as client:
            assert client.post(f"/api/jobs/{job_id}/cancel/").status_code == 200

        # then: the job, its tasks and leases end at once; the daemons stop the executors and clean up
        job = cluster.job(job_id)
        assert job["status"] == "cancelled"
        assert {task["status"] for task in job["tasks"]} == {"cancelled"}
        assert {lease["status"] for lease in job["leases"]} == {"released"}
        deadline = time.monotonic() + 30
        while any(root.glob("workers/*/hypha-*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(root.glob("workers/*/hypha-*")), cluster.logs()
        logs = "\n".join(child.tail(500_000) for child in cluster.daemons.values())
        for task in job["tasks"]:
            assert f"task {task['id']} exited" in logs, logs[-4000:]
