"""Shared pieces of the inference job tests: a submission body, rigs that offer the inference executor, a
job whose workers are leased and dispatched, slice claims and result uploads through the real endpoint."""

from __future__ import annotations

import hashlib
import uuid

from apps.jobs import services as job_services
from apps.jobs.models import DEFAULT_EXECUTORS, INFERENCE, Job, Task
from tests.apps.conftest import advert, connect, offer_on
from worker_daemon import protocol

INFER = protocol.ExecutorDescriptor.model_validate(DEFAULT_EXECUTORS[INFERENCE])

BODY = {
    "name": "embed-tiny",
    "model": {
        "source": {"type": "huggingface", "repository": "hypha-space/tiny", "filenames": ["config.json"]},
    },
    "dataset": {"name": "tiny-text"},
    "task": {"type": "generate", "max_new_tokens": 4},
    "batch_size": 2,
    "workers": 2,
    "worker": {"resources": {"cpu": 2, "memory": 4}, "price": {"bid": 60, "max": 90}},
}


def connect_inference_rigs(rigs) -> list:
    """Connect ``rigs`` as daemons that offer the inference executor only."""
    for rig in rigs:
        connect(rig, executors=(INFER,))
        rig.refresh_from_db()
    return list(rigs)


def submit(client, capture, body: dict | None = None):
    """POST the body (default :data:`BODY`) and run what its commit queues (the allocation)."""
    with capture(execute=True):
        return client.post("/api/jobs/inference/", body or BODY, format="json")


def lease_workers(job: Job, rigs, capture) -> Job:
    """Each rig offers on the job's inference advert: its leases become ACTIVE and it is dispatched."""
    with capture(execute=True):
        for rig in rigs:
            job_services.offer_made(worker=rig, message=offer_on(advert(job, INFERENCE), price=70.0))
    job.refresh_from_db()
    return job


def task_of(job: Job, rig) -> Task:
    return Task.objects.get(job=job, lease__worker=rig)


def fetch(job: Job, rig, *, dataset: str = "tiny-text") -> protocol.SliceAssigned:
    message = protocol.FetchSlice(request_id=uuid.uuid4(), task_id=task_of(job, rig).pk, dataset=dataset)
    return job_services.slice_requested(worker=rig, message=message)


def token_of(sent, job: Job, rig) -> str:
    """The transfer token the rig's task was dispatched with."""
    task = task_of(job, rig)
    return next(
        message.transfer_token
        for _, message in sent
        if isinstance(message, protocol.DispatchJob) and message.task_id == task.pk
    )


def upload(client, job: Job, index: int, body: bytes, *, token: str, sha256: str | None = None, fmt="jsonl"):
    headers = {
        "HTTP_X_CONTENT_SHA256": sha256 or hashlib.sha256(body).hexdigest(),
        "HTTP_X_RESULT_FORMAT": fmt,
    }
    if token:
        headers["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    return client.put(
        f"/api/jobs/{job.pk}/results/{index}/", body, content_type="application/octet-stream", **headers
    )
