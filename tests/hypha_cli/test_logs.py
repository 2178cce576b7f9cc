"""``hypha logs JOB [--task TASK]``: every task's full log under a header line, or one task's log alone
(issue 16, item 8)."""

from __future__ import annotations

import json

import httpx
import pytest

from hypha_cli.exceptions import ExitCode
from tests.hypha_cli.conftest import JOB_ID, job, json_response

SERVER_TASK = "3f1e8a52-6d0b-4c8e-9a43-2f4b1c9d7e01"
TRAINER_TASK = "a7c2d915-0e4f-4b6a-8c3d-5e9f1a2b3c4d"
TASKS = [
    {
        "id": SERVER_TASK,
        "role": "parameter_server",
        "worker": "rig-c",
        "status": "running",
        "exit_code": None,
    },
    {"id": TRAINER_TASK, "role": "trainer", "worker": "rig-a", "status": "failed", "exit_code": 3},
]


def text(body: str) -> httpx.Response:
    return httpx.Response(200, content=body.encode(), headers={"Content-Type": "text/plain; charset=utf-8"})


def serve(api) -> None:
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = json_response(200, job(tasks=TASKS))
    api.routes[("GET", f"/api/jobs/{JOB_ID}/tasks/{SERVER_TASK}/log")] = text("listening\nround 1\n")
    api.routes[("GET", f"/api/jobs/{JOB_ID}/tasks/{TRAINER_TASK}/log")] = text("step 1\nValueError: é\n")


def test_logs_prints_every_tasks_log_under_a_header(api, hypha, capsys):
    serve(api)

    assert hypha("logs", JOB_ID) == ExitCode.OK

    assert capsys.readouterr().out == (
        f"==> parameter_server on rig-c ({SERVER_TASK}, running) <==\n"
        "listening\nround 1\n"
        "\n"
        f"==> trainer on rig-a ({TRAINER_TASK}, failed, exit 3) <==\n"
        "step 1\nValueError: é\n"
    )


def test_logs_of_one_task_prints_its_log_alone_by_id_or_the_start_of_it(api, hypha, capsys):
    serve(api)

    assert hypha("logs", JOB_ID, "--task", TRAINER_TASK[:8]) == ExitCode.OK
    assert capsys.readouterr().out == "step 1\nValueError: é\n"
    assert hypha("logs", JOB_ID, "--task", SERVER_TASK) == ExitCode.OK
    assert capsys.readouterr().out == "listening\nround 1\n"
    # only that task's log was asked for
    asked = [request.url.path for request in api.requests if request.url.path.endswith("/log")]
    assert asked == [
        f"/api/jobs/{JOB_ID}/tasks/{TRAINER_TASK}/log",
        f"/api/jobs/{JOB_ID}/tasks/{SERVER_TASK}/log",
    ]


def test_logs_json_prints_each_task_with_its_log(api, hypha, capsys):
    serve(api)

    assert hypha("logs", JOB_ID, "--json") == ExitCode.OK

    assert json.loads(capsys.readouterr().out) == [
        {
            "id": SERVER_TASK,
            "role": "parameter_server",
            "worker": "rig-c",
            "status": "running",
            "log": "listening\nround 1\n",
        },
        {
            "id": TRAINER_TASK,
            "role": "trainer",
            "worker": "rig-a",
            "status": "failed",
            "log": "step 1\nValueError: é\n",
        },
    ]


def test_an_unknown_task_exits_4_and_a_job_without_tasks_says_so(api, hypha, capsys):
    serve(api)

    assert hypha("logs", JOB_ID, "--task", "ffff") == ExitCode.NOT_FOUND
    assert capsys.readouterr().err == (
        f"hypha: error: job {JOB_ID} has no task 'ffff' (`hypha logs {JOB_ID}` lists its tasks)\n"
    )

    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = json_response(200, job("pending"))
    assert hypha("logs", JOB_ID) == ExitCode.OK
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"job {JOB_ID} has no tasks yet (pending)\n")


def test_logs_of_a_missing_job_exits_4(api, hypha):
    assert hypha("logs", JOB_ID) == ExitCode.NOT_FOUND


# --- against a real control plane (pytest-django's live server, over real HTTP) -------------------------------


@pytest.fixture
def logged_task(leased_job, bobs_worker, settings, tmp_path):
    """A running trainer of alice's job on bob's worker, whose daemon forwarded two frames of output."""
    from apps.jobs import services as job_services
    from apps.jobs.models import Task
    from worker_daemon import protocol

    settings.HYPHA_DATA_DIR = tmp_path
    task = Task.objects.create(
        job=leased_job, lease=leased_job.leases.get(), role="trainer", status=Task.Status.RUNNING
    )
    for lines in (["step 1", "step 2"], ["round 1: 2 steps ✓"]):
        job_services.task_output(worker=bobs_worker, message=protocol.TaskLog(task_id=task.pk, lines=lines))
    return task


def test_logs_against_a_real_control_plane(live_server, alice, bob, logged_task, tmp_path, capsys):
    from hypha_cli.__main__ import run

    def hypha(persona, *argv: str) -> int:
        return run(
            ["logs", "--server", live_server.url, "--token", persona.token, *argv],
            environ={"HOME": str(tmp_path)},
        )

    job_id = str(logged_task.job_id)
    assert hypha(alice, job_id) == ExitCode.OK
    assert capsys.readouterr().out == (
        f"==> trainer on bobs-gpu ({logged_task.pk}, running) <==\nstep 1\nstep 2\nround 1: 2 steps ✓\n"
    )
    assert hypha(alice, job_id, "--task", str(logged_task.pk)[:8]) == ExitCode.OK
    assert capsys.readouterr().out == "step 1\nstep 2\nround 1: 2 steps ✓\n"
    # bob runs the worker but does not own the job: not found
    assert hypha(bob, job_id) == ExitCode.NOT_FOUND
