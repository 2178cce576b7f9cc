"""The submit form's "Advanced training" fields (the training knobs; docs/configuration.md, "Training knobs"):
stored as the API stores them, each mistake shown next to its field."""

from __future__ import annotations

import pytest

from apps.jobs.models import Job
from tests.apps.dashboard.test_submit import default_fields, errors_next_to

pytestmark = pytest.mark.django_db


def test_the_form_shows_the_knobs_with_their_defaults(ada_browser, tiny_text):
    html = ada_browser.get("/jobs/new/").content.decode()

    assert "<legend>Advanced training</legend>" in html
    assert 'name="job-gradient_accumulation_steps" value="1"' in html
    assert 'name="job-dataloader_workers" value="0"' in html
    assert '<option value="bf16">' in html


def test_the_knobs_are_stored_in_the_job_spec(ada_browser, tiny_text):
    fields = default_fields(
        weight_decay="0.1",
        max_grad_norm="1.5",
        gradient_accumulation_steps="4",
        mixed_precision="bf16",
        gradient_checkpointing="on",
        dataloader_workers="0",
    )

    response = ada_browser.post("/jobs/new/", fields)

    assert response.status_code == 302, response.content.decode()[:2000]
    job = Job.objects.get()
    assert job.spec["training"] == {
        "max_grad_norm": 1.5,
        "gradient_accumulation_steps": 4,
        "mixed_precision": "bf16",
        "gradient_checkpointing": True,
        "dataloader_workers": 0,
    }
    assert job.spec["inner_optimizer"]["weight_decay"] == 0.1


def test_bad_knobs_are_shown_next_to_their_fields(ada_browser, tiny_text):
    fields = default_fields(max_grad_norm="0", dataloader_workers="40", weight_decay="-1")

    html = ada_browser.post("/jobs/new/", fields).content.decode()

    assert Job.objects.count() == 0
    assert errors_next_to(html, "max_grad_norm")
    assert errors_next_to(html, "dataloader_workers")
    assert errors_next_to(html, "weight_decay")


def test_dataloader_workers_are_stored(ada_browser, tiny_text):
    response = ada_browser.post("/jobs/new/", default_fields(dataloader_workers="2"))

    assert response.status_code == 302, response.content.decode()[:2000]
    assert Job.objects.get().spec["training"]["dataloader_workers"] == 2


def test_micro_batches_that_do_not_split_the_batch_are_refused(ada_browser, tiny_text):
    html = ada_browser.post("/jobs/new/", default_fields(gradient_accumulation_steps="3")).content.decode()

    # 3 micro-batches cannot split the default batch of 16.
    assert Job.objects.count() == 0
    assert any(
        "must divide batch_size" in error for error in errors_next_to(html, "gradient_accumulation_steps")
    )


def test_fp16_without_a_trainer_gpu_is_refused_next_to_its_field(ada_browser, tiny_text):
    html = ada_browser.post("/jobs/new/", default_fields(mixed_precision="fp16")).content.decode()

    assert Job.objects.count() == 0
    assert any(
        "fp16 needs a CUDA GPU" in error for error in errors_next_to(html, "gradient_accumulation_steps")
    )


def test_clone_carries_the_knobs(ada_browser, training_job):
    from apps.dashboard import clone

    spec = {
        **training_job.spec,
        "inner_optimizer": {**training_job.spec["inner_optimizer"], "weight_decay": 0.2},
        "training": {
            "max_grad_norm": 1.0,
            "gradient_accumulation_steps": 1,
            "mixed_precision": "bf16",
            "gradient_checkpointing": True,
            "dataloader_workers": 0,
        },
    }
    Job.objects.filter(pk=training_job.pk).update(spec=spec)
    training_job.refresh_from_db()

    form = ada_browser.get(f"/jobs/new/?clone={training_job.pk}").content.decode()
    response = ada_browser.post("/jobs/new/", clone.form_data(clone.initial_for(training_job)))

    assert "The form cannot say" not in form
    assert '<option value="bf16" selected>' in form
    copy = Job.objects.exclude(pk=training_job.pk).get()
    assert response.status_code == 302
    assert copy.spec == training_job.spec
