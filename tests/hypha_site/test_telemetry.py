"""OpenTelemetry tracing: off unless the standard OTEL_* variables ask for it; on, requests and tasks are spans.

Tracing installs a process-wide tracer provider and instruments Django and Celery for good, so the on/off
tests run the control plane in a child process and look at what it reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from hypha_site import telemetry

ROOT = Path(__file__).resolve().parents[2]

#: Run in a child process: set up Django (which starts tracing if the environment asks), collect spans in
#: memory next to the configured exporters, make a request, run a Celery task, trace a gateway block.
PROBE = """
import json, sys
import django
django.setup()
from hypha_site import telemetry
spans = None
if telemetry._tracer_provider is not None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    memory = InMemorySpanExporter()
    telemetry._tracer_provider.add_span_processor(SimpleSpanProcessor(memory))
from django.test import Client
from hypha_site.celery import app

@app.task(name="probe.add")
def add(a, b):
    return a + b

status = Client().get("/api/jobs/").status_code
add.apply(args=(1, 2))
with telemetry.span("gateway status", **{"hypha.worker": "rig-a"}):
    pass
Client().get("/healthz")
if telemetry._tracer_provider is not None:
    spans = [
        {"name": span.name, "kind": span.kind.name, "attributes": dict(span.attributes)}
        for span in memory.get_finished_spans()
    ]
loaded = sorted({name.split(".")[1] for name in sys.modules if name.startswith("opentelemetry.")})
print("PROBE " + json.dumps({"status": status, "spans": spans, "loaded": loaded}))
"""


def run_probe(tmp_path, **otel) -> tuple[dict, str]:
    environment = {
        name: value for name, value in os.environ.items() if not name.startswith(("OTEL_", "DATABASE_URL"))
    }
    environment.update(otel, HYPHA_DATA_DIR=str(tmp_path), DJANGO_SETTINGS_MODULE="hypha_site.settings")
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=environment,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    return json.loads(line.removeprefix("PROBE ")), result.stdout


def test_without_otel_variables_nothing_of_opentelemetry_is_loaded(tmp_path):
    report, _ = run_probe(tmp_path)
    assert report == {"status": 401, "spans": None, "loaded": []}


def test_otel_variables_turn_on_spans_for_requests_tasks_and_the_gateway(tmp_path):
    # when: the console exporter is asked for (the OTLP one is chosen the same way, by the variables alone)
    report, stdout = run_probe(tmp_path, OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="hypha-test")

    # then: a server span for the request (named by its route), a span for the task run, the gateway's span;
    # none for /healthz
    spans = {span["name"]: span for span in report["spans"]}
    assert set(spans) == {"GET api/jobs/$", "run/probe.add", "gateway status"}, report["spans"]
    request = spans["GET api/jobs/$"]
    assert request["kind"] == "SERVER"
    assert request["attributes"]["http.method"] == "GET"
    assert request["attributes"]["http.status_code"] == 401
    assert spans["run/probe.add"]["attributes"]["celery.task_name"] == "probe.add"
    assert spans["gateway status"]["attributes"] == {"hypha.worker": "rig-a"}
    # the console exporter printed them too, with the service name from OTEL_SERVICE_NAME
    assert '"name": "GET api/jobs/$"' in stdout
    assert '"service.name": "hypha-test"' in stdout


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp, console"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, []),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
        ({"OTEL_SERVICE_NAME": "hypha"}, []),  # naming the service alone exports nothing
    ],
)
def test_which_variables_turn_tracing_on(environ, expected):
    assert telemetry.exporters_named(environ) == expected
    assert telemetry.enabled(environ) is bool(expected)


def test_an_exporter_that_is_not_installed_is_a_configuration_error():
    with pytest.raises(ImproperlyConfigured, match="OTEL_TRACES_EXPORTER='zipkin': zipkin not installed"):
        telemetry.exporters_named({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_the_grpc_protocol_is_a_configuration_error(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(ImproperlyConfigured, match="only http/protobuf is installed"):
        telemetry._otlp_exporter()


def test_the_otlp_exporter_speaks_http_protobuf(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector.example:4318")
    exporter = telemetry._otlp_exporter()
    assert type(exporter).__module__ == "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    assert exporter._endpoint == "http://collector.example:4318/v1/traces"
    exporter.shutdown()


def test_span_is_a_no_op_while_tracing_is_off(monkeypatch):
    monkeypatch.setattr(telemetry, "_tracer_provider", None)
    with telemetry.span("gateway status", worker="rig-a") as span:
        assert span is None
