"""An inference job's page, live (issue 19): the snapshot carries the slices' progress and the inference
section, a result stored through the real upload endpoint reaches the page's socket as a ``progress`` event
(slices done, the result's link), and the last one completes the job in a ``job`` event."""

from __future__ import annotations

import json

import pytest
from channels.db import database_sync_to_async

from apps.dashboard import live
from tests.apps.dashboard.inference_fixtures import running_inference_job, store_result
from tests.apps.dashboard.test_consumers import TIMEOUT, browser_socket, next_event  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def inference_job(
    job_owner, rig_a, rig_b, tiny_text, sent, django_capture_on_commit_callbacks, settings, tmp_path
):
    settings.HYPHA_DATA_DIR = tmp_path
    return running_inference_job(job_owner, [rig_a, rig_b], django_capture_on_commit_callbacks, settings)


async def test_each_stored_result_reaches_the_page_and_the_last_completes_it(
    browser_socket,  # noqa: F811
    inference_job,
    job_owner,
    rig_a,
    rig_b,
    sent,
):
    # given: Ada's inference job page is open
    live._last_progress.clear()
    connected, _, socket = await browser_socket(f"/ws/dashboard/jobs/{inference_job.pk}/", user=job_owner)
    assert connected
    snapshot = json.loads(await socket.receive_from(timeout=TIMEOUT))
    assert snapshot["job"]["kind"] == "inference"
    assert (snapshot["progress"]["slices_done"], snapshot["progress"]["slices_total"]) == (0, 4)
    assert snapshot["inference"]["task"] == "generate"
    assert sorted(worker["worker"] for worker in snapshot["inference"]["workers"]) == ["rig-a", "rig-b"]

    # when: rig-a stores the result of its first slice
    index = await database_sync_to_async(store_result)(inference_job, rig_a, sent)

    # then: a progress event with the slice counted and its result linked (not throttled away)
    event = await next_event(socket, "progress")
    assert (event["progress"]["slices_done"], event["progress"]["percent"]) == (1, 25)
    assert event["progress"]["text"].startswith("slice 1 of 4 done")
    assert [result["index"] for result in event["inference"]["results"]] == [index]
    assert event["inference"]["results"][0]["url"] == f"/api/jobs/{inference_job.pk}/results/{index}/"
    [worker_a] = [worker for worker in event["inference"]["workers"] if worker["worker"] == "rig-a"]
    assert worker_a["results"] == 1

    # when: a second result at once (within the training throttle's interval) is sent too
    await database_sync_to_async(store_result)(inference_job, rig_b, sent)
    second = await next_event(socket, "progress")
    assert second["progress"]["slices_done"] == 2

    # when: the last two: the job completes, and a job event says so with the full bar
    for rig in (rig_a, rig_b):
        await database_sync_to_async(store_result)(inference_job, rig, sent)
    job_event = await next_event(socket, "job")
    while job_event["job"]["status"] != "completed":
        job_event = await next_event(socket, "job")
    assert (job_event["progress"]["slices_done"], job_event["progress"]["percent"]) == (4, 100)
    assert job_event["inference"]["results_stored"] == 4
