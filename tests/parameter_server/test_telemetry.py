"""Tracing of the parameter server: a span per update (accepted or refused) and per round, when on.

Tracing is switched on for a test by giving :mod:`worker_daemon.telemetry` a private provider with an
in-memory exporter (switching on by the OTEL_* variables is tested in tests/worker_daemon/test_telemetry.py).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.parameter_server.conftest import ALICE, BOB, CAROL
from tests.parameter_server.test_server import Served, safetensors_bytes
from tests.parameter_server.test_server import served as served  # noqa: F401 (the fixture)
from worker_daemon import telemetry


@pytest.fixture
def memory_spans(monkeypatch):
    """Tracing on for this test only: a private provider whose finished spans ``memory_spans()`` returns."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    monkeypatch.setattr(telemetry, "_tracer_provider", provider)
    yield memory.get_finished_spans
    provider.shutdown()


async def test_updates_and_rounds_are_spans(served: Served, memory_spans):
    # given
    good = safetensors_bytes(served.tmp_path, {"w": torch.tensor([0.2, -0.4]), "b": torch.tensor([0.1])})
    wrong = safetensors_bytes(served.tmp_path, {"w": torch.tensor([0.2, -0.4])}, name="wrong")

    # when: a refused update, a duplicate, then every trainer's update, which closes round 1
    assert (await served.put_update(ALICE, 1, wrong))[0] == 422
    assert (await served.put_update(ALICE, 1, good, samples=2))[0] == 200
    assert (await served.put_update(ALICE, 1, good))[0] == 409
    assert (await served.put_update(BOB, 1, good, samples=3))[0] == 200
    assert (await served.put_update(CAROL, 1, good, samples=5))[0] == 200
    await asyncio.wait_for(served.coordinator.published.get(), 5)

    # then
    spans = memory_spans()
    updates = [dict(span.attributes) for span in spans if span.name == "update"]
    assert [
        (update.get("hypha.peer"), update["hypha.outcome"], update["http.response.status_code"])
        for update in updates
    ] == [
        (ALICE, "refused", 422),
        (ALICE, "accepted", 200),
        (ALICE, "refused", 409),
        (BOB, "accepted", 200),
        (CAROL, "accepted", 200),
    ]
    assert updates[1] == {
        "hypha.peer": ALICE,
        "hypha.round": 1,
        "hypha.samples": 2,
        "hypha.outcome": "accepted",
        "http.response.status_code": 200,
    }
    assert updates[2]["hypha.reason"] == f"{ALICE} already sent its update for round 1"
    [round_span] = [span for span in spans if span.name == "round"]
    attributes = dict(round_span.attributes)
    assert attributes.pop("hypha.duration_s") >= 0
    assert attributes.pop("hypha.bytes_in") > 0
    assert attributes == {
        "hypha.round": 1,
        "hypha.participants": (ALICE, BOB, CAROL),
        "hypha.participant_count": 3,
        "hypha.left_out": (),
        "hypha.refused_count": 0,
        "hypha.samples": 10,
        "hypha.stepped": True,
    }
