"""The run page people expect (issue 16): the job page's progress bar with elapsed time and ETA, then end time
and duration; clone a job into the submit form; the overview's job list filtered and a page at a time; and the
compare page, which overlays the curves of the user's own jobs only."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from apps.dashboard import clone
from apps.jobs import services as job_services
from apps.jobs import spec as job_spec
from apps.jobs.models import Job, Round, Task
from tests.apps.dashboard.conftest import SPEC, record_round, status, task_of
from tests.apps.dashboard.test_views import snapshot_of

pytestmark = pytest.mark.django_db


@dataclass
class FakeClock:
    now: datetime


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """``timezone.now`` stopped where the test puts it."""
    fake = FakeClock(now=timezone.now().replace(microsecond=0))
    monkeypatch.setattr(timezone, "now", lambda: fake.now)
    return fake


def step(rig, job: Job, count: int) -> None:
    task = task_of(job, rig)
    for _ in range(count):
        status(rig, task, {"status": {"batch_size": 4, "loss": 4.0, "step_time": 0.1}})


def json_in(html: str, element_id: str):
    start_tag = f'<script id="{element_id}" type="application/json">'
    start = html.index(start_tag) + len(start_tag)
    return json.loads(html[start : html.index("</script>", start)])


# --- progress -----------------------------------------------------------------------------------------------


def test_a_running_job_shows_its_progress_elapsed_time_and_eta(ada_browser, training_job, online_rigs, clock):
    # given: dispatched at T, round 1 of 3 closed, then each trainer through all 3 inner steps of round 2
    started = training_job.created_at.replace(microsecond=0) + timedelta(seconds=60)  # JSON keeps ms only
    Task.objects.filter(job=training_job).update(dispatched_at=started)
    record_round(training_job, online_rigs, 1)
    rig_a, rig_b, _ = online_rigs
    step(rig_a, training_job, 3)
    step(rig_b, training_job, 3)
    clock.now = started + timedelta(seconds=120)

    # when
    response = ada_browser.get(f"/jobs/{training_job.pk}/")

    # then: (1 round + 3/3 of the next) of 3 = 2/3 done in 120 s, so 60 s to go
    progress = snapshot_of(response)["progress"]
    assert {key: progress[key] for key in ("rounds_done", "rounds_total", "steps_done", "steps_total")} == {
        "rounds_done": 1,
        "rounds_total": 3,
        "steps_done": 6,
        "steps_total": 9,
    }
    assert (progress["fraction"], progress["percent"], progress["elapsed"], progress["eta"]) == (
        0.6667,
        66,
        120.0,
        60.0,
    )
    assert parse_datetime(progress["eta_at"]) == clock.now + timedelta(seconds=60)
    assert parse_datetime(progress["started_at"]) == started
    assert (progress["ended_at"], progress["duration"], progress["final"]) == (None, None, False)
    html = response.content.decode()
    assert 'id="progress-fill" style="width: 66%"' in html
    assert "round 1 of 3 done · step 6 of 9 · 66% · elapsed 2 m 00 s · ETA 1 m 00 s (" in html


def test_an_ended_job_shows_when_it_ended_and_how_long_it_took(ada_browser, training_job, online_rigs, clock):
    # given: dispatched 60 s after submission, round 1 of 3 closed, cancelled 300 s after submission
    created = training_job.created_at.replace(microsecond=0)  # JSON keeps milliseconds only
    Job.objects.filter(pk=training_job.pk).update(created_at=created)
    training_job.refresh_from_db()
    Task.objects.filter(job=training_job).update(dispatched_at=created + timedelta(seconds=60))
    record_round(training_job, online_rigs, 1)
    clock.now = created + timedelta(seconds=300)
    job_services.cancel_job(training_job, reason="cancelled by its owner")

    # when
    progress = snapshot_of(ada_browser.get(f"/jobs/{training_job.pk}/"))["progress"]

    # then: no ETA; trained 240 s, 300 s from submission to its end
    assert (progress["final"], progress["status"], progress["fraction"], progress["eta"]) == (
        True,
        "cancelled",
        0.3333,
        None,
    )
    assert parse_datetime(progress["ended_at"]) == clock.now
    assert (progress["elapsed"], progress["duration"]) == (240.0, 300.0)
    assert progress["text"].startswith("round 1 of 3 done · step 3 of 9 · 33% · cancelled at ")
    assert progress["text"].endswith(" · trained 4 m 00 s · 5 m 00 s from submission to end")


def test_a_completed_job_is_all_done(ada_browser, training_job):
    Job.objects.filter(pk=training_job.pk).update(status=Job.Status.COMPLETED, ended_at=timezone.now())

    progress = snapshot_of(ada_browser.get(f"/jobs/{training_job.pk}/"))["progress"]

    assert (progress["fraction"], progress["percent"], progress["steps_done"]) == (1.0, 100, 9)


def test_a_job_waiting_for_workers_has_no_elapsed_time(ada_browser, job_owner, tiny_text):
    job = job_services.create_job(
        owner=job_owner,
        name="queued",
        num_trainers=2,
        requirements=job_spec.to_requirements(job_spec.parse_json(SPEC)),
        spec=job_spec.parse_json(SPEC).model_dump(mode="json"),
    )

    progress = snapshot_of(ada_browser.get(f"/jobs/{job.pk}/"))["progress"]

    assert (progress["fraction"], progress["elapsed"], progress["eta"], progress["started_at"]) == (
        0.0,
        None,
        None,
        None,
    )
    assert progress["text"] == "round 0 of 3 done · step 0 of 9 · 0% · not started: waiting for its workers"


# --- clone ----------------------------------------------------------------------------------------------------


def test_clone_fills_the_form_with_the_jobs_settings_and_resubmitting_makes_the_same_spec(
    ada_browser, training_job
):
    # given: the job page links to the clone
    page = ada_browser.get(f"/jobs/{training_job.pk}/").content.decode()
    assert f'href="/jobs/new/?clone={training_job.pk}"' in page

    # when: the form is opened from it and posted as it is
    form = ada_browser.get(f"/jobs/new/?clone={training_job.pk}").content.decode()
    initial = clone.initial_for(training_job)
    response = ada_browser.post("/jobs/new/", clone.form_data(initial))

    # then: the form shows the job's values, and the new job has the same spec under the copy's name
    assert 'name="job-name" value="tiny-gpt (copy)"' in form
    assert 'name="job-update_rounds" value="3"' in form
    assert 'name="job-inner_steps" value="3"' in form
    assert 'name="job-trainer_max" value="130.0"' in form
    assert "&quot;n_embd&quot;: 8" in form
    assert 'id="clone-note"' in form and "The form cannot say" not in form
    copy = Job.objects.exclude(pk=training_job.pk).get()
    assert (response.status_code, response["Location"]) == (302, f"/jobs/{copy.pk}/")
    assert (copy.name, copy.spec, copy.requirements) == (
        "tiny-gpt (copy)",
        training_job.spec,
        training_job.requirements,
    )


def test_clone_names_the_settings_the_form_cannot_carry(ada_browser, training_job):
    # given: a setting the fields do not have (the optimizer's betas)
    spec = {
        **training_job.spec,
        "inner_optimizer": {**training_job.spec["inner_optimizer"], "betas": [0.8, 0.9]},
    }
    Job.objects.filter(pk=training_job.pk).update(spec=spec)

    form = ada_browser.get(f"/jobs/new/?clone={training_job.pk}").content.decode()

    assert "The form cannot say these settings of it, which would take their defaults: " in form
    assert "<code>inner_optimizer.betas</code>" in form


def test_another_users_job_cannot_be_cloned(eve_browser, training_job):
    assert eve_browser.get(f"/jobs/new/?clone={training_job.pk}").status_code == 404
    assert eve_browser.get("/jobs/new/?clone=not-an-id").status_code == 404


# --- the job list: filter, search, pages -----------------------------------------------------------------------


def make_jobs(owner, count: int, *, name: str = "run", status: str = Job.Status.PENDING) -> list[Job]:
    jobs = [
        Job.objects.create(owner=owner, name=f"{name}-{index:02d}", requirements={}, status=status)
        for index in range(count)
    ]
    # Distinct creation times, oldest first (auto_now_add gives equal ones within a clock tick).
    base = timezone.now() - timedelta(hours=1)
    for index, job in enumerate(jobs):
        Job.objects.filter(pk=job.pk).update(created_at=base + timedelta(seconds=index))
    return jobs


def listed(html: str) -> list[str]:
    return re.findall(r'<tr data-job="([0-9a-f-]+)">', html)


def test_thirty_jobs_make_two_pages(ada_browser, job_owner):
    jobs = make_jobs(job_owner, 30)
    newest_first = [str(job.pk) for job in reversed(jobs)]

    first = ada_browser.get("/").content.decode()
    second = ada_browser.get("/?page=2").content.decode()

    assert listed(first) == newest_first[:25]
    assert listed(second) == newest_first[25:]
    assert "1–25 of 30" in first and 'href="?page=2" id="page-older"' in first
    assert "26–30 of 30" in second and 'href="?page=1" id="page-newer"' in second
    assert "page 2 of 2" in second


def test_the_list_filters_by_status_and_name(ada_browser, job_owner, eve):
    make_jobs(job_owner, 3, name="alpha", status=Job.Status.RUNNING)
    make_jobs(job_owner, 2, name="beta", status=Job.Status.RUNNING)
    failed = make_jobs(job_owner, 1, name="alpha-bad", status=Job.Status.FAILED)
    make_jobs(eve, 2, name="alpha", status=Job.Status.RUNNING)  # another user's: never listed

    running_alpha = ada_browser.get("/?status=running&q=ALPHA").content.decode()
    failed_only = ada_browser.get("/?status=failed").content.decode()
    nothing = ada_browser.get("/?q=gamma").content.decode()
    fragment = ada_browser.get("/?status=failed&fragment=1").content.decode()

    assert len(listed(running_alpha)) == 3
    assert "1–3 of 3 matching (of 6)" in running_alpha
    assert '<option value="running" selected>' in running_alpha and 'value="ALPHA"' in running_alpha
    assert listed(failed_only) == [str(failed[0].pk)]
    assert listed(nothing) == [] and 'id="no-match"' in nothing
    assert listed(fragment) == [str(failed[0].pk)]
    # The live refresh fetches the same filtered page.
    assert 'data-fragment-url="/?status=running&amp;q=ALPHA&amp;fragment=1"' in running_alpha


def test_page_links_keep_the_filter(ada_browser, job_owner):
    make_jobs(job_owner, 27, name="sweep", status=Job.Status.FAILED)

    html = ada_browser.get("/?status=failed&q=sweep").content.decode()

    assert 'href="?status=failed&amp;q=sweep&amp;page=2" id="page-older"' in html


# --- compare ----------------------------------------------------------------------------------------------------


def with_rounds(job: Job, losses: list[tuple[float, float]]) -> Job:
    for number, (mean_loss, eval_loss) in enumerate(losses, start=1):
        Round.objects.create(job=job, number=number, closed=True, mean_loss=mean_loss, eval_loss=eval_loss)
    return job


def test_compare_overlays_the_curves_of_the_users_jobs(ada_browser, job_owner):
    # given
    first, second = make_jobs(job_owner, 2, name="lr")
    Job.objects.filter(pk=second.pk).update(spec={"inner_optimizer": {"learning_rate": 0.01}, "seed": 0})
    Job.objects.filter(pk=first.pk).update(spec={"inner_optimizer": {"learning_rate": 0.003}, "seed": 0})
    with_rounds(first, [(4.0, 4.1), (3.5, 3.6)])
    with_rounds(second, [(3.9, 4.0), (3.2, 3.3), (3.0, 3.1)])

    # when: as the overview's checkboxes send them, and as a comma list
    ticked = ada_browser.get(f"/jobs/compare/?ids={first.pk}&ids={second.pk}")
    comma = ada_browser.get(f"/jobs/compare/?ids={first.pk},{second.pk}")

    # then
    assert ticked.status_code == comma.status_code == 200
    runs = json_in(ticked.content.decode(), "compare-runs-data")
    assert runs == json_in(comma.content.decode(), "compare-runs-data")
    assert [(run["id"], run["name"]) for run in runs] == [(str(first.pk), "lr-00"), (str(second.pk), "lr-01")]
    assert runs[0]["rounds"] == [
        {"number": 1, "mean_loss": 4.0, "eval_loss": 4.1},
        {"number": 2, "mean_loss": 3.5, "eval_loss": 3.6},
    ]
    assert [(run["last_mean_loss"], run["best_eval_loss"]) for run in runs] == [(3.5, 3.6), (3.0, 3.1)]
    html = ticked.content.decode()
    assert "vendor/chartjs/chart.umd.min.js" in html and "dashboard/compare.js" in html
    # Where their specs differ: the learning rate, not the seed.
    assert '<td class="mono">inner_optimizer.learning_rate</td>' in html
    assert '<td class="mono">seed</td>' not in html


def test_compare_leaves_out_other_users_jobs_with_a_message(ada_browser, eve_browser, job_owner, eve):
    (mine,) = make_jobs(job_owner, 1, name="mine")
    (theirs,) = make_jobs(eve, 1, name="theirs")

    mixed = ada_browser.get(f"/jobs/compare/?ids={mine.pk},{theirs.pk}")
    only_theirs = ada_browser.get(f"/jobs/compare/?ids={theirs.pk}")
    none = ada_browser.get("/jobs/compare/")

    assert [run["id"] for run in json_in(mixed.content.decode(), "compare-runs-data")] == [str(mine.pk)]
    assert "1 of the jobs asked for is not yours, unknown or beyond the first 12: left out." in (
        mixed.content.decode()
    )
    assert "theirs" not in mixed.content.decode()
    assert only_theirs.status_code == 404
    assert (none.status_code, none["Location"]) == (302, "/")


def test_the_job_list_has_checkboxes_that_open_the_compare_page(ada_browser, job_owner):
    jobs = make_jobs(job_owner, 2)

    html = ada_browser.get("/").content.decode()

    assert '<form method="get" action="/jobs/compare/" id="compare-form">' in html
    for job in jobs:
        assert f'<input type="checkbox" name="ids" value="{job.pk}" class="compare-pick"' in html


def test_compare_overlays_the_per_step_loss_from_the_jobs_metrics(
    ada_browser, training_job, online_rigs, job_owner
):
    # given: both trainers of the running job take three steps at loss 4.0; the other job has no steps yet
    rig_a, rig_b, _ = online_rigs
    step(rig_a, training_job, 3)
    step(rig_b, training_job, 3)
    (idle,) = make_jobs(job_owner, 1, name="idle")

    html = ada_browser.get(f"/jobs/compare/?ids={training_job.pk},{idle.pk}").content.decode()

    # then: the trainers' mean per step, as GET /api/jobs/{id}/metrics/ gives it
    runs = json_in(html, "compare-runs-data")
    assert runs[0]["steps"] == {"step": [1, 2, 3], "loss": [4.0, 4.0, 4.0]}
    assert runs[1]["steps"] == {"step": [], "loss": []}
    assert 'id="compare-steps-chart"' in html
