"""Worker benchmarks on the control plane: the score arrives in ``hello`` or ``benchmark_result``, offers carry
it, operators ask for a new run (API for staff, admin action), and bad scores change nothing."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest
from channels.db import database_sync_to_async
from django.urls import reverse

from apps.market.models import Offer
from apps.workers import services
from apps.workers.models import Worker
from tests.apps.conftest import advert, market_rows, offer_on
from tests.apps.workers.test_consumers import TIMEOUT, gateway, greet, receive  # noqa: F401 - fixture
from worker_daemon import protocol

pytestmark = pytest.mark.django_db(transaction=True)

MEASURED_AT = datetime(2026, 11, 22, 3, 0, tzinfo=UTC)


def result(score: float = 412.5, **fields) -> protocol.BenchmarkResult:
    return protocol.BenchmarkResult(
        score=score,
        device="cpu",
        model="tiny-gpt-2x128",
        parameters=445952,
        batch_size=8,
        sequence_length=128,
        threads=2,
        warmup_steps=2,
        steps=40,
        step_seconds=8 / score,
        duration_seconds=4.5,
        slowdown=1.0,
        torch_version="2.13.0",
        measured_at=MEASURED_AT,
        **fields,
    )


def details(benchmark: protocol.BenchmarkResult) -> dict:
    return json.loads(benchmark.model_dump_json())


snapshot = database_sync_to_async(market_rows)


async def refetch(worker: Worker) -> Worker:
    return await database_sync_to_async(Worker.objects.get)(pk=worker.pk)


# --- hello --------------------------------------------------------------------------------------------------


async def test_a_hello_with_a_benchmark_stores_its_score_and_details(gateway, rig_a):  # noqa: F811
    communicator = await gateway(rig_a.token)

    await greet(communicator, benchmark=result(412.5))

    worker = await refetch(rig_a)
    assert worker.benchmark_score == 412.5
    assert worker.benchmark == details(result(412.5))


async def test_a_hello_without_a_benchmark_is_welcomed_and_keeps_the_last_score(gateway, rig_a):  # noqa: F811
    # given: a score from an earlier connection
    await database_sync_to_async(rig_a.record_benchmark)(result(300.0))
    communicator = await gateway(rig_a.token)

    # when: an old daemon (or one still measuring) says hello without one
    await greet(communicator)

    # then
    worker = await refetch(rig_a)
    assert (worker.status, worker.benchmark_score) == ("online", 300.0)


BAD_SCORES = {
    "negative": -5,
    "zero": 0,
    "NaN": "NaN",
    "infinite": "Infinity",
    "huge": 1e12,
    "a string": '"x"',
}


@pytest.mark.parametrize("case", list(BAD_SCORES))
async def test_a_hello_with_a_bad_score_is_refused_and_the_connection_survives(gateway, rig_a, case):  # noqa: F811
    # given
    communicator = await gateway(rig_a.token)
    frame = json.loads(protocol.encode(protocol.Hello(
        protocol_version=1, resources=protocol.Resources(cpu=2), executors=[], benchmark=result(),
    )))  # fmt: skip
    text = json.dumps(frame).replace('"score": 412.5', f'"score": {BAD_SCORES[case]}')
    assert text != json.dumps(frame)
    before = await snapshot()

    # when
    await communicator.send_to(text_data=text)

    # then: an error frame naming the field, nothing stored, and a good hello still works
    [error] = await receive(communicator)
    assert (error["type"], error["code"], error["ref"]) == ("error", "malformed", "hello")
    assert "benchmark.score" in error["message"]
    assert await snapshot() == before
    await greet(communicator)
    assert (await refetch(rig_a)).benchmark_score is None


# --- benchmark_result -----------------------------------------------------------------------------------------


async def test_a_benchmark_result_stores_the_new_score(gateway, rig_a):  # noqa: F811
    communicator = await gateway(rig_a.token)
    await greet(communicator, benchmark=result(100.0))
    request_id = uuid.uuid4()

    await communicator.send_to(
        text_data=protocol.encode(protocol.BenchmarkReport(request_id=request_id, benchmark=result(250.0)))
    )

    assert await communicator.receive_nothing(timeout=0.3)  # no reply: it is a report
    worker = await refetch(rig_a)
    assert (worker.benchmark_score, worker.benchmark) == (250.0, details(result(250.0)))


async def test_a_failed_benchmark_keeps_the_score_and_records_why(gateway, rig_a):  # noqa: F811
    communicator = await gateway(rig_a.token)
    await greet(communicator, benchmark=result(100.0))

    await communicator.send_to(
        text_data=protocol.encode(protocol.BenchmarkReport(error="busy: 1 task(s) or lease(s) held"))
    )
    assert await communicator.receive_nothing(timeout=0.3)

    worker = await refetch(rig_a)
    assert worker.benchmark_score == 100.0
    assert worker.benchmark["error"] == "busy: 1 task(s) or lease(s) held"
    assert worker.benchmark["score"] == 100.0 and "error_at" in worker.benchmark


@pytest.mark.parametrize(
    "body",
    [
        {"type": "benchmark_result"},  # neither result nor error
        {"type": "benchmark_result", "error": "x", "benchmark": "RESULT"},  # both
        {"type": "benchmark_result", "benchmark": {"score": 10}},  # details missing
        {"type": "benchmark_result", "benchmark": "RESULT", "request_id": "not-a-uuid"},
    ],
)
async def test_a_malformed_benchmark_result_is_refused_and_changes_nothing(gateway, rig_a, body):  # noqa: F811
    communicator = await gateway(rig_a.token)
    await greet(communicator)
    before = await snapshot()
    if body.get("benchmark") == "RESULT":
        body = {**body, "benchmark": details(result())}

    await communicator.send_to(text_data=json.dumps(body))

    [error] = await receive(communicator)
    assert (error["type"], error["code"], error["ref"]) == ("error", "malformed", "benchmark_result")
    assert await snapshot() == before


# --- offers -----------------------------------------------------------------------------------------------------


async def test_an_offer_carries_the_score_into_its_row(gateway, rig_a, job):  # noqa: F811
    communicator = await gateway(rig_a.token)
    await greet(communicator, benchmark=result(412.5))
    ad = await database_sync_to_async(advert)(job, "trainer")

    await communicator.send_to(text_data=protocol.encode(offer_on(ad, price=100.0, benchmark_score=412.5)))

    frames = await receive(communicator, 1)
    assert frames[-1]["type"] == "offer_received", frames
    offer = await database_sync_to_async(Offer.objects.get)(pk=frames[-1]["offer_id"])
    assert offer.benchmark_score == 412.5


async def test_an_offer_without_a_score_stores_none(gateway, rig_a, job):  # noqa: F811
    communicator = await gateway(rig_a.token)
    await greet(communicator)
    ad = await database_sync_to_async(advert)(job, "trainer")

    await communicator.send_to(text_data=protocol.encode(offer_on(ad, price=100.0)))

    [frame] = await receive(communicator)
    offer = await database_sync_to_async(Offer.objects.get)(pk=frame["offer_id"])
    assert offer.benchmark_score is None


async def test_an_offer_with_a_negative_score_is_refused_and_changes_nothing(gateway, rig_a, job):  # noqa: F811
    communicator = await gateway(rig_a.token)
    await greet(communicator)
    ad = await database_sync_to_async(advert)(job, "trainer")
    before = await snapshot()
    frame = json.loads(protocol.encode(offer_on(ad, price=100.0)))

    await communicator.send_to(text_data=json.dumps({**frame, "benchmark_score": -1}))

    [error] = await receive(communicator)
    assert (error["code"], error["ref"]) == ("malformed", "offer")
    assert await snapshot() == before


# --- asking for a run -------------------------------------------------------------------------------------------


async def test_request_benchmark_sends_run_benchmark_to_the_connected_daemon(gateway, rig_a):  # noqa: F811
    communicator = await gateway(rig_a.token)
    await greet(communicator)

    message = await database_sync_to_async(services.request_benchmark)(await refetch(rig_a))

    [frame] = await receive(communicator)
    assert frame == {"type": "run_benchmark", "request_id": str(message.request_id)}


def test_request_benchmark_refuses_an_offline_worker(rig_a):
    from apps.workers.exceptions import WorkerOffline

    with pytest.raises(WorkerOffline, match="rig-a is offline"):
        services.request_benchmark(rig_a)


# --- API and admin ---------------------------------------------------------------------------------------------


def _sent_frames(monkeypatch) -> list[dict]:
    sent: list[dict] = []
    monkeypatch.setattr(
        "apps.workers.services.group_send_many",
        lambda sends: sent.extend({"group": group, **event} for group, event in sends),
    )
    return sent


def test_staff_can_ask_an_online_worker_for_a_benchmark(operator, bobs_worker, monkeypatch):
    sent = _sent_frames(monkeypatch)

    response = operator.client.post(f"/api/workers/{bobs_worker.pk}/benchmark/")

    assert response.status_code == 202, response.json()
    assert response.json()["id"] == str(bobs_worker.pk)
    [event] = sent
    assert event["group"] == f"worker.{bobs_worker.pk}"
    assert json.loads(event["text"])["type"] == "run_benchmark"


def test_owners_who_are_not_staff_cannot_ask_for_a_benchmark(bob, bobs_worker, anonymous, monkeypatch):
    sent = _sent_frames(monkeypatch)

    assert bob.client.post(f"/api/workers/{bobs_worker.pk}/benchmark/").status_code == 403
    assert anonymous.post(f"/api/workers/{bobs_worker.pk}/benchmark/").status_code == 401
    assert sent == []


def test_asking_an_offline_worker_for_a_benchmark_is_a_409(operator, rig_a, monkeypatch):
    sent = _sent_frames(monkeypatch)

    response = operator.client.post(f"/api/workers/{rig_a.pk}/benchmark/")

    assert response.status_code == 409
    assert response.json() == {"detail": "worker rig-a is offline: its daemon cannot run a benchmark now"}
    assert sent == []


def test_the_api_shows_the_score_and_details(bob, bobs_worker):
    bobs_worker.record_benchmark(result(412.5))

    body = bob.client.get(f"/api/workers/{bobs_worker.pk}/").json()

    assert (body["benchmark_score"], body["benchmark"]) == (412.5, details(result(412.5)))
    listed = bob.client.get("/api/workers/").json()["results"]
    assert [worker["benchmark_score"] for worker in listed] == [412.5]


def test_the_admin_action_asks_online_workers_and_names_offline_ones(
    operator, bobs_worker, rig_a, client, monkeypatch
):
    sent = _sent_frames(monkeypatch)
    client.force_login(operator.user)

    response = client.post(
        reverse("admin:workers_worker_changelist"),
        {"action": "run_benchmarks", "_selected_action": [str(bobs_worker.pk), str(rig_a.pk)]},
        follow=True,
    )

    assert response.status_code == 200
    texts = [str(message) for message in response.context["messages"]]
    assert "Asked 1 worker(s) to run their benchmark: bobs-gpu." in texts
    assert "Not asked, offline: rig-a." in texts
    assert [event["group"] for event in sent] == [f"worker.{bobs_worker.pk}"]


def test_the_admin_shows_the_score(operator, bobs_worker, client):
    bobs_worker.record_benchmark(result(412.5))
    client.force_login(operator.user)

    listing = client.get(reverse("admin:workers_worker_changelist")).content.decode()
    page = client.get(reverse("admin:workers_worker_change", args=[bobs_worker.pk])).content.decode()

    assert "412.5" in listing
    assert "tiny-gpt-2x128" in page
