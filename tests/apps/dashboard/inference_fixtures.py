"""An inference job for the dashboard tests: Ada's "embed-tiny" (generate, 2 workers) on tiny-text (4 slices),
submitted through the REST API, its workers rig-a and rig-b leased and dispatched; and a slice's result stored
through the real upload endpoint."""

from __future__ import annotations

from django.test import Client
from rest_framework.test import APIClient

from apps.jobs.models import Job
from apps.workers.models import UserToken
from tests.apps.jobs.inference_helpers import (
    BODY,
    connect_inference_rigs,
    fetch,
    lease_workers,
    submit,
    token_of,
    upload,
)


def running_inference_job(owner, rigs, capture, settings) -> Job:
    settings.HYPHA_OFFER_WINDOW = 60.0
    rigs = connect_inference_rigs(rigs)
    _, token = UserToken.issue(owner)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    response = submit(api, capture, BODY)
    assert response.status_code == 201, response.content
    job = lease_workers(Job.objects.get(pk=response.json()["id"]), rigs, capture)
    assert job.status == Job.Status.RUNNING, job.status_reason
    return job


def store_result(job: Job, rig, sent, body: bytes = b'{"row": 0, "tokens": [1, 2]}\n') -> int:
    """``rig`` claims its next slice and uploads ``body`` as its result; returns the slice's index."""
    index = fetch(job, rig).index
    response = upload(Client(), job, index, body, token=token_of(sent, job, rig))
    assert response.status_code == 201, response.content
    return index
