"""The submit form's aggregation rule, its option and verification, ``max_cost`` and ``training.processes``
(issues 17 and 18): each reaches the job's spec as the API stores it, a mistake is shown next to its field, and a
clone of a job that sets them fills them in."""

from __future__ import annotations

import pytest

from apps.dashboard import clone
from apps.jobs.models import Job
from apps.jobs.spec.rounds import VerificationSpec
from tests.apps.dashboard.test_submit import default_fields, errors_next_to

pytestmark = pytest.mark.django_db


def test_the_form_offers_the_rules_with_mean_and_the_rules_default_verification(ada_browser, tiny_text):
    html = ada_browser.get("/jobs/new/").content.decode()

    assert '<option value="mean" selected>mean</option>' in html
    for rule in ("clipped_mean", "trimmed_mean", "median"):
        assert f'<option value="{rule}">{rule}</option>' in html
    assert '<option value="" selected>the rule&#x27;s default' in html
    assert 'name="job-processes" value="1"' in html
    assert 'name="job-max_cost"' in html


def test_a_default_form_stores_none_of_them(ada_browser, tiny_text):
    response = ada_browser.post("/jobs/new/", default_fields())

    assert response.status_code == 302, response.content.decode()[:2000]
    spec = Job.objects.get().spec
    assert not {"aggregation", "clip_factor", "trim_fraction", "verification"} & set(spec["rounds"])
    assert spec.get("max_cost") is None
    assert "processes" not in spec["training"]


def test_a_clipped_mean_with_its_factor_verification_off_a_max_cost_and_two_processes_reach_the_spec(
    ada_browser, tiny_text
):
    fields = default_fields(
        aggregation="clipped_mean", clip_factor="3", verification="off", max_cost="250.5", processes="2"
    )

    response = ada_browser.post("/jobs/new/", fields)

    assert response.status_code == 302, response.content.decode()[:2000]
    spec = Job.objects.get().spec
    assert (spec["rounds"]["aggregation"], spec["rounds"]["clip_factor"]) == ("clipped_mean", 3.0)
    assert spec["rounds"]["verification"]["enabled"] is False
    assert "trim_fraction" not in spec["rounds"]
    assert spec["max_cost"] == 250.5
    assert spec["training"]["processes"] == 2


def test_a_trimmed_mean_with_its_fraction_and_a_verified_mean_reach_the_spec(ada_browser, tiny_text):
    trimmed = ada_browser.post(
        "/jobs/new/", default_fields(name="t", aggregation="trimmed_mean", trim_fraction="0.2")
    )
    verified = ada_browser.post("/jobs/new/", default_fields(name="v", verification="on"))

    assert (trimmed.status_code, verified.status_code) == (302, 302)
    rounds = Job.objects.get(name="t").spec["rounds"]
    assert (rounds["aggregation"], rounds["trim_fraction"]) == ("trimmed_mean", 0.2)
    assert "verification" not in rounds  # the rule's default: on
    rounds = Job.objects.get(name="v").spec["rounds"]
    assert "aggregation" not in rounds and rounds["verification"]["enabled"] is True


def test_an_option_of_another_rule_is_refused_next_to_its_field(ada_browser, tiny_text):
    fields = default_fields(aggregation="median", clip_factor="2", trim_fraction="0.1")

    response = ada_browser.post("/jobs/new/", fields)

    html = response.content.decode()
    assert response.status_code == 400
    assert errors_next_to(html, "clip_factor") == [
        "clip_factor is an option of aggregation = &#x27;clipped_mean&#x27; (this job&#x27;s is median)."
    ]
    assert errors_next_to(html, "trim_fraction") == [
        "trim_fraction is an option of aggregation = &#x27;trimmed_mean&#x27; (this job&#x27;s is median)."
    ]
    assert Job.objects.count() == 0


def test_out_of_range_values_are_refused_next_to_their_fields(ada_browser, tiny_text):
    fields = default_fields(
        aggregation="clipped_mean", clip_factor="0.5", max_cost="0", processes="65", verification="maybe"
    )

    html = ada_browser.post("/jobs/new/", fields).content.decode()

    assert errors_next_to(html, "clip_factor") == ["Input should be greater than or equal to 1"]
    assert errors_next_to(html, "max_cost") == ["Input should be greater than 0"]
    assert errors_next_to(html, "processes") == ["Input should be less than or equal to 64"]
    assert errors_next_to(html, "verification")[0].startswith("Select a valid choice.")
    assert Job.objects.count() == 0


def test_processes_that_do_not_split_the_batch_are_refused(ada_browser, tiny_text):
    html = ada_browser.post("/jobs/new/", default_fields(processes="3")).content.decode()

    # 3 processes cannot split the default batch of 16 (the spec's rule is about the training table).
    assert Job.objects.count() == 0
    assert any(
        "must divide batch_size" in error for error in errors_next_to(html, "gradient_accumulation_steps")
    )


def test_a_clone_fills_them_in_and_resubmits_the_same_spec(ada_browser, training_job):
    spec = {
        **training_job.spec,
        "rounds": {
            **training_job.spec["rounds"],
            "aggregation": "trimmed_mean",
            "trim_fraction": 0.1,
            # As the API stores it: every threshold at its default.
            "verification": VerificationSpec(enabled=False).model_dump(),
        },
        "max_cost": 75.0,
        "training": {**training_job.spec.get("training", {}), "processes": 2},
    }
    Job.objects.filter(pk=training_job.pk).update(spec=spec)
    training_job.refresh_from_db()

    form = ada_browser.get(f"/jobs/new/?clone={training_job.pk}").content.decode()
    response = ada_browser.post("/jobs/new/", clone.form_data(clone.initial_for(training_job)))

    assert "The form cannot say" not in form
    assert '<option value="trimmed_mean" selected>' in form
    assert '<option value="off" selected>' in form
    assert 'name="job-trim_fraction" value="0.1"' in form
    assert 'name="job-max_cost" value="75.0"' in form
    assert 'name="job-processes" value="2"' in form
    assert response.status_code == 302, response.content.decode()[:2000]
    copy = Job.objects.exclude(pk=training_job.pk).get()
    assert copy.spec == training_job.spec
