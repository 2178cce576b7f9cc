"""Who holds a worker's connection, end to end: a real control plane (embedded or services, per the environment)
and real ``hypha-worker-daemon`` processes on loopback.

* A daemon hangs (SIGSTOP: its connection lingers, half-open as far as anyone can tell) and is restarted with
  the same token: the new process takes the worker over at once and serves its leases. When the old process
  wakes up (SIGCONT) it stops with exit code 6 and says why, instead of taking the worker back (which would
  make the two take turns for ever).
* A connected daemon holding a lease has its token revoked: its connection is closed, its lease released
  with the reason, the job advertises the role again, and the daemon exits 3 instead of reconnecting.

Deadlines, not speed: every wait polls the REST API with a deadline.
"""

from __future__ import annotations

import signal
import subprocess
from datetime import datetime

import httpx
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

POLL = 0.1
#: Exit codes of hypha-worker-daemon (worker_daemon.exceptions.ExitCode).
EXIT_TOKEN_REFUSED = 3
EXIT_SUPERSEDED = 6


def get(api: httpx.Client, path: str, **params) -> dict:
    response = api.get(path, params=params)
    response.raise_for_status()
    return response.json()


def worker(api: httpx.Client, name: str) -> dict:
    (found,) = [item for item in get(api, "/api/workers/", limit=1000)["results"] if item["name"] == name]
    return found


def job_leases(api: httpx.Client, job_id: str) -> list[dict]:
    return get(api, "/api/leases/", job=job_id, limit=100)["results"]


def active_lease(api: httpx.Client, job_id: str, *, renewed: int = 0) -> dict | None:
    """The job's one ACTIVE lease once it has been renewed at least ``renewed`` times (its daemon answers)."""
    active = [lease for lease in job_leases(api, job_id) if lease["status"] == "active"]
    assert len(active) <= 1, active
    return active[0] if active and active[0]["renewals"] >= renewed else None


@pytest.fixture
def submit(control_plane):
    """``submit(name)`` creates a job of 1 trainer + 1 parameter server (one 2-cpu worker offers all it has and
    gets one of the two roles) and returns its id; the job is cancelled at teardown, so that the next test's
    workers are not drawn to it (the control plane is shared by the module)."""
    api = control_plane.api()
    submitted: list[str] = []

    def create(name: str) -> str:
        response = api.post("/api/jobs/", json={"name": name, "num_trainers": 1})
        assert response.status_code == 201, response.text
        submitted.append(response.json()["id"])
        return submitted[-1]

    yield create
    for job_id in submitted:
        api.post(f"/api/jobs/{job_id}/cancel/")


def exit_code(daemon, *, timeout: float) -> int:
    try:
        return daemon.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{daemon.name} did not exit within {timeout:g} s:\n{daemon.logs()}")


def test_a_restarted_daemon_takes_over_and_the_hung_one_stops_when_it_wakes(
    control_plane, daemon_factory, wait_until, submit
) -> None:
    ttl = control_plane.lease_ttl
    token = control_plane.create_worker_tokens(["worker-r"])["worker-r"]
    api = control_plane.api()
    job_id = submit("e2e-restart")

    # given: the first daemon holds a lease of the job and answers its renewals
    old = daemon_factory(name="worker-r", token=token)
    old_lease = wait_until(
        lambda: active_lease(api, job_id, renewed=1), timeout=20.0, interval=POLL, message="a renewed lease"
    )
    first_connection = worker(api, "worker-r")["connected_at"]

    # when: it hangs, its connection left open, and the operator starts the daemon again
    old.signal(signal.SIGSTOP)
    try:
        new = daemon_factory(name="worker-r-restarted", token=token)

        # then: the new daemon takes the worker over at once (no waiting for the old connection to time out) …
        online = wait_until(
            lambda: (found := worker(api, "worker-r"))["connected_at"] != first_connection and found,
            timeout=15.0,
            interval=POLL,
            message="a newer connection of worker-r",
        )
        assert online["status"] == "online"
        # … the lease the old daemon held ends (the new one does not hold it) and the job leases the worker
        # again, and the new daemon answers the renewals of that lease
        ended = wait_until(
            lambda: (
                (lease := next(item for item in job_leases(api, job_id) if item["id"] == old_lease["id"]))[
                    "status"
                ]
                != "active"
                and lease
            ),
            timeout=10.0,
            interval=POLL,
            message="the old daemon's lease ended",
        )
        assert (ended["status"], ended["status_reason"]) == (
            "released",
            "the worker's daemon no longer holds it (reconnected without it)",
        )
        new_lease = wait_until(
            lambda: (
                (lease := active_lease(api, job_id, renewed=1)) and lease["id"] != old_lease["id"] and lease
            ),
            timeout=ttl * 3 + 10.0,
            interval=POLL,
            message="a new lease, renewed by the new daemon",
        )
    finally:
        # when: the old daemon wakes up
        old.signal(signal.SIGCONT)

    # then: it stops, saying why, and does not take the worker back
    assert exit_code(old, timeout=30.0) == EXIT_SUPERSEDED, old.logs()
    log = old.stderr.read_text()
    assert "another daemon connected with this worker's token and took the worker over" in log, log
    assert "giving up (exit code 6)" in log
    # the new daemon kept the worker all along: the same connection, its lease still ACTIVE and renewed since
    renewals = new_lease["renewals"]
    wait_until(
        lambda: (
            (lease := active_lease(api, job_id)) is not None
            and lease["id"] == new_lease["id"]
            and lease["renewals"] > renewals + 1
        ),
        timeout=ttl * 2 + 5.0,
        interval=POLL,
        message="the new daemon's lease renewed twice more",
    )
    now = worker(api, "worker-r")
    assert (now["status"], now["connected_at"]) == ("online", online["connected_at"])
    assert new.poll() is None, new.logs()
    assert "closed: code 4009" not in new.stderr.read_text()
    assert "giving up" not in new.stderr.read_text()


def test_revoking_a_connected_daemon_releases_its_lease_and_the_daemon_exits_3(
    control_plane, daemon_factory, wait_until, submit
) -> None:
    tokens = control_plane.create_worker_tokens(["worker-v", "worker-w"])
    api = control_plane.api()
    job_id = submit("e2e-revoke")
    daemon = daemon_factory(name="worker-v", token=tokens["worker-v"])
    lease = wait_until(
        lambda: active_lease(api, job_id, renewed=1), timeout=20.0, interval=POLL, message="a renewed lease"
    )
    assert lease["worker"] == "worker-v"
    worker_id = worker(api, "worker-v")["id"]

    # when: the operator revokes its token
    response = api.post(f"/api/workers/{worker_id}/revoke/")
    assert response.status_code == 200, response.text

    # then: the lease is released with the reason, at once (not when it would have expired) …
    (ended,) = [item for item in job_leases(api, job_id) if item["id"] == lease["id"]]
    assert (ended["status"], ended["status_reason"]) == ("released", "the worker's token was revoked")
    # … the daemon exits 3 and says why, instead of reconnecting …
    assert exit_code(daemon, timeout=15.0) == EXIT_TOKEN_REFUSED, daemon.logs()
    log = daemon.stderr.read_text()
    assert "the token of worker 'worker-v' has been revoked" in log, log
    assert "code 4003 (TOKEN_REVOKED)" in log
    wait_until(
        lambda: (found := worker(api, "worker-v"))["status"] == "offline" and found["revoked"],
        timeout=10.0,
        interval=POLL,
        message="worker-v offline and revoked",
    )
    # … and the job reschedules, saying why: another worker takes the role
    job = get(api, f"/api/jobs/{job_id}/")
    assert job["status"] == "allocating"
    ended_at = datetime.fromisoformat(ended["ended_at"]).strftime("%H:%M:%S")
    note = f"lease on worker-v released at {ended_at} UTC: the worker's token was revoked"
    assert job["status_reason"].endswith(note), job["status_reason"]
    other = daemon_factory(name="worker-w", token=tokens["worker-w"])
    replacement = wait_until(
        lambda: active_lease(api, job_id, renewed=1), timeout=20.0, interval=POLL, message="a new lease"
    )
    assert replacement["worker"] == "worker-w"
    assert other.poll() is None
