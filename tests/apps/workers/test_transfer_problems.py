"""Transfer problems from outside: a daemon's ``transfer_problem`` frame through the real gateway consumer ends up
in ``GET /api/jobs/<id>/`` (and its ``transfer_ok`` takes it out again); a malformed or foreign one gets an error
frame and changes nothing."""

from __future__ import annotations

import asyncio
import json

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connections
from rest_framework.test import APIClient

from apps.datasets import services as dataset_services
from apps.jobs.models import Job, Task
from apps.leases.models import Lease
from apps.workers.models import Worker
from hypha_site.asgi import router
from tests.apps.conftest import CAPACITY, TRAIN
from tests.apps.jobs.conftest import SLICES
from tests.apps.jobs.test_training import SPEC, create_running_job
from worker_daemon import protocol

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 30.0  # generous: a busy machine runs the database calls in a thread pool
SINCE = "2026-03-01T10:00:00+00:00"


@pytest.fixture
def running_job(job_owner, online_rigs, sent, django_capture_on_commit_callbacks, settings) -> Job:
    """A DiLoCo job whose tasks are dispatched: rig-a and rig-b train, rig-c serves the parameter server."""
    settings.HYPHA_OFFER_WINDOW = 60.0  # the offers settle the adverts, never the window
    node, _ = dataset_services.create_data_node(name="data-east", url="http://east.example:8100")
    dataset_services.register_dataset(node, "tiny-text", SLICES)
    return create_running_job(SPEC, job_owner, online_rigs, django_capture_on_commit_callbacks)


@pytest.fixture
async def daemon_of():
    """Connects a rig over the gateway as its daemon would, holding its active leases (``await daemon_of(rig)``);
    every connection is closed at the end."""
    opened: list[WebsocketCommunicator] = []

    async def connect(worker) -> WebsocketCommunicator:
        leases = await database_sync_to_async(
            lambda: list(
                Lease.objects.filter(worker=worker, status=Lease.Status.ACTIVE).values_list("pk", flat=True)
            )
        )()
        communicator = WebsocketCommunicator(
            router, "/ws/worker/", headers=[(b"authorization", f"Bearer {worker.token}".encode())]
        )
        opened.append(communicator)
        connected, _ = await communicator.connect(timeout=TIMEOUT)
        assert connected
        hello = protocol.Hello(
            protocol_version=protocol.PROTOCOL_VERSION,
            resources=CAPACITY,
            executors=[TRAIN],
            leases=leases,
            reachable=True,
        )
        await communicator.send_to(text_data=protocol.encode(hello))
        welcome = await communicator.receive_json_from(timeout=TIMEOUT)
        assert welcome["type"] == "welcome", welcome
        assert [lease["lease_id"] for lease in welcome["leases"]] == [str(lease) for lease in leases]
        # The gateway repeats the dispatch of the rig's live task after the welcome.
        dispatch = await communicator.receive_json_from(timeout=TIMEOUT)
        assert dispatch["type"] == "dispatch_job", dispatch
        return communicator

    yield connect
    for communicator in opened:
        if not communicator.future.done():
            await communicator.disconnect(timeout=TIMEOUT)
    await database_sync_to_async(connections.close_all)()


def job_detail(job: Job) -> dict:
    client = APIClient()
    client.force_authenticate(job.owner)
    response = client.get(f"/api/jobs/{job.pk}/")
    assert response.status_code == 200
    return response.json()


async def api_until(job: Job, check) -> dict:
    """``GET /api/jobs/<id>/`` until ``check(body)`` holds (a frame without a reply has then been handled)."""
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while True:
        body = await database_sync_to_async(job_detail)(job)
        if check(body):
            return body
        assert asyncio.get_running_loop().time() < deadline, body["transfer_problems"]
        await asyncio.sleep(0.05)


def problem_frame(task_id, **changes) -> dict:
    frame = {
        "type": "transfer_problem",
        "task_id": str(task_id),
        "peer": "0d5bba44-7a0e-4f3f-9a57-54f3c9f7e0b1",
        "role": "parameter_server",
        "url": "http://10.0.0.3:7070",
        "operation": "model file config.json",
        "cause": "Cannot connect to host 10.0.0.3:7070 ssl:default [Connect call failed ('10.0.0.3', 7070)]",
        "attempts": 4,
        "since": SINCE,
    }
    return {**frame, **changes}


def task_on(job: Job, worker) -> Task:
    return Task.objects.select_related("lease__worker").get(job=job, lease__worker=worker)


async def test_a_transfer_problem_frame_shows_on_the_job_until_its_transfer_ok(
    running_job, online_rigs, daemon_of
):
    rig_a = online_rigs[0]
    task = await database_sync_to_async(task_on)(running_job, rig_a)
    daemon = await daemon_of(rig_a)

    # when: the trainer's bridge cannot reach its parameter server
    await daemon.send_to(text_data=json.dumps(problem_frame(task.pk)))

    # then: the job says so, in the task and in the job's own list
    body = await api_until(running_job, lambda body: body["transfer_problems"])
    [shown] = body["transfer_problems"]
    updated_at = shown.pop("updated_at")
    assert shown == {
        "task": str(task.pk),
        "task_status": "dispatched",
        "worker": "rig-a",
        "peer": "0d5bba44-7a0e-4f3f-9a57-54f3c9f7e0b1",
        "role": "parameter_server",
        "url": "http://10.0.0.3:7070",
        "operation": "model file config.json",
        "cause": "Cannot connect to host 10.0.0.3:7070 ssl:default [Connect call failed ('10.0.0.3', 7070)]",
        "attempts": 4,
        "since": "2026-03-01T10:00:00Z",
    }
    [task_body] = [entry for entry in body["tasks"] if entry["id"] == str(task.pk)]
    assert task_body["transfer_problems"] == [
        {key: value for key, value in shown.items() if key not in ("task", "task_status", "worker")}
        | {"updated_at": updated_at}
    ]
    others = [entry["transfer_problems"] for entry in body["tasks"] if entry["id"] != str(task.pk)]
    assert others == [[], []]

    # when: it fails again, for another operation, then the parameter server answers
    await daemon.send_to(
        text_data=json.dumps(
            problem_frame(
                task.pk,
                operation="round 1 update",
                attempts=5,
                since="2026-03-01T10:00:09+00:00",
                cause="timeout",
            )
        )
    )
    body = await api_until(running_job, lambda body: body["transfer_problems"][0]["attempts"] == 5)
    [shown] = body["transfer_problems"]
    # the problem began with the first report
    assert (shown["operation"], shown["cause"], shown["since"]) == (
        "round 1 update",
        "timeout",
        "2026-03-01T10:00:00Z",
    )
    await daemon.send_to(
        text_data=json.dumps(
            {"type": "transfer_ok", "task_id": str(task.pk), "peer": "0d5bba44-7a0e-4f3f-9a57-54f3c9f7e0b1"}
        )
    )

    # then
    body = await api_until(running_job, lambda body: not body["transfer_problems"])
    assert [entry["transfer_problems"] for entry in body["tasks"]] == [[], [], []]
    assert await daemon.receive_nothing(timeout=0.2)  # neither frame is answered


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attempts": 0}, "invalid 'transfer_problem': attempts: Input should be greater than or equal to 1"),
        (
            {"since": "2026-03-01T10:00:00"},
            "invalid 'transfer_problem': since: Input should have timezone info",
        ),
        (
            {"role": "scheduler"},
            "invalid 'transfer_problem': role: Input should be 'parameter_server' or 'data_node'",
        ),
        ({"peer": ""}, "invalid 'transfer_problem': peer: String should have at least 1 character"),
        (
            {"cause": "x" * 1001},
            "invalid 'transfer_problem': cause: String should have at most 1000 characters",
        ),
    ],
    ids=["no attempt", "naive since", "unknown role", "no peer", "cause too long"],
)
async def test_a_malformed_transfer_problem_gets_an_error_frame_and_changes_nothing(
    running_job, online_rigs, daemon_of, changes, message
):
    rig_a = online_rigs[0]
    task = await database_sync_to_async(task_on)(running_job, rig_a)
    daemon = await daemon_of(rig_a)

    # when
    await daemon.send_to(text_data=json.dumps(problem_frame(task.pk, **changes)))

    # then
    assert await daemon.receive_json_from(timeout=TIMEOUT) == {
        "type": "error",
        "code": "malformed",
        "message": message,
        "ref": "transfer_problem",
        "lease_id": None,
        "at": None,
    }
    task = await database_sync_to_async(task_on)(running_job, rig_a)
    assert task.transfer_problems == {}
    assert (await database_sync_to_async(job_detail)(running_job))["transfer_problems"] == []


async def test_a_transfer_problem_of_another_workers_task_is_refused_and_changes_nothing(
    running_job, online_rigs, daemon_of
):
    rig_a, rig_b = online_rigs[:2]
    others = await database_sync_to_async(task_on)(running_job, rig_b)
    daemon = await daemon_of(rig_a)

    # when
    await daemon.send_to(text_data=json.dumps(problem_frame(others.pk)))

    # then
    assert await daemon.receive_json_from(timeout=TIMEOUT) == {
        "type": "error",
        "code": "refused",
        "message": f"task {others.pk} is not a task of this worker",
        "ref": "transfer_problem",
        "lease_id": None,
        "at": None,
    }
    assert (await database_sync_to_async(task_on)(running_job, rig_b)).transfer_problems == {}
    assert (await database_sync_to_async(job_detail)(running_job))["transfer_problems"] == []


async def test_a_hello_says_whether_the_worker_is_reachable(running_job, online_rigs, daemon_of, operator):
    rig_a = online_rigs[0]
    # as an older daemon's hello leaves it (the test rigs' hellos say "true")
    await database_sync_to_async(Worker.objects.filter(pk=rig_a.pk).update)(reachable="auto")

    # when
    await daemon_of(rig_a)

    # then
    response = await database_sync_to_async(operator.client.get)(f"/api/workers/{rig_a.pk}/")
    assert (response.status_code, response.json()["reachable"]) == (200, "true")
