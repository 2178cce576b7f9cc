"""The job page shows the transfer problems of its tasks: rendered with the page (the card hidden while there are
none) and sent live with the job's next event, as ``GET /api/jobs/<id>/`` lists them."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from channels.db import database_sync_to_async

from apps.jobs import services as job_services
from tests.apps.dashboard.conftest import task_of
from tests.apps.dashboard.test_consumers import TIMEOUT, browser_socket, next_event  # noqa: F401 (a fixture)
from worker_daemon import protocol

CAUSE = "Cannot connect to host 10.0.0.3:7070 ssl:default [Connect call failed ('10.0.0.3', 7070)]"


def report(job, rig) -> None:
    job_services.transfer_problem_reported(
        worker=rig,
        message=protocol.TransferProblem(
            task_id=task_of(job, rig).pk,
            peer=str(job.tasks.get(role="parameter_server").lease.worker_id),
            role="parameter_server",
            url="http://10.0.0.3:7070",
            operation="round 1 update",
            cause=CAUSE,
            attempts=4,
            since=datetime(2026, 3, 1, 10, 0, tzinfo=UTC),
        ),
    )


@pytest.mark.django_db
def test_the_job_page_shows_a_problem_and_hides_the_card_without_one(training_job, online_rigs, ada_browser):
    # given: no problem yet
    html = ada_browser.get(f"/jobs/{training_job.pk}/").content.decode()
    assert '<section class="card" id="problems-card" hidden>' in html

    # when
    report(training_job, online_rigs[0])

    # then
    html = ada_browser.get(f"/jobs/{training_job.pk}/").content.decode()
    assert '<section class="card" id="problems-card">' in html
    assert (
        f'<tr><td><a href="/workers/{online_rigs[0].pk}/">rig-a</a></td><td>parameter_server '
        f'{online_rigs[2].pk}</td><td class="mono small">http://10.0.0.3:7070</td><td>round 1 update</td>'
        '<td class="error">Cannot connect to host 10.0.0.3:7070 ssl:default [Connect call failed (&#x27;10.0.0.3&#x27;, 7070)]</td>'
        '<td class="num">4</td><td class="mono small"><time datetime="2026-03-01T10:00:00+00:00" title="'
    ) in html
    assert ' ago">2026-03-01 10:00:00 UTC</time></td></tr>' in html


@pytest.mark.django_db(transaction=True)
async def test_a_reported_problem_reaches_the_open_job_page(
    browser_socket,  # noqa: F811 (the fixture imported above)
    training_job,
    online_rigs,
    job_owner,
):
    connected, _, socket = await browser_socket(f"/ws/dashboard/jobs/{training_job.pk}/", user=job_owner)
    assert connected
    snapshot = json.loads(await socket.receive_from(timeout=TIMEOUT))
    assert [task["transfer_problems"] for task in snapshot["tasks"]] == [[], [], []]

    # when
    await database_sync_to_async(report)(training_job, online_rigs[0])

    # then
    event = await next_event(socket, "job")
    [problem] = [problem for task in event["tasks"] for problem in task["transfer_problems"]]
    assert (problem["operation"], problem["cause"], problem["attempts"], problem["since"]) == (
        "round 1 update",
        CAUSE,
        4,
        "2026-03-01T10:00:00Z",
    )
