"""Fixtures of the jobs tests."""

from __future__ import annotations

import uuid

import pytest

from apps.workers import services as worker_services
from worker_daemon import protocol


@pytest.fixture
def sent(monkeypatch) -> list[tuple[uuid.UUID, protocol._Message]]:
    """Every message the control plane sends to a daemon, in order (still delivered as usual)."""
    messages: list = []
    original = worker_services.send_to_worker

    def record(worker_id, message):
        messages.append((worker_id, message))
        original(worker_id, message)

    monkeypatch.setattr(worker_services, "send_to_worker", record)
    return messages
