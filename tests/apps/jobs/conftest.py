"""Fixtures of the jobs tests."""

from __future__ import annotations

import pytest

from apps.datasets import services as dataset_services

#: The slices of the training tests' dataset ``tiny-text``: (index, size, sha256).
SLICES = [(index, 1000 + index, f"{index:x}" * 64) for index in range(4)]


@pytest.fixture
def data_node(db):
    """A data node serving ``tiny-text`` (the training tests' dataset)."""
    node, _ = dataset_services.create_data_node(name="data-east", url="http://east.example:8100")
    dataset_services.register_dataset(node, "tiny-text", SLICES)
    return node
