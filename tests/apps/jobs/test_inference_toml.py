"""The TOML form of a batch inference job (``apps/jobs/spec_toml.py``): the training form's job table with
``type = "inference"``, read into the same :class:`InferenceSpec` as its JSON; mistakes reported at the TOML
keys as written; submitted as ``application/toml`` to ``POST /api/jobs/inference/`` through the real view."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apps.jobs.exceptions import SpecError
from apps.jobs.models import Job
from apps.jobs.spec import inference as inference_spec
from apps.jobs.spec_toml import parse_inference_toml, parse_toml

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "inference"
URL = "/api/jobs/inference/"

GENERATE_TOML = """\
[scheduler.job]
type = "inference"
batch_size = 2
allocation_timeout = 600.0

[scheduler.job.model]
repository = "hypha-space/tiny"
filenames = ["config.json"]
input-names = ["input_ids"]

[scheduler.job.dataset]
dataset = "tiny-text"

[scheduler.job.task]
type = "generate"
max-new-tokens = 4
temperature = 0.5
seed = 7

[scheduler.job.verification]
fraction = 0.25

[scheduler.job.resources]
num_workers = 2
worker = { cpu = 2.0, memory = 4.0 }
worker_price = { bid = 60.0, max = 90.0 }
worker_min_reliability = 0.4
"""

GENERATE_JSON = {
    "model": {
        "source": {"type": "huggingface", "repository": "hypha-space/tiny", "filenames": ["config.json"]},
        "input_names": ["input_ids"],
    },
    "dataset": {"name": "tiny-text"},
    "task": {"type": "generate", "max_new_tokens": 4, "temperature": 0.5, "seed": 7},
    "batch_size": 2,
    "allocation_timeout": 600.0,
    "verification": {"fraction": 0.25},
    "workers": 2,
    "worker": {
        "resources": {"cpu": 2.0, "memory": 4.0},
        "price": {"bid": 60.0, "max": 90.0},
        "min_reliability": 0.4,
    },
}


def errors_of(text: str) -> dict[str, str]:
    with pytest.raises(SpecError) as raised:
        parse_inference_toml(text)
    return {item["field"]: item["message"] for item in raised.value.errors}


# --- parsing ------------------------------------------------------------------------------------------------


def test_an_inference_toml_is_the_spec_its_json_says():
    assert parse_inference_toml(GENERATE_TOML) == inference_spec.parse_json(GENERATE_JSON)


@pytest.mark.parametrize("table", ["[job]", ""])
def test_the_job_table_may_be_job_or_the_document_itself(table):
    # given: the same job under [job], or at the top level
    text = GENERATE_TOML.replace("[scheduler.job]\n", f"{table}\n" if table else "")
    text = text.replace("[scheduler.job.", "[job." if table else "[")

    assert parse_inference_toml(text) == inference_spec.parse_json(GENERATE_JSON)


def test_the_example_is_its_json_twin():
    for toml_path in sorted(EXAMPLES.glob("*.toml")):
        written = json.loads(toml_path.with_suffix(".json").read_text())
        written.pop("name")
        assert parse_inference_toml(toml_path.read_text()) == inference_spec.parse_json(written), toml_path


def test_classify_and_embed_tasks_and_every_model_source():
    base = GENERATE_TOML.replace(
        'type = "generate"\nmax-new-tokens = 4\ntemperature = 0.5\nseed = 7', 'type = "classify"\ntop-k = 3'
    )
    assert parse_inference_toml(base).task == inference_spec.ClassifyTask(type="classify", top_k=3)
    embed = GENERATE_TOML.replace(
        'type = "generate"\nmax-new-tokens = 4\ntemperature = 0.5\nseed = 7', 'type = "embed"'
    )
    assert parse_inference_toml(embed).task.type == "embed"
    for source, expected in (
        ('upload = "tiny-gpt2.zip"', {"type": "upload", "file": "tiny-gpt2.zip"}),
        ('url = "https://example.com/m.zip"', {"type": "url", "url": "https://example.com/m.zip"}),
        (
            'config = { model_type = "gpt2", n_layer = 1 }',
            {"type": "config", "config": {"model_type": "gpt2", "n_layer": 1}},
        ),
    ):
        text = GENERATE_TOML.replace('repository = "hypha-space/tiny"\nfilenames = ["config.json"]', source)
        assert parse_inference_toml(text).model.source.model_dump(exclude_none=True) == expected


def test_the_tomls_own_mistakes_are_reported_at_their_keys():
    text = (
        GENERATE_TOML.replace("input-names", 'type = "causal-lm"\ninput-names')
        .replace(
            "worker_min_reliability = 0.4", "worker_min_reliability = 0.4\nparameter_server = { cpu = 1.0 }"
        )
        .replace("batch_size = 2", "batch_size = 2\nrounds = 3")
    )

    assert errors_of(text) == {
        "scheduler.job.model.type": "The task decides how the model is loaded (generate: causal-lm, classify: "
        "sequence-classification, embed: feature-extraction).",
        "scheduler.job.resources.parameter_server": "An inference job has no parameter server.",
        "scheduler.job.rounds": "Unknown key.",
    }


def test_the_specs_own_errors_are_renamed_to_toml_keys():
    text = GENERATE_TOML.replace("max-new-tokens = 4", "max-new-tokens = 0\nbeams = 2").replace(
        "num_workers = 2", "num_workers = 0"
    )

    assert errors_of(text) == {
        "scheduler.job.task.max-new-tokens": "Input should be greater than or equal to 1",
        "scheduler.job.task.beams": "Unknown key.",
        "scheduler.job.resources.num_workers": "Input should be greater than or equal to 1",
    }


def test_verification_needs_two_workers_at_its_toml_key():
    text = GENERATE_TOML.replace("num_workers = 2", "num_workers = 1")

    assert errors_of(text) == {
        "scheduler.job.verification.fraction": "Verification needs at least 2 workers (3 to settle a disagreement)."
    }


def test_a_requirement_array_names_the_inference_executor():
    # given: the docs' [[resources.worker]] array instead of the worker table
    text = GENERATE_TOML.split("[scheduler.job.resources]")[0] + (
        "[scheduler.job.resources]\nnum_workers = 2\n"
        '[[scheduler.job.resources.worker]]\ntype = "CPU"\nmin = 2.0\n'
        '[[scheduler.job.resources.worker]]\nkind = "diloco-trainer"\n'
    )

    assert errors_of(text) == {
        "scheduler.job.resources.worker.1.kind": "The worker executor is 'batch-inference'."
    }
    fixed = parse_inference_toml(text.replace('kind = "diloco-trainer"', 'kind = "batch-inference"'))
    assert fixed.worker.resources.cpu == 2.0


def test_the_type_says_which_kind_each_parser_takes():
    assert errors_of(GENERATE_TOML.replace('type = "inference"\n', "")) == {
        "scheduler.job.type": 'An inference job needs type = "inference" in its job table.'
    }
    with pytest.raises(SpecError) as raised:
        parse_toml(GENERATE_TOML)
    assert raised.value.errors == [
        {
            "field": "scheduler.job.type",
            "message": "An inference job: submit it to POST /api/jobs/inference/ (`hypha submit` does).",
        }
    ]


# --- the API ------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _data_dir(settings, tmp_path):
    settings.HYPHA_DATA_DIR = tmp_path


@pytest.mark.django_db
def test_a_toml_body_submits_an_inference_job_stored_as_its_json_twin(alice, data_node):
    # when
    from_toml = alice.client.generic(
        "POST", f"{URL}?name=generate", GENERATE_TOML.encode(), content_type="application/toml"
    )
    from_json = alice.client.post(URL, {"name": "generate", **GENERATE_JSON}, format="json")

    # then
    assert from_toml.status_code == 201, from_toml.content
    assert from_json.status_code == 201, from_json.content
    job = Job.objects.get(pk=from_toml.json()["id"])
    assert job.kind == "inference"
    assert job.name == "generate"
    assert job.spec == Job.objects.get(pk=from_json.json()["id"]).spec


@pytest.mark.django_db
def test_a_refused_toml_body_is_a_400_keyed_by_toml_paths(alice, data_node):
    text = GENERATE_TOML.replace("max-new-tokens = 4", "max-new-tokens = 0")

    response = alice.client.generic("POST", URL, text.encode(), content_type="application/toml")

    assert response.status_code == 400
    assert response.json() == {
        "scheduler.job.task.max-new-tokens": ["Input should be greater than or equal to 1"]
    }
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_a_toml_that_cannot_be_read_is_a_400_with_a_detail(alice, data_node):
    response = alice.client.generic("POST", URL, b"[scheduler.job\n", content_type="application/toml")

    assert response.status_code == 400
    assert "TOML syntax error" in response.json()["detail"]


@pytest.mark.django_db
def test_an_inference_toml_sent_to_the_diloco_endpoint_says_where_it_goes(alice, data_node):
    response = alice.client.generic(
        "POST", "/api/jobs/diloco/", GENERATE_TOML.encode(), content_type="application/toml"
    )

    assert response.status_code == 400
    assert response.json() == {
        "scheduler.job.type": [
            "An inference job: submit it to POST /api/jobs/inference/ (`hypha submit` does)."
        ]
    }


@pytest.mark.django_db
def test_a_name_with_a_nul_is_a_400(alice, data_node):
    response = alice.client.generic(
        "POST", f"{URL}?name=a%00b", GENERATE_TOML.encode(), content_type="application/toml"
    )

    assert response.status_code == 400
    assert "name" in response.json()
