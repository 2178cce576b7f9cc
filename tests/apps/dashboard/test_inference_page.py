"""The dashboard and batch inference jobs (issue 19): the job page shows the kind, the task, slices done of all
with samples/s and an ETA, the workers and the results' download links, without the training-only panels; the
overview lists the kind; the submit page's inference form creates the job the API would, and shows every
mistake next to its field."""

from __future__ import annotations

import io
import re
import zipfile
from datetime import timedelta

import pytest

from apps.dashboard.inference import inference_progress
from apps.datasets.models import JobSlice
from apps.jobs.models import Job
from tests.apps.dashboard.inference_fixtures import running_inference_job, store_result

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _data_dir(settings, tmp_path):
    settings.HYPHA_DATA_DIR = tmp_path


@pytest.fixture
def inference_job(job_owner, rig_a, rig_b, tiny_text, sent, django_capture_on_commit_callbacks, settings):
    return running_inference_job(job_owner, [rig_a, rig_b], django_capture_on_commit_callbacks, settings)


# --- the job page -------------------------------------------------------------------------------------------


def test_the_page_of_an_inference_job_shows_its_kind_task_progress_and_workers_without_training_panels(
    ada_browser, inference_job
):
    # when
    response = ada_browser.get(f"/jobs/{inference_job.pk}/")

    # then
    assert response.status_code == 200
    html = response.content.decode()
    assert '<span id="job-kind" class="badge kind-inference">inference</span>' in html
    assert '<strong id="inference-task">generate</strong> over tiny-text · 2 workers' in html
    assert "slice 0 of 4 done" in html
    assert 'id="inference-card"' in html
    assert html.count('href="/workers/') >= 2 and "rig-a" in html and "rig-b" in html
    assert f'href="/api/jobs/{inference_job.pk}/results/"' in html
    assert "No result stored yet." in html
    # the training-only panels are left out, not shown empty
    for panel in (
        'id="chart-card"',
        'id="run-charts"',
        'id="trainers-card"',
        'id="rounds-card"',
        "charts.js",
    ):
        assert panel not in html
    assert 'id="clone-link"' not in html and 'id="model-link"' not in html
    # the lease table has the one role of the job
    assert 'data-role="inference"' in html and 'data-role="trainer"' not in html


def test_a_stored_result_moves_the_bar_and_is_linked_for_download_with_the_session(
    ada_browser, inference_job, rig_a, sent
):
    # given
    index = store_result(inference_job, rig_a, sent)

    # when
    html = ada_browser.get(f"/jobs/{inference_job.pk}/").content.decode()

    # then: 1 of 4, 25 %, its link, and both downloads work with the page's session
    assert "slice 1 of 4 done · 25%" in html
    assert 'aria-valuenow="25"' in html
    link = f"/api/jobs/{inference_job.pk}/results/{index}/"
    assert f'href="{link}"' in html
    single = ada_browser.get(link)
    assert single.status_code == 200
    assert b"".join(single.streaming_content) == b'{"row": 0, "tokens": [1, 2]}\n'
    archive = ada_browser.get(f"/api/jobs/{inference_job.pk}/results/")
    assert archive.status_code == 200
    names = zipfile.ZipFile(io.BytesIO(b"".join(archive.streaming_content))).namelist()
    assert sorted(names) == sorted(["manifest.json", f"{index}.jsonl"])


def test_the_progress_counts_slices_samples_per_second_and_a_straight_line_eta(inference_job, rig_a, sent):
    # given: one slice of 4 done, and its worker reported 10 rows
    store_result(inference_job, rig_a, sent)
    inference_job.tasks.filter(lease__worker=rig_a).update(samples_total=10)
    started = inference_job.tasks.order_by("dispatched_at").first().dispatched_at

    # when: 20 s after the first dispatch
    progress = inference_progress(inference_job, now=started + timedelta(seconds=20))

    # then
    assert (progress["slices_done"], progress["slices_total"], progress["percent"]) == (1, 4, 25)
    assert (progress["samples"], progress["samples_per_second"]) == (10, 0.5)
    assert (progress["elapsed"], progress["eta"]) == (20.0, 60.0)
    assert progress["text"].startswith(
        "slice 1 of 4 done · 0.5 samples/s · 25% · elapsed 20 s · ETA 1 m 00 s"
    )


def test_another_users_inference_job_is_a_404(eve_browser, inference_job):
    assert eve_browser.get(f"/jobs/{inference_job.pk}/").status_code == 404


def test_a_training_job_keeps_its_panels_and_says_its_kind(ada_browser, training_job):
    html = ada_browser.get(f"/jobs/{training_job.pk}/").content.decode()
    assert '<span id="job-kind" class="badge kind-training">training</span>' in html
    for panel in ('id="chart-card"', 'id="run-charts"', 'id="trainers-card"', 'id="rounds-card"'):
        assert panel in html
    assert 'id="inference-card"' not in html


def test_the_overview_lists_each_jobs_kind(ada_browser, inference_job, training_job):
    html = ada_browser.get("/").content.decode()
    kinds = re.findall(r'<td class="kind"><span class="badge kind-(\w+)">', html)
    assert sorted(kinds) == ["inference", "training"]


# --- the submission form ------------------------------------------------------------------------------------


def inference_fields(**changes) -> dict:
    fields = {
        "source": "inference",
        "inference-name": "from-the-form",
        "inference-source_type": "huggingface",
        "inference-repository": "hypha-space/tiny",
        "inference-filenames": "config.json, model.safetensors",
        "inference-input_names": "input_ids",
        "inference-dataset": "tiny-text",
        "inference-task": "generate",
        "inference-max_new_tokens": "4",
        "inference-temperature": "0",
        "inference-seed": "0",
        "inference-batch_size": "2",
        "inference-workers": "2",
        "inference-cpu": "2",
        "inference-memory": "4",
        "inference-storage": "0",
        "inference-gpu": "0",
        "inference-bid": "60",
        "inference-max_price": "90",
    }
    fields.update({f"inference-{key}": value for key, value in changes.items()})
    return fields


def field_errors(html: str, field: str) -> list[str]:
    match = re.search(
        rf'<ul class="errorlist" id="errors-inference-{field}" role="alert">(.*?)</ul>', html, re.S
    )
    return re.findall(r"<li>(.*?)</li>", match.group(1)) if match else []


def test_the_submit_page_has_the_inference_form_next_to_the_training_form(ada_browser, tiny_text):
    html = ada_browser.get("/jobs/new/").content.decode()
    assert 'id="job-form"' in html and 'id="inference-form"' in html
    assert 'data-tab="inference"' in html
    assert 'name="inference-task"' in html and '<option value="tiny-text"' in html


def test_a_valid_inference_form_creates_the_job_the_api_would(ada_browser, tiny_text, job_owner):
    # when
    response = ada_browser.post("/jobs/new/", inference_fields())

    # then: redirected to the new job's page
    job = Job.objects.get(owner=job_owner)
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.pk}/"
    assert (job.kind, job.name, job.num_trainers) == (Job.Kind.INFERENCE, "from-the-form", 2)
    assert job.spec["task"] == {"type": "generate", "max_new_tokens": 4, "temperature": 0.0, "seed": 0}
    assert job.spec["model"]["source"]["filenames"] == ["config.json", "model.safetensors"]
    assert job.spec["worker"]["price"] == {"bid": 60.0, "max": 90.0}
    assert job.requirements["inference"]["executor"] == {"class": "inference", "name": "batch-inference"}
    assert JobSlice.objects.filter(job=job).count() == 4  # its slices, as the API makes them


def test_an_embed_job_from_a_config_sends_only_its_tasks_fields(ada_browser, tiny_text, job_owner):
    response = ada_browser.post(
        "/jobs/new/",
        inference_fields(task="embed", source_type="config", model_config='{"model_type": "gpt2"}'),
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    job = Job.objects.get(owner=job_owner)
    assert job.spec["task"] == {"type": "embed"}
    assert job.spec["model"]["source"] == {"type": "config", "config": {"model_type": "gpt2"}}


def test_bad_values_are_shown_next_to_their_fields_and_nothing_is_created(ada_browser, tiny_text):
    # when
    response = ada_browser.post(
        "/jobs/new/",
        inference_fields(repository="", workers="0", batch_size="many", max_new_tokens="5000", bid="100"),
    )

    # then
    assert response.status_code == 400
    html = response.content.decode()
    assert field_errors(html, "repository")
    assert field_errors(html, "workers") == ["Input should be greater than or equal to 1"]
    assert field_errors(html, "batch_size") == ["Enter a whole number."]
    assert field_errors(html, "max_new_tokens") == ["Input should be less than or equal to 1024"]
    assert field_errors(html, "max_price")  # a maximum below the bid
    assert 'id="inference"' in html and 'data-tab="inference"' in html
    assert not Job.objects.exists()


def test_what_keeps_a_valid_spec_from_running_is_shown_next_to_its_field(ada_browser, tiny_text):
    response = ada_browser.post("/jobs/new/", inference_fields(source_type="upload", upload="nothing.bin"))
    assert response.status_code == 400
    assert field_errors(response.content.decode(), "upload") == [
        "You have no upload &#x27;nothing.bin&#x27; (POST the file to /api/uploads/ first)."
    ]
    assert not Job.objects.exists()
