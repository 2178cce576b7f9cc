"""Submitting a full DiLoCo specification: JSON or Hypha's scheduler TOML, every mistake at once."""

from __future__ import annotations

import pytest

from apps.datasets import services as dataset_services
from apps.jobs.models import Job
from apps.market.models import Advertisement
from tests.apps.jobs.test_spec import HYPHA_DEFAULT_TOML

URL = "/api/jobs/diloco/"


@pytest.fixture(autouse=True)
def _registered_datasets(db):
    """The datasets the specs below train on, as a data node registers them (4 slices each)."""
    node, _ = dataset_services.create_data_node(name="node-1", url="http://127.0.0.1:9")
    for name in ("tiny-text", "mnist"):
        dataset_services.register_dataset(node, name, [(index, 100, "a" * 64) for index in range(4)])


SPEC = {
    "name": "tiny-gpt",
    "model": {
        "source": {"type": "huggingface", "repository": "hypha-space/tiny-gpt", "filenames": ["config.json"]},
        "type": "causal-lm",
        "input_names": ["input_ids", "labels"],
    },
    "dataset": {"name": "tiny-text"},
    "inner_optimizer": {"learning_rate": 0.001},
    "outer_optimizer": {"learning_rate": 0.7, "momentum": 0.9},
    "rounds": {"update_rounds": 10, "inner_steps": 50},
    "num_trainers": 3,
    "trainer": {
        "resources": {"cpu": 2, "memory": 4, "storage": 1, "gpu": 0},
        "price": {"bid": 90, "max": 120},
    },
}


@pytest.mark.django_db(transaction=True)  # the allocation is queued on commit
def test_a_json_spec_creates_a_job_with_its_requirements_and_spec(alice):
    # when
    response = alice.client.post(URL, SPEC, format="json")

    # then
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert (job.name, job.num_trainers, job.owner) == ("tiny-gpt", 3, alice.user)
    assert job.requirements["trainer"] == {
        "resources": {
            "cpu": 2.0,
            "memory": 4.0,
            "storage": 1.0,
            "gpu": 0.0,
            "devices": 0,
            "device_memory": 0.0,
        },
        "executor": {"class": "train", "name": "diloco-transformer"},
        "bid": 90.0,
        "max": 120.0,
    }
    assert job.spec["rounds"] == {
        "update_rounds": 10,
        "inner_steps": 50,
        "avg_samples_between_updates": None,
        "max_batch_size": None,
        "round_timeout": 120.0,
        "weighted": True,
        "encoding": "float32",
        "encoding_block_size": None,
        "overlap": "none",
        "fragments": None,
        "mix": None,
        "checkpoint_every": 10,
    }
    assert job.spec["model"]["type"] == "causal-lm"
    wanted = dict(Advertisement.objects.filter(job=job).values_list("role", "wanted"))
    assert wanted == {"trainer": 3, "parameter_server": 1}


@pytest.mark.django_db(transaction=True)
def test_hypha_scheduler_toml_creates_a_job(alice):
    # when
    response = alice.client.generic(
        "POST", f"{URL}?name=lenet", HYPHA_DEFAULT_TOML.encode(), content_type="application/toml"
    )

    # then: the original's defaults (2 workers, gpu 10 per trainer, bid = max = 100)
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert (job.name, job.num_trainers) == ("lenet", 2)
    assert job.requirements["trainer"]["resources"]["gpu"] == 10.0
    assert job.spec["dataset"] == {"name": "mnist"}


@pytest.mark.django_db
def test_every_mistake_is_reported_at_once_and_nothing_is_created(alice):
    # given
    bad = {
        **SPEC,
        "model": {**SPEC["model"], "type": "vision-classification"},
        "inner_optimizer": {"learning_rate": -1},
        "rounds": {"update_rounds": 10, "inner_steps": 50, "avg_samples_between_updates": 100},
    }

    # when
    response = alice.client.post(URL, bad, format="json")

    # then
    assert response.status_code == 400
    body = response.json()
    assert set(body) == {"model.type", "inner_optimizer.learning_rate", "rounds"}
    assert "image-classification" in body["model.type"][0]
    assert Job.objects.count() == 0


@pytest.mark.django_db
def test_broken_toml_is_a_400_naming_the_line(alice):
    response = alice.client.generic("POST", URL, b"[scheduler.job\n", content_type="application/toml")

    assert response.status_code == 400
    assert response.json()["detail"].startswith("TOML syntax error")
    assert Job.objects.count() == 0


@pytest.mark.django_db
def test_toml_that_is_not_utf8_is_a_400(alice):
    response = alice.client.generic("POST", URL, b"\xff\xfe[", content_type="application/toml")

    assert response.status_code == 400
    assert Job.objects.count() == 0


@pytest.mark.django_db
def test_another_content_type_is_a_415(alice):
    response = alice.client.generic("POST", URL, b"name=x", content_type="application/x-www-form-urlencoded")

    assert response.status_code == 415


@pytest.mark.django_db
def test_anonymous_cannot_submit(anonymous):
    assert anonymous.post(URL, SPEC, format="json").status_code == 401
