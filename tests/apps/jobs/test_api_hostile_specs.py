"""Specifications that would turn the workers against their own networks or exhaust them (issue 12, findings 7
and 10): a model URL that points at a private address, and a model config far too large for what the job
leases. Both are refused at ``POST /api/jobs/diloco/`` with a field error, and nothing is created."""

from __future__ import annotations

import pytest

from apps.datasets import services as dataset_services
from apps.jobs.models import Job
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


def spec(source: dict, *, trainer_memory: float = 4.0, server_memory: float = 4.0) -> dict:
    return {
        "name": "hostile",
        "model": {"source": source, "type": "causal-lm", "input_names": ["input_ids", "labels"]},
        "dataset": {"name": "tiny-text"},
        "inner_optimizer": {"learning_rate": 0.001},
        "outer_optimizer": {"learning_rate": 0.7, "momentum": 0.9},
        "rounds": {"update_rounds": 2, "inner_steps": 5},
        "num_trainers": 2,
        "trainer": {"resources": {"cpu": 1, "memory": trainer_memory, "storage": 0, "gpu": 0}},
        "parameter_server": {"resources": {"cpu": 1, "memory": server_memory, "storage": 0, "gpu": 0}},
    }


def assert_nothing_created() -> None:
    assert Job.objects.count() == 0
    assert Advertisement.objects.count() == 0


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8530/internal/model.safetensors",
        "http://localhost:8530/internal/model.safetensors",
        "http://10.1.2.3/model.zip",
        "http://192.168.0.10/model.zip",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]:8000/model.zip",
        "http://[::ffff:127.0.0.1]/model.zip",
        "http://0.0.0.0:8000/model.zip",
        "http://224.0.0.1/model.zip",
    ],
)
@pytest.mark.django_db
def test_a_model_url_at_a_private_address_is_refused(alice, settings, url):
    settings.HYPHA_ALLOW_PRIVATE_URLS = False

    response = alice.client.post(URL, spec({"type": "url", "url": url}), format="json")

    assert response.status_code == 400, response.content
    body = response.json()
    assert list(body) == ["model.source.url"]
    assert "not a public address" in body["model.source.url"][0]
    assert "HYPHA_ALLOW_PRIVATE_URLS" in body["model.source.url"][0]
    assert_nothing_created()


@pytest.mark.django_db(transaction=True)
def test_the_operator_may_allow_private_model_urls(alice, settings):
    settings.HYPHA_ALLOW_PRIVATE_URLS = True

    response = alice.client.post(
        URL, spec({"type": "url", "url": "http://127.0.0.1:8530/model.zip"}), format="json"
    )

    assert response.status_code == 201, response.content
    assert Job.objects.get().spec["model"]["source"]["url"] == "http://127.0.0.1:8530/model.zip"


@pytest.mark.django_db
def test_a_config_far_larger_than_any_worker_is_refused(alice):
    # given: GPT-2 with a million layers of width a million (~1.2e19 parameters)
    huge = {**TINY_GPT2, "n_embd": 1_000_000, "n_layer": 1_000_000, "n_head": 1}

    # when
    response = alice.client.post(URL, spec({"type": "config", "config": huge}), format="json")

    # then
    assert response.status_code == 400, response.content
    body = response.json()
    assert list(body) == ["model.source.config"]
    assert "parameters" in body["model.source.config"][0]
    assert "HYPHA_MAX_MODEL_PARAMETERS" in body["model.source.config"][0]
    assert_nothing_created()


@pytest.mark.django_db
def test_a_config_larger_than_the_declared_memory_is_refused_with_what_it_needs(alice, settings):
    # given: GPT-2 small's shape (124,439,808 parameters: ~2.5 GB per trainer at 4 B × 5 copies), 1 GB declared
    gpt2_small = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12}

    # when
    response = alice.client.post(
        URL, spec({"type": "config", "config": gpt2_small}, trainer_memory=1, server_memory=1), format="json"
    )

    # then
    assert response.status_code == 400, response.content
    [message] = response.json()["model.source.config"]
    assert "124,439,808 parameters" in message
    assert "trainer.resources" in message and "parameter_server.resources" in message
    assert_nothing_created()


@pytest.mark.django_db(transaction=True)
def test_a_config_within_the_declared_memory_is_accepted(alice):
    response = alice.client.post(
        URL, spec({"type": "config", "config": TINY_GPT2}, trainer_memory=1), format="json"
    )

    assert response.status_code == 201, response.content


@pytest.mark.django_db
def test_a_config_whose_tensors_cannot_even_be_sized_is_refused(alice):
    # given: two layers, but a width whose attention matrix has more elements than an int64 counts
    huge = {**TINY_GPT2, "n_embd": 10**10, "n_head": 1}

    response = alice.client.post(URL, spec({"type": "config", "config": huge}), format="json")

    assert response.status_code == 400, response.content
    [message] = response.json()["model.source.config"]
    assert message.startswith("transformers cannot build a model of this config: ")
    assert_nothing_created()
