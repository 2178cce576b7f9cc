"""Issue 16, "numbers that look wrong" and "small things": every number on the pages says what it is.

* A round its checkpoint closed whose report never came (the job was cancelled between the two) is "yes, no
  report" with "—" for its samples, duration and bytes, not "closed yes, 0 samples"; the API says
  ``reported: false``.
* A trainer's samples/s starts at its second step (the first step's report starts the clock: a step's samples
  over the milliseconds since showed 15,533 samples/s).
* Prices carry their unit (credits per hour of a lease) on every page and in the API schema; an advert's
  attempt counts from 1 on the page, its "wanted" is "still wanted"; an offer's score says what it is.
* One timestamp format, ``<time datetime=… title="3 minutes ago">2026-11-26 13:20:01 UTC</time>``; worker names
  link to their pages; the job's status line is a live region; every page has a favicon.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from apps.jobs.models import Round, Task
from tests.apps.dashboard.conftest import record_round, status, task_of
from tests.apps.dashboard.test_views import snapshot_of

pytestmark = pytest.mark.django_db

#: The one format of a time on the pages: its ISO form, the relative time as the tooltip, then UTC.
TIME = re.compile(
    r'<time datetime="\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?\+00:00" title="([^"]+)">'
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC</time>"
)
PRICE_TITLE = 'title="credits per hour of a lease, per worker"'


def visible_text(html: str) -> str:
    """The page without its scripts, tags and attributes: what a reader sees."""
    html = re.sub(r"<script.*?</script>", "", html, flags=re.S)
    return re.sub(r"<[^>]+>", " ", html)


def api(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user=user)
    return client


# --- rounds ---------------------------------------------------------------------------------------------


def test_a_round_applied_but_never_reported_says_so_on_the_page_and_in_the_api(
    training_job, online_rigs, ada_browser, job_owner
):
    # given: round 1 reported; round 2 closed by its saved checkpoint alone (as training/checkpoints.py does)
    # and then the job cancelled, so the parameter server never reported it
    record_round(training_job, online_rigs, 1)
    Round.objects.create(
        job=training_job,
        number=2,
        closed=True,
        closed_at=timezone.now(),
        participants=[str(online_rigs[0].pk), str(online_rigs[1].pk)],
    )
    assert ada_browser.post(f"/jobs/{training_job.pk}/cancel/").status_code == 302

    # when
    html = ada_browser.get(f"/jobs/{training_job.pk}/").content.decode()
    rounds = api(job_owner).get(f"/api/jobs/{training_job.pk}/").json()["rounds"]

    # then: round 1 is a reported round; round 2 is applied without a report, its numbers unknown, not 0
    assert [(r["number"], r["closed"], r["reported"]) for r in rounds] == [(1, True, True), (2, True, False)]
    assert (rounds[1]["samples"], rounds[1]["duration"], rounds[1]["bytes_out"]) == (0, None, 0)
    row_1 = re.search(r'<tr data-round="1">(.*?)</tr>', html).group(1)
    row_2 = re.search(r'<tr data-round="2">(.*?)</tr>', html).group(1)
    assert '<td class="num">1</td><td>yes</td>' in row_1 and '<td class="num">24</td>' in row_1
    assert '<td class="num">2.0\xa0KB</td>' in row_1  # bytes out
    assert '<span title="applied, but the job ended before the parameter server reported the round' in row_2
    assert ">yes, no report</span>" in row_2
    # samples, duration, bytes in, bytes out, and how the bytes travelled
    assert '<td class="num">—</td>' * 4 + "<td>—</td>" in row_2
    assert "<td>float32 · direct</td>" in row_1
    assert (
        'title="what the parameter server sent in the round, encoded: its result to each participant' in html
    )


def test_the_round_fields_say_what_they_count_in_the_api_schema(client):
    schema = client.get("/api/schema/?format=json").json()["components"]["schemas"]

    round_ = schema["Round"]["properties"]
    assert "result to each participant that fetched it" in round_["bytes_out"]["description"]
    assert "its checkpoint alone" in round_["reported"]["description"]


# --- samples/s ------------------------------------------------------------------------------------------


def test_samples_per_second_starts_at_the_second_step_and_leaves_the_first_steps_samples_out(
    training_job, online_rigs, ada_browser
):
    # given: rig-a reports its first step (4 samples)
    rig_a = online_rigs[0]
    task = task_of(training_job, rig_a)
    status(rig_a, task, {"status": {"batch_size": 4, "loss": 4.0, "step_time": 0.1}})

    # then: no rate from one report (it was 4 samples over the milliseconds since: thousands per second)
    trainer = {t["worker"]: t for t in snapshot_of(ada_browser.get(f"/jobs/{training_job.pk}/"))["trainers"]}
    assert trainer["rig-a"]["samples_per_second"] is None

    # when: two more steps, and the first one's report 10 s ago (the steps since took 10 s)
    for loss in (3.9, 3.8):
        status(rig_a, task, {"status": {"batch_size": 4, "loss": loss, "step_time": 0.1}})
    Task.objects.filter(pk=task.pk).update(first_step_at=timezone.now() - timedelta(seconds=10))

    # then: the 8 samples after the first step over those 10 s, not 12
    response = ada_browser.get(f"/jobs/{training_job.pk}/")
    html = response.content.decode()
    trainer = {t["worker"]: t for t in snapshot_of(response)["trainers"]}
    assert 0.75 <= trainer["rig-a"]["samples_per_second"] <= 0.8
    assert '<th title="samples trained per second of wall time since its first step' in html


# --- prices, adverts, offers ----------------------------------------------------------------------------


def test_prices_carry_their_unit_on_every_page(training_job, online_rigs, staff_browser):
    job_page = staff_browser.get(f"/jobs/{training_job.pk}/").content.decode()
    overview = staff_browser.get("/").content.decode()
    worker_page = staff_browser.get(f"/workers/{online_rigs[1].pk}/").content.decode()

    price = f'<span class="price" {PRICE_TITLE}>125 credits/h</span>'  # rig-b's winning offer
    assert f'<td class="num">{price}</td>' in job_page  # its lease
    assert f'bid <span class="price" {PRICE_TITLE}>' in job_page and " credits/h</span>, max " in job_page
    assert f'<td class="num">{price}</td>' in overview  # its offer
    assert f"at {price}</div>" in overview  # its current lease
    assert f'<td class="num">{price}</td>' in worker_page  # jobs served, lease history
    assert '<dt>Price floor</dt><dd><span class="price"' in worker_page
    # no bare price column is left: every price cell holds the unit
    for page in (job_page, overview, worker_page):
        assert not re.search(r'<td class="num">\d+(\.\d+)?</td>\s*<td class="num">\d+</td>\s*<td><time', page)


def test_adverts_count_attempts_from_one_and_say_what_wanted_and_score_are(training_job, staff_browser):
    overview = staff_browser.get("/").content.decode()

    # the job's adverts were filled on their first attempt (attempt 0 in the API)
    assert (
        '<th title="workers the role still needs: 0 once the advertisement is filled">Still wanted</th>'
        in overview
    )
    assert '<th title="which offer window it is in: 1 is the first' in overview
    adverts = re.search(r"<h3>Advertisements</h3>(.*?)</table>", overview, flags=re.S).group(1)
    assert re.search(
        r'<td class="num">0</td>.*?<td class="num">1</td>\s*<td><span class="badge ad-filled">',
        adverts,
        flags=re.S,
    )
    assert (
        '<th title="price ÷ the worker&#x27;s weighted capacity' not in overview
    )  # static text is not escaped
    assert "<th title=\"price ÷ the worker's weighted capacity (25 per GB of GPU memory" in overview
    assert 'the lowest score wins">Score</th>' in overview


def test_the_api_schema_gives_every_price_its_unit(client):
    schemas = client.get("/api/schema/?format=json").json()["components"]["schemas"]

    unit = "credits per hour of a lease, per worker"
    for name, field in [
        ("Lease", "price"),
        ("JobLease", "price"),
        ("Offer", "price"),
        ("Advertisement", "bid"),
        ("Advertisement", "max_price"),
        ("Price", "bid"),
        ("Price", "max"),
    ]:
        assert unit in schemas[name]["properties"][field]["description"], (name, field)
    assert (
        "0 once the advertisement is filled"
        in schemas["Advertisement"]["properties"]["wanted"]["description"]
    )
    assert "counted from 0" in schemas["Advertisement"]["properties"]["attempt"]["description"]
    assert "weighted capacity (25·GPU GB" in schemas["Offer"]["properties"]["score"]["description"]


# --- times, links, live region, favicon -----------------------------------------------------------------


def test_every_time_on_the_pages_is_one_format_with_the_relative_time_as_its_tooltip(
    training_job, online_rigs, staff_browser
):
    record_round(training_job, online_rigs, 1)
    pages = {
        "job": staff_browser.get(f"/jobs/{training_job.pk}/").content.decode(),
        "overview": staff_browser.get("/").content.decode(),
        "worker": staff_browser.get(f"/workers/{online_rigs[0].pk}/").content.decode(),
    }

    for name, html in pages.items():
        times = TIME.findall(html)
        assert times, name
        assert all(re.fullmatch(r"(just now|.+ ago|in .+)", title) for _, title in times), name
        text = visible_text(html)
        # no ISO time, no bare "… ago" outside a tooltip
        assert not re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d", text), name
        assert not re.search(r"\bago\b", text), name
    job = pages["job"]
    assert re.search(r"submitted " + TIME.pattern, job)  # the job's head
    assert len(re.findall(r'<td class="mono small">' + TIME.pattern, job)) >= 2  # its status history
    assert len(re.findall(r"<td>" + TIME.pattern + r"</td></tr>", job)) == 3  # its leases' expiry


def test_worker_names_on_a_job_link_to_their_pages(training_job, online_rigs, ada_browser):
    # given: rig-a's trainer ended with a reason (its log shows on the job page)
    rig_a = online_rigs[0]
    with_log = task_of(training_job, rig_a)
    Task.objects.filter(pk=with_log.pk).update(log_tail="step 1 loss 4.0\n", reason="exited with code 1")

    html = ada_browser.get(f"/jobs/{training_job.pk}/").content.decode()

    link = f'<a href="/workers/{rig_a.pk}/">rig-a</a>'
    assert html.count(link) >= 3  # trainers, leases, the log's summary
    assert f"trainer on {link} — " in html


def test_the_job_status_line_is_a_live_region(training_job, ada_browser):
    html = ada_browser.get(f"/jobs/{training_job.pk}/").content.decode()

    assert '<div class="status-line" role="status" aria-live="polite">' in html


def test_every_page_links_the_favicon_and_it_is_served(training_job, ada_browser, client):
    for path in ("/", f"/jobs/{training_job.pk}/", "/jobs/new/"):
        html = ada_browser.get(path).content.decode()
        assert '<link rel="icon" type="image/svg+xml" href="/static/dashboard/favicon.svg">' in html, path
    assert '<link rel="icon"' in client.get("/login/").content.decode()

    response = client.get("/static/dashboard/favicon.svg")
    assert response.status_code == 200
    assert b"<svg" in b"".join(response.streaming_content)
