"""Personas of the datasets tests, on top of tests/apps/conftest.py's cast (``job`` is Ada's "tiny-gpt").

* ``east`` — data node "data-east" (https://east.example), owned by nobody.
* ``west`` — data node "data-west" (https://west.example).
* ``tiny_text`` — dataset "tiny-text" registered by ``east``: 3 slices of 100, 200 and 300 bytes whose
  SHA-256 digests are :func:`digest` of ``b"slice-0"`` … ``b"slice-2"``.
* ``lease_a``, ``lease_b`` — ACTIVE trainer leases of ``job`` on rig-a and rig-b (connected).
* ``prepared_job`` — ``job`` prepared for tiny-text: epoch 0, every slice AVAILABLE.
"""

from __future__ import annotations

import hashlib

import pytest

from apps.datasets import services
from apps.datasets.models import DataNode, Dataset, JobSlice, SliceEvent
from apps.jobs.models import TRAINER
from apps.leases import services as lease_services
from apps.leases.models import Lease
from tests.apps.conftest import connect
from worker_daemon import protocol

#: Small enough that one rig (8 cores) holds eight trainer leases at once.
SMALL = protocol.Resources(cpu=1, memory=1, storage=0, gpu=0)


def digest(index: int) -> str:
    return hashlib.sha256(f"slice-{index}".encode()).hexdigest()


TINY_TEXT_SLICES = [(0, 100, digest(0)), (1, 200, digest(1)), (2, 300, digest(2))]


def active_lease(worker, job) -> Lease:
    """A fresh ACTIVE trainer lease of ``job`` on ``worker`` (connected first), as a won offer leaves it."""
    if worker.status != worker.Status.ONLINE:
        connect(worker)
        worker.refresh_from_db()
    lease = lease_services.reserve(worker_id=worker.pk, job=job, role=TRAINER, resources=SMALL, price=120.0)
    lease.activate(ttl=lease_services.lease_ttl())
    return lease


def job_slices(job) -> list[tuple]:
    """``(epoch, index, status, assigned lease id)`` of every job slice, in order."""
    return list(
        JobSlice.objects.filter(job=job)
        .order_by("epoch", "slice__index")
        .values_list("epoch", "slice__index", "status", "assigned_lease_id")
    )


def snapshot(job) -> tuple[list[dict], list[tuple]]:
    """Every job slice row and slice event of ``job``, to compare before and after a refused action."""
    rows = list(JobSlice.objects.filter(job=job).order_by("pk").values())
    events = list(
        SliceEvent.objects.filter(job_slice__job=job)
        .order_by("pk")
        .values_list("pk", "job_slice_id", "kind", "from_status", "to_status", "lease_id", "detail", "at")
    )
    return rows, events


@pytest.fixture
def east(db) -> DataNode:
    node, _token = services.create_data_node(name="data-east", url="https://east.example")
    return node


@pytest.fixture
def west(db) -> DataNode:
    node, _token = services.create_data_node(name="data-west", url="https://west.example")
    return node


@pytest.fixture
def tiny_text(east) -> Dataset:
    return services.register_dataset(east, "tiny-text", TINY_TEXT_SLICES)


@pytest.fixture
def lease_a(job, rig_a) -> Lease:
    return active_lease(rig_a, job)


@pytest.fixture
def lease_b(job, rig_b) -> Lease:
    return active_lease(rig_b, job)


@pytest.fixture
def prepared_job(job, tiny_text):
    services.prepare_job(job, "tiny-text")
    return job
