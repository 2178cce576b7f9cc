"""``GET /metrics``: the state gauges counted in the database, the gateway's event counters, the token.

The job is the training tests' running job (Ada's "tiny-gpt": rig-a and rig-b train, rig-c is the parameter
server), driven through ``apps.jobs.services`` as its daemons would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import DatabaseError, connections
from django.test import AsyncClient
from prometheus_client.parser import text_string_to_metric_families

from hypha_site import metrics
from hypha_site.asgi import router
from tests.apps import conftest as app_fixtures
from tests.apps.conftest import hello
from tests.apps.jobs import conftest as job_fixtures
from tests.apps.jobs import test_training
from tests.apps.jobs.test_training import ready, status, task_of
from worker_daemon import protocol

# The app tests' personas and transports, as fixtures of this module (tests/apps/conftest.py is not ours).
_market_timing = app_fixtures._market_timing
_isolated_transports = app_fixtures._isolated_transports
job_owner = app_fixtures.job_owner
rig_a, rig_b, rig_c = app_fixtures.rig_a, app_fixtures.rig_b, app_fixtures.rig_c
online_rigs = app_fixtures.online_rigs
sent = app_fixtures.sent
data_node = job_fixtures.data_node
running_job = test_training.running_job

ROOT = Path(__file__).resolve().parents[2]
STATE = (
    "hypha_database_up",
    "hypha_jobs",
    "hypha_workers",
    "hypha_leases",
    "hypha_advertisements",
    "hypha_offers",
    "hypha_rounds",
    "hypha_round_bytes",
)


def samples(text: str, *names: str) -> dict[tuple, float]:
    """``{(sample name, (label, value), …): value}`` of the exposition's families ``names``."""
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name in names:
            for sample in family.samples:
                found[(sample.name, *sorted(sample.labels.items()))] = sample.value
    return found


@pytest.fixture(autouse=True)
def _public_metrics(settings):
    """The tests of what is exposed scrape without credentials: the operator opened the endpoint. The tests of
    who may scrape set this back to the default (closed)."""
    settings.HYPHA_METRICS_PUBLIC = True


@pytest.fixture
def zeroed_counters():
    """The event counters are per process and live across tests: start this test from zero."""
    for counter in (metrics.DAEMON_MESSAGES, metrics.STATUS_MESSAGES, metrics.STATUS_SECONDS):
        counter.clear()


@pytest.mark.django_db
def test_the_state_of_a_job_after_a_round_is_in_the_exposition(running_job, online_rigs, client):
    # given: the parameter server listens, a trainer reports round 1, the parameter server applies it, and
    # the trainer's metrics for round 2 open the next round
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    status(rig_a, task_of(running_job, rig_a), {"metrics": {"round": 1, "metrics": {"loss": 2.5}}})
    report = {"round": 1, "participants": [str(rig_a.pk)], "bytes_in": 1000, "bytes_out": 2000}
    assert status(rig_c, task_of(running_job, rig_c), {"round": report}) == {"type": "Ok"}
    status(rig_b, task_of(running_job, rig_b), {"metrics": {"round": 2, "metrics": {"loss": 2.0}}})

    # when: a scraper without a session or token asks
    response = client.get("/metrics")

    # then
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    assert samples(response.content.decode(), *STATE) == {
        ("hypha_database_up",): 1.0,
        ("hypha_jobs", ("status", "pending")): 0.0,
        ("hypha_jobs", ("status", "allocating")): 0.0,
        ("hypha_jobs", ("status", "allocated")): 0.0,
        ("hypha_jobs", ("status", "running")): 1.0,
        ("hypha_jobs", ("status", "completed")): 0.0,
        ("hypha_jobs", ("status", "cancelled")): 0.0,
        ("hypha_jobs", ("status", "failed")): 0.0,
        ("hypha_workers", ("status", "online")): 3.0,
        ("hypha_workers", ("status", "offline")): 0.0,
        ("hypha_leases", ("status", "temporary")): 0.0,
        ("hypha_leases", ("status", "active")): 3.0,
        ("hypha_leases", ("status", "expired")): 0.0,
        ("hypha_leases", ("status", "released")): 0.0,
        ("hypha_advertisements", ("status", "open")): 0.0,
        ("hypha_advertisements", ("status", "filled")): 2.0,
        ("hypha_advertisements", ("status", "cancelled")): 0.0,
        ("hypha_offers", ("status", "open")): 0.0,
        ("hypha_offers", ("status", "accepted")): 3.0,
        ("hypha_offers", ("status", "declined")): 0.0,
        ("hypha_offers", ("status", "expired")): 0.0,
        ("hypha_rounds", ("closed", "true")): 1.0,
        ("hypha_rounds", ("closed", "false")): 1.0,
        ("hypha_round_bytes", ("direction", "in")): 1000.0,
        ("hypha_round_bytes", ("direction", "out")): 2000.0,
    }


@pytest.mark.django_db
def test_a_running_jobs_throughput_is_a_gauge_labelled_by_the_job(running_job, online_rigs, client):
    # given: both trainers report round 1 (tokens/s of one derived from tokens over train time), and one
    # reports round 2 before the round closes
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    one = {"loss": 2.5, "samples_per_second": 40.0, "tokens_per_second": 5120.0}
    status(rig_a, task_of(running_job, rig_a), {"metrics": {"round": 1, "metrics": one}})
    other = {"loss": 2.5, "samples_per_second": 10.0, "tokens": 1536.0, "train_seconds": 1.2}
    status(rig_b, task_of(running_job, rig_b), {"metrics": {"round": 1, "metrics": other}})
    report = {"round": 1, "participants": [str(rig_a.pk), str(rig_b.pk)]}
    assert status(rig_c, task_of(running_job, rig_c), {"round": report}) == {"type": "Ok"}
    status(rig_a, task_of(running_job, rig_a), {"metrics": {"round": 2, "metrics": one}})

    # when
    text = client.get("/metrics").content.decode()

    # then: the closed round's sums (the open round has heard from one trainer only)
    job = str(running_job.pk)
    assert samples(text, "hypha_job_samples_per_second", "hypha_job_tokens_per_second") == {
        ("hypha_job_samples_per_second", ("job", job)): 50.0,
        ("hypha_job_tokens_per_second", ("job", job)): 6400.0,
    }


@pytest.mark.django_db
def test_an_empty_control_plane_exposes_zeros(client):
    text = client.get("/metrics").content.decode()
    state = samples(text, *STATE)
    assert state.pop(("hypha_database_up",)) == 1.0
    assert set(state.values()) == {0.0}
    assert len(state) == 24  # every status of every family, zeros included
    # the process's own metrics come along
    assert "process_resident_memory_bytes" in text


@pytest.mark.django_db
def test_a_database_that_does_not_answer_still_gives_a_scrape(client, monkeypatch):
    def unavailable(*families):
        raise DatabaseError("connection refused")

    monkeypatch.setattr(metrics.DatabaseCollector, "_fill", staticmethod(unavailable))
    response = client.get("/metrics")
    assert response.status_code == 200
    assert samples(response.content.decode(), *STATE) == {("hypha_database_up",): 0.0}


@pytest.mark.django_db
def test_the_token_guards_the_endpoint_when_set(client, settings):
    settings.HYPHA_METRICS_TOKEN = "scrape-token-0123456789"

    refused = [
        client.get("/metrics"),
        client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong-token-0123456789"),
        client.get("/metrics", HTTP_AUTHORIZATION="Token scrape-token-0123456789"),
    ]
    accepted = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-token-0123456789")

    assert [response.status_code for response in refused] == [401, 401, 401]
    assert refused[0]["WWW-Authenticate"] == 'Bearer realm="metrics"'
    assert b"hypha_jobs" not in refused[0].content
    assert accepted.status_code == 200
    assert b'hypha_jobs{status="running"} 0.0' in accepted.content


@pytest.mark.django_db
def test_by_default_only_staff_sessions_may_scrape(client, settings, alice, operator):
    # given: the defaults: no token, not public
    settings.HYPHA_METRICS_PUBLIC = False
    settings.HYPHA_METRICS_TOKEN = None

    # when
    anonymous = client.get("/metrics")
    client.force_login(alice.user)
    user = client.get("/metrics")
    client.force_login(operator.user)
    staff_member = client.get("/metrics")

    # then
    assert (anonymous.status_code, user.status_code, staff_member.status_code) == (401, 403, 200)
    assert anonymous["WWW-Authenticate"] == 'Bearer realm="metrics"'
    assert b"hypha_jobs" not in anonymous.content and b"hypha_jobs" not in user.content
    assert b'hypha_jobs{status="running"} 0.0' in staff_member.content


@pytest.mark.django_db
def test_a_token_opens_it_to_the_scraper_and_staff_still_get_in(client, settings, operator):
    settings.HYPHA_METRICS_PUBLIC = False
    settings.HYPHA_METRICS_TOKEN = "scrape-token-0123456789"

    scraper = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-token-0123456789")
    client.force_login(operator.user)
    staff_member = client.get("/metrics")

    assert (scraper.status_code, staff_member.status_code) == (200, 200)


@pytest.mark.django_db
def test_only_get_is_answered(client):
    assert client.post("/metrics").status_code == 405


def test_the_metrics_endpoint_is_not_in_the_api_schema():
    schema = (ROOT / "docs" / "openapi.yaml").read_text()
    # The Prometheus endpoint's path; a job's training metrics (/api/jobs/{id}/metrics/) are API.
    assert "\n  /metrics:" not in schema and "\n  /metrics/:" not in schema
    assert "\n  /api/jobs/{id}/metrics/:" in schema


@pytest.mark.django_db(transaction=True)
async def test_status_reports_over_the_gateway_are_counted_with_their_latency(
    zeroed_counters, running_job, online_rigs
):
    # given: rig-a's daemon on the gateway, its parameter server listening
    rig_a, _rig_b, rig_c = online_rigs
    await database_sync_to_async(ready)(running_job, rig_c)
    trainer = await database_sync_to_async(task_of)(running_job, rig_a)
    gateway = WebsocketCommunicator(
        router, "/ws/worker/", headers=[(b"authorization", f"Bearer {rig_a.token}".encode())]
    )
    assert (await gateway.connect(timeout=3))[0]
    # it reconnects holding its lease, as a daemon does (a hello without it would give the lease up)
    await gateway.send_to(text_data=protocol.encode(hello(leases=(trainer.lease_id,))))
    assert (await gateway.receive_json_from(timeout=3))["type"] == "welcome"
    # after the welcome, the dispatch of its live task again (it may have missed it while away)
    redispatch = await gateway.receive_json_from(timeout=3)
    assert (redispatch["type"], redispatch["task_id"]) == ("dispatch_job", str(trainer.pk))

    async def report(task_id, progress) -> dict:
        message = protocol.StatusReport(request_id=uuid.uuid4(), task_id=task_id, progress=progress)
        await gateway.send_to(text_data=protocol.encode(message))
        return await gateway.receive_json_from(timeout=3)

    # when: a step (ok), a nonsense kind (answered Error), a report on a task that is not rig-a's (refused:
    # an error frame, then the Error reply), and a frame that is not a protocol message
    try:
        assert (await report(trainer.pk, {"status": {"batch_size": 4}}))["reply"] == {"type": "Continue"}
        assert (await report(trainer.pk, {"nonsense": 1}))["reply"] == {"type": "Error"}
        assert (await report(uuid.uuid4(), "update"))["type"] == "error"
        assert (await gateway.receive_json_from(timeout=3))["reply"] == {"type": "Error"}
        await gateway.send_to(text_data='{"type": "no-such-message"}')
        assert (await gateway.receive_json_from(timeout=3))["type"] == "error"
    finally:
        await gateway.disconnect()

    # then
    try:
        text = (await AsyncClient().get("/metrics")).content.decode()
    finally:
        # The consumer's and the view's database calls ran in asgiref's thread; with CONN_MAX_AGE
        # (PostgreSQL) its connection would keep the test database from being dropped.
        await database_sync_to_async(connections.close_all)()
    events = samples(text, "hypha_status_messages", "hypha_gateway_messages")
    assert events == {
        ("hypha_gateway_messages_total", ("type", "hello")): 1.0,
        ("hypha_gateway_messages_total", ("type", "status")): 3.0,
        ("hypha_gateway_messages_total", ("type", "invalid")): 1.0,
        ("hypha_status_messages_total", ("kind", "status"), ("outcome", "ok")): 1.0,
        ("hypha_status_messages_total", ("kind", "other"), ("outcome", "error")): 1.0,
        ("hypha_status_messages_total", ("kind", "update"), ("outcome", "refused")): 1.0,
    }
    latency = samples(text, "hypha_status_message_seconds")
    for kind in ("status", "other", "update"):
        assert latency[("hypha_status_message_seconds_count", ("kind", kind))] == 1.0
        assert 0 < latency[("hypha_status_message_seconds_sum", ("kind", kind))] < 3.0
        assert latency[("hypha_status_message_seconds_bucket", ("kind", kind), ("le", "+Inf"))] == 1.0


def test_multiprocess_mode_sums_the_counters_of_every_process(tmp_path):
    """With PROMETHEUS_MULTIPROC_DIR, any process answers with the counters of all of them."""
    shared = tmp_path / "prometheus"
    shared.mkdir()
    environment = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(shared),
        "HYPHA_DATA_DIR": str(tmp_path / "data"),
        "DJANGO_SETTINGS_MODULE": "hypha_site.settings",
    }
    environment.pop("DATABASE_URL", None)  # the scrape's database part is not what this test is about
    count = (
        "import django; django.setup(); from hypha_site import metrics; "
        "metrics.status_handled(kind='status', outcome='ok', seconds=0.01)"
    )
    scrape = (
        "import django; django.setup(); from hypha_site import metrics; "
        "from prometheus_client import generate_latest; "
        "print(generate_latest(metrics.scrape_registry()).decode())"
    )
    for _ in range(2):
        subprocess.run([sys.executable, "-c", count], env=environment, cwd=ROOT, check=True, timeout=60)
    result = subprocess.run(
        [sys.executable, "-c", scrape],
        env=environment,
        cwd=ROOT,
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    )
    found = samples(result.stdout, "hypha_status_messages", "hypha_status_message_seconds")
    assert found[("hypha_status_messages_total", ("kind", "status"), ("outcome", "ok"))] == 2.0
    assert found[("hypha_status_message_seconds_count", ("kind", "status"))] == 2.0
    assert "process_resident_memory_bytes" not in result.stdout
