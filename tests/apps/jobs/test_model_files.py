"""The final model's upload takes only the files the parameter server writes (config.json, model.safetensors,
and the model's data files: generation_config.json, tokenizer files, …): anything else is a 400 and nothing is
written, so the zip users download holds only the model, with what it needs to generate and tokenize."""

from __future__ import annotations

import io
import zipfile

import pytest

from apps.jobs import training
from apps.jobs.models import Job
from parameter_server.model import CONFIG_FILENAME, WEIGHTS_FILENAME
from tests.apps.jobs.test_training import (  # noqa: F401 - fixture
    dispatches_token,
    finish_rounds,
    ready,
    running_job,
)
from worker_daemon.protocol import MODEL_EXTRA_FILES

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_allowed_model_files_are_what_the_parameter_server_uploads():
    assert set(training.MODEL_FILES) == {CONFIG_FILENAME, WEIGHTS_FILENAME}
    assert set(training.FINAL_MODEL_FILES) == {CONFIG_FILENAME, WEIGHTS_FILENAME, *MODEL_EXTRA_FILES}
    assert "generation_config.json" in MODEL_EXTRA_FILES and "tokenizer.json" in MODEL_EXTRA_FILES
    assert not [
        name for name in MODEL_EXTRA_FILES if not name.endswith((".json", ".txt", ".model", ".jinja"))
    ]


@pytest.mark.parametrize(
    "filename", ["evil.py", "modeling_gpt2.py", "model.zip", "tokenizer.json.part", "config.json.part"]
)
def test_a_file_that_is_not_part_of_the_model_is_refused_and_nothing_written(
    running_job,  # noqa: F811 - the fixture imported above
    online_rigs,
    client,
    filename,  # noqa: F811
):
    # given: the job's parameter server, with its real transfer token
    rig_c = online_rigs[2]
    ready(running_job, rig_c)
    finish_rounds(running_job, rig_c)
    token = dispatches_token(running_job, rig_c)
    url = f"/api/jobs/{running_job.pk}/model"

    # when
    response = client.put(
        f"{url}/{filename}", b"import os", content_type="application/octet-stream",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )  # fmt: skip

    # then: a 400 naming the field and the files allowed; nothing on disk or on the job
    assert (response.status_code, response.json()) == (
        400,
        {
            "filename": [
                f"{filename!r} is not a file of the model: the parameter server uploads only "
                f"{', '.join(training.FINAL_MODEL_FILES)}"
            ]
        },
    )
    assert not training.model_directory(running_job.pk).exists()
    assert Job.objects.get(pk=running_job.pk).model_files == {}

    # and the model uploaded afterwards downloads as exactly its files
    for name, body in ((CONFIG_FILENAME, b'{"model_type": "gpt2"}'), (WEIGHTS_FILENAME, b"weights")):
        stored = client.put(
            f"{url}/{name}", body, content_type="application/octet-stream",
            HTTP_AUTHORIZATION=f"Bearer {token}",
        )  # fmt: skip
        assert stored.status_code == 201, stored.content
    Job.objects.filter(pk=running_job.pk).update(status=Job.Status.COMPLETED)
    client.force_login(running_job.owner)
    archive = client.get(url)
    assert archive.status_code == 200
    with zipfile.ZipFile(io.BytesIO(b"".join(archive.streaming_content))) as bundle:
        assert sorted(bundle.namelist()) == ["config.json", "model.safetensors"]
    assert sorted(path.name for path in training.model_directory(running_job.pk).iterdir()) == [
        "config.json",
        "model.safetensors",
        "model.zip",
    ]


def test_the_downloaded_zip_carries_the_generation_config_and_tokenizer_files(
    running_job,  # noqa: F811
    online_rigs,
    client,
):
    # given: the parameter server uploads the model's data files first, as it does, then config and weights
    rig_c = online_rigs[2]
    ready(running_job, rig_c)
    finish_rounds(running_job, rig_c)
    token = dispatches_token(running_job, rig_c)
    url = f"/api/jobs/{running_job.pk}/model"
    files = {
        "generation_config.json": b'{"max_new_tokens": 7}',
        "tokenizer.json": b'{"version": "1.0"}',
        "tokenizer_config.json": b'{"model_max_length": 128}',
        "special_tokens_map.json": b"{}",
        CONFIG_FILENAME: b'{"model_type": "gpt2"}',
        WEIGHTS_FILENAME: b"weights",
    }

    # when
    for name, body in files.items():
        stored = client.put(
            f"{url}/{name}", body, content_type="application/octet-stream",
            HTTP_AUTHORIZATION=f"Bearer {token}",
        )  # fmt: skip
        assert stored.status_code == 201, stored.content
    Job.objects.filter(pk=running_job.pk).update(status=Job.Status.COMPLETED)
    client.force_login(running_job.owner)
    archive = client.get(url)

    # then: the zip holds every file, byte for byte, and nothing else
    assert archive.status_code == 200
    with zipfile.ZipFile(io.BytesIO(b"".join(archive.streaming_content))) as bundle:
        assert {name: bundle.read(name) for name in bundle.namelist()} == files
    assert sorted(Job.objects.get(pk=running_job.pk).model_files) == sorted(files)
