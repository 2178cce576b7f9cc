"""A bad submit form shows every mistake at once, as ``POST /api/jobs/diloco/`` reports them: a field that
cannot even be read (model config that is not JSON, a word for a number) does not hide the others' errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from apps.jobs.models import Job
from tests.apps.dashboard.test_submit import default_fields, errors_next_to

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-gpt2.toml"

pytestmark = pytest.mark.django_db


def test_bad_model_json_is_shown_with_every_other_mistake(ada_browser, tiny_text):
    # given: the model config is not JSON, and four other fields break the spec's rules
    fields = default_fields(
        model_config="{not json",
        outer_momentum=5,
        mix=0.5,
        trainer_max=1,
        holdout=4,
    )

    # when
    response = ada_browser.post("/jobs/new/", fields)

    # then
    assert response.status_code == 400
    html = response.content.decode()
    assert errors_next_to(html, "model_config")[0].startswith("Not JSON: ")
    assert errors_next_to(html, "outer_momentum") == ["Input should be less than or equal to 1"]
    assert errors_next_to(html, "mix") == [
        "mix is an option of overlap = &#x27;streaming&#x27; (this job&#x27;s is none)."
    ]
    assert errors_next_to(html, "trainer_max") == ["Must be at least the bid (100)."]
    assert Job.objects.count() == 0


def test_unreadable_fields_do_not_hide_the_others_and_are_not_reported_twice(ada_browser, tiny_text):
    # given: two fields that are not numbers, the model config's JSON not an object, a bad learning rate
    fields = default_fields(
        batch_size="many", inner_steps="lots", model_config="[1, 2]", outer_learning_rate=-1
    )

    # when
    response = ada_browser.post("/jobs/new/", fields)

    # then: each field's own error once, and the spec's rule for the field that could be read
    html = response.content.decode()
    assert errors_next_to(html, "batch_size") == ["Enter a whole number."]
    assert errors_next_to(html, "inner_steps") == ["Enter a whole number."]
    assert errors_next_to(html, "model_config") == [
        "A JSON object, e.g. {&quot;model_type&quot;: &quot;gpt2&quot;, …}."
    ]
    assert errors_next_to(html, "outer_learning_rate") == ["Input should be greater than 0"]
    assert Job.objects.count() == 0


def test_the_dataset_check_runs_beside_a_bad_field(ada_browser, tiny_text):
    # given: holding out every slice (a check of the registered dataset) and a word for the trainers
    response = ada_browser.post("/jobs/new/", default_fields(num_trainers="two", holdout=4))

    # then
    html = response.content.decode()
    assert errors_next_to(html, "num_trainers") == ["Enter a whole number."]
    assert errors_next_to(html, "holdout") == ["Holding out 4 of 4 slices leaves none to train on."]
    assert Job.objects.count() == 0


def test_the_tiny_gpt2_toml_example_creates_the_job_the_form_defaults_create(ada_browser, tiny_text):
    # when: the defaults of the fields, then the example TOML uploaded
    ada_browser.post("/jobs/new/", default_fields(name="fields"))
    upload = SimpleUploadedFile("tiny-gpt2.toml", EXAMPLE.read_bytes(), content_type="application/toml")
    response = ada_browser.post(
        "/jobs/new/", {"source": "toml", "toml-name": "toml", "toml-toml_file": upload}
    )

    # then
    assert response.status_code == 302
    fields, toml = Job.objects.get(name="fields"), Job.objects.get(name="toml")
    assert toml.spec == fields.spec
    assert toml.requirements == fields.requirements
