"""Hypha's AIM status bridge: one POST per trainer metric, after commit, and never a failure of the workflow.

A real HTTP receiver (``http.server`` in a thread) stands in for the AIM driver. Both delivery paths are
exercised: the Celery task (services mode; the tests run Celery eagerly) and the embedded sender thread.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core.exceptions import ImproperlyConfigured

from apps.jobs import status_bridge
from apps.jobs.models import Round
from hypha_site.metrics import STATUS_BRIDGE_POSTS
from hypha_site.settings import status_bridge_checked
from tests.apps.jobs import test_training
from tests.apps.jobs.test_training import ready, status, task_of

# The training tests' running job (its three rigs, data node and ACTIVE leases), as a fixture of this module.
running_job = test_training.running_job


class Receiver:
    """An AIM driver's ``POST /status``: records every request and answers ``reply_status``."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict]] = []
        self.reply_status = 200
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((self.path, self.headers["Content-Type"], json.loads(body)))
                self.send_response(receiver.reply_status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.close()


@pytest.fixture
def closed_port() -> str:
    """An address nothing listens on: a port the kernel handed out and that was closed at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"127.0.0.1:{port}"


@pytest.fixture(autouse=True)
def _fresh_bridge_state(monkeypatch):
    """Each test starts with a healthy bridge (no pause from an earlier failure) and zeroed counters."""
    monkeypatch.setattr(status_bridge, "_health", status_bridge._Health())
    STATUS_BRIDGE_POSTS.clear()
    yield
    assert status_bridge.drain(), "the embedded sender did not finish"


@pytest.fixture(params=["services", "embedded"])
def mode(request, settings) -> str:
    settings.EMBEDDED_TRANSPORTS = request.param == "embedded"
    return request.param


def trainer_reports_metrics(job, rig, rig_c, capture, *, metrics: dict, round_number: int = 1) -> dict:
    """rig's trainer reports its metrics of a round, committed (so after-commit work runs); the reply."""
    ready(job, rig_c)
    with capture(execute=True):
        reply = status(rig, task_of(job, rig), {"metrics": {"round": round_number, "metrics": metrics}})
    status_bridge.drain()
    return reply


def posted(outcome: str) -> float:
    """The ``hypha_status_bridge_posts_total`` sample of ``outcome`` (0 if none was counted)."""
    samples = STATUS_BRIDGE_POSTS.collect()[0].samples
    return next(
        (s.value for s in samples if s.name.endswith("_total") and s.labels == {"outcome": outcome}), 0
    )


@pytest.mark.django_db
def test_each_metric_becomes_one_post_to_the_bridge(
    mode, settings, receiver, running_job, online_rigs, django_capture_on_commit_callbacks
):
    # given
    rig_a, _rig_b, rig_c = online_rigs
    settings.HYPHA_STATUS_BRIDGE = receiver.address

    # when
    reply = trainer_reports_metrics(
        running_job,
        rig_a,
        rig_c,
        django_capture_on_commit_callbacks,
        metrics={"loss": 2.25, "accuracy": 0.5, "junk": "x"},
    )

    # then: exactly the finite metrics, in the body of reference §8, to /status
    assert reply == {"type": "Ok"}
    assert receiver.requests == [
        (
            "/status",
            "application/json",
            {"worker_id": str(rig_a.pk), "round": 1, "metric_name": "loss", "value": 2.25},
        ),
        (
            "/status",
            "application/json",
            {"worker_id": str(rig_a.pk), "round": 1, "metric_name": "accuracy", "value": 0.5},
        ),
    ]
    assert posted("sent") == 2


@pytest.mark.django_db
def test_nothing_is_posted_before_commit_or_without_a_bridge(
    settings, receiver, running_job, online_rigs, django_capture_on_commit_callbacks
):
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    settings.HYPHA_STATUS_BRIDGE = receiver.address

    # inside the transaction: queued for after commit, not sent
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        status(rig_a, task_of(running_job, rig_a), {"metrics": {"round": 1, "metrics": {"loss": 1.0}}})
    assert receiver.requests == []
    for callback in callbacks:  # the commit
        callback()
    status_bridge.drain()
    assert [body["value"] for _, _, body in receiver.requests] == [1.0]

    # no bridge: nothing is posted
    settings.HYPHA_STATUS_BRIDGE = None
    with django_capture_on_commit_callbacks(execute=True):
        status(rig_a, task_of(running_job, rig_a), {"metrics": {"round": 2, "metrics": {"loss": 0.5}}})
    status_bridge.drain()
    assert [body["value"] for _, _, body in receiver.requests] == [1.0]


@pytest.mark.django_db
def test_a_bridge_answering_an_error_is_ignored(
    mode, settings, receiver, running_job, online_rigs, django_capture_on_commit_callbacks
):
    rig_a, _rig_b, rig_c = online_rigs
    settings.HYPHA_STATUS_BRIDGE = receiver.address
    receiver.reply_status = 500

    reply = trainer_reports_metrics(
        running_job, rig_a, rig_c, django_capture_on_commit_callbacks, metrics={"loss": 2.0}
    )

    assert reply == {"type": "Ok"}
    assert [body["value"] for _, _, body in receiver.requests] == [2.0]
    assert (posted("sent"), posted("rejected")) == (0, 1)


@pytest.mark.django_db
def test_an_unreachable_bridge_fails_nothing_and_is_logged_once(
    mode, settings, closed_port, running_job, online_rigs, django_capture_on_commit_callbacks, caplog
):
    # given: a bridge address where nothing listens
    rig_a, rig_b, rig_c = online_rigs
    settings.HYPHA_STATUS_BRIDGE = closed_port

    # when: two trainers report their metrics
    with caplog.at_level(logging.WARNING, logger="apps.jobs.status_bridge"):
        first = trainer_reports_metrics(
            running_job, rig_a, rig_c, django_capture_on_commit_callbacks, metrics={"loss": 2.0, "ppl": 7.4}
        )
        with django_capture_on_commit_callbacks(execute=True):
            second = status(
                rig_b, task_of(running_job, rig_b), {"metrics": {"round": 1, "metrics": {"loss": 3.0}}}
            )
        status_bridge.drain()

    # then: the metrics are recorded as always, one warning names the bridge, and the rest is dropped
    assert first == second == {"type": "Ok"}
    assert Round.objects.get(job=running_job, number=1).trainer_metrics == {
        str(rig_a.pk): {"loss": 2.0, "ppl": 7.4},
        str(rig_b.pk): {"loss": 3.0},
    }
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"status bridge {closed_port} unreachable (ConnectError")
    # the first post failed; the rest of its batch and the next batch (within the pause) were not tried
    assert (posted("failed"), posted("dropped"), posted("sent")) == (1, 2, 0)


def test_post_never_raises_even_on_a_bug(monkeypatch, settings, receiver):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(status_bridge.httpx, "Client", broken)
    assert status_bridge.post(receiver.address, [{"metric_name": "loss"}]) == {
        "sent": 0,
        "rejected": 0,
        "failed": 0,
        "dropped": 0,
    }
    assert receiver.requests == []


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:61000", "127.0.0.1:61000"),
        ("aim.internal:61000", "aim.internal:61000"),
        ("http://aim.internal:61000/", "aim.internal:61000"),
        ("[::1]:61000", "[::1]:61000"),
    ],
)
def test_the_bridge_setting_takes_host_and_port(value, expected):
    assert status_bridge_checked("HYPHA_STATUS_BRIDGE", value) == expected


@pytest.mark.parametrize(
    "value",
    ["aim.internal", "aim:notaport", "https://aim:61000", "aim:61000/status", "user@aim:61000", ":61000"],
)
def test_a_bridge_setting_without_host_and_port_is_refused(value):
    with pytest.raises(ImproperlyConfigured, match="HYPHA_STATUS_BRIDGE=.* is not a host:port"):
        status_bridge_checked("HYPHA_STATUS_BRIDGE", value)
