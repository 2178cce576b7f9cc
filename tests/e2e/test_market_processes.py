"""The market end to end: a real control plane (embedded or services, per the environment) and real
``hypha-worker-daemon`` processes on loopback.

One job of 2 trainers + 1 parameter server on three 2-cpu workers: each worker offers all it has, so each
ends up with exactly one of the three leases. Then the workers go away in the two ways they can — killed
(``kill -9``: the lease runs out because nobody confirms its renewal) and stopped (SIGTERM: the daemon gives
the lease back at once) — and the owner cancels the job.

Deadlines, not speed: every wait polls with a deadline; the only timing assertions are the contracts of the
lease protocol (expiry within TTL + 1 s of the kill, release within ~1 s of SIGTERM).
"""

from __future__ import annotations

import signal
import subprocess
import time
from datetime import datetime

import httpx
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

#: Seconds between two polls of the REST API.
POLL = 0.1
ALLOCATION_DEADLINE = 15.0
#: An expiry must land within one TTL of the kill, plus 1 s for the 0.2 s lease clock and slack.
EXPIRY_SLACK = 1.0
#: A released lease is released "at once": the daemon's release_lease and the server's answer.
RELEASE_DEADLINE = 1.0
#: Exit codes of hypha-worker-daemon (worker_daemon.exceptions.ExitCode).
EXIT_OK = 0
EXIT_TOKEN_REFUSED = 3


def job_leases(api: httpx.Client, job_id: str) -> list[dict]:
    response = api.get("/api/leases/", params={"job": job_id, "limit": 100})
    response.raise_for_status()
    return response.json()["results"]


def held_leases(api: httpx.Client, job_id: str) -> dict[str, dict]:
    """The job's leases that were ever ACTIVE, by worker name.

    A worker may hold other leases of the job that never became ACTIVE: the TEMPORARY lease of an offer that
    lost (a worker whose trainer offer lost goes on to offer on the parameter server's advert).
    """
    leases: dict[str, dict] = {}
    for lease in job_leases(api, job_id):
        if lease["activated_at"] is None:
            continue
        assert lease["worker"] not in leases, f"two activated leases on {lease['worker']}: {lease}"
        leases[lease["worker"]] = lease
    return leases


def get_job(api: httpx.Client, job_id: str) -> dict:
    response = api.get(f"/api/jobs/{job_id}/")
    response.raise_for_status()
    return response.json()


def clock(timestamp: str) -> str:
    """``HH:MM:SS`` of an API timestamp, as job reasons print it."""
    return datetime.fromisoformat(timestamp).strftime("%H:%M:%S")


def worker_statuses(api: httpx.Client, names: list[str]) -> dict[str, str]:
    response = api.get("/api/workers/", params={"limit": 1000})
    response.raise_for_status()
    return {
        worker["name"]: worker["status"] for worker in response.json()["results"] if worker["name"] in names
    }


def test_a_job_is_leased_renewed_and_survives_its_workers_leaving(
    control_plane, daemon_factory, wait_until
) -> None:
    ttl = control_plane.lease_ttl
    names = ["worker-a", "worker-b", "worker-c"]
    tokens = control_plane.create_worker_tokens(names)
    daemons = {name: daemon_factory(name=name, token=tokens[name]) for name in names}
    api = control_plane.api()
    wait_until(
        lambda: worker_statuses(api, names) == dict.fromkeys(names, "online"),
        timeout=15.0,
        interval=POLL,
        message="three workers online",
    )

    def wait_for_lease(worker: str, status: str, *, since: float, deadline: float) -> tuple[dict, float]:
        """Poll until the job's lease on ``worker`` is ``status``; return it and the seconds since ``since``."""
        lease = wait_until(
            lambda: (lease := held_leases(api, job_id)[worker])["status"] == status and lease,
            timeout=deadline + 2.0,
            interval=POLL,
            message=f"lease on {worker} {status}",
        )
        return lease, time.monotonic() - since

    # when: a job of 2 trainers + 1 parameter server (defaults: 1 cpu, 1 GB each, bid 100, max 100)
    response = api.post("/api/jobs/", json={"name": "e2e", "num_trainers": 2})
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]

    # then: three ACTIVE leases, one per worker (each offers all its capacity, so it fits one role)
    leases = wait_until(
        lambda: (
            (found := held_leases(api, job_id))
            and len(found) == 3
            and all(lease["status"] == "active" for lease in found.values())
            and found
        ),
        timeout=ALLOCATION_DEADLINE,
        interval=POLL,
        message="3 active leases",
    )
    allocated_at = time.monotonic()
    assert sorted(leases) == names
    assert sorted(lease["role"] for lease in leases.values()) == ["parameter_server", "trainer", "trainer"]
    assert [lease["price"] for lease in leases.values()] == [100.0, 100.0, 100.0]
    job = wait_until(
        lambda: (job := get_job(api, job_id))["status"] == "allocated" and job,
        timeout=5.0,
        interval=POLL,
        message="job allocated",
    )
    assert job["status_reason"] == "ALLOCATED: all 3 leases active (2 of 2 trainers, 1 of 1 parameter server)"

    # then: past one TTL every lease is still ACTIVE, which it only is because its daemon confirmed renewals
    time.sleep(max(0.0, allocated_at + ttl + 0.5 - time.monotonic()))
    leases = held_leases(api, job_id)
    assert {name: lease["status"] for name, lease in leases.items()} == dict.fromkeys(names, "active")
    assert all(lease["renewals"] >= 1 for lease in leases.values()), leases

    killed, kept = sorted(name for name, lease in leases.items() if lease["role"] == "trainer")
    (stopped,) = [name for name, lease in leases.items() if lease["role"] == "parameter_server"]

    # when: a trainer's daemon is killed outright
    killed_at = time.monotonic()
    daemons[killed].signal(signal.SIGKILL)
    # then: its lease expires within one TTL, since nobody confirms its renewal …
    lease, elapsed = wait_for_lease(killed, "expired", since=killed_at, deadline=ttl + EXPIRY_SLACK)
    print(f"lease on {killed} expired {elapsed:.2f}s after kill -9 (TTL {ttl:g}s)")
    assert elapsed <= ttl + EXPIRY_SLACK + POLL, f"lease expired {elapsed:.2f}s after the kill"
    assert lease["status_reason"] == "not renewed before it ran out"
    # … and the job goes back to allocating and says why (naming the worker), in its reason and its history
    lost = (
        f"trainer lease on {killed} expired at {clock(lease['ended_at'])} UTC: not renewed before it ran out"
    )
    job = get_job(api, job_id)
    assert job["status"] == "allocating"
    assert job["status_reason"].startswith("ALLOCATING: 1 of 2 trainers, 1 of 1 parameter server leased")
    assert job["status_reason"].endswith(f" — {lost}"), job["status_reason"]
    left_allocated = [
        (event["to_status"], event["reason"])
        for event in job["events"]
        if event["from_status"] == "allocated"
    ]
    assert left_allocated == [
        ("allocating", f"ALLOCATING: 1 of 2 trainers, 1 of 1 parameter server leased — {lost}"),
    ]
    assert {name: lease["status"] for name, lease in held_leases(api, job_id).items()} == {
        killed: "expired",
        kept: "active",
        stopped: "active",
    }

    # when: the parameter server's daemon is stopped
    stopped_at = time.monotonic()
    daemons[stopped].signal(signal.SIGTERM)
    # then: it gives its lease back at once, and exits 0
    lease, elapsed = wait_for_lease(stopped, "released", since=stopped_at, deadline=RELEASE_DEADLINE)
    print(f"lease on {stopped} released {elapsed:.2f}s after SIGTERM")
    assert elapsed <= RELEASE_DEADLINE + POLL, f"lease released {elapsed:.2f}s after SIGTERM"
    assert lease["status_reason"] == "released by the worker: daemon shutting down"
    assert daemons[stopped].wait(10.0) == EXIT_OK
    job = get_job(api, job_id)
    assert job["status"] == "allocating"
    assert job["status_reason"].startswith("ALLOCATING: 1 of 2 trainers, 0 of 1 parameter server leased")
    assert job["status_reason"].endswith(
        f" — parameter server lease on {stopped} released at {clock(lease['ended_at'])} UTC: "
        "released by the worker: daemon shutting down"
    ), job["status_reason"]

    # when: the owner cancels the job
    response = api.post(f"/api/jobs/{job_id}/cancel/")
    assert response.status_code == 200, response.text
    # then: the lease still held is released, the ended ones stay as they ended, and nothing of the job is live
    assert [lease for lease in job_leases(api, job_id) if lease["status"] in ("temporary", "active")] == []
    leases = held_leases(api, job_id)
    assert {name: (lease["status"], lease["status_reason"]) for name, lease in leases.items()} == {
        killed: ("expired", "not renewed before it ran out"),
        kept: ("released", "job cancelled"),
        stopped: ("released", "released by the worker: daemon shutting down"),
    }
    job = get_job(api, job_id)
    assert (job["status"], job["status_reason"]) == ("cancelled", "CANCELLED: cancelled by its owner")
    # the stopped daemon has exited, but the gateway may still be handling its closed connection
    wait_until(
        lambda: worker_statuses(api, names) == {killed: "offline", kept: "online", stopped: "offline"},
        timeout=5.0,
        interval=POLL,
        message=f"{killed} and {stopped} offline, {kept} online",
    )
    assert daemons[kept].poll() is None


def test_a_daemon_with_a_refused_token_exits_3(daemon_factory) -> None:
    # given: a token the control plane never issued
    daemon = daemon_factory(name="worker-x", token="hw_not-a-real-token")
    # then
    try:
        code = daemon.wait(15.0)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the daemon did not exit within 15 s:\n{daemon.logs()}")
    assert code == EXIT_TOKEN_REFUSED, daemon.logs()
    assert "unknown worker token" in daemon.stderr.read_text()
