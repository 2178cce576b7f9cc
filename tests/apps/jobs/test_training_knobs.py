"""The training knobs (``training`` and ``inner_optimizer.weight_decay``; docs/configuration.md, "Training
knobs"): submitted through the real API as JSON and as Hypha's TOML, refused with field errors, and carried into
the trainers' job JSON only when set."""

from __future__ import annotations

import pytest

from apps.jobs.models import Job
from apps.jobs.spec import parse_json, to_train_job_json
from tests.apps.jobs.test_api_diloco import SPEC, URL, _registered_datasets  # noqa: F401 (fixture)
from tests.apps.jobs.test_spec import HYPHA_DEFAULT_TOML

KNOBS = {
    "max_grad_norm": 1.0,
    "gradient_accumulation_steps": 4,
    "mixed_precision": "bf16",
    "gradient_checkpointing": True,
    "dataloader_workers": 2,  # DataLoader workers read the slices; the trainer still fetches them
}


def knobbed(**training: object) -> dict:
    return {**SPEC, "batch_size": 8, "training": training}


def trainer_config(spec: dict) -> dict:
    envelope = to_train_job_json(
        parse_json({key: value for key, value in spec.items() if key != "name"}),
        job_id="job-1",
        data_reference={"type": "scheduler"},
        updates_reference={},
        results_reference={},
    )
    return envelope["executor"]["config"]


@pytest.mark.django_db(transaction=True)
def test_a_job_with_every_knob_keeps_them_in_its_spec(alice):
    spec = {**knobbed(**KNOBS), "inner_optimizer": {"learning_rate": 0.001, "weight_decay": 0.1}}

    response = alice.client.post(URL, spec, format="json")

    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert job.spec["training"] == KNOBS
    assert job.spec["inner_optimizer"]["weight_decay"] == 0.1


@pytest.mark.django_db(transaction=True)
def test_a_job_without_knobs_gets_the_defaults(alice):
    response = alice.client.post(URL, SPEC, format="json")

    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert job.spec["training"] == {
        "max_grad_norm": None,
        "gradient_accumulation_steps": 1,
        "mixed_precision": "no",
        "gradient_checkpointing": False,
        "dataloader_workers": 0,
    }
    assert job.spec["inner_optimizer"]["weight_decay"] is None


@pytest.mark.parametrize(
    ("training", "field", "message"),
    [
        ({"max_grad_norm": 0}, "training.max_grad_norm", "greater than 0"),
        ({"max_grad_norm": -1.0}, "training.max_grad_norm", "greater than 0"),
        (
            {"gradient_accumulation_steps": 0},
            "training.gradient_accumulation_steps",
            "greater than or equal to 1",
        ),
        ({"gradient_accumulation_steps": 2048}, "training.gradient_accumulation_steps", "less than or equal"),
        ({"gradient_accumulation_steps": 2.0}, "training.gradient_accumulation_steps", "integer"),
        ({"mixed_precision": "fp8"}, "training.mixed_precision", "'no', 'bf16' or 'fp16'"),
        ({"gradient_checkpointing": "yes"}, "training.gradient_checkpointing", "boolean"),
        ({"dataloader_workers": -1}, "training.dataloader_workers", "greater than or equal to 0"),
        ({"dataloader_workers": 33}, "training.dataloader_workers", "less than or equal to 32"),
        ({"clip": 1.0}, "training.clip", "Unknown key"),
        # Cross-checks: micro-batches of equal size, and fp16 only where a CUDA GPU is asked for.
        ({"gradient_accumulation_steps": 3}, "training", "must divide batch_size (8)"),
        ({"mixed_precision": "fp16"}, "training", "fp16 needs a CUDA GPU"),
    ],
)
@pytest.mark.django_db
def test_a_bad_knob_is_a_field_error(alice, training, field, message):
    response = alice.client.post(URL, knobbed(**training), format="json")

    assert response.status_code == 400, response.content
    body = response.json()
    assert field in body, body
    assert message in body[field][0]
    assert Job.objects.count() == 0


@pytest.mark.parametrize("decay", [-0.1, 11.0, "0.1"])
@pytest.mark.django_db
def test_a_bad_weight_decay_is_a_field_error(alice, decay):
    spec = {**SPEC, "inner_optimizer": {"learning_rate": 0.001, "weight_decay": decay}}

    response = alice.client.post(URL, spec, format="json")

    assert response.status_code == 400
    assert "inner_optimizer.weight_decay" in response.json()


@pytest.mark.parametrize("resources", [{"gpu": 8}, {"devices": 1}])
@pytest.mark.django_db(transaction=True)
def test_fp16_is_accepted_when_the_trainers_ask_for_a_gpu(alice, resources):
    spec = {**knobbed(mixed_precision="fp16"), "trainer": {**SPEC["trainer"], "resources": resources}}

    response = alice.client.post(URL, spec, format="json")

    assert response.status_code == 201, response.content


TOML_KNOBS = """
[scheduler.job.inner_optimizer]
learning-rate = 0.001
weight-decay = 0.05

[scheduler.job.training]
max_grad_norm = 0.5
gradient-accumulation-steps = 2
mixed_precision = "bf16"
gradient_checkpointing = true
dataloader_workers = 3
"""


def _with_knobs(toml: str) -> str:
    # The default TOML has its own inner_optimizer table: replace it by the one above.
    start = toml.index("[scheduler.job.inner_optimizer]")
    end = toml.index("[", toml.index("\n", start) + 1)
    toml = toml[:start] + toml[end:] + TOML_KNOBS
    # Two micro-batches need a batch that splits in two.
    return toml.replace('type = "diloco"\n', 'type = "diloco"\nbatch_size = 4\n', 1)


@pytest.mark.django_db(transaction=True)
def test_hypha_toml_takes_the_knobs_in_either_spelling(alice):
    response = alice.client.generic(
        "POST", f"{URL}?name=knobs", _with_knobs(HYPHA_DEFAULT_TOML).encode(), content_type="application/toml"
    )

    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert job.spec["training"] == {
        "max_grad_norm": 0.5,
        "gradient_accumulation_steps": 2,
        "mixed_precision": "bf16",
        "gradient_checkpointing": True,
        "dataloader_workers": 3,
    }
    assert job.spec["inner_optimizer"]["weight_decay"] == 0.05


@pytest.mark.django_db
def test_a_bad_toml_knob_is_reported_at_its_toml_key(alice):
    toml = _with_knobs(HYPHA_DEFAULT_TOML).replace('mixed_precision = "bf16"', 'mixed_precision = "fp8"')
    toml = toml.replace("dataloader_workers = 3", "dataloader_workers = 3\nworkers = 2")

    response = alice.client.generic("POST", URL, toml.encode(), content_type="application/toml")

    assert response.status_code == 400
    body = response.json()
    assert "scheduler.job.training.mixed_precision" in body, body
    assert "scheduler.job.training.workers" in body, body


def test_the_trainers_job_json_carries_the_knobs_only_when_set():
    default = trainer_config(SPEC)
    assert "training" not in default
    assert "weight-decay" not in default["optimizer"]

    config = trainer_config(
        {**knobbed(**KNOBS), "inner_optimizer": {"learning_rate": 0.001, "weight_decay": 0}}
    )
    assert config["training"] == KNOBS
    assert config["optimizer"]["weight-decay"] == 0
