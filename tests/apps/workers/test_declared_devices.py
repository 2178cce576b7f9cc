"""Devices a daemon declares in ``hello`` over the real gateway: a hostile list (a repeated index, a negative
one, 10^9 devices) gets an error frame naming the problem and stores nothing; a good one is stored and shown."""

from __future__ import annotations

import json

import pytest
from channels.db import database_sync_to_async

from apps.workers.models import Worker
from tests.apps.conftest import market_rows
from tests.apps.workers.test_consumers import gateway, receive  # noqa: F401 - fixture
from worker_daemon import protocol

snapshot = database_sync_to_async(market_rows)


def hello_frame(devices) -> str:
    frame = json.loads(
        protocol.encode(protocol.Hello(protocol_version=1, resources=protocol.Resources(cpu=2), executors=[]))
    )
    frame["devices"] = devices
    return json.dumps(frame)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("devices", "complaint"),
    [
        ([{"index": 0, "memory": 24}, {"index": 0, "memory": 24}], "device index 0 is listed twice"),
        ([{"index": -1, "memory": 24}], "devices.0.index"),
        ([{"index": 0, "memory": -24}], "devices.0.memory"),
        ([{"index": index, "memory": 1} for index in range(65)], "at most 64"),
    ],
)
async def test_a_hostile_device_list_is_refused_and_nothing_stored(gateway, rig_a, devices, complaint):  # noqa: F811
    communicator = await gateway(rig_a.token)
    before = await snapshot()

    await communicator.send_to(text_data=hello_frame(devices))

    [error] = await receive(communicator)
    assert (error["type"], error["code"], error["ref"]) == ("error", "malformed", "hello")
    assert complaint in error["message"]
    assert await snapshot() == before
    assert (await database_sync_to_async(Worker.objects.get)(pk=rig_a.pk)).status == Worker.Status.OFFLINE


@pytest.mark.django_db(transaction=True)
async def test_a_good_device_list_is_stored(gateway, rig_a):  # noqa: F811
    communicator = await gateway(rig_a.token)

    await communicator.send_to(
        text_data=hello_frame([{"index": 1, "memory": 80, "name": "H100"}, {"index": 0, "memory": 24}])
    )

    [welcome] = await receive(communicator)
    assert welcome["type"] == "welcome"
    worker = await database_sync_to_async(Worker.objects.get)(pk=rig_a.pk)
    assert worker.devices == [
        {"index": 1, "memory": 80.0, "name": "H100"},
        {"index": 0, "memory": 24.0, "name": ""},
    ]
