"""Tasks through the whole daemon: dispatch, status round trips, lease loss and shutdown against a scripted
control plane (a websockets server on 127.0.0.1), with a real child process as the executor."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from worker_daemon import protocol
from worker_daemon.config import WorkerConfig

EXECUTOR = r"""
import json, sys, time
import httpx

socket_path, job_json = sys.argv[1:3]
mode = json.loads(job_json)["executor"]["config"]["mode"]
if mode == "status":
    client = httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), base_url="http://hypha", timeout=10)
    reply = client.post("/status/send", json={"status": {"batch_size": 2}}).json()
    print("reply", json.dumps(reply), flush=True)
    sys.exit(0 if reply == {"type": "Done"} else 1)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def config(short_dir: Path) -> WorkerConfig:
    script = short_dir / "executor.py"
    script.write_text(EXECUTOR)
    return WorkerConfig.model_validate(
        {
            "work_dir": str(short_dir / "w"),
            "resources": {"cpu": 8, "memory": 32, "storage": 100, "gpu": 24},
            "offer": {"price": 120.0, "floor": 100.0},
            "kill_grace": 0.5,
            "executors": [
                {
                    "class": "train",
                    "name": "diloco-transformer",
                    "runtime": "process",
                    "cmd": sys.executable,
                    "args": [str(script), "{SOCKET_PATH}", "{JOB_JSON}"],
                }
            ],
        }
    )


async def leased(control_plane, daemons, config, make):
    """A daemon holding one ACTIVE lease: (connection, lease id, job id)."""
    daemon, _ = daemons.start(config=config, server_url=control_plane.url)
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)
    advertisement = make.advertisement()
    await connection.send(make.welcome(advertisements=[advertisement]))
    offer = await connection.expect(protocol.Offer)
    lease_id = uuid.uuid4()
    await connection.send(make.grant(advertisement, lease_id, resources=offer.resources, expires_in=30.0))
    await make.wait_until(lambda: daemon.session.book.lease(lease_id) is not None)
    return daemon, connection, lease_id, advertisement.job_id


def dispatch(lease_id: uuid.UUID, job_id: uuid.UUID, mode: str) -> protocol.DispatchJob:
    return protocol.DispatchJob(
        task_id=uuid.uuid4(),
        lease_id=lease_id,
        job_id=job_id,
        role="trainer",
        spec={
            "job_id": str(job_id),
            "executor": {
                "class": "train",
                "descriptor": {"name": "diloco-transformer"},
                "config": {"mode": mode},
            },
        },
    )


async def test_a_dispatched_task_reports_status_and_its_exit(control_plane, daemons, config, make):
    daemon, connection, lease_id, job_id = await leased(control_plane, daemons, config, make)
    message = dispatch(lease_id, job_id, "status")

    await connection.send(message)

    assert await connection.expect(protocol.JobStarted) == protocol.JobStarted(task_id=message.task_id)
    report = await connection.expect(protocol.StatusReport, timeout=10)
    assert (report.task_id, report.progress) == (message.task_id, {"status": {"batch_size": 2}})
    await connection.send(protocol.StatusReply(request_id=report.request_id, reply={"type": "Done"}))
    exited = await connection.expect(protocol.JobExited, timeout=10)
    assert (exited.task_id, exited.exit_code, exited.cancelled) == (message.task_id, 0, False)
    assert exited.log_tail == 'reply {"type": "Done"}'
    assert daemon.jobs.tasks == {}
    assert list((config.work_dir).iterdir()) == []


async def test_an_ended_lease_stops_its_task(control_plane, daemons, config, make):
    daemon, connection, lease_id, job_id = await leased(control_plane, daemons, config, make)
    message = dispatch(lease_id, job_id, "sleep")
    await connection.send(message)
    await connection.expect(protocol.JobStarted)
    await make.wait_until(lambda: "ready" in daemon.jobs.tasks[message.task_id].output)

    await connection.send(protocol.LeaseEnded(lease_id=lease_id, status="expired", reason="not renewed"))

    exited = await connection.expect(protocol.JobExited, timeout=10)
    assert (exited.task_id, exited.cancelled, exited.reason) == (
        message.task_id,
        True,
        f"lease {lease_id} ended",
    )


async def test_cancel_job_and_a_refused_dispatch(control_plane, daemons, config, make):
    daemon, connection, lease_id, job_id = await leased(control_plane, daemons, config, make)
    refused = dispatch(uuid.uuid4(), job_id, "sleep")
    await connection.send(refused)
    exited = await connection.expect(protocol.JobExited)
    assert (exited.task_id, exited.reason) == (
        refused.task_id,
        f"lease {refused.lease_id} is not held (active) by this worker",
    )

    message = dispatch(lease_id, job_id, "sleep")
    await connection.send(message)
    await connection.expect(protocol.JobStarted)
    await connection.send(protocol.CancelJob(task_id=message.task_id, reason="job cancelled"))
    exited = await connection.expect(protocol.JobExited, timeout=10)
    assert (exited.task_id, exited.cancelled, exited.reason) == (message.task_id, True, "job cancelled")


async def test_shutdown_stops_tasks_before_releasing_leases(control_plane, daemons, config, make):
    daemon, connection, lease_id, job_id = await leased(control_plane, daemons, config, make)
    message = dispatch(lease_id, job_id, "sleep")
    await connection.send(message)
    await connection.expect(protocol.JobStarted)

    daemon.request_shutdown(reason="test")

    exited = await connection.expect(protocol.JobExited, timeout=10)
    assert (exited.task_id, exited.cancelled, exited.reason) == (
        message.task_id,
        True,
        "daemon shutting down",
    )
    release = await connection.expect(protocol.ReleaseLease)
    assert release.lease_id == lease_id


async def test_an_exit_while_disconnected_is_sent_after_the_next_welcome(
    control_plane, daemons, config, make
):
    daemon, connection, lease_id, job_id = await leased(control_plane, daemons, config, make)
    message = dispatch(lease_id, job_id, "sleep")
    await connection.send(message)
    await connection.expect(protocol.JobStarted)

    # when the connection drops, and the task is cancelled before the next welcome
    await connection.close(1011, "restart")
    connection = await control_plane.next_connection()
    hello = await connection.expect(protocol.Hello)
    assert hello.leases == [lease_id]
    daemon.jobs.cancel(message.task_id, reason="cancelled while offline")
    await make.wait_until(lambda: daemon.jobs.tasks == {})
    # (its output, if it printed any yet, goes just before: task_log)
    assert [frame.type for frame in daemon.jobs.link.queued if frame.type != "task_log"] == ["job_exited"]
    await connection.expect_silence(seconds=0.1)

    # then its exit is reported after the welcome (whose lease list keeps the lease)
    resources = protocol.Resources(cpu=8, memory=32, storage=100, gpu=24)
    await connection.send(make.welcome(leases=[make.lease_info(lease_id, resources=resources)]))
    exited = await connection.expect(protocol.JobExited)
    assert (exited.task_id, exited.reason) == (message.task_id, "cancelled while offline")


async def test_a_fresh_transfer_token_frame_reaches_the_running_task(control_plane, daemons, config, make):
    # given a running task dispatched with a token that will expire
    daemon, connection, lease_id, job_id = await leased(control_plane, daemons, config, make)
    message = dispatch(lease_id, job_id, "sleep").model_copy(update={"transfer_token": "first-token"})
    await connection.send(message)
    await connection.expect(protocol.JobStarted)

    # when the control plane sends a fresh one over the websocket (as it does with each lease renewal)
    await connection.send(protocol.TransferToken(task_id=message.task_id, transfer_token="fresh-token"))

    # then the daemon's parser takes the frame and the task holds the new token; no error frame comes back
    await make.wait_until(lambda: daemon.jobs.tasks[message.task_id].dispatch.transfer_token == "fresh-token")
    await connection.expect_silence(seconds=0.2)


async def test_a_task_whose_authorisation_is_lost_is_reported_failed_with_the_reason(
    control_plane, daemons, config, make
):
    # given a running task
    daemon, connection, lease_id, job_id = await leased(control_plane, daemons, config, make)
    message = dispatch(lease_id, job_id, "sleep")
    await connection.send(message)
    await connection.expect(protocol.JobStarted)
    await make.wait_until(lambda: "ready" in daemon.jobs.tasks[message.task_id].output)

    # when its bridge gives up on a token the parameter server keeps refusing
    daemon.jobs.tasks[message.task_id].backend.authorisation.grace = 0.0
    daemon.jobs.tasks[message.task_id].backend.authorisation.refused("round 3: 401 transfer token expired")

    # then the daemon stops it and reports a failure (not a cancellation) with the reason
    exited = await connection.expect(protocol.JobExited, timeout=10)
    assert (exited.task_id, exited.cancelled, exited.exit_code) == (message.task_id, False, None)
    assert exited.reason.startswith("the parameter server refused this task's transfer token for 0 s")
    assert exited.reason.endswith("round 3: 401 transfer token expired")
