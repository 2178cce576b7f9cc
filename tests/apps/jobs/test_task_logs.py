"""Each task's full log on the control plane (issue 16, item 8): kept from the daemon's ``task_log`` frames
(and its exit's last lines), size-capped and rotated, served to the job's owner at
``GET /api/jobs/<job>/tasks/<task>/log`` as text/plain."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from apps.jobs import services as job_services
from apps.jobs.models import Job
from tests.apps.jobs.test_training import SPEC, create_running_job, ready, task_of
from worker_daemon import protocol


@pytest.fixture
def running_job(
    job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings, tmp_path
) -> Job:
    settings.HYPHA_OFFER_WINDOW = 60.0
    settings.HYPHA_DATA_DIR = tmp_path
    return create_running_job(SPEC, job_owner, online_rigs, django_capture_on_commit_callbacks)


def owner_client(job: Job) -> APIClient:
    client = APIClient()
    client.force_authenticate(job.owner)
    return client


def send(worker, task, lines: list[str]) -> None:
    job_services.task_output(worker=worker, message=protocol.TaskLog(task_id=task.pk, lines=lines))


def log_url(job, task) -> str:
    return f"/api/jobs/{job.pk}/tasks/{task.pk}/log"


@pytest.mark.django_db
def test_the_owner_downloads_a_tasks_full_log_and_no_one_else_sees_it(
    running_job, online_rigs, bob, operator
):
    # given: a trainer's output in three frames, longer than the 100-line tail the job keeps
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    task = task_of(running_job, rig_a)
    for start in (0, 100, 200):
        send(rig_a, task, [f"step {n}" for n in range(start, start + 100)])

    # when
    response = owner_client(running_job).get(log_url(running_job, task))

    # then: every line, in order, as text
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    assert response.content.decode().splitlines() == [f"step {n}" for n in range(300)]
    task.refresh_from_db()
    assert len(task.log_tail.splitlines()) == 100
    # another user gets a 404 (as for the job itself), even asking for text
    refused = bob.client.get(log_url(running_job, task), HTTP_ACCEPT="text/plain")
    assert refused.status_code == 404
    assert bob.client.get(log_url(running_job, task)).json() == {"detail": "No such task."}
    # staff see every job, so its logs too
    assert operator.client.get(log_url(running_job, task)).status_code == 200
    # a task of the job with no output yet: an empty log; a task id of no task of this job: 404
    server = task_of(running_job, rig_c)
    empty = owner_client(running_job).get(log_url(running_job, server))
    assert (empty.status_code, empty.content) == (200, b"")
    other = owner_client(running_job).get(f"/api/jobs/{running_job.pk}/tasks/{running_job.pk}/log")
    assert other.status_code == 404
    # without credentials: 401
    assert APIClient().get(log_url(running_job, task)).status_code in (401, 403)


@pytest.mark.django_db
def test_past_the_cap_the_oldest_output_is_dropped_and_the_log_says_so(running_job, online_rigs, settings):
    # given: a small cap
    settings.HYPHA_TASK_LOG_MAX_BYTES = 2048
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    task = task_of(running_job, rig_a)

    # when: far more output than the cap arrives, in many frames
    lines = [f"line {n:05d} " + "x" * 40 for n in range(1000)]
    for start in range(0, len(lines), 5):
        send(rig_a, task, lines[start : start + 5])

    # then: what is kept stays within the cap, ends with the newest line, and starts by saying what was dropped
    directory = settings.HYPHA_DATA_DIR / "logs" / str(running_job.pk)
    kept_bytes = sum(
        path.stat().st_size for path in directory.glob(f"{task.pk}.log*") if path.suffix != ".dropped"
    )
    assert 0 < kept_bytes <= 2048
    text = owner_client(running_job).get(log_url(running_job, task)).content.decode()
    first, *rest = text.splitlines()
    sent_bytes = sum(len(line) + 1 for line in lines)
    assert first == (
        f"[hypha: the first {sent_bytes - kept_bytes} bytes of this log were dropped "
        "(HYPHA_TASK_LOG_MAX_BYTES = 2048)]"
    )
    assert rest == lines[-len(rest) :]
    assert len(rest) >= 2048 // 2 // 52  # at least half the cap's worth of whole lines


@pytest.mark.django_db
def test_hostile_output_holds_the_cap_and_never_fails(running_job, online_rigs, settings):
    # given: the smallest cap, and a worker token holder sending the largest frames the protocol allows,
    # with NUL (which PostgreSQL cannot store), four-byte characters and embedded newlines
    settings.HYPHA_TASK_LOG_MAX_BYTES = 1024
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    task = task_of(running_job, rig_a)
    huge = ["\x00" * 10 + "\U0001f600" * 990] * 200
    for _ in range(5):
        send(rig_a, task, huge)
    send(rig_a, task, ["fake\nline", "last"])

    # then: the cap holds and the log is served
    directory = settings.HYPHA_DATA_DIR / "logs" / str(running_job.pk)
    kept = sum(path.stat().st_size for path in directory.glob(f"{task.pk}.log*") if path.suffix != ".dropped")
    assert kept <= 1024
    response = owner_client(running_job).get(log_url(running_job, task))
    assert response.status_code == 200
    assert response.content.decode().endswith("fake\nline\nlast\n")
    assert response.content.decode().startswith("[hypha: the first ")
    task.refresh_from_db()
    assert "\x00" not in task.log_tail and task.log_tail.endswith("last")


@pytest.mark.django_db
def test_a_task_that_ended_before_forwarding_any_output_keeps_its_last_lines(running_job, online_rigs):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    # given: a trainer whose output was forwarded, which then exits: it keeps that, not its tail again
    forwarded = task_of(running_job, rig_a)
    send(rig_a, forwarded, ["a", "b"])
    exited = protocol.JobExited(task_id=forwarded.pk, exit_code=0, log_tail="b")
    job_services.task_exited(worker=rig_a, message=exited)
    assert owner_client(running_job).get(log_url(running_job, forwarded)).content == b"a\nb\n"

    # when: a trainer fails at once: its daemon sent only job_exited's log tail
    task = task_of(running_job, rig_b)
    exited = protocol.JobExited(task_id=task.pk, exit_code=1, log_tail="Traceback\nValueError: no")
    job_services.task_exited(worker=rig_b, message=exited)

    # then: the tail is its log; later frames of the ended task add nothing
    send(rig_b, task, ["late"])
    assert owner_client(running_job).get(log_url(running_job, task)).content == b"Traceback\nValueError: no\n"


@pytest.mark.django_db
def test_a_frame_larger_than_half_the_cap_keeps_its_newest_whole_lines(running_job, online_rigs, settings):
    # given: a small cap and some earlier output
    settings.HYPHA_TASK_LOG_MAX_BYTES = 2048
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    task = task_of(running_job, rig_a)
    earlier = [f"early {n}" for n in range(10)]
    send(rig_a, task, earlier)

    # when: one frame of 60 lines of 50 bytes (3000 bytes) arrives
    burst = [f"burst {n:03d} " + "y" * 39 for n in range(60)]
    send(rig_a, task, burst)

    # then: the earlier output, then the burst's newest whole lines within half the cap (20 of 50 bytes)
    text = owner_client(running_job).get(log_url(running_job, task)).content.decode()
    note, *rest = text.splitlines()
    assert note == "[hypha: the first 2000 bytes of this log were dropped (HYPHA_TASK_LOG_MAX_BYTES = 2048)]"
    assert rest == earlier + burst[-20:]


@pytest.mark.django_db
def test_logs_of_jobs_ended_longer_ago_than_the_retention_are_deleted_by_the_clock(
    running_job, online_rigs, settings, job_owner, django_capture_on_commit_callbacks, tmp_path
):
    # given: a 30-day retention; the running job's trainer has output, and a second job of the owner ended
    # 31 days ago with output of its own, and a directory of logs no job owns (a job row deleted by hand)
    from datetime import timedelta

    from django.utils import timezone

    from apps.jobs import tasks
    from apps.jobs.training import task_logs

    settings.HYPHA_TASK_LOG_RETENTION_DAYS = 30
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    kept_task = task_of(running_job, rig_a)
    send(rig_a, kept_task, ["still running"])
    old_task = task_of(running_job, rig_c)
    send(rig_c, old_task, ["server output"])
    job_services.cancel_job(running_job, reason="test")
    running_job.refresh_from_db()
    orphan = tmp_path / "logs" / "00000000-0000-4000-8000-000000000000"
    orphan.mkdir(parents=True)
    (orphan / "x.log").write_text("nobody's")
    # when: the sweep runs 29 days after the job ended
    Job.objects.filter(pk=running_job.pk).update(ended_at=timezone.now() - timedelta(days=29))
    tasks.sweep_task_logs()
    # then: the ended job's logs are still served, the orphan directory is gone
    client = owner_client(running_job)
    assert client.get(log_url(running_job, kept_task)).content == b"still running\n"
    assert not orphan.exists()
    # when: 31 days after
    Job.objects.filter(pk=running_job.pk).update(ended_at=timezone.now() - timedelta(days=31))
    tasks.sweep_task_logs()
    # then: the files are gone and the log says why, not an empty 200 that looks like silence
    assert not task_logs.log_directory(running_job.pk).exists()
    response = client.get(log_url(running_job, kept_task))
    assert response.status_code == 200
    assert (
        "deleted" in response.content.decode()
        and "HYPHA_TASK_LOG_RETENTION_DAYS" in response.content.decode()
    )
    # and: a retention of 0 keeps logs for ever
    settings.HYPHA_TASK_LOG_RETENTION_DAYS = 0
    task_logs.append(running_job.pk, kept_task.pk, ["kept"])
    Job.objects.filter(pk=running_job.pk).update(ended_at=timezone.now() - timedelta(days=3650))
    tasks.sweep_task_logs()
    assert task_logs.read(running_job.pk, kept_task.pk) == "kept\n"
