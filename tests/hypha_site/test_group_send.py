"""``group_send_many``: many channel-layer sends from synchronous code in one trip into asyncio (the lease
clock's renewal requests, a settlement's declines), on the configured layer (in-memory or Redis)."""

from __future__ import annotations

import uuid

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from hypha_site import runtime


def joined(count: int) -> list[tuple[str, str]]:
    """``count`` fresh (group, channel) pairs, each channel a member of its group."""
    layer = get_channel_layer()
    pairs = []
    for _ in range(count):
        group = f"test-group-send-{uuid.uuid4().hex[:12]}"
        channel = async_to_sync(layer.new_channel)()
        async_to_sync(layer.group_add)(group, channel)
        pairs.append((group, channel))
    return pairs


def received(channel: str) -> dict:
    return async_to_sync(get_channel_layer().receive)(channel)


def test_each_message_reaches_its_group():
    # given: 40 groups, more than the sends allowed in flight at once
    pairs = joined(runtime.SEND_CONCURRENCY * 2 + 8)

    # when
    runtime.group_send_many([(group, {"type": "test.frame", "text": group}) for group, _ in pairs])

    # then
    for group, channel in pairs:
        assert received(channel) == {"type": "test.frame", "text": group}


def test_a_failed_send_does_not_stop_the_others_and_is_raised(monkeypatch):
    # given: the layer refuses to send to one of three groups
    pairs = joined(3)
    layer = get_channel_layer()
    original = layer.group_send
    broken = pairs[1][0]

    async def group_send(group, message):
        if group == broken:
            raise ConnectionError("the broker went away")
        await original(group, message)

    monkeypatch.setattr(layer, "group_send", group_send)

    # when
    with pytest.raises(ConnectionError, match="the broker went away"):
        runtime.group_send_many([(group, {"type": "test.frame", "text": group}) for group, _ in pairs])

    # then
    for group, channel in (pairs[0], pairs[2]):
        assert received(channel) == {"type": "test.frame", "text": group}


def test_nothing_to_send_costs_nothing(monkeypatch):
    monkeypatch.setattr(runtime, "async_to_sync", lambda function: pytest.fail("no trip into asyncio"))

    runtime.group_send_many([])
