"""An elastic pool under churn with real processes (docs/training.md, "Elastic pools"; bench/churn.py).

A job of ``trainers = {min = 2, target = 4}`` on five trainer daemons; every few seconds a live trainer daemon
is killed (SIGKILL, its executor with it) while more than ``min`` are up, and comes back seconds later. The
job completes every round; every slice of a finished epoch is used exactly once and none is acknowledged twice
in an epoch; no round counts a trainer's update twice. The daemons lost count toward the replacement limit only
while no round closes (``dispatch.MAX_REPLACEMENTS_PER_TRAINER``), so churn that lets rounds close never fails
the job.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.conftest import only_in_mode, services_mode

pytestmark = pytest.mark.timeout(900)

ROUNDS = 4


@only_in_mode(
    "embedded", "the pool and its replacements are the control plane's logic, the same in both modes"
)
def test_a_churning_pool_completes_using_every_slice_once_and_counting_every_update_once(
    tmp_path: Path,
) -> None:
    from bench.churn import churn

    # given / when: daemons killed every 7–10 s, each back 5–10 s later
    started = time.monotonic()
    result = churn(
        tmp_path,
        minimum=2,
        target=4,
        daemons=5,
        rounds=ROUNDS,
        inner_steps=4,
        seed=2,
        # Generous: ~85 s on a quiet machine. At most four kills, so a loaded machine's longer run is not also
        # a harsher one (more daemons lost while a slow round is open would reach the replacement limit).
        timeout=600.0,
        kill_every=(7.0, 10.0),
        back_after=(5.0, 10.0),
        max_kills=4,
        mode="services" if services_mode() else "embedded",
    )

    # then
    job, checks = result["job"], result["checks"]
    assert job["status"] == "completed", f"{job['status_reason']}\n{result['logs']}"
    assert result["kills"], "no daemon was killed: the test saw no churn"
    assert [round_["number"] for round_ in job["rounds"]] == list(range(1, ROUNDS + 1))
    assert checks["twice"] == [], job["rounds"]
    # No slice skipped in an epoch: none handed out in epoch e + 1 before its epoch e was used. (One released
    # by a killed daemon's lease near the end may stay AVAILABLE in its epoch when the job stops claiming.)
    assert checks["overtaken"] == 0, result["slices"]
    assert checks["acknowledged_twice"] == 0, result["slices"]
    lost = [task for task in job["tasks"] if task["role"] == "trainer" and task["status"] == "cancelled"]
    assert len(lost) >= 1, job["tasks"]
    print(
        f"churn e2e: {time.monotonic() - started:.0f} s ({result['elapsed']:.0f} s training), "
        f"{len(result['kills'])} kills, {len(lost)} lost"
    )
