"""The final model's upload takes only the files the parameter server writes (config.json, model.safetensors):
anything else is a 400 and nothing is written, so the zip users download holds only the model."""

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

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_allowed_model_files_are_what_the_parameter_server_uploads():
    assert set(training.MODEL_FILES) == {CONFIG_FILENAME, WEIGHTS_FILENAME}


@pytest.mark.parametrize("filename", ["evil.py", "model.zip", "tokenizer.json", "config.json.part"])
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
                "config.json, model.safetensors"
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
