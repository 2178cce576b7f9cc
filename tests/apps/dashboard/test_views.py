"""The dashboard's pages and who may see them: login required; own jobs, and the pool's workers; staff see all;
another user's job is a 404, like an unknown one; cancel is a POST with CSRF."""

from __future__ import annotations

import json
import re
import uuid

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from apps.jobs.models import Job, JobEvent
from apps.leases.models import Lease
from tests.apps.dashboard.conftest import record_round

pytestmark = pytest.mark.django_db

#: A price as the pages write it: its unit, and what that is as its tooltip.
PRICE_125 = '<td class="num"><span class="price" title="credits per hour of a lease, per worker">125 credits/h</span></td>'


def snapshot_of(response) -> dict:
    html = response.content.decode()
    start = html.index('<script id="job-snapshot" type="application/json">') + len(
        '<script id="job-snapshot" type="application/json">'
    )
    return json.loads(html[start : html.index("</script>", start)])


# --- login ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/jobs/new/", f"/jobs/{uuid.uuid4()}/", f"/workers/{uuid.uuid4()}/"])
def test_every_page_sends_an_anonymous_visitor_to_the_login_page(client, path):
    response = client.get(path)

    assert response.status_code == 302
    assert response["Location"] == f"/login/?next={path}"


def test_the_login_page_logs_in_and_goes_to_the_overview(client):
    # given
    get_user_model().objects.create_user(username="ada", password="correct horse")

    # when
    page = client.get("/login/")
    wrong = client.post("/login/", {"username": "ada", "password": "wrong"})
    right = client.post("/login/", {"username": "ada", "password": "correct horse", "next": ""})

    # then
    assert page.status_code == 200 and 'name="password"' in page.content.decode()
    assert (
        wrong.status_code == 200 and "Please enter a correct username and password" in wrong.content.decode()
    )
    assert (right.status_code, right["Location"]) == (302, "/")
    assert client.get("/").status_code == 200


def test_the_login_page_follows_next(client):
    get_user_model().objects.create_user(username="ada", password="correct horse")

    response = client.post("/login/?next=/jobs/new/", {"username": "ada", "password": "correct horse"})

    assert response["Location"] == "/jobs/new/"


def test_logging_out_is_a_post_and_ends_the_session(ada_browser):
    response = ada_browser.post("/logout/")

    assert (response.status_code, response["Location"]) == (302, "/login/")
    assert ada_browser.get("/").status_code == 302


# --- the overview -----------------------------------------------------------------------------------------


def test_the_overview_shows_a_user_their_jobs_only_and_the_pool(
    training_job, online_rigs, ada_browser, eve_browser, eve
):
    # when
    ada_page = ada_browser.get("/").content.decode()
    eve_page = eve_browser.get("/").content.decode()

    # then: Ada sees her running job and the offers on it; both see the pool (test_pool.py has the details)
    rig_a = online_rigs[0]
    assert f'data-job="{training_job.pk}"' in ada_page
    assert "RUNNING: parameter server listening at http://10.0.0.3:7070; 2 trainers told" in ada_page
    assert f'<td><a href="/workers/{rig_a.pk}/">rig-a</a></td>' in ada_page  # its offer on her job
    assert f'data-job="{training_job.pk}"' not in eve_page
    assert "No jobs yet." in eve_page
    assert f'data-worker="{rig_a.pk}"' in ada_page and f'data-worker="{rig_a.pk}"' in eve_page
    assert "tiny-gpt" not in eve_page


def test_the_overview_shows_staff_every_worker_its_lease_and_the_market(
    training_job, staff_browser, online_rigs
):
    # when
    page = staff_browser.get("/").content.decode()

    # then: workers with resources and current lease, jobs by status, adverts and the offers that won
    for rig in online_rigs:
        assert f'data-worker="{rig.pk}"' in page
    assert "3 online of 3" in page
    assert '<li class="badge status-running" data-status="running">running <b>1</b></li>' in page
    assert 'trainer · <a href="/jobs/' in page
    assert '<span class="badge offer-accepted">won</span>' in page
    assert page.count('<span class="badge offer-accepted">won</span>') == 3
    assert PRICE_125 in page  # rig-b's winning price, with its unit


def test_the_overview_fragment_is_the_sections_alone(ada_browser, training_job):
    response = ada_browser.get("/?fragment=1")

    html = response.content.decode()
    assert response.status_code == 200
    assert '<section class="card" id="jobs">' in html and "<html" not in html


# --- the job page -----------------------------------------------------------------------------------------


def test_the_owner_sees_the_job_page_with_leases_rounds_trainers_and_data(
    training_job, online_rigs, ada_browser, django_capture_on_commit_callbacks
):
    # given: one round recorded
    with django_capture_on_commit_callbacks(execute=True):
        record_round(training_job, online_rigs, 1, losses=(3.5, 3.7), eval_loss=3.4)

    # when
    response = ada_browser.get(f"/jobs/{training_job.pk}/")

    # then
    html = response.content.decode()
    assert response.status_code == 200
    assert '<span class="badge big status-running" id="job-status">running</span>' in html
    assert "RUNNING: round 1 of 3 applied (2 trainers, eval loss 3.4000)" in html
    assert f'data-websocket="/ws/dashboard/jobs/{training_job.pk}/"' in html
    assert 'id="cancel-form"' in html and "Cancel job" in html
    assert "/static/vendor/chartjs/chart.umd.min.js" in html
    snapshot = snapshot_of(response)
    rig_a, rig_b, rig_c = online_rigs
    assert snapshot["job"]["status"] == "running"
    assert [(lease["role"], lease["worker"], lease["status"]) for lease in snapshot["leases"]] == [
        ("parameter_server", "rig-c", "active"),
        ("trainer", "rig-a", "active"),
        ("trainer", "rig-b", "active"),
    ]
    [round_] = snapshot["rounds"]
    assert (round_["number"], round_["closed"], round_["mean_loss"], round_["eval_loss"]) == (
        1,
        True,
        3.6,
        3.4,
    )
    assert round_["trainer_metrics"] == {str(rig_a.pk): {"loss": 3.5}, str(rig_b.pk): {"loss": 3.7}}
    assert snapshot["workers"] == {str(rig.pk): rig.name for rig in online_rigs}
    assert sorted(trainer["worker"] for trainer in snapshot["trainers"]) == ["rig-a", "rig-b"]
    assert snapshot["data"] == {"epoch": 0, "available": 3, "assigned": 0, "used": 0, "total": 3}
    assert '<tr data-round="1">' in html


def test_another_users_job_is_a_404_like_an_unknown_one(training_job, eve_browser):
    assert eve_browser.get(f"/jobs/{training_job.pk}/").status_code == 404
    assert eve_browser.get(f"/jobs/{uuid.uuid4()}/").status_code == 404


def test_staff_see_every_job(training_job, staff_browser):
    assert staff_browser.get(f"/jobs/{training_job.pk}/").status_code == 200


def test_a_completed_job_offers_its_model(training_job, ada_browser):
    # given
    Job.objects.filter(pk=training_job.pk).update(
        status=Job.Status.COMPLETED, model_files={"model.safetensors": {"size": 1, "sha256": "0" * 64}}
    )

    # when
    html = ada_browser.get(f"/jobs/{training_job.pk}/").content.decode()

    # then: the download link is shown, the cancel button is not
    assert f'<a class="button primary" id="model-link" href="/api/jobs/{training_job.pk}/model">' in html
    assert 'id="cancel-form" hidden' in html


# --- cancel -----------------------------------------------------------------------------------------------


def test_the_owner_cancels_a_job_with_a_post(training_job, ada_browser):
    # when
    response = ada_browser.post(f"/jobs/{training_job.pk}/cancel/", follow=True)

    # then
    training_job.refresh_from_db()
    assert response.redirect_chain == [(f"/jobs/{training_job.pk}/", 302)]
    assert (training_job.status, training_job.status_reason) == (
        "cancelled",
        "CANCELLED: cancelled by its owner",
    )
    assert not Lease.objects.filter(job=training_job, status__in=Lease.LIVE).exists()
    assert "Job cancelled" in response.content.decode()


def test_cancel_is_not_a_get(training_job, ada_browser):
    assert ada_browser.get(f"/jobs/{training_job.pk}/cancel/").status_code == 405
    training_job.refresh_from_db()
    assert training_job.status == "running"


def test_another_user_cannot_cancel_a_job(training_job, eve_browser):
    # given
    events = JobEvent.objects.filter(job=training_job).count()

    # when
    response = eve_browser.post(f"/jobs/{training_job.pk}/cancel/")

    # then: a 404, and nothing changed
    training_job.refresh_from_db()
    assert response.status_code == 404
    assert training_job.status == "running"
    assert JobEvent.objects.filter(job=training_job).count() == events


def test_cancel_needs_the_csrf_token(training_job, job_owner):
    # given: a browser that enforces CSRF, as a real one does
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(job_owner)

    # when
    refused = browser.post(f"/jobs/{training_job.pk}/cancel/")
    page = browser.get(f"/jobs/{training_job.pk}/")
    token = page.context["csrf_token"]
    accepted = browser.post(f"/jobs/{training_job.pk}/cancel/", {"csrfmiddlewaretoken": str(token)})

    # then
    assert refused.status_code == 403
    assert accepted.status_code == 302
    training_job.refresh_from_db()
    assert training_job.status == "cancelled"


def test_cancelling_an_ended_job_says_why(training_job, ada_browser):
    ada_browser.post(f"/jobs/{training_job.pk}/cancel/")

    response = ada_browser.post(f"/jobs/{training_job.pk}/cancel/", follow=True)

    assert f"job {training_job.pk} is already cancelled" in response.content.decode()


# --- the worker page --------------------------------------------------------------------------------------


def test_the_worker_page_shows_resources_leases_jobs_served_and_throughput(
    training_job, online_rigs, staff_browser, django_capture_on_commit_callbacks
):
    # given: rig-a trained three steps of 4 samples
    from tests.apps.dashboard.conftest import status, task_of

    rig_a = online_rigs[0]
    for loss in (4.0, 3.9, 3.8):
        status(
            rig_a, task_of(training_job, rig_a), {"status": {"batch_size": 4, "loss": loss, "step_time": 0.1}}
        )

    # when
    html = staff_browser.get(f"/workers/{rig_a.pk}/").content.decode()

    # then
    assert "<dt>CPU</dt><dd>8 cores</dd>" in html
    assert "<code>train/diloco-transformer</code>" in html
    assert "3 steps · 12 samples · 0 rounds" in html
    assert f'<a href="/jobs/{training_job.pk}/">tiny-gpt</a>' in html
    assert '<span class="badge lease-active">active</span>' in html


def test_another_users_worker_is_a_page_of_the_pool(online_rigs, eve_browser, bobs_worker):
    # rigs belong to nobody, bob's worker is bob's: Eve sees their public pages (test_pool.py)
    assert eve_browser.get(f"/workers/{online_rigs[0].pk}/").status_code == 200
    assert eve_browser.get(f"/workers/{bobs_worker.pk}/").status_code == 200


def test_a_worker_owner_sees_their_worker(bob, bobs_worker):
    browser = Client()
    browser.force_login(bob.user)

    assert browser.get(f"/workers/{bobs_worker.pk}/").status_code == 200
    assert f'data-worker="{bobs_worker.pk}"' in browser.get("/").content.decode()


# --- assets -----------------------------------------------------------------------------------------------


def test_the_chart_library_and_the_dashboard_assets_are_served_by_this_server(client):
    for path, marker in (
        ("/static/vendor/chartjs/chart.umd.min.js", b"Chart.js v4.6.1"),
        ("/static/dashboard/dashboard.js", b"liveSocket"),
        ("/static/dashboard/dashboard.css", b"[hidden]"),
    ):
        response = client.get(path)
        assert response.status_code == 200, path
        assert marker in b"".join(response.streaming_content), path


def test_no_page_loads_anything_from_elsewhere(training_job, ada_browser):
    for path in ("/", "/jobs/new/", f"/jobs/{training_job.pk}/"):
        html = ada_browser.get(path).content.decode()
        assert not re.search(r'(src|href)="(https?:)?//', html), path


def test_the_worker_page_compares_the_benchmark_with_measured_throughput(
    training_job, online_rigs, staff_browser
):
    # given: rig-a benchmarked at 412.5 samples/s, then trained three steps of 4 samples
    from tests.apps.dashboard.conftest import status, task_of
    from tests.apps.workers.test_benchmark import result

    rig_a = online_rigs[0]
    rig_a.record_benchmark(result(412.5))
    for loss in (4.0, 3.9, 3.8):
        status(
            rig_a, task_of(training_job, rig_a), {"status": {"batch_size": 4, "loss": loss, "step_time": 0.1}}
        )

    # when
    html = staff_browser.get(f"/workers/{rig_a.pk}/").content.decode()
    overview = staff_browser.get("/").content.decode()

    # then: the score with its workload, and each trainer's samples/s as a share of it
    assert '<dt>Benchmark</dt><dd id="benchmark"><strong>412.5 samples/s</strong>' in html
    assert "(tiny-gpt-2x128, cpu, batch 8, median step 0.0194 s, measured <time " in html
    assert '<time datetime="2026-11-22T03:00:00+00:00" title="' in html
    assert ' ago">2026-11-22 03:00:00 UTC</time>)' in html
    # the share, and why it can pass 100 %
    assert "<th title=\"measured samples/s ÷ the benchmark's samples/s. Over 100 % is normal when" in html
    assert re.search(r'<td class="num" title="measured samples/s[^"]*">\d+%</td>', html)
    assert '<td class="num">412.5 samples/s</td>' in overview
    assert overview.count('<td class="num"><span class="muted">—</span></td>') == 2  # rig-b, rig-c


def test_the_worker_page_says_when_a_worker_was_never_benchmarked(online_rigs, staff_browser):
    html = staff_browser.get(f"/workers/{online_rigs[0].pk}/").content.decode()

    assert '<dd id="benchmark"><span class="muted">not measured yet</span>' in html
