"""Fixtures of the jobs tests."""

from __future__ import annotations

import uuid

import pytest

from apps.datasets import services as dataset_services
from apps.workers import services as worker_services
from worker_daemon import protocol

#: The slices of the training tests' dataset ``tiny-text``: (index, size, sha256).
SLICES = [(index, 1000 + index, f"{index:x}" * 64) for index in range(4)]


@pytest.fixture
def data_node(db):
    """A data node serving ``tiny-text`` (the training tests' dataset)."""
    node, _ = dataset_services.create_data_node(name="data-east", url="http://east.example:8100")
    dataset_services.register_dataset(node, "tiny-text", SLICES)
    return node


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
