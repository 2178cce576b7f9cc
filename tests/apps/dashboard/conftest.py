"""Fixtures of the dashboard tests.

* ``tiny_text`` — the dataset "tiny-text" (4 slices), registered by data node "data-east".
* ``training_job`` — Ada's DiLoCo job "tiny-gpt" on it, RUNNING: rig-a and rig-b train, rig-c is its parameter
  server (listening), every trainer dispatched.
* ``ada_browser`` / ``eve_browser`` / ``staff_browser`` — Django test clients logged in as Ada (the job's
  owner), as Eve (another user, no jobs) and as a staff user.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from apps.datasets import services as dataset_services
from apps.jobs.models import Job, Task
from tests.apps.jobs.conftest import SLICES
from tests.apps.jobs.test_training import SPEC as TRAINING_SPEC
from tests.apps.jobs.test_training import create_running_job, status

#: test_training's job with three rounds (the dashboard tests record up to three).
SPEC = {**TRAINING_SPEC, "rounds": {**TRAINING_SPEC["rounds"], "update_rounds": 3}}


@pytest.fixture
def tiny_text(db):
    node, _ = dataset_services.create_data_node(name="data-east", url="http://east.example:8100")
    return dataset_services.register_dataset(node, "tiny-text", SLICES)


def task_of(job: Job, worker) -> Task:
    return Task.objects.select_related("lease").get(job=job, lease__worker=worker)


@pytest.fixture
def training_job(job_owner, online_rigs, tiny_text, django_capture_on_commit_callbacks, settings) -> Job:
    # Enough offers settle an advert at once; a long window only keeps a slow machine from closing it between
    # the advert and the offers (the default 1 s window closed first on a busy machine).
    settings.HYPHA_OFFER_WINDOW = 60.0
    job = create_running_job(SPEC, job_owner, online_rigs, django_capture_on_commit_callbacks)
    rig_c = online_rigs[2]
    with django_capture_on_commit_callbacks(execute=True):
        reply = status(rig_c, task_of(job, rig_c), {"ready": {"url": "http://10.0.0.3:7070", "round": 0}})
        assert reply == {"type": "Ok", "path": "direct"}
    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING, job.status_reason
    return job


def record_round(job: Job, rigs, number: int, *, losses=(3.5, 3.7), eval_loss: float = 3.4) -> None:
    """Both trainers report their metrics for round ``number``, then the parameter server reports it."""
    rig_a, rig_b, rig_c = rigs
    for rig, loss in zip((rig_a, rig_b), losses, strict=True):
        status(rig, task_of(job, rig), {"metrics": {"round": number, "metrics": {"loss": loss}}})
    report = {
        "round": number,
        "participants": [str(rig_a.pk), str(rig_b.pk)],
        "left_out": [],
        "refused": {},
        "samples": 24,
        "duration": 1.5,
        "bytes_in": 4096,
        "bytes_out": 2048,
        "eval_loss": eval_loss,
    }
    status(rig_c, task_of(job, rig_c), {"round": report})


def browser(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def ada_browser(job_owner) -> Client:
    return browser(job_owner)


@pytest.fixture
def eve(db):
    return get_user_model().objects.create_user(username="eve", password=None)


@pytest.fixture
def eve_browser(eve) -> Client:
    return browser(eve)


@pytest.fixture
def staff_browser(db) -> Client:
    return browser(get_user_model().objects.create_user(username="root", password=None, is_staff=True))
