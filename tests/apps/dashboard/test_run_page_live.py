"""The job page's progress bar follows the run live: the snapshot and every later event carry the progress
(``apps.dashboard.progress``), so the bar moves with the trainers' steps and the rounds."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from channels.db import database_sync_to_async

from apps.dashboard import live
from tests.apps.dashboard.conftest import record_round, status, task_of
from tests.apps.dashboard.test_consumers import TIMEOUT, browser_socket, next_event  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db(transaction=True)


async def test_progress_moves_with_steps_and_rounds(
    browser_socket,  # noqa: F811 (the fixture imported above)
    training_job,
    online_rigs,
    job_owner,
    monkeypatch,
):
    # given: the throttle's clock stands still (every first step of the test is sent)
    monkeypatch.setattr(live, "time", SimpleNamespace(monotonic=lambda: 1000.0))
    live._last_progress.clear()
    connected, _, socket = await browser_socket(f"/ws/dashboard/jobs/{training_job.pk}/", user=job_owner)
    assert connected
    snapshot = json.loads(await socket.receive_from(timeout=TIMEOUT))
    assert (snapshot["progress"]["fraction"], snapshot["progress"]["rounds_total"]) == (0.0, 3)
    rig_a = online_rigs[0]

    def one_step() -> None:
        status(
            rig_a, task_of(training_job, rig_a), {"status": {"batch_size": 4, "loss": 4.0, "step_time": 0.1}}
        )

    # when: rig-a takes a step (1 of 3, rig-b none: 1/6 of round 1), then round 1 is recorded
    await database_sync_to_async(one_step)()
    stepped = await next_event(socket, "progress")
    await database_sync_to_async(record_round)(training_job, online_rigs, 1)
    event = await next_event(socket, "round")
    while not event["round"]["closed"]:
        event = await next_event(socket, "round")
    job_event = await next_event(socket, "job")

    # then: each event carries the progress as of its commit
    assert (stepped["progress"]["fraction"], stepped["progress"]["steps_done"]) == (0.0556, 0)
    assert event["progress"]["rounds_done"] == 1
    assert job_event["progress"]["rounds_done"] == 1
    assert job_event["progress"]["text"].startswith("round 1 of 3 done")
