"""Per-step metrics through the worker gateway: the status frames a daemon sends over its websocket (parsed by
the real consumer) land in the trainer's metric series (apps/jobs/metrics.py)."""

from __future__ import annotations

import json
import uuid

import pytest
from channels.db import database_sync_to_async

from apps.jobs import metrics
from apps.jobs.models import MetricSeries
from tests.apps.workers.test_consumers import greet, receive
from tests.apps.workers.test_gateway_security import gateway, training  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)


def frame(task_id, body: dict) -> str:
    """A status frame as a daemon writes it (JSON text)."""
    return json.dumps(
        {
            "type": "status",
            "request_id": str(uuid.uuid4()),
            "task_id": str(task_id),
            "progress": {"status": body},
        }
    )


async def test_step_frames_from_a_daemon_become_points_of_its_series(gateway, online_rigs, training):  # noqa: F811
    # given: rig-b's daemon, connected
    rig_b = online_rigs[1]
    task = training["rig-b"]
    communicator = await gateway(rig_b.token)
    await greet(communicator, leases=(task.lease_id,))
    await receive(communicator)  # the dispatch of its task, sent again after the welcome

    # when: its first step, then a forwarded step that stands for the one its daemon answered itself
    await communicator.send_to(
        text_data=frame(task.pk, {"batch_size": 4, "loss": 3.0, "step_time": 0.5, "lr": 0.01})
    )
    first = await receive(communicator)
    summary = [{"steps": 1, "loss": 2.5, "seconds": 0.5, "samples": 4, "lr": 0.01, "age": 0.5}]
    await communicator.send_to(
        text_data=frame(
            task.pk,
            {"batch_size": 4, "loss": 2.0, "step_time": 0.5, "lr": 0.01, "covered_steps": 2, "covered_samples": 8,
             "covered_points": summary},
        )
    )  # fmt: skip
    second = await receive(communicator)

    # then
    assert [reply[0]["reply"]["type"] for reply in (first, second)] == ["Continue", "ScheduleUpdate"]
    points = await database_sync_to_async(
        lambda: metrics.stored_points(MetricSeries.objects.get(task=task))
    )()
    assert [(point[0], point[2], point[3]) for point in points] == [(1, 1, 3.0), (2, 1, 2.5), (3, 1, 2.0)]
    assert {point[7] for point in points} == {8.0}
