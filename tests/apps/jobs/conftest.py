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


# --- inference jobs (tests/apps/jobs/test_inference_*.py) ----------------------------------------------------


@pytest.fixture
def inference_rigs(rig_a, rig_b, rig_c):
    """rig-a, rig-b and rig-c, online and offering the executor class ``inference``."""
    from tests.apps.jobs.inference_helpers import connect_inference_rigs

    return connect_inference_rigs([rig_a, rig_b, rig_c])


@pytest.fixture
def running(alice, data_node, inference_rigs, sent, django_capture_on_commit_callbacks):
    """Alice's inference job on tiny-text (4 slices), its 2 workers (rig-a, rig-b) leased and dispatched."""
    from apps.jobs.models import Job
    from tests.apps.jobs.inference_helpers import lease_workers, submit

    response = submit(alice.client, django_capture_on_commit_callbacks)
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    return lease_workers(job, inference_rigs[:2], django_capture_on_commit_callbacks)
