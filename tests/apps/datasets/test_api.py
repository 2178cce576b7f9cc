"""The datasets API (read-only): every authenticated user sees datasets, their slices and replica nodes."""

from __future__ import annotations

import pytest

from apps.datasets import services
from apps.datasets.models import DataNode, Dataset
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
    return {
        "name": node.name,
        "url": node.url,
        "reachable": node.reachable,
        "online": node.online,
        "last_seen_at": iso(node.last_seen_at),
    }


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


# --- a data node registers a dataset --------------------------------------------------------------------------


def register(node_token: str | None, body: dict, *, scheme: str = "Bearer"):
    from rest_framework.test import APIClient

    client = APIClient()
    if node_token is not None:
        client.credentials(HTTP_AUTHORIZATION=f"{scheme} {node_token}")
    return client.post("/api/datasets/register/", body, format="json")


def announcement(name: str = "fresh-text", url: str = "http://10.0.0.7:8750") -> dict:
    return {
        "name": name,
        "url": url,
        "slices": [{"index": index, "size": size, "sha256": sha} for index, size, sha in TINY_TEXT_SLICES],
    }


@pytest.fixture
def north(db) -> tuple[DataNode, str]:
    return services.create_data_node(name="data-north", url="https://north.example")


def test_a_data_node_registers_a_new_dataset_and_its_url(north):
    # given
    node, token = north

    # when
    response = register(token, announcement())

    # then
    assert response.status_code == 201
    node.refresh_from_db()
    assert node.url == "http://10.0.0.7:8750"
    assert node.online is True
    body = response.json()
    assert body["name"] == "fresh-text"
    assert body["slice_count"] == 3
    assert body["total_bytes"] == 600
    assert body["replicas"] == [node_json(node)]
    assert body["slices"] == [
        {"index": 0, "size_bytes": 100, "sha256": digest(0)},
        {"index": 1, "size_bytes": 200, "sha256": digest(1)},
        {"index": 2, "size_bytes": 300, "sha256": digest(2)},
    ]


def test_registering_the_same_slices_again_is_200_and_another_node_becomes_a_replica(north, tiny_text, east):
    # given: tiny-text is registered by east with TINY_TEXT_SLICES
    node, token = north

    # when
    again = register(token, announcement("tiny-text"))
    repeated = register(token, announcement("tiny-text"))

    # then
    assert [again.status_code, repeated.status_code] == [200, 200]
    assert [replica["name"] for replica in repeated.json()["replicas"]] == ["data-east", "data-north"]


def test_different_slices_under_a_registered_name_are_a_409_and_change_nothing(north, tiny_text):
    # given
    node, token = north
    body = announcement("tiny-text", url="http://10.9.9.9:1")
    body["slices"][2]["size"] = 301

    # when
    response = register(token, body)

    # then
    assert response.status_code == 409
    assert "already registered" in response.json()["detail"]
    assert "slice 2 is 300 bytes" in response.json()["detail"]
    node.refresh_from_db()
    assert node.url == "https://north.example"
    assert node.online is False
    assert [n.name for n in services.replicas(tiny_text)] == ["data-east"]


def test_a_malformed_body_is_a_400_with_every_field_error(north):
    # when
    response = register(
        north[1],
        {
            "name": "no spaces",
            "url": "nope",
            "slices": [{"index": -1, "size": 0, "sha256": "XY"}],
            "extra": 1,
        },
    )

    # then
    assert response.status_code == 400
    assert set(response.json()) == {"name", "url", "slices", "extra"}
    assert set(response.json()["slices"]["0"]) == {"index", "size", "sha256"}
    assert not DataNode.objects.get(name="data-north").online


def test_a_form_body_is_a_415_and_registers_nothing(north):
    # given: the slices cannot travel in a form, so the endpoint reads (and documents) JSON only
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {north[1]}")

    # when
    response = client.post(
        "/api/datasets/register/",
        {"name": "fresh-text", "url": "http://10.0.0.7:8750", "slices": "[]"},
        format="multipart",
    )

    # then (it was a 400 about the slices, for a body the schema said was fine)
    assert response.status_code == 415
    assert not Dataset.objects.filter(name="fresh-text").exists()
    assert not DataNode.objects.get(name="data-north").online


def test_slice_indices_must_be_0_to_n_minus_1(north):
    # given
    body = announcement()
    body["slices"][2]["index"] = 5

    # when
    response = register(north[1], body)

    # then
    assert response.status_code == 400
    assert "slice indices must be 0..2" in response.json()["slices"][0]
    assert not Dataset.objects.filter(name="fresh-text").exists()


def test_registration_needs_a_data_node_token(north, alice):
    # when
    responses = [
        register(None, announcement()),
        register("hd_not-a-token", announcement()),
        register(north[1], announcement(), scheme="Token"),
        alice.client.post("/api/datasets/register/", announcement(), format="json"),
    ]

    # then
    assert [response.status_code for response in responses] == [401, 401, 401, 401]
    assert not Dataset.objects.filter(name="fresh-text").exists()


# --- the download key -------------------------------------------------------------------------------------------


def test_the_registration_answer_carries_the_nodes_download_key_uncached(north, east, alice):
    # given
    node, token = north

    # when: registered twice (the key is derived, so every answer carries the same one)
    first = register(token, announcement())
    again = register(token, announcement())

    # then
    key = first.json()["download_key"]
    assert key == services.download_key(node)
    assert again.json()["download_key"] == key
    assert len(key) == 64 and key != services.download_key(east)
    assert first["Cache-Control"] == "no-store"
    # derived, not stored; and nobody reading the dataset sees it
    assert key not in str(DataNode.objects.filter(pk=node.pk).values().get())
    assert "download_key" not in alice.client.get("/api/datasets/fresh-text/").json()


def test_a_refused_registration_carries_no_download_key(north):
    response = register("hd_not-a-token", announcement())
    assert response.status_code == 401
    assert "download_key" not in response.json()
