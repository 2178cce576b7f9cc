"""The worker benchmark end to end: a real control plane and a real ``hypha-worker-daemon`` that runs its
benchmark at start (the default); the score reaches the API, and a staff request runs it again.

Deadlines, not speed: the benchmark takes a few seconds on an idle 2-core machine, longer on a busy one.
"""

from __future__ import annotations

import httpx
import pytest

from tests.modes import only_in_mode

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

#: The daemon kills a benchmark after 60 s; the rest is start-up on a loaded machine.
BENCHMARK_DEADLINE = 90.0


def worker_named(api: httpx.Client, name: str) -> dict | None:
    response = api.get("/api/workers/", params={"limit": 100})
    response.raise_for_status()
    return next((worker for worker in response.json()["results"] if worker["name"] == name), None)


@only_in_mode("services", "the rerun frame travels over channels_redis there, the path a deployment uses")
def test_the_start_benchmark_reaches_the_control_plane_and_staff_can_rerun_it(
    control_plane, daemon_factory, wait_until
):
    # given: a daemon slowed 1.5× that benchmarks at start
    token = control_plane.manage("create_worker_token", "bench-1")
    daemon = daemon_factory(name="bench-1", token=token, benchmark=True, options=("--slowdown", "1.5"))

    with control_plane.api() as api:
        # when it has connected and measured
        worker = wait_until(
            lambda: (found := worker_named(api, "bench-1")) and found["benchmark_score"] and found,
            timeout=BENCHMARK_DEADLINE,
            message="a benchmark score for bench-1",
        )

        # then: the score and the details of the measurement are the worker's
        first = worker["benchmark"]
        assert worker["status"] == "online"
        assert worker["benchmark_score"] == first["score"] > 0
        assert (first["model"], first["device"], first["slowdown"]) == ("tiny-gpt-2x128", "cpu", 1.5)

        # when a staff user asks for a new run
        response = api.post(f"/api/workers/{worker['id']}/benchmark/")
        assert response.status_code == 202, response.text

        # then a new measurement replaces it
        rerun = wait_until(
            lambda: (
                (found := worker_named(api, "bench-1"))["benchmark"].get("measured_at")
                != first["measured_at"]
                and found
            ),
            timeout=BENCHMARK_DEADLINE,
            message="a second benchmark of bench-1",
        )
        assert rerun["benchmark_score"] == rerun["benchmark"]["score"] > 0
        assert "error" not in rerun["benchmark"]
    assert "worker benchmark: " in daemon.logs()
