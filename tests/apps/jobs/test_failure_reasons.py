"""A failed task fails its job with its root cause: a transfer problem it reported shortly before the end, else
what its daemon found in the output, else its last output line that is not a launcher's wrapper; and how the
control plane keeps transfer problems (one per peer, bounded, only for live tasks)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from apps.jobs import services as job_services
from apps.jobs.models import Job, Task
from apps.jobs.training import problems
from tests.apps.jobs.test_training import SPEC, create_running_job, task_of
from worker_daemon import protocol

pytestmark = pytest.mark.django_db

PEER = "0d5bba44-7a0e-4f3f-9a57-54f3c9f7e0b1"
#: The end of a trainer's output under ``accelerate launch`` when its parameter server cannot be reached.
LAUNCHER_TAIL = "\n".join(
    [
        "2026-03-01 10:15:00,000 INFO worker_daemon.executors.training: job 1: starting the trainer",
        '2026-03-01 10:30:01,000 ERROR worker_daemon.executors.training: BridgeCallError: /resources/fetch: HTTP 500: {"error":"connector_error","detail":"model file config.json: Cannot connect to host 10.0.0.3:7070"}',
        "Traceback (most recent call last):",
        '  File "/venv/lib/python3.11/site-packages/accelerate/commands/launch.py", line 1168, in simple_launcher',
        "    raise subprocess.CalledProcessError(returncode=process.returncode, cmd=cmd)",
        "subprocess.CalledProcessError: Command '['/venv/bin/python', '-m', 'worker_daemon.executors.training', "
        "'--socket', '/tmp/hypha-1/bridge.sock']' returned non-zero exit status 3.",
    ]
)


@pytest.fixture
def running_job(job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings) -> Job:
    settings.HYPHA_OFFER_WINDOW = 60.0  # the offers settle the adverts, never the window
    return create_running_job(SPEC, job_owner, online_rigs, django_capture_on_commit_callbacks)


def report(worker, task: Task, *, peer: str = PEER, since: datetime | None = None, **fields) -> bool:
    message = protocol.TransferProblem(
        task_id=task.pk,
        peer=peer,
        role=fields.pop("role", "parameter_server"),
        url=fields.pop("url", "http://10.0.0.3:7070"),
        operation=fields.pop("operation", "model file config.json"),
        cause=fields.pop("cause", "Cannot connect to host 10.0.0.3:7070"),
        attempts=fields.pop("attempts", 4),
        since=since or timezone.now() - timedelta(seconds=30),
    )
    return job_services.transfer_problem_reported(worker=worker, message=message)


def exit_failed(worker, task: Task, **fields) -> Job:
    job_services.task_exited(
        worker=worker,
        message=protocol.JobExited(task_id=task.pk, exit_code=fields.pop("exit_code", 1), **fields),
    )
    return Job.objects.get(pk=task.job_id)


def test_a_trainer_that_could_not_reach_its_parameter_server_fails_the_job_with_that_cause(
    running_job, online_rigs
):
    rig_a = online_rigs[0]
    task = task_of(running_job, rig_a)
    since = timezone.now() - timedelta(seconds=900)
    report(rig_a, task, since=since, attempts=14)

    # when: the launcher's wrapper is all its daemon (an older one) said
    job = exit_failed(rig_a, task, reason="exited with code 1", log_tail=LAUNCHER_TAIL)

    # then
    assert job.status == Job.Status.FAILED
    assert job.status_reason == (
        "FAILED: the trainer on rig-a failed with exit code 1: could not reach the parameter server at "
        "http://10.0.0.3:7070 for 900 s (model file config.json, 14 attempts): Cannot connect to host "
        "10.0.0.3:7070 — last output: 2026-03-01 10:30:01,000 ERROR worker_daemon.executors.training: "
        'BridgeCallError: /resources/fetch: HTTP 500: {"error":"connector_error","detail":"model file '
        "config.json: Cannot connect to host 10.0.0."
    )
    # the problem stays on the failed task: it says why
    assert [entry["cause"] for entry in problems.of_job(job)] == ["Cannot connect to host 10.0.0.3:7070"]


def test_without_a_transfer_problem_the_daemons_root_cause_is_the_reason(running_job, online_rigs):
    rig_a = online_rigs[0]
    task = task_of(running_job, rig_a)

    # when
    job = exit_failed(
        rig_a,
        task,
        reason="BridgeCallError: /resources/fetch: connector_error: model file config.json: Cannot connect",
        log_tail=LAUNCHER_TAIL,
    )

    # then: no launcher wrapper, no repeated output
    assert job.status_reason == (
        "FAILED: the trainer on rig-a failed with exit code 1: BridgeCallError: /resources/fetch: "
        "connector_error: model file config.json: Cannot connect"
    )


def test_an_older_daemons_bare_reason_shows_the_last_output_line_that_is_not_the_launchers(
    running_job, online_rigs
):
    rig_a = online_rigs[0]
    task = task_of(running_job, rig_a)
    tail = (
        "loss 2.1\nValueError: the batch has no 'labels'\nTraceback (most recent call last):\n  File \"x\"\n"
        + (
            "subprocess.CalledProcessError: Command '['/venv/bin/python', '-m', 'x']' returned non-zero exit status 1."
        )
    )

    # when
    job = exit_failed(rig_a, task, reason="exited with code 1", log_tail=tail)

    # then
    assert job.status_reason == (
        "FAILED: the trainer on rig-a failed with exit code 1 — last output: ValueError: the batch has no 'labels'"
    )


def test_a_stale_transfer_problem_is_not_blamed_for_a_later_failure(running_job, online_rigs):
    rig_a = online_rigs[0]
    task = task_of(running_job, rig_a)
    report(rig_a, task)
    stale = (timezone.now() - problems.CAUSE_WINDOW - timedelta(seconds=5)).isoformat()
    Task.objects.filter(pk=task.pk).update(
        transfer_problems={PEER: {**task_of(running_job, rig_a).transfer_problems[PEER], "updated_at": stale}}
    )

    # when
    job = exit_failed(rig_a, task, reason="DivergedError: the training loss is NaN")

    # then
    assert (
        job.status_reason
        == "FAILED: the trainer on rig-a failed with exit code 1: DivergedError: the training loss is NaN"
    )


def test_problems_are_kept_per_peer_and_cleared_when_the_peer_answers(running_job, online_rigs):
    rig_a = online_rigs[0]
    task = task_of(running_job, rig_a)
    first = datetime(2026, 3, 1, 10, 0, tzinfo=UTC)

    # when: the parameter server fails twice (the second for another operation), a data node once
    report(rig_a, task, since=first, attempts=4)
    report(
        rig_a,
        task,
        since=first + timedelta(seconds=60),
        attempts=5,
        operation="round 1 update",
        cause="timeout",
    )
    report(
        rig_a,
        task,
        peer="east.example:8100",
        role="data_node",
        url="http://east.example:8100/datasets/tiny-text/slices/0",
        operation="slice download (tiny-text)",
        cause="answered 503",
        attempts=1,
        since=first + timedelta(seconds=5),
    )

    # then: one entry per peer, the latest report of each, since its first
    stored = task_of(running_job, rig_a).transfer_problems
    assert sorted(stored) == [PEER, "east.example:8100"]
    assert {key: stored[PEER][key] for key in ("operation", "cause", "attempts", "since")} == {
        "operation": "round 1 update",
        "cause": "timeout",
        "attempts": 5,
        "since": "2026-03-01T10:00:00+00:00",
    }
    assert [(entry["peer"], entry["role"]) for entry in problems.of_job(running_job)] == [
        (PEER, "parameter_server"),
        ("east.example:8100", "data_node"),
    ]

    # when: the parameter server answers again; a peer never reported answers too
    cleared = job_services.transfer_recovered(
        worker=rig_a, message=protocol.TransferOk(task_id=task.pk, peer=PEER)
    )
    unknown = job_services.transfer_recovered(
        worker=rig_a, message=protocol.TransferOk(task_id=task.pk, peer="nobody:1")
    )

    # then
    assert (cleared, unknown) == (True, False)
    assert list(task_of(running_job, rig_a).transfer_problems) == ["east.example:8100"]


def test_a_task_keeps_the_latest_problems_of_at_most_16_peers(running_job, online_rigs):
    rig_a = online_rigs[0]
    task = task_of(running_job, rig_a)

    # when
    for number in range(problems.MAX_PEERS + 3):
        report(rig_a, task, peer=f"node-{number:02}:80", role="data_node")

    # then
    stored = task_of(running_job, rig_a).transfer_problems
    assert sorted(stored) == [f"node-{number:02}:80" for number in range(3, problems.MAX_PEERS + 3)]


def test_an_ended_task_takes_no_new_problem(running_job, online_rigs):
    rig_a = online_rigs[0]
    task = task_of(running_job, rig_a)
    exit_failed(rig_a, task, reason="DivergedError: the training loss is NaN")

    # when
    kept = report(rig_a, task)

    # then
    assert kept is False
    assert task_of(running_job, rig_a).transfer_problems == {}


def test_a_daemons_clock_ahead_does_not_put_a_problem_in_the_future(running_job, online_rigs, frozen_now):
    rig_a = online_rigs[0]
    task = task_of(running_job, rig_a)

    # when
    report(rig_a, task, since=frozen_now + timedelta(hours=1))

    # then
    assert task_of(running_job, rig_a).transfer_problems[PEER]["since"] == frozen_now.isoformat()
