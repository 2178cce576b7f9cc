"""The submit form's elastic pool (issue 17; docs/training.md, "Elastic pools"): "Minimum trainers" and "Grace"
beside "Trainers" (the pool's target) become the spec's ``trainers: {min, target, grace}``, stored as
``POST /api/jobs/diloco/`` stores it; each mistake is shown next to its field and nothing is created."""

from __future__ import annotations

import pytest

from apps.dashboard.clone import initial_for
from apps.jobs.models import Job
from tests.apps.dashboard.test_submit import default_fields, errors_next_to

pytestmark = pytest.mark.django_db


def test_the_form_shows_the_pool_fields_empty(ada_browser, tiny_text):
    html = ada_browser.get("/jobs/new/").content.decode()

    assert 'name="job-trainers_min"' in html
    assert 'name="job-trainers_grace"' in html
    assert 'name="job-trainers_min" value=' not in html  # empty: no pool unless asked for


def test_a_pool_is_stored_with_the_trainers_as_its_target(ada_browser, tiny_text):
    response = ada_browser.post(
        "/jobs/new/", default_fields(num_trainers="4", trainers_min="2", trainers_grace="30")
    )

    assert response.status_code == 302, response.content.decode()[:2000]
    job = Job.objects.get()
    assert job.spec["trainers"] == {"min": 2, "target": 4, "grace": 30.0}
    assert job.num_trainers == 4


def test_a_pool_without_grace_gets_the_default(ada_browser, tiny_text):
    response = ada_browser.post("/jobs/new/", default_fields(num_trainers="3", trainers_min="1"))

    assert response.status_code == 302, response.content.decode()[:2000]
    assert Job.objects.get().spec["trainers"] == {"min": 1, "target": 3, "grace": 0.0}


def test_no_minimum_means_no_pool(ada_browser, tiny_text):
    response = ada_browser.post("/jobs/new/", default_fields())

    assert response.status_code == 302, response.content.decode()[:2000]
    assert Job.objects.get().spec["trainers"] is None


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"trainers_min": "5"}, "trainers_min", "min (5) must be at most target (2)"),
        ({"trainers_min": "0"}, "trainers_min", "greater than or equal to 1"),
        ({"trainers_min": "1", "trainers_grace": "-1"}, "trainers_grace", "greater than or equal to 0"),
        ({"trainers_min": "1", "trainers_grace": "1e9"}, "trainers_grace", "less than or equal to 86400"),
        ({"trainers_grace": "30"}, "trainers_min", "Field required"),
        ({"trainers_min": "two"}, "trainers_min", "Enter a whole number"),
        ({"trainers_min": "1", "trainers_grace": "nan"}, "trainers_grace", "Enter a number"),
        ({"trainers_min": "9" * 400}, "trainers_min", ""),
    ],
)
def test_bad_pool_values_are_shown_next_to_their_fields(ada_browser, tiny_text, changes, field, fragment):
    html = ada_browser.post("/jobs/new/", default_fields(**changes)).content.decode()

    assert Job.objects.count() == 0
    errors = errors_next_to(html, field)
    assert errors, html[:3000]
    assert any(fragment in error for error in errors), errors


def test_a_clone_keeps_the_pool(ada_browser, tiny_text):
    ada_browser.post("/jobs/new/", default_fields(num_trainers="4", trainers_min="2", trainers_grace="30"))
    job = Job.objects.get()

    initial = initial_for(job)

    assert (initial["num_trainers"], initial["trainers_min"], initial["trainers_grace"]) == (4, 2, 30.0)
    html = ada_browser.get(f"/jobs/new/?clone={job.pk}").content.decode()
    assert 'name="job-trainers_min" value="2"' in html
