"""How trainers reach their parameter server: directly or through the relay, decided when it reports ready
(docs/transfers.md)."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import pytest

from apps.jobs.models import PARAMETER_SERVER, TRAINER, Task
from apps.workers.models import Worker
from tests.apps.jobs.test_training import dispatches, ready, running_job  # noqa: F401 (fixture)


@pytest.fixture
def listening_url() -> Iterator[str]:
    """A real HTTP server on loopback that answers anything with 401 (as a parameter server without a token)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(401)
            self.end_headers()

        def log_message(self, *arguments) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def closed_url() -> str:
    """A loopback port nothing listens on (connection refused at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def declare(worker: Worker, reachable: str) -> None:
    Worker.objects.filter(pk=worker.pk).update(reachable=reachable)
    worker.refresh_from_db()


@pytest.mark.django_db
def test_a_parameter_server_that_accepts_no_connections_is_reached_through_the_relay(
    running_job,  # noqa: F811
    online_rigs,
    sent,
):
    rig_a, rig_b, rig_c = online_rigs
    declare(rig_c, "false")
    sent.clear()

    # when
    reply = ready(running_job, rig_c)

    # then: the parameter server is told to serve through the relay, and so is every trainer
    assert reply == {"type": "Ok", "path": "relay"}
    server = Task.objects.get(job=running_job, role=PARAMETER_SERVER)
    assert server.transfer_path == "relay"
    trainer = dispatches(sent)[TRAINER]
    assert trainer.relay == [str(rig_c.pk)]
    assert trainer.peers == {str(rig_c.pk): "http://10.0.0.3:7070"}
    stored = Task.objects.get(pk=trainer.task_id).dispatch_message
    assert stored["relay"] == [str(rig_c.pk)]  # what a reconnecting daemon is sent
    running_job.refresh_from_db()
    assert running_job.status_reason == (
        "RUNNING: parameter server listening at http://10.0.0.3:7070; 2 trainers told; they reach it through "
        "the relay: its daemon accepts no inbound connections (reachable = false)"
    )


@pytest.mark.django_db
def test_a_parameter_server_that_says_it_is_reachable_is_reached_directly_unchecked(
    running_job,  # noqa: F811
    online_rigs,
    sent,
    closed_url,
):
    rig_c = online_rigs[2]
    declare(rig_c, "true")
    sent.clear()

    reply = ready(running_job, rig_c, url=closed_url)

    assert reply == {"type": "Ok", "path": "direct"}
    assert dispatches(sent)[TRAINER].relay == []
    running_job.refresh_from_db()
    assert (
        running_job.status_reason == f"RUNNING: parameter server listening at {closed_url}; 2 trainers told"
    )


@pytest.mark.django_db
def test_auto_is_decided_by_trying_the_url(running_job, online_rigs, sent, listening_url, closed_url):  # noqa: F811
    rig_c = online_rigs[2]
    declare(rig_c, "auto")

    # an address that answers (even 401) is reached directly
    assert ready(running_job, rig_c, url=listening_url) == {"type": "Ok", "path": "direct"}
    assert Task.objects.get(job=running_job, role=PARAMETER_SERVER).transfer_path == "direct"

    # a restarted server at an address nobody answers at: the trainers are switched to the relay
    sent.clear()
    assert ready(running_job, rig_c, url=closed_url) == {"type": "Ok", "path": "relay"}
    assert dispatches(sent)[TRAINER].relay == [str(rig_c.pk)]
    running_job.refresh_from_db()
    assert running_job.status_reason.startswith(
        f"RUNNING: parameter server listening at {closed_url}; 2 trainers told; they reach it through the "
        f"relay: the control plane could not reach {closed_url} (ConnectError"
    )
