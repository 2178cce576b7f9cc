"""Verification of batch inference end to end (issue 19, docs/inference.md "Verification"), with real processes
on loopback: the control plane (embedded), one data node and three worker daemons, one of which runs its
executors with the wrong-results test knob (``HYPHA_INFERENCE_WRONG_RESULTS=1`` in that daemon's environment,
which the daemon hands to every executor it starts). Every slice is verified: the job completes, every
accepted result is an honest worker's, and the dishonest worker's record counts each result it lost.
"""

from __future__ import annotations

import io
import json
import signal
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.e2e.conftest import TIMINGS, only_in_mode

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(120),
    only_in_mode(
        "embedded", "the subject is the workers' results and their comparison, the same in both modes"
    ),
]

WRONG = "worker-3"
JOB_DEADLINE = 80.0
SPEC = {
    "model": {
        "source": {
            "type": "config",
            "config": {
                "model_type": "gpt2",
                "vocab_size": 256,
                "n_positions": 160,
                "n_embd": 32,
                "n_layer": 1,
                "n_head": 2,
            },
        },
        "input_names": ["input_ids"],
    },
    "dataset": {"name": "stdlib"},
    "task": {"type": "generate", "max_new_tokens": 4, "temperature": 0.0},
    "batch_size": 4,
    "workers": 3,
    "worker": {"resources": {"cpu": 1, "memory": 1}, "price": {"bid": 100, "max": 100}},
    "verification": {"fraction": 1.0},
}


def test_verification_catches_a_worker_that_returns_wrong_results(tmp_path: Path) -> None:
    from bench.cluster import prepare_stdlib_text, training_cluster

    dataset = prepare_stdlib_text(tmp_path / "stdlib", max_bytes=24_000, samples_per_slice=8)
    with training_cluster(
        root=tmp_path / "cluster", dataset_dir=dataset, workers=3, benchmark=False, settings=dict(TIMINGS)
    ) as cluster:
        # given: worker-3 restarted with the wrong-results knob in its daemon's environment
        cluster.daemons[WRONG].signal(signal.SIGTERM)
        cluster.daemons[WRONG].popen.wait(60)
        honest_environment = cluster.daemon_environment
        cluster.daemon_environment = {**honest_environment, "HYPHA_INFERENCE_WRONG_RESULTS": "1"}
        try:
            cluster.restart_daemon(WRONG)
        finally:
            cluster.daemon_environment = honest_environment
        with cluster.api() as client:
            deadline = time.monotonic() + 30
            while True:
                workers = client.get("/api/workers/").json()
                workers = workers["results"] if isinstance(workers, dict) else workers
                online = {worker["name"]: worker for worker in workers if worker.get("status") == "online"}
                if len(online) == 3:
                    break
                assert time.monotonic() < deadline, f"the daemons did not come online: {online}"
                time.sleep(0.3)
            wrong_id = online[WRONG]["id"]

            # when: a job whose every slice is computed twice runs on the three
            response = client.post("/api/jobs/inference/", json={"name": "e2e-verification", **SPEC})
            assert response.status_code == 201, response.text
            job_id = response.json()["id"]
            deadline = time.monotonic() + JOB_DEADLINE
            while (job := cluster.job(job_id))["status"] not in ("completed", "failed", "cancelled"):
                assert time.monotonic() < deadline, f"job still {job['status']}\n{cluster.logs()[-8000:]}"
                time.sleep(0.3)

            # then: it completes, every slice verified, none in dispute
            assert job["status"] == "completed", (job["status_reason"], cluster.logs()[-8000:])
            progress = job["progress"]
            assert progress["slices_done"] == progress["slices_total"] == progress["verified"] > 0
            assert progress["disputed"] == 0
            # every accepted result is an honest worker's: the archive serves none of worker-3's
            archive = client.get(f"/api/jobs/{job_id}/results/")
            assert archive.status_code == 200
            with zipfile.ZipFile(io.BytesIO(archive.content)) as bundle:
                manifest = json.loads(bundle.read("manifest.json"))
            assert len(manifest["results"]) == progress["slices_total"]
            assert wrong_id not in {entry["worker"] for entry in manifest["results"]}
            # and: worker-3's record counts each result it lost, once, and only its own
            detail = client.get(f"/api/workers/{wrong_id}/").json()
            assert detail["reputation"]["results_lost"] == progress["rejected"] > 0, (detail, progress)
            assert detail["reputation"]["reliability"] < 0.5
            for name, worker in online.items():
                if name != WRONG:
                    record = client.get(f"/api/workers/{worker['id']}/").json()["reputation"]
                    assert record["results_lost"] == 0, (name, record)
