"""A TOML job's model from a file the user uploaded (``upload = "<name or id>"``), as the JSON spec's
``{"type": "upload", "file": ...}``: submitted through the API, pinned to the upload's id like JSON."""

from __future__ import annotations

import pytest

from apps.datasets import services as dataset_services
from apps.jobs.models import Job
from apps.jobs.spec import SpecError, parse_json, parse_toml

URL = "/api/jobs/diloco/"

JOB = """
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
"""


def model(source_lines: str) -> str:
    return f"""
[scheduler.job.model]
type = "causal-lm"
input-names = ["input_ids", "labels"]
{source_lines}
"""


@pytest.fixture
def tiny_text(db):
    node, _ = dataset_services.create_data_node(name="data-east", url="http://east.example:8100")
    dataset_services.register_dataset(node, "tiny-text", [(index, 100, "a" * 64) for index in range(4)])


def submit(persona, text: str):
    return persona.client.generic(
        "POST", f"{URL}?name=from-upload", text.encode(), content_type="application/toml"
    )


def test_an_upload_key_is_the_json_specs_upload_source():
    parsed = parse_toml(model('upload = "tiny.zip"') + JOB)
    assert (
        parsed.model.source
        == parse_json(
            {
                "model": {
                    "source": {"type": "upload", "file": "tiny.zip"},
                    "type": "causal-lm",
                    "input_names": ["input_ids", "labels"],
                },
                "dataset": {"name": "tiny-text"},
                "inner_optimizer": {"learning_rate": 0.003},
                "outer_optimizer": {"learning_rate": 0.7, "momentum": 0.9},
                "rounds": {"update_rounds": 3, "inner_steps": 10},
            }
        ).model.source
    )


@pytest.mark.parametrize(
    ("source_lines", "field", "message"),
    [
        (
            'upload = "tiny.zip"\nrepository = "gpt2"',
            "scheduler.job.model.upload",
            "Give one of repository, url, upload and config ('repository' is not for an upload).",
        ),
        (
            'upload = "tiny.zip"\nfilenames = ["model.safetensors"]',
            "scheduler.job.model.upload",
            "Give one of repository, url, upload and config ('filenames' is not for an upload).",
        ),
        ('upload = "tiny.zip"\nconfig = { model_type = "gpt2" }', "scheduler.job.model.config", None),
        ("upload = 7", "scheduler.job.model.upload", None),
        ('upload = ""', "scheduler.job.model.upload", None),
    ],
)
def test_a_wrong_upload_key_is_named_by_its_toml_key(source_lines, field, message):
    with pytest.raises(SpecError) as raised:
        parse_toml(model(source_lines) + JOB)
    fields = {error["field"]: error["message"] for error in raised.value.errors}
    assert field in fields, raised.value.errors
    if message is not None:
        assert fields[field] == message


@pytest.mark.django_db
def test_a_toml_job_on_an_upload_is_created_through_the_api_and_pinned_to_its_id(alice, bob, tiny_text):
    # given: alice uploaded tiny.zip; bob has none
    upload_id = alice.client.post(
        "/api/uploads/?name=tiny.zip", b"PK fake zip", content_type="application/octet-stream"
    ).json()["id"]
    text = model('upload = "tiny.zip"') + JOB

    # when
    refused = submit(bob, text)
    created = submit(alice, text)
    by_id = submit(alice, model(f'upload = "{upload_id}"') + JOB)

    # then
    assert refused.status_code == 400
    assert refused.json() == {
        "model.source.file": ["You have no upload 'tiny.zip' (POST the file to /api/uploads/ first)."]
    }
    assert created.status_code == 201, created.content
    assert by_id.status_code == 201, by_id.content
    for response in (created, by_id):
        job = Job.objects.get(pk=response.json()["id"])
        assert job.spec["model"]["source"] == {"type": "upload", "file": upload_id}
        assert job.name == "from-upload"
    assert Job.objects.filter(owner=bob.user).count() == 0
