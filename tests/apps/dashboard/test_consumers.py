"""The browsers' websockets, driven with WebsocketCommunicator against ``hypha_site.asgi.router`` with a real
session cookie: a job's page gets a snapshot, then live events after commit; another user's job, an anonymous
visitor and a foreign Origin are refused during the handshake."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from types import SimpleNamespace

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connections, transaction
from django.test import Client

from apps.dashboard import live, snapshots
from apps.dashboard.consumers import FORBIDDEN, NOT_LOGGED_IN
from apps.jobs import services as job_services
from apps.jobs import training
from apps.jobs.models import Job
from hypha_site.asgi import router
from tests.apps.dashboard.conftest import record_round, status, task_of
from worker_daemon import protocol

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 30.0  # generous: a busy machine runs the database calls in a thread pool


def session_cookie(user) -> bytes:
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}".encode()


@pytest.fixture
async def browser_socket():
    """``await browser_socket(path, user=…, origin=…)`` → (connected, close code or None, communicator)."""
    opened: list[WebsocketCommunicator] = []

    async def open_socket(path: str, *, user=None, origin: bytes | None = b"http://testserver"):
        headers = [(b"host", b"testserver")]
        if origin is not None:
            headers.append((b"origin", origin))
        if user is not None:
            headers.append((b"cookie", await database_sync_to_async(session_cookie)(user)))
        communicator = WebsocketCommunicator(router, path, headers=headers)
        opened.append(communicator)
        connected, code = await communicator.connect(timeout=TIMEOUT)
        return connected, code, communicator

    yield open_socket
    for communicator in opened:
        if not communicator.future.done():
            await communicator.disconnect(timeout=TIMEOUT)
    await database_sync_to_async(connections.close_all)()


async def next_event(communicator: WebsocketCommunicator, kind: str) -> dict:
    """The next event of type ``kind`` (events of other types before it are skipped)."""
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while True:
        remaining = deadline - asyncio.get_running_loop().time()
        assert remaining > 0, f"no {kind!r} event in time"
        event = json.loads(await communicator.receive_from(timeout=remaining))
        if event["type"] == kind:
            return event


# --- the job's socket -------------------------------------------------------------------------------------


async def test_the_owner_gets_a_snapshot_and_then_the_round_as_it_is_recorded(
    browser_socket, training_job, online_rigs, job_owner
):
    # given: Ada's job page is open
    connected, _, socket = await browser_socket(f"/ws/dashboard/jobs/{training_job.pk}/", user=job_owner)
    assert connected
    snapshot = json.loads(await socket.receive_from(timeout=TIMEOUT))
    assert (snapshot["type"], snapshot["job"]["status"], snapshot["rounds"]) == ("snapshot", "running", [])

    # when: the trainers and the parameter server report round 1
    await database_sync_to_async(record_round)(training_job, online_rigs, 1, losses=(3.5, 3.7), eval_loss=3.4)

    # then: round events (the trainers' metrics, then the parameter server's report) and the job's new reason
    rig_a, rig_b, _ = online_rigs
    event = await next_event(socket, "round")
    while not event["round"]["closed"]:
        event = await next_event(socket, "round")
    round_ = event["round"]
    assert (round_["number"], round_["mean_loss"], round_["eval_loss"], round_["samples"]) == (
        1,
        3.6,
        3.4,
        24,
    )
    assert round_["trainer_metrics"] == {str(rig_a.pk): {"loss": 3.5}, str(rig_b.pk): {"loss": 3.7}}
    assert (round_["bytes_in"], round_["bytes_out"], round_["duration"]) == (4096, 2048, 1.5)
    assert sorted(trainer["worker"] for trainer in event["trainers"]) == ["rig-a", "rig-b"]
    assert event["data"]["total"] == 3
    job_event = await next_event(socket, "job")
    assert job_event["job"]["status_reason"] == "RUNNING: round 1 of 3 applied (2 trainers, eval loss 3.4000)"
    assert [lease["worker"] for lease in job_event["leases"]] == ["rig-c", "rig-a", "rig-b"]


async def test_trainer_progress_is_throttled_per_job(
    browser_socket, training_job, online_rigs, job_owner, monkeypatch
):
    # given: the throttle's clock stands still until the test moves it (a busy machine may take longer than
    # the interval between two steps)
    clock = {"now": 1000.0}
    monkeypatch.setattr(live, "time", SimpleNamespace(monotonic=lambda: clock["now"]))
    live._last_progress.clear()
    connected, _, socket = await browser_socket(f"/ws/dashboard/jobs/{training_job.pk}/", user=job_owner)
    assert connected
    await socket.receive_from(timeout=TIMEOUT)  # the snapshot
    rig_a = online_rigs[0]

    def steps(count: int) -> None:
        task = task_of(training_job, rig_a)
        for _ in range(count):
            status(rig_a, task, {"status": {"batch_size": 4, "loss": 4.0, "step_time": 0.1}})

    # when: two steps at once — only the first is sent; a step after the interval is sent again
    await database_sync_to_async(steps)(2)
    first = await next_event(socket, "progress")
    assert await socket.receive_nothing(timeout=0.2)
    clock["now"] += live.PROGRESS_INTERVAL
    await database_sync_to_async(steps)(1)
    second = await next_event(socket, "progress")

    # then
    [trainer_a_first] = [trainer for trainer in first["trainers"] if trainer["worker"] == "rig-a"]
    [trainer_a_second] = [trainer for trainer in second["trainers"] if trainer["worker"] == "rig-a"]
    assert (trainer_a_first["steps_total"], trainer_a_first["samples_total"]) == (1, 4)
    assert (trainer_a_second["steps_total"], trainer_a_second["samples_total"]) == (3, 12)
    assert trainer_a_second["last_loss"] == 4.0


async def test_the_snapshot_and_a_progress_event_carry_the_jobs_cost(
    browser_socket, training_job, online_rigs, job_owner
):
    # given: Ada's job page is open (the snapshot: its cost at the socket's start)
    connected, _, socket = await browser_socket(f"/ws/dashboard/jobs/{training_job.pk}/", user=job_owner)
    assert connected
    snapshot = json.loads(await socket.receive_from(timeout=TIMEOUT))
    live._last_progress.clear()

    # when: a trainer reports a step
    def step() -> None:
        status(
            online_rigs[0], task_of(training_job, online_rigs[0]), {"status": {"batch_size": 4, "loss": 4.0}}
        )

    await database_sync_to_async(step)()
    event = await next_event(socket, "progress")

    # then: both frames carry the cost so far (read at the send; the fixture's leases run on the real clock)
    for frame in (snapshot, event):
        assert set(frame["cost"]) == {"credits", "max_cost", "as_of"}
        assert Decimal(frame["cost"]["credits"]) >= 0 and frame["cost"]["max_cost"] is None
    assert event["cost"]["as_of"] >= snapshot["cost"]["as_of"]


async def test_a_cancelled_job_is_announced_to_its_page(browser_socket, training_job, job_owner):
    connected, _, socket = await browser_socket(f"/ws/dashboard/jobs/{training_job.pk}/", user=job_owner)
    assert connected
    await socket.receive_from(timeout=TIMEOUT)

    await database_sync_to_async(job_services.cancel_job)(training_job, reason="cancelled by its owner")

    event = await next_event(socket, "job")
    assert (event["job"]["status"], event["job"]["final"]) == ("cancelled", True)
    assert {lease["status"] for lease in event["leases"]} == {"released"}


async def test_another_users_job_is_refused(browser_socket, training_job, eve):
    connected, code, _ = await browser_socket(f"/ws/dashboard/jobs/{training_job.pk}/", user=eve)

    assert (connected, code) == (False, FORBIDDEN)


async def test_staff_may_watch_any_job(browser_socket, training_job, operator):
    connected, _, socket = await browser_socket(f"/ws/dashboard/jobs/{training_job.pk}/", user=operator.user)

    assert connected
    assert json.loads(await socket.receive_from(timeout=TIMEOUT))["job"]["id"] == str(training_job.pk)


async def test_an_anonymous_visitor_is_refused(browser_socket, training_job):
    connected, code, _ = await browser_socket(f"/ws/dashboard/jobs/{training_job.pk}/")

    assert (connected, code) == (False, NOT_LOGGED_IN)


async def test_another_sites_page_is_refused(browser_socket, training_job, job_owner):
    connected, code, _ = await browser_socket(
        f"/ws/dashboard/jobs/{training_job.pk}/", user=job_owner, origin=b"http://evil.example"
    )

    assert (connected, code) == (False, FORBIDDEN)


# --- the page converges on what a fresh load shows (issue 16) ---------------------------------------------

#: The sections of the job page that a fresh load and the live page must agree on.
PAGE_SECTIONS = ("job", "leases", "tasks", "trainers", "rounds", "events", "data")


class LivePage:
    """What the job page's script holds (``apply`` in static/dashboard/dashboard.js): the snapshot, then each
    event applied to it the way the script applies it."""

    def __init__(self, snapshot: dict) -> None:
        self.state = snapshot

    def apply(self, event: dict) -> None:
        if event["type"] == "snapshot":
            self.state = event
        elif event["type"] == "job":
            for key in ("job", "leases", "tasks", "trainers", "events", "data"):
                if key in event:
                    self.state[key] = event[key]
        elif event["type"] == "round":
            number = event["round"]["number"]
            others = [round_ for round_ in self.state["rounds"] if round_["number"] != number]
            self.state["rounds"] = sorted([*others, event["round"]], key=lambda round_: round_["number"])
            self.state["trainers"], self.state["data"] = event["trainers"], event["data"]
        elif event["type"] == "progress":
            self.state["trainers"], self.state["data"] = event["trainers"], event["data"]

    def sections(self) -> dict:
        return {key: self.state.get(key) for key in PAGE_SECTIONS}


def fresh_sections(job_id) -> dict:
    """The sections as a fresh load of the page gets them (its snapshot, encoded as the page gets it)."""
    snapshot = json.loads(snapshots.to_json(snapshots.job_snapshot(Job.objects.get(pk=job_id))))
    return {key: snapshot.get(key) for key in PAGE_SECTIONS}


async def follow(socket: WebsocketCommunicator, page: LivePage, until) -> None:
    """Apply the socket's events to ``page`` until ``until(page)`` holds (fails after :data:`TIMEOUT`)."""
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while not until(page):
        remaining = deadline - asyncio.get_running_loop().time()
        assert remaining > 0, f"the page did not get there in time: {page.sections()}"
        page.apply(json.loads(await socket.receive_from(timeout=remaining)))


async def open_page(browser_socket, job, user) -> tuple[WebsocketCommunicator, LivePage]:
    connected, _, socket = await browser_socket(f"/ws/dashboard/jobs/{job.pk}/", user=user)
    assert connected
    snapshot = json.loads(await socket.receive_from(timeout=TIMEOUT))
    assert snapshot["type"] == "snapshot"
    return socket, LivePage(snapshot)


def transitions(sections: dict) -> list[tuple[str, str, str]]:
    return [(event["from_status"], event["to_status"], event["reason"]) for event in sections["events"]]


def complete(job: Job, rigs) -> None:
    """The job's three rounds are recorded, its parameter server stores the model and exits, then its
    trainers exit: the job completes with the last."""
    rig_a, rig_b, rig_c = rigs
    for number in (1, 2, 3):
        record_round(
            job, rigs, number, losses=(3.5 - number / 10, 3.7 - number / 10), eval_loss=3.4 - number / 10
        )
    token = training.transfer_token(task_of(job, rig_c).lease)
    for name, body in (("config.json", b'{"model_type": "gpt2"}'), ("model.safetensors", b"weights")):
        response = Client().put(
            f"/api/jobs/{job.pk}/model/{name}",
            body,
            content_type="application/octet-stream",
            HTTP_AUTHORIZATION=f"Bearer {token}",
        )
        assert response.status_code == 201, response.content
    for rig in (rig_c, rig_a, rig_b):
        job_services.task_exited(
            worker=rig, message=protocol.JobExited(task_id=task_of(job, rig).pk, exit_code=0)
        )
    job.refresh_from_db()
    assert job.status == Job.Status.COMPLETED, job.status_reason


async def test_a_page_open_through_the_jobs_end_shows_what_a_fresh_load_shows(
    browser_socket, training_job, online_rigs, job_owner
):
    # given: Ada's job page is open while the job runs
    socket, page = await open_page(browser_socket, training_job, job_owner)

    # when: the job runs its rounds to the end
    await database_sync_to_async(complete)(training_job, online_rigs)
    fresh = await database_sync_to_async(fresh_sections)(training_job.pk)

    # then: the live page comes to show exactly what a fresh load shows: every transition in its history,
    # every task ended (in the task list and the trainers' table), every round, the job final
    await follow(socket, page, lambda page: page.sections() == fresh)
    assert transitions(fresh)[:4] == [
        ("running", "completed", "COMPLETED: 3 rounds; eval loss 3.1000"),
        ("running", "running", "RUNNING: round 3 of 3 applied (2 trainers, eval loss 3.1000)"),
        ("running", "running", "RUNNING: round 2 of 3 applied (2 trainers, eval loss 3.2000)"),
        ("running", "running", "RUNNING: round 1 of 3 applied (2 trainers, eval loss 3.3000)"),
    ]
    assert [trainer["status"] for trainer in fresh["trainers"]] == ["exited", "exited"]
    assert {task["status"] for task in fresh["tasks"]} == {"exited"}
    assert (fresh["job"]["status"], fresh["job"]["final"]) == ("completed", True)
    assert [round_["closed"] for round_ in fresh["rounds"]] == [True, True, True]


async def test_transitions_committed_together_all_reach_the_pages_history(
    browser_socket, training_job, job_owner
):
    # given
    socket, page = await open_page(browser_socket, training_job, job_owner)
    before = transitions(page.sections())

    # when: two transitions commit in one transaction (their two events both read the state after both)
    def two_at_once() -> None:
        with transaction.atomic():
            job = Job.objects.get(pk=training_job.pk)
            job.transition(Job.Status.RUNNING, reason="RUNNING: first")
            job.transition(Job.Status.RUNNING, reason="RUNNING: second")

    await database_sync_to_async(two_at_once)()

    # then
    await follow(socket, page, lambda page: len(page.sections()["events"]) == len(before) + 2)
    assert transitions(page.sections()) == [
        ("running", "running", "RUNNING: second"),
        ("running", "running", "RUNNING: first"),
        *before,
    ]


async def test_a_trainers_end_reaches_the_page_while_the_job_runs_on(
    browser_socket, training_job, online_rigs, job_owner
):
    # given
    socket, page = await open_page(browser_socket, training_job, job_owner)
    rig_a = online_rigs[0]

    # when: one trainer's process exits (the job waits for its parameter server)
    await database_sync_to_async(job_services.task_exited)(
        worker=rig_a,
        message=protocol.JobExited(
            task_id=(await database_sync_to_async(task_of)(training_job, rig_a)).pk, exit_code=3
        ),
    )

    # then: its row says so in the trainers' table and in the task list
    def ended(page: LivePage) -> bool:
        trainers = {trainer["worker"]: trainer["status"] for trainer in page.sections()["trainers"]}
        return trainers.get("rig-a") == "failed"

    await follow(socket, page, ended)
    [task] = [task for task in page.sections()["tasks"] if task["worker"] == "rig-a"]
    assert (task["status"], task["exit_code"]) == ("failed", 3)


async def test_a_trainers_new_sync_state_is_sent_even_within_the_progress_interval(
    browser_socket, training_job, online_rigs, job_owner, monkeypatch
):
    # given: the throttle's clock stands still; a step was just sent
    clock = {"now": 2000.0}
    monkeypatch.setattr(live, "time", SimpleNamespace(monotonic=lambda: clock["now"]))
    live._last_progress.clear()
    socket, page = await open_page(browser_socket, training_job, job_owner)
    rig_a = online_rigs[0]

    def report(progress) -> None:
        status(rig_a, task_of(training_job, rig_a), progress)

    await database_sync_to_async(report)({"status": {"batch_size": 4, "loss": 4.0, "step_time": 0.1}})
    await next_event(socket, "progress")

    # when: within the same interval, the trainer sends its update (training → updating)
    await database_sync_to_async(report)("update")

    # then: that change is sent at once, not left to the next event
    event = await next_event(socket, "progress")
    [trainer] = [trainer for trainer in event["trainers"] if trainer["worker"] == "rig-a"]
    assert (trainer["sync_state"], trainer["steps_total"]) == ("updating", 1)


# --- the overview's socket --------------------------------------------------------------------------------


async def test_the_overview_hears_of_the_users_own_jobs_only(browser_socket, training_job, job_owner, eve):
    # given: Ada's and Eve's overviews are open
    _, _, ada = await browser_socket("/ws/dashboard/", user=job_owner)
    _, _, eve_socket = await browser_socket("/ws/dashboard/", user=eve)

    # when
    await database_sync_to_async(job_services.cancel_job)(training_job, reason="cancelled by its owner")

    # then
    event = json.loads(await ada.receive_from(timeout=TIMEOUT))
    assert event == {
        "type": "job",
        "job": {
            "id": str(training_job.pk),
            "name": "tiny-gpt",
            "status": "cancelled",
            "status_reason": "CANCELLED: cancelled by its owner",
        },
    }
    assert await eve_socket.receive_nothing(timeout=0.3)


async def test_the_overview_of_staff_hears_of_every_job(browser_socket, training_job, operator):
    _, _, socket = await browser_socket("/ws/dashboard/", user=operator.user)

    await database_sync_to_async(job_services.cancel_job)(training_job, reason="cancelled by staff")

    event = json.loads(await socket.receive_from(timeout=TIMEOUT))
    assert (event["job"]["id"], event["job"]["status"]) == (str(training_job.pk), "cancelled")


async def test_the_overview_refuses_an_anonymous_visitor(browser_socket):
    connected, code, _ = await browser_socket("/ws/dashboard/")

    assert (connected, code) == (False, NOT_LOGGED_IN)


async def test_the_worker_gateway_is_not_reachable_with_a_session(browser_socket, job_owner):
    # The gateway ignores the session: without a worker token it is refused (error frame, then 4000).
    connected, _, socket = await browser_socket("/ws/worker/", user=job_owner)

    assert connected
    frame = json.loads(await socket.receive_from(timeout=TIMEOUT))
    assert frame["type"] == "error"
    output = await socket.receive_output(timeout=TIMEOUT)
    assert (output["type"], output["code"]) == ("websocket.close", 4000)
