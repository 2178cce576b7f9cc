"""``POST /api/jobs/`` with a non-empty ``spec``: that job is a DiLoCo training job, so its spec is checked at
submission exactly as ``POST /api/jobs/diloco/`` checks one (the shape, then the private-URL, model-size, upload
and dataset checks). A mistake is a 400 naming the field (``{"spec": {"model": {"type": [...]}}}``) and nothing
is stored; before, it was stored as it came and failed only when the job was planned, after its leases."""

from __future__ import annotations

import pytest

from apps.jobs import training
from apps.jobs.models import Job
from apps.market.models import Advertisement

URL = "/api/jobs/"

#: The rest of a DiLoCo spec (the roles, num_trainers and allocation_timeout are the submission's own fields).
REST = {
    "model": {
        "source": {
            "type": "config",
            "config": {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2},
        },
        "type": "causal-lm",
        "input_names": ["input_ids", "labels"],
    },
    "dataset": {"name": "tiny-text"},
    "inner_optimizer": {"learning_rate": 0.001},
    "outer_optimizer": {"learning_rate": 0.7, "momentum": 0.9},
    "rounds": {"update_rounds": 2, "inner_steps": 5},
}


def submission(**changes) -> dict:
    return {
        "name": "plain",
        "num_trainers": 2,
        "trainer": {
            "resources": {"cpu": 2, "memory": 8, "storage": 0, "gpu": 0},
            "price": {"bid": 80, "max": 90},
        },
        "spec": REST,
        **changes,
    }


def assert_nothing_created() -> None:
    assert Job.objects.count() == 0
    assert Advertisement.objects.count() == 0


@pytest.mark.django_db
def test_a_spec_that_is_not_a_diloco_spec_is_refused_field_by_field(alice, data_node):
    # given: what the API once stored as it came (and the job then failed at plan time, holding leases)
    body = submission(spec={"model": "gpt2-tiny", "rounds": 3})

    # when
    response = alice.client.post(URL, body, format="json")

    # then
    assert response.status_code == 400, response.content
    errors = response.json()["spec"]
    assert set(errors) == {"model", "rounds", "dataset", "inner_optimizer", "outer_optimizer"}
    assert errors["dataset"] == ["Field required"]
    assert_nothing_created()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("rest", "path"),
    [
        ({**REST, "inner_optimizer": {"learning_rate": "0.1"}}, ("inner_optimizer", "learning_rate")),
        ({**REST, "inner_optimizer": {"learning_rate": True}}, ("inner_optimizer", "learning_rate")),
        ({**REST, "rounds": {"update_rounds": 2, "inner_steps": 10**12}}, ("rounds", "inner_steps")),
        ({**REST, "dataset": {"name": "x" * 100_000}}, ("dataset", "name")),
        ({**REST, "modle": {}}, ("modle",)),
        ({**REST, "model": [REST["model"]]}, ("model",)),
    ],
)
def test_wrong_types_huge_values_and_unknown_keys_are_field_errors(alice, data_node, rest, path):
    response = alice.client.post(URL, submission(spec=rest), format="json")

    assert response.status_code == 400, response.content
    errors = response.json()["spec"]
    for key in path:
        errors = errors[key]
    assert isinstance(errors, list) and errors and all(isinstance(message, str) for message in errors)
    assert_nothing_created()


@pytest.mark.django_db
def test_a_private_model_url_is_refused_here_too(alice, data_node, settings):
    # given: the SSRF check of /api/jobs/diloco/ must not be one POST away from being skipped
    settings.HYPHA_ALLOW_PRIVATE_URLS = False
    rest = {**REST, "model": {**REST["model"], "source": {"type": "url", "url": "http://169.254.169.254/x"}}}

    response = alice.client.post(URL, submission(spec=rest), format="json")

    assert response.status_code == 400, response.content
    assert list(response.json()) == ["spec"]
    assert "not a public address" in response.json()["spec"]["model"]["source"]["url"][0]
    assert_nothing_created()


@pytest.mark.django_db
def test_an_unknown_dataset_and_a_missing_upload_are_refused(alice, data_node):
    rest = {
        **REST,
        "dataset": {"name": "nowhere"},
        "model": {**REST["model"], "source": {"type": "upload", "file": "mine.zip"}},
    }

    response = alice.client.post(URL, submission(spec=rest), format="json")

    assert response.status_code == 400, response.content
    errors = response.json()["spec"]
    assert "nowhere" in errors["dataset"]["name"][0]
    assert "mine.zip" in errors["model"]["source"]["file"][0]
    assert_nothing_created()


@pytest.mark.django_db
@pytest.mark.parametrize("key", ["num_trainers", "trainer", "parameter_server", "allocation_timeout", "name"])
def test_the_submissions_own_fields_are_refused_inside_the_spec(alice, data_node, key):
    value = {"num_trainers": 3, "allocation_timeout": 60, "name": "x"}.get(key, {"resources": {"cpu": 1}})

    response = alice.client.post(URL, submission(spec={**REST, key: value}), format="json")

    assert response.status_code == 400, response.content
    assert list(response.json()["spec"]) == [key]
    assert_nothing_created()


@pytest.mark.django_db
def test_a_pool_target_that_differs_from_num_trainers_is_refused(alice, data_node):
    rest = {**REST, "trainers": {"min": 1, "target": 4}}

    response = alice.client.post(URL, submission(spec=rest), format="json")

    assert response.status_code == 400, response.content
    assert response.json() == {"num_trainers": ["2 differs from spec.trainers.target (4); give one."]}
    assert_nothing_created()


@pytest.mark.django_db(transaction=True)
def test_a_pool_without_num_trainers_sets_it(alice, data_node):
    body = submission(spec={**REST, "trainers": {"min": 1, "target": 4, "grace": 30}})
    del body["num_trainers"]

    response = alice.client.post(URL, body, format="json")

    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert job.num_trainers == 4
    assert job.spec["trainers"] == {"min": 1, "target": 4, "grace": 30.0}


@pytest.mark.django_db(transaction=True)
def test_a_valid_spec_is_stored_whole_and_agrees_with_the_submission(alice, data_node):
    # when
    response = alice.client.post(URL, submission(allocation_timeout=120), format="json")

    # then: the stored spec is what planning reads, and it says what the roles and counts say
    assert response.status_code == 201, response.content
    job = Job.objects.get()
    parsed = training.plan(job).spec
    assert (parsed.num_trainers, job.num_trainers) == (2, 2)
    assert parsed.trainer.resources.cpu == 2.0
    assert (parsed.trainer.price.bid, parsed.trainer.price.max) == (80.0, 90.0)
    assert parsed.allocation_timeout == job.allocation_timeout == 120.0
    assert parsed.dataset.name == "tiny-text"
    assert response.json()["spec"] == job.spec


@pytest.mark.django_db(transaction=True)
def test_an_empty_spec_is_still_a_market_only_job(alice):
    response = alice.client.post(URL, submission(spec={}), format="json")

    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert job.spec == {}
    assert not training.is_training_job(job)


@pytest.mark.django_db
@pytest.mark.parametrize("target", [10**30, 0, "4", True])
def test_a_pool_target_that_is_no_count_of_trainers_is_the_specs_error(alice, data_node, target):
    rest = {**REST, "trainers": {"min": 1, "target": target}}

    response = alice.client.post(URL, submission(spec=rest), format="json")

    assert response.status_code == 400, response.content
    assert list(response.json()) == ["spec"]
    assert list(response.json()["spec"]["trainers"]) == ["target"]
    assert_nothing_created()
