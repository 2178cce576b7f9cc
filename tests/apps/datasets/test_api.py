"""The datasets API (read-only): every authenticated user sees datasets, their slices and replica nodes."""

from __future__ import annotations

import pytest

from apps.datasets import services
from apps.datasets.models import DataNode
from tests.apps.api_helpers import iso
from tests.apps.datasets.conftest import TINY_TEXT_SLICES, digest


@pytest.fixture
def replicated(tiny_text, east, west):
    """tiny-text on both nodes; data-east has gone offline since."""
    services.register_dataset(west, "tiny-text", TINY_TEXT_SLICES)
    DataNode.objects.filter(pk=east.pk).update(online=False)
    east.refresh_from_db()
    west.refresh_from_db()
    return tiny_text


def node_json(node: DataNode) -> dict:
    return {"name": node.name, "url": node.url, "online": node.online, "last_seen_at": iso(node.last_seen_at)}


def test_the_list_shows_each_dataset_with_its_nodes_online_first(carol, replicated, east, west):
    # when
    response = carol.client.get("/api/datasets/")

    # then
    assert response.status_code == 200
    assert response.json() == {
        "count": 1,
        "next": None,
        "previous": None,
        "results": [
            {
                "name": "tiny-text",
                "slice_count": 3,
                "total_bytes": 600,
                "created_at": iso(replicated.created_at),
                "replicas": [node_json(west), node_json(east)],
            }
        ],
    }


def test_a_dataset_shows_its_slices(alice, tiny_text, east):
    # when
    response = alice.client.get("/api/datasets/tiny-text/")

    # then
    assert response.status_code == 200
    assert response.json() == {
        "name": "tiny-text",
        "slice_count": 3,
        "total_bytes": 600,
        "created_at": iso(tiny_text.created_at),
        "replicas": [node_json(east)],
        "slices": [
            {"index": 0, "size_bytes": 100, "sha256": digest(0)},
            {"index": 1, "size_bytes": 200, "sha256": digest(1)},
            {"index": 2, "size_bytes": 300, "sha256": digest(2)},
        ],
    }


def test_an_unknown_dataset_is_not_found(alice, tiny_text):
    assert alice.client.get("/api/datasets/nope/").status_code == 404


def test_anonymous_callers_see_no_datasets(anonymous, tiny_text):
    assert anonymous.get("/api/datasets/").status_code == 401
    assert anonymous.get("/api/datasets/tiny-text/").status_code == 401


def test_the_api_is_read_only(operator, tiny_text):
    # when
    responses = [
        operator.client.post("/api/datasets/", {"name": "x"}, format="json"),
        operator.client.delete("/api/datasets/tiny-text/"),
    ]

    # then
    assert [response.status_code for response in responses] == [405, 405]
    assert services.replicas(tiny_text)[0].name == "data-east"
