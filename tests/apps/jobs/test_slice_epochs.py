"""A trainer's lease lost at an epoch boundary, through the control plane's own paths (``fetch_slice`` and
``slice_ack`` frames, the lease clock): the slices it had prefetched are trained in their own epoch, and no
slice is handed to a second trainer while the first holds it (the epoch accounting itself:
tests/apps/datasets/test_epochs.py)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.datasets.models import JobSlice
from apps.jobs import services as job_services
from apps.jobs.models import Job
from apps.leases.models import Lease
from tests.apps.jobs.test_training import SPEC, create_running_job, ready, task_of
from worker_daemon import protocol


@pytest.fixture
def running_job(job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings) -> Job:
    """test_training.py's running job: tiny-text's slices 0..2 train, slice 3 is held out."""
    settings.HYPHA_OFFER_WINDOW = 60.0
    return create_running_job(SPEC, job_owner, online_rigs, django_capture_on_commit_callbacks)


def fetch(job, worker) -> int | None:
    message = protocol.FetchSlice(
        request_id=uuid.uuid4(), task_id=task_of(job, worker).pk, dataset="tiny-text"
    )
    reply = job_services.slice_requested(worker=worker, message=message)
    assert reply.error is None, reply.error
    return reply.index


def ack(job, worker, index: int) -> None:
    job_services.slice_acknowledged(
        worker=worker, message=protocol.SliceAck(task_id=task_of(job, worker).pk, index=index)
    )


def used_by(job) -> list[tuple[int, int, str, str | None]]:
    return list(
        JobSlice.objects.filter(job=job)
        .order_by("epoch", "slice__index")
        .values_list("epoch", "slice__index", "status", "assigned_lease__worker__name")
    )


@pytest.mark.django_db
def test_slices_prefetched_by_a_trainer_lost_at_the_epoch_boundary_are_trained_in_their_epoch(
    running_job, online_rigs, django_capture_on_commit_callbacks
):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)

    # given: rig-a trains slice 0 and prefetches 1 and 2; rig-b finds epoch 0 handed out and starts epoch 1
    assert fetch(running_job, rig_a) == 0
    ack(running_job, rig_a, 0)
    assert [fetch(running_job, rig_a), fetch(running_job, rig_a)] == [1, 2]
    assert fetch(running_job, rig_b) == 0
    ack(running_job, rig_b, 0)

    # then: rig-b is not given slice 1 or 2, which rig-a holds, nor kept waiting on them: slice 0's epoch 2
    assert fetch(running_job, rig_b) == 0
    ack(running_job, rig_b, 0)

    # when: rig-a's lease runs out (its daemon died) with slices 1 and 2 of epoch 0 unacknowledged
    Lease.objects.filter(job=running_job, worker=rig_a).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    with django_capture_on_commit_callbacks(execute=True):
        job_services.tick_leases()

    # then: rig-b trains them in epoch 0, then in epoch 1, then in epoch 2 (the lowest epoch first)
    handed = []
    for _ in range(6):
        handed.append(fetch(running_job, rig_b))
        ack(running_job, rig_b, handed[-1])
    assert handed == [1, 2, 1, 2, 1, 2]
    assert used_by(running_job) == [
        (0, 0, "used", "rig-a"),
        (0, 1, "used", "rig-b"),
        (0, 2, "used", "rig-b"),
        (1, 0, "used", "rig-b"),
        (1, 1, "used", "rig-b"),
        (1, 2, "used", "rig-b"),
        (2, 0, "used", "rig-b"),
        (2, 1, "used", "rig-b"),
        (2, 2, "used", "rig-b"),
    ]
