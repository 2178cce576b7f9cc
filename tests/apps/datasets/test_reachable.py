"""A data node says whether trainers can connect to its URL when it registers (``reachable``): stored on the node,
shown in the API; anything but true, false or "auto" is a 400 that changes nothing."""

from __future__ import annotations

import pytest

from apps.datasets.models import DataNode
from tests.apps.datasets.test_api import announcement, north, register  # noqa: F401 (north: a fixture)

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(("said", "stored"), [(True, "true"), (False, "false"), ("auto", "auto")])
def test_a_registration_records_whether_the_node_is_reachable(north, said, stored):  # noqa: F811
    node, token = north

    # when
    response = register(token, {**announcement(), "reachable": said})

    # then
    assert response.status_code == 201
    node.refresh_from_db()
    assert node.reachable == stored
    assert [replica["reachable"] for replica in response.json()["replicas"]] == [stored]


def test_a_registration_that_says_nothing_is_auto_as_an_older_nodes(north):  # noqa: F811
    node, token = north
    register(token, {**announcement(), "reachable": False})

    # when: the node restarts without --reachable
    response = register(token, announcement())

    # then
    assert response.status_code == 200
    node.refresh_from_db()
    assert node.reachable == "auto"


@pytest.mark.parametrize(
    ("said", "message"),
    [
        (1, 'Must be true, false or "auto".'),
        ("yes", 'Must be true, false or "auto".'),
        ("true", 'Must be true, false or "auto".'),
        ([], 'Must be true, false or "auto".'),
        (None, "This field may not be null."),
    ],
)
def test_anything_else_is_refused_and_changes_nothing(north, said, message):  # noqa: F811
    node, token = north
    before = list(DataNode.objects.values())

    # when
    response = register(token, {**announcement(url="http://10.9.9.9:1"), "reachable": said})

    # then
    assert response.status_code == 400
    assert response.json() == {"reachable": [message]}
    assert list(DataNode.objects.values()) == before
