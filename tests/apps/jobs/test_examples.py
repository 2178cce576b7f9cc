"""Every job in ``examples/`` is submitted as its README says — ``hypha submit FILE`` against a real control plane
(pytest-django's live server, over real HTTP) — and must be accepted (201) and stored as the file says.

The examples that need a model from the Hugging Face Hub or a URL cannot train here (no Internet): for those the
submission, that is every check the control plane makes, is what is tested. Each TOML example has a JSON twin
that must be stored as the same spec, and the tiny GPT-2 example is the dashboard form's default job.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest

from apps.dashboard.forms import DiLoCoJobForm
from apps.datasets import services as dataset_services
from apps.jobs import spec as job_spec
from apps.jobs.models import Job, Upload
from hypha_cli.__main__ import run
from hypha_cli.exceptions import ExitCode

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
JSON_EXAMPLES = sorted(EXAMPLES.glob("*.json"))
TOML_EXAMPLES = sorted(EXAMPLES.glob("*.toml"))
#: The kinds of job the examples must cover: every model source, both sync rules, every encoding and overlap.
KINDS = {
    "source": {"config", "huggingface", "url", "upload"},
    "sync": {"inner_steps", "avg_samples_between_updates"},
    "encoding": {"float32", "float16", "bfloat16", "int8"},
    "overlap": {"none", "eager", "streaming"},
}


@pytest.fixture
def tiny_text(db):
    """``tiny-text`` as ``hypha-data prepare-text`` would register it: 8 slices (2 of them held out)."""
    node, _ = dataset_services.create_data_node(name="data-east", url="http://east.example:8100")
    dataset_services.register_dataset(
        node, "tiny-text", [(index, 1000, f"{index:x}" * 64) for index in range(8)]
    )


@pytest.fixture
def tiny_gpt2_zip(alice):
    """The upload the upload example names: a model zip as ``hypha download`` saves it."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("config.json", json.dumps({"model_type": "gpt2", "n_layer": 2}))
        archive.writestr("model.safetensors", b"\0" * 64)
    response = alice.client.post(
        "/api/uploads/?name=tiny-gpt2.zip", buffer.getvalue(), content_type="application/octet-stream"
    )
    assert response.status_code == 201, response.content
    return Upload.objects.get(name="tiny-gpt2.zip")


def submit(live_server, persona, tmp_path, capsys, path: Path, *argv: str) -> dict:
    """``hypha submit PATH --json`` as the examples' README says; the created job as the server sent it."""
    code = run(
        ["submit", str(path), "--server", live_server.url, "--token", persona.token, "--json", *argv],
        environ={"HOME": str(tmp_path)},
    )
    captured = capsys.readouterr()
    assert code == ExitCode.OK, (path.name, captured.out, captured.err)
    return json.loads(captured.out)


def stored(job: dict) -> dict:
    """The spec the control plane stored for the created job (read from the database, not the reply)."""
    return Job.objects.get(pk=job["id"]).spec


def contains(whole, part) -> bool:
    """Whether every key and value of ``part`` is in ``whole`` (dicts recursively; all else equal)."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(
            key in whole and contains(whole[key], part[key]) for key in part
        )
    return whole == part


def test_the_examples_cover_every_kind_of_job_and_model_source():
    # given
    specs = [json.loads(path.read_text()) for path in JSON_EXAMPLES]

    # then
    covered = {
        "source": {spec["model"]["source"]["type"] for spec in specs},
        "sync": {key for spec in specs for key in KINDS["sync"] if key in spec["rounds"]},
        "encoding": {spec["rounds"].get("encoding", "float32") for spec in specs},
        "overlap": {spec["rounds"].get("overlap", "none") for spec in specs},
    }
    assert covered == KINDS
    # Every example is there as TOML and as its JSON twin (the upload one's TOML uses our `upload` key).
    assert {path.stem for path in JSON_EXAMPLES} == {path.stem for path in TOML_EXAMPLES}
    # The README names each of them.
    readme = (EXAMPLES / "README.md").read_text()
    for path in [*JSON_EXAMPLES, *TOML_EXAMPLES]:
        assert path.name in readme


@pytest.mark.parametrize("path", JSON_EXAMPLES, ids=lambda path: path.name)
def test_each_json_example_is_accepted_and_stored_as_the_file_says(
    path, live_server, alice, tiny_text, tiny_gpt2_zip, tmp_path, capsys
):
    # given
    written = json.loads(path.read_text())

    # when
    job = submit(live_server, alice, tmp_path, capsys, path)

    # then: the name, and every key the file gives, stored as given
    assert job["name"] == written.pop("name") == path.stem
    spec = stored(job)
    assert spec == job["spec"]
    if written["model"]["source"]["type"] == "upload":
        # An upload named by its file name is pinned to its id (a later upload of that name changes nothing).
        assert spec["model"]["source"] == {"type": "upload", "file": str(tiny_gpt2_zip.pk)}
        written["model"]["source"]["file"] = str(tiny_gpt2_zip.pk)
    assert contains(spec, written), (spec, written)


@pytest.mark.parametrize("path", TOML_EXAMPLES, ids=lambda path: path.name)
def test_each_toml_example_is_accepted_and_stored_as_its_json_twin(
    path, live_server, alice, tiny_text, tiny_gpt2_zip, tmp_path, capsys
):
    # when
    from_toml = submit(live_server, alice, tmp_path, capsys, path, "--name", path.stem)
    from_json = submit(live_server, alice, tmp_path, capsys, path.with_suffix(".json"))

    # then
    assert from_toml["name"] == path.stem
    assert stored(from_toml) == stored(from_json)


def test_the_tiny_gpt2_example_is_the_dashboard_forms_default_job(tiny_text):
    # given: the form as a browser posts it untouched
    form = DiLoCoJobForm(owner=None, prefix="job")
    data = {f"job-{name}": form.get_initial_for_field(field, name) for name, field in form.fields.items()}
    data = {key: "" if value is None else value for key, value in data.items()}
    data["job-dataset"] = "tiny-text"
    posted = DiLoCoJobForm(data, owner=None, prefix="job")
    assert posted.is_valid(), posted.errors

    # then
    default = posted.parsed
    assert job_spec.parse_toml((EXAMPLES / "tiny-gpt2.toml").read_text()) == default
    written = json.loads((EXAMPLES / "tiny-gpt2.json").read_text())
    written.pop("name")
    assert job_spec.parse_json(written) == default
