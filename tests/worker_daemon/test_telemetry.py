"""Tracing of the daemons (worker_daemon/telemetry.py): off unless the standard OTEL_* variables ask for it;
on, bridge requests, dispatches, tasks and the backend's transfers are spans.

``configure`` installs a process-wide tracer provider, so the tests of switching on and off run a bridge in a
child process and look at what it reports; the others give :mod:`worker_daemon.telemetry` a private provider
with an in-memory exporter (the ``memory_spans`` fixture of conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from worker_daemon import telemetry
from worker_daemon.bridge.references import ParameterServerReference, PeersReference
from worker_daemon.bridge.remote import RemoteBackend

ROOT = Path(__file__).resolve().parents[2]

#: Run in a child process: configure tracing as the daemon does, serve a bridge with a tiny backend, make a
#: good request, a refused one (415) and a failing one (the backend raises), and report the spans.
PROBE = """
import asyncio, json, sys, tempfile
from pathlib import Path
import aiohttp
from worker_daemon import telemetry
from worker_daemon.bridge import serve_bridge
from worker_daemon.bridge.exceptions import NetworkError

on = telemetry.configure(service_name="hypha-worker-daemon")
memory = None
if on:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    memory = InMemorySpanExporter()
    telemetry._tracer_provider.add_span_processor(SimpleSpanProcessor(memory))

class Backend:
    calls = 0
    async def status(self, *, job_id, progress):
        self.calls += 1
        if self.calls > 1:
            raise NetworkError("the control plane is away")
        return {"type": "Continue"}

async def main():
    directory = Path(tempfile.mkdtemp(prefix="hb-"))
    bridge = await serve_bridge(socket_path=directory / "bridge.sock", work_dir=directory, backend=Backend())
    statuses = []
    connector = aiohttp.UnixConnector(path=str(bridge.socket_path))
    async with aiohttp.ClientSession(connector=connector) as session:
        for body, headers in (
            ("update", None),
            ("not json", {"Content-Type": "text/plain"}),
            ("update", None),
        ):
            options = {"json": body} if headers is None else {"data": body, "headers": headers}
            async with session.post("http://hypha/status/send", **options) as response:
                statuses.append(response.status)
    with telemetry.span("outside", job=None) as current:
        nothing = current is None
    await bridge.close()
    return statuses, nothing

statuses, nothing = asyncio.run(main())
telemetry.shutdown()
spans = None
if memory is not None:
    spans = [
        {"name": span.name, "attributes": dict(span.attributes), "parent": span.parent is not None}
        for span in memory.get_finished_spans()
    ]
loaded = sorted({name.split(".")[1] for name in sys.modules if name.startswith("opentelemetry.")})
print("PROBE " + json.dumps({"statuses": statuses, "nothing": nothing, "spans": spans, "loaded": loaded}))
"""


def run_probe(**otel: str) -> tuple[dict, str]:
    environment = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    environment.update(otel)
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=environment, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    return json.loads(line.removeprefix("PROBE ")), result.stdout


def test_without_otel_variables_nothing_is_traced_and_opentelemetry_is_not_imported():
    report, _ = run_probe(OTEL_SERVICE_NAME="named-but-not-on")
    assert report == {"statuses": [200, 415, 500], "nothing": True, "spans": None, "loaded": []}


def test_otel_variables_turn_on_a_span_per_bridge_request():
    # when: the console exporter is asked for (OTLP is chosen the same way, by the variables alone)
    report, stdout = run_probe(OTEL_TRACES_EXPORTER="console")

    # then: one span per request with its path and final status (a bridge error's answer included)
    assert report["statuses"] == [200, 415, 500]
    bridge_spans = [span for span in report["spans"] if span["name"].startswith("bridge ")]
    assert [(span["name"], span["attributes"]) for span in bridge_spans] == [
        (
            "bridge POST /status/send",
            {"http.request.method": "POST", "url.path": "/status/send", "http.response.status_code": status},
        )
        for status in (200, 415, 500)
    ]
    assert {"name": "outside", "attributes": {}, "parent": False} in report["spans"]
    # the console exporter printed them, with the daemon's default service name
    assert '"name": "bridge POST /status/send"' in stdout
    assert '"service.name": "hypha-worker-daemon"' in stdout


def test_otel_service_name_wins_over_the_default():
    _, stdout = run_probe(OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="rig-a")
    assert '"service.name": "rig-a"' in stdout
    assert "hypha-worker-daemon" not in stdout


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "   "}, []),  # blank is unset
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": " OTLP , Console ,"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp,none"}, []),
        ({"OTEL_TRACES_EXPORTER": "none,zipkin"}, []),  # none wins before names are checked
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "otlp"}, []),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
        ({"OTEL_SERVICE_NAME": "hypha"}, []),  # naming the service alone exports nothing
    ],
)
def test_which_variables_turn_tracing_on(environ, expected):
    assert telemetry.exporters_named(environ) == expected


def test_an_exporter_that_is_not_installed_is_a_value_error():
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER='otlp,zipkin': zipkin not installed"):
        telemetry.exporters_named({"OTEL_TRACES_EXPORTER": "otlp,zipkin"})
    assert issubclass(telemetry.TelemetryConfigError, ValueError)


def test_the_grpc_protocol_is_refused(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    with pytest.raises(telemetry.TelemetryConfigError, match="only http/protobuf is installed"):
        telemetry.otlp_exporter()


def test_a_bad_variable_stops_the_daemon_with_a_usage_error(tmp_path):
    environment = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    environment["OTEL_TRACES_EXPORTER"] = "jaeger"
    result = subprocess.run(
        [sys.executable, "-m", "worker_daemon", "--server", "http://127.0.0.1:9", "--token", "t"]
        + ["--work-dir", str(tmp_path)],
        env=environment,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2  # ExitCode.USAGE
    assert "error: OTEL_TRACES_EXPORTER='jaeger': jaeger not installed" in result.stderr


def test_span_is_a_no_op_while_tracing_is_off(monkeypatch):
    monkeypatch.setattr(telemetry, "_tracer_provider", None)
    with telemetry.span("dispatch_job", job=uuid.UUID(int=1)) as current:
        assert current is None
    telemetry.annotate(current, exit_code=0)  # nothing to annotate, no error


# --- the backend's transfers, with a private provider ----------------------------------------------------------


async def test_downloads_and_uploads_of_the_backend_are_spans(memory_spans, link, peer, tmp_path):
    # given
    task_id = uuid.UUID(int=5)
    job_id = "5b0f1f0e-2f7c-4a43-9b8e-3a1c2d4e5f60"
    backend = RemoteBackend(
        task_id=task_id,
        job_id=job_id,
        link=link,
        work_dir=tmp_path,
        peers={"ps": peer.url + "/"},
        transfer_token="token",
        request_timeout=2.0,
        retry_base=0.01,
    )
    (tmp_path / "artifacts").mkdir()
    peer.model = {"model.safetensors": b"weights"}
    peer.rounds_completed = 2
    (tmp_path / "delta.safetensors").write_bytes(b"pseudo-gradient")
    peer.update_statuses = [503]

    # when: a model file is fetched and an update sent (retried once after the 503)
    try:
        await backend.fetch(
            reference=ParameterServerReference(peer="ps", filenames=["model.safetensors"]),
            artifacts_dir=tmp_path / "artifacts",
        )
        await backend.send(
            reference=PeersReference(peers=["ps"], strategy={"type": "All"}),
            path=tmp_path / "delta.safetensors",
        )
    finally:
        await backend.close()

    # then
    spans = [(span.name, dict(span.attributes)) for span in memory_spans()]
    base = f"{peer.url}/jobs/{job_id}"
    upload = {
        "http.request.method": "PUT",
        "url.full": f"{base}/rounds/3/update",
        "hypha.task_id": str(task_id),
        "hypha.round": 3,
        "hypha.samples": 0,
    }
    assert spans == [
        (
            "model download",
            {
                "http.request.method": "GET",
                "url.full": f"{base}/model/model.safetensors",
                "hypha.task_id": str(task_id),
                "http.response.status_code": 200,
                "hypha.bytes": 7,
            },
        ),
        ("update upload", {**upload, "http.response.status_code": 503}),
        ("update upload", {**upload, "http.response.status_code": 200}),
    ]
