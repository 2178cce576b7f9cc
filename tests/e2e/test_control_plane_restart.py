"""The control plane restarts in the middle of a training job, and no lease is lost.

Real processes on loopback: the control plane (services: ``web``, ``worker`` and ``beat``; embedded: one
``hypha-server``), a data node and three daemons training a small job. Once a round is done every control-plane
process is killed with SIGKILL — no clean shutdown, no disconnect recorded — and started again on the same
port, database and data directory after an outage longer than a lease TTL, so that every lease's expiry falls
in the outage. The daemons keep their leases and tasks while cut off, reconnect with backoff, and are welcomed
with their leases; the lease clock resumes and gives each lease one TTL from the restart instead of expiring
it; the job completes all its rounds on the leases it had.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import services_mode, small_training_job

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROUNDS = 2
TRAINERS = 2
LEASE_TTL = 4.0
#: Longer than any lease's remaining time (at most one TTL after its last renewal), so every lease runs out
#: during the outage; far shorter than a TTL plus the daemons' grace while cut off (60 s).
OUTAGE = LEASE_TTL + 2.0
CONTROL_PLANE = ("web", "worker", "beat", "server")
WELCOMED = re.compile(r"welcomed as worker .*: lease_ttl [\d.]+s, offer_ttl [\d.]+s, (\d+) lease\(s\) kept")


def test_the_control_plane_restarts_mid_job_and_no_lease_is_lost(tmp_path: Path) -> None:
    from bench.cluster import training_cluster

    # given: a job of two trainers and a parameter server, training (a round is done)
    dataset, spec = small_training_job(
        tmp_path, trainers=TRAINERS, rounds=ROUNDS, inner_steps=8, round_timeout=120.0
    )
    with training_cluster(
        root=tmp_path / "cluster",
        dataset_dir=dataset,
        workers=TRAINERS + 1,
        mode="services" if services_mode() else "embedded",
        settings={"HYPHA_LEASE_TTL": str(LEASE_TTL)},
        benchmark=False,
    ) as cluster:
        job_id = cluster.submit(spec, name="e2e-control-plane-restart")
        deadline = time.monotonic() + 180
        job = cluster.job(job_id)
        while not any(round_["closed"] for round_ in job["rounds"]):
            alive = job["status"] in ("pending", "allocating", "allocated", "running")
            assert time.monotonic() < deadline and alive, (job["status_reason"], cluster.logs())
            time.sleep(0.3)
            job = cluster.job(job_id)
        assert job["status"] == "running", job["status_reason"]
        leases_before = {lease["id"]: lease for lease in job["leases"]}
        assert len(leases_before) == TRAINERS + 1
        assert {lease["status"] for lease in leases_before.values()} == {"active"}
        welcomes_before = {
            name: len(WELCOMED.findall(child.tail(2_000_000))) for name, child in cluster.daemons.items()
        }

        # when: every control-plane process is killed, stays down longer than a lease TTL, and comes back
        killed = [child for child in cluster.plane.children if child.name in CONTROL_PLANE]
        for child in killed:
            child.signal(signal.SIGKILL)
        for child in killed:
            child.popen.wait(10)
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < OUTAGE:
            # the daemons carry on, cut off: none gives up its tasks
            for name, child in cluster.daemons.items():
                assert child.popen.poll() is None, f"{name} exited:\n{child.tail()}"
            time.sleep(0.5)
        for child in killed:
            cluster.plane.children.remove(child)
        # same port, database (or data directory) and Redis database: the environment and argv they had
        for child in killed:
            cluster.plane.start(child.name, list(child.popen.args))
        cluster.plane.wait_healthy()
        down_for = time.monotonic() - killed_at

        # then: every daemon is welcomed again with the lease it held
        def welcomed_again() -> dict[str, list[int]]:
            return {
                name: [int(kept) for kept in WELCOMED.findall(child.tail(2_000_000))[welcomes_before[name] :]]
                for name, child in cluster.daemons.items()
            }

        deadline = time.monotonic() + 30
        while not all(welcomed_again().values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert welcomed_again() == {name: [1] for name in cluster.daemons}, cluster.logs()

        # and the job completes, every round recorded, on the leases it had before the restart
        job = cluster.follow(job_id, timeout=180)
        assert job["status"] == "completed", f"{job['status_reason']}\n{cluster.logs()}"
        with cluster.api() as client:
            lease_events = {
                lease_id: [event["kind"] for event in client.get(f"/api/leases/{lease_id}/").json()["events"]]
                for lease_id in leases_before
            }

    assert down_for > LEASE_TTL
    rounds = job["rounds"]
    assert [round_["number"] for round_ in rounds] == list(range(1, ROUNDS + 1))
    assert all(round_["closed"] and len(round_["participants"]) == TRAINERS for round_ in rounds), rounds
    trainers = [task for task in job["tasks"] if task["role"] == "trainer"]
    assert [(task["status"], task["round"], task["exit_code"]) for task in trainers] == [
        ("exited", ROUNDS, 0)
    ] * TRAINERS
    # no lease expired: the same three leases, released when the job completed
    assert {lease["id"]: lease["status"] for lease in job["leases"]} == dict.fromkeys(
        leases_before, "released"
    )
    assert not any("expired" in event["reason"] for event in job["events"]), job["events"]
    # each was carried over the outage by the lease clock's resume (and none expired)
    for lease_id, kinds in lease_events.items():
        assert "extended" in kinds and "expired" not in kinds, (lease_id, kinds)
        assert kinds[-1] == "released", (lease_id, kinds)
