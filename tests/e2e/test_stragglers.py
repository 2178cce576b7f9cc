"""A trainer that falls behind stays in sync (issue 13, finding 1), with real processes on loopback.

One trainer is slowed down 5× (``slowdown = 5``) in a fixed-H job with a short ``round_timeout``: the rounds
close without it. It still merges each round's result, late, in order — each from its own file — and after
each merge its global weights must be bit for bit the parameter server's (the digest the server logs for the
round equals the one the trainer logs as checked). The model downloaded from the control plane is the
parameter server's last published global weights.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

import pytest

from tests.e2e.conftest import only_in_mode, services_mode, small_training_job

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

pytestmark = [
    pytest.mark.timeout(600),
    only_in_mode("embedded", "the training math it checks is the same over either transport"),
]

ROUNDS = 3
PUBLISHED = re.compile(r"round (\d+): the global weights' digest is (sha256:[0-9a-f]{64})")
CHECKED = re.compile(r"round (\d+): \d+ steps, .* weights (sha256:[0-9a-f]{64}) \(checked\)")


def test_a_trainer_left_out_of_rounds_merges_each_of_them_and_ends_with_the_global_weights(
    tmp_path: Path,
) -> None:
    from bench.cluster import training_cluster, worker_toml
    from hypha_tensors import weights

    # given: a parameter server, a trainer, and one 5x slower; rounds close 0.5 s after the first update
    dataset, spec = small_training_job(
        tmp_path,
        trainers=2,
        rounds=ROUNDS,
        inner_steps=6,
        round_timeout=0.5,
        dedicated_parameter_server=True,
    )
    with training_cluster(
        root=tmp_path / "cluster",
        dataset_dir=dataset,
        workers=3,
        mode="services" if services_mode() else "embedded",
        settings={"HYPHA_LEASE_TTL": "10"},
        worker_tomls=[
            worker_toml(parameter_server_only=True, benchmark=False),
            worker_toml(slowdown=1.0, benchmark=False),
            worker_toml(slowdown=5.0, benchmark=False),
        ],
    ) as cluster:
        # when
        job_id = cluster.submit(spec, name="e2e-straggler")
        job = cluster.follow(job_id, timeout=300)
        assert job["status"] == "completed", f"{job['status_reason']}\n{cluster.logs()}"
        with cluster.api() as client:
            workers = {worker["name"]: worker for worker in client.get("/api/workers/").json()["results"]}
        archive = cluster.download_model(job_id, tmp_path / "model.zip")
        logs = {name: child.log.read_text(errors="replace") for name, child in cluster.daemons.items()}

    # then: the slow trainer was left out of at least two rounds
    slow_id = workers["worker-3"]["id"]
    left_out = [round_["number"] for round_ in job["rounds"] if slow_id in round_["left_out"]]
    assert len(left_out) >= 2, (left_out, job["rounds"])

    # the parameter server published a digest of its global weights for every round
    published = {int(number): digest for number, digest in PUBLISHED.findall("\n".join(logs.values()))}
    assert sorted(published) == list(range(1, ROUNDS + 1)), published

    # and after every round — those it was left out of too — the slow trainer held exactly those weights
    slow_log = logs["worker-3"]
    checked = {int(number): digest for number, digest in CHECKED.findall(slow_log)}
    # It merges rounds in order until the job's last round is closed; then its next merge is answered Done
    # (nothing is left to train), so it may stop before merging the last rounds.
    assert checked and sorted(checked) == list(range(1, len(checked) + 1)), (checked, slow_log[-4000:])
    assert checked == {number: published[number] for number in checked}, (checked, published)
    assert "done after" in slow_log, slow_log[-4000:]
    assert "fetching the full global weights" not in slow_log, slow_log[-4000:]

    # the downloaded model is the parameter server's last published global weights
    with zipfile.ZipFile(archive) as bundle:
        downloaded = tmp_path / "downloaded.safetensors"
        downloaded.write_bytes(bundle.read("model.safetensors"))
    assert weights.publication(downloaded) == (ROUNDS, published[ROUNDS])
    assert weights.digest(weights.load(downloaded)) == published[ROUNDS]
