"""The job page's executor logs: each task with output links its full log (``GET /api/jobs/<id>/tasks/<task>/log``),
which the signed-in owner downloads with the page's session; the header says the lines stream while it runs
(issue 16, item 8)."""

from __future__ import annotations

import pytest

from apps.jobs import services as job_services
from tests.apps.dashboard.conftest import task_of
from worker_daemon import protocol


@pytest.mark.django_db
def test_each_task_with_output_links_its_full_log(
    training_job, online_rigs, ada_browser, eve_browser, settings, tmp_path
):
    # given: a trainer that printed its lines
    settings.HYPHA_DATA_DIR = tmp_path
    rig = online_rigs[0]
    task = task_of(training_job, rig)
    job_services.task_output(
        worker=rig, message=protocol.TaskLog(task_id=task.pk, lines=["step 1", "step 2"])
    )

    # when
    html = ada_browser.get(f"/jobs/{training_job.pk}/").content.decode()

    # then: the header tells what happens, and the task links its full log
    assert "streamed every few seconds while it runs" in html
    assert "once it exits" not in html
    url = f"/api/jobs/{training_job.pk}/tasks/{task.pk}/log"
    assert f'<a class="task-log" href="{url}" download="task-{task.pk}.log">full log</a>' in html
    assert (
        f'data-log-url="/api/jobs/{training_job.pk}/tasks/00000000-0000-0000-0000-000000000000/log"' in html
    )
    # the link works with the page's session, for the owner only
    response = ada_browser.get(url)
    assert (response.status_code, response.content) == (200, b"step 1\nstep 2\n")
    assert eve_browser.get(url).status_code == 404
