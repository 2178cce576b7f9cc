"""A DiLoCo job's trainer asks for devices: ``trainer.resources.devices`` (count, 0 = none, as before) and
``device_memory`` (GB per device). Taken by ``POST /api/jobs/diloco/`` and the TOML form; hostile values are
field errors and create nothing; the advertisement carries them."""

from __future__ import annotations

import pytest

from apps.datasets import services as dataset_services
from apps.jobs.models import Job
from apps.jobs.spec import parse_json, parse_toml, to_requirements
from apps.market.models import Advertisement

URL = "/api/jobs/diloco/"
TINY_GPT2 = {
    "model_type": "gpt2",
    "vocab_size": 256,
    "n_positions": 128,
    "n_embd": 128,
    "n_layer": 2,
    "n_head": 4,
}


@pytest.fixture(autouse=True)
def _registered_dataset(db):
    node, _ = dataset_services.create_data_node(name="node-1", url="http://127.0.0.1:9")
    dataset_services.register_dataset(node, "tiny-text", [(index, 100, "a" * 64) for index in range(4)])


def spec(trainer_resources: dict) -> dict:
    return {
        "name": "gpus",
        "model": {
            "source": {"type": "config", "config": TINY_GPT2},
            "type": "causal-lm",
            "input_names": ["input_ids", "labels"],
        },
        "dataset": {"name": "tiny-text"},
        "inner_optimizer": {"learning_rate": 0.001},
        "outer_optimizer": {"learning_rate": 0.7, "momentum": 0.9},
        "rounds": {"update_rounds": 2, "inner_steps": 5},
        "num_trainers": 1,
        "trainer": {"resources": {"cpu": 1, "memory": 4, "storage": 0, "gpu": 0, **trainer_resources}},
    }


def without_name(data: dict) -> dict:
    return {key: value for key, value in data.items() if key != "name"}


def test_devices_default_to_none_and_reach_the_requirements():
    plain = to_requirements(parse_json(without_name(spec({}))))
    with_devices = to_requirements(parse_json(without_name(spec({"devices": 2, "device_memory": 40.0}))))

    assert (plain["trainer"]["resources"]["devices"], plain["trainer"]["resources"]["device_memory"]) == (
        0,
        0.0,
    )
    assert with_devices["trainer"]["resources"]["devices"] == 2
    assert with_devices["trainer"]["resources"]["device_memory"] == 40.0


def test_the_toml_form_takes_devices_in_the_worker_table():
    text = """
[scheduler.job.model]
type = "causal-lm"
input_names = ["input_ids", "labels"]
config = { model_type = "gpt2", vocab_size = 256, n_positions = 128, n_embd = 128, n_layer = 2, n_head = 4 }
[scheduler.job.dataset]
dataset = "tiny-text"
[scheduler.job.rounds]
update_rounds = 3
inner_steps = 10
[scheduler.job.inner_optimizer]
learning-rate = 0.003
[scheduler.job.outer_optimizer]
learning-rate = 0.7
momentum = 0.9
[scheduler.job.resources.worker]
cpu = 1.0
memory = 4.0
devices = 4
device_memory = 80.0
"""

    resources = parse_toml(text).trainer.resources

    assert (resources.devices, resources.device_memory) == (4, 80.0)


@pytest.mark.django_db(transaction=True)
def test_a_job_asking_for_devices_advertises_them(alice):
    response = alice.client.post(URL, spec({"devices": 2, "device_memory": 24}), format="json")

    assert response.status_code == 201, response.content
    ad = Advertisement.objects.get(role="trainer")
    assert (ad.devices, ad.device_memory) == (2, 24.0)
    assert Advertisement.objects.get(role="parameter_server").devices == 0


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("resources", "field"),
    [
        ({"devices": -1}, "trainer.resources.devices"),
        ({"devices": 10**9}, "trainer.resources.devices"),
        ({"devices": "2"}, "trainer.resources.devices"),
        ({"devices": 2.5}, "trainer.resources.devices"),
        ({"devices": 1, "device_memory": -24}, "trainer.resources.device_memory"),
        ({"devices": 1, "device_memory": 1e12}, "trainer.resources.device_memory"),
    ],
)
def test_hostile_device_requests_are_field_errors_and_create_nothing(alice, resources, field):
    response = alice.client.post(URL, spec(resources), format="json")

    assert response.status_code == 400, response.content
    assert list(response.json()) == [field]
    assert Job.objects.count() == 0
    assert Advertisement.objects.count() == 0


# --- the plain jobs API (POST /api/jobs/): the same two keys in a role's resources ---------------------------

PLAIN = {
    "name": "plain",
    "num_trainers": 1,
    "trainer": {"resources": {"cpu": 2, "memory": 8, "storage": 0, "gpu": 0}},
    "spec": {},
}


def plain(**resources) -> dict:
    return {**PLAIN, "trainer": {"resources": {**PLAIN["trainer"]["resources"], **resources}}}


@pytest.mark.django_db(transaction=True)
def test_the_plain_jobs_api_takes_devices_and_advertises_them(alice):
    response = alice.client.post("/api/jobs/", plain(devices=4, device_memory=80), format="json")

    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert (job.requirement("trainer").devices, job.requirement("trainer").device_memory) == (4, 80.0)
    assert Advertisement.objects.get(role="trainer").devices == 4


@pytest.mark.django_db
@pytest.mark.parametrize(
    "resources",
    [{"devices": -1}, {"devices": 10**9}, {"devices": 2.5}, {"devices": True}, {"device_memory": -1}],
)
def test_the_plain_jobs_api_refuses_hostile_device_requests(alice, resources):
    response = alice.client.post("/api/jobs/", plain(**resources), format="json")

    assert response.status_code == 400, response.content
    assert list(response.json()) == ["trainer"]
    assert list(response.json()["trainer"]["resources"]) == list(resources)
    assert Job.objects.count() == 0
