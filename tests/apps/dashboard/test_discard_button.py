"""The owner's Discard button in the job page's rounds table (docs/dashboard.md, "Discarding a round"): on the
latest closed, not discarded round of a running job, for the job's owner only; it posts to the API with the
session and the page's CSRF token, as the cancel form does."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from apps.jobs.models import Job, Round
from tests.apps.dashboard.conftest import record_round

pytestmark = pytest.mark.django_db

BUTTON = re.compile(r'<button type="button" class="danger small discard-round" data-round="(\d+)"')


def buttons(browser: Client, job: Job) -> list[int]:
    """The rounds the page shows a Discard button on."""
    html = browser.get(f"/jobs/{job.pk}/").content.decode()
    return [int(number) for number in BUTTON.findall(html)]


def test_the_owner_sees_discard_on_the_latest_closed_round_only(training_job, online_rigs, ada_browser):
    record_round(training_job, online_rigs, 1)
    record_round(training_job, online_rigs, 2)

    html = ada_browser.get(f"/jobs/{training_job.pk}/").content.decode()

    assert buttons(ada_browser, training_job) == [2]
    assert f'data-discard-url="/api/jobs/{training_job.pk}/rounds/0/discard/"' in html


def test_staff_and_other_users_see_no_button(training_job, online_rigs, staff_browser, eve_browser):
    record_round(training_job, online_rigs, 1)

    staff_html = staff_browser.get(f"/jobs/{training_job.pk}/").content.decode()

    assert staff_browser.get(f"/jobs/{training_job.pk}/").status_code == 200
    assert buttons(staff_browser, training_job) == []
    assert "data-discard-url" not in staff_html and "data-csrf-token" not in staff_html
    assert eve_browser.get(f"/jobs/{training_job.pk}/").status_code == 404


def test_no_button_before_a_round_closed_on_the_last_round_or_once_asked(
    training_job, online_rigs, ada_browser
):
    assert buttons(ada_browser, training_job) == []
    record_round(training_job, online_rigs, 1)
    Round.objects.filter(job=training_job, number=1).update(discard_requested_at="2026-01-01T00:00:00Z")
    assert buttons(ada_browser, training_job) == []
    record_round(training_job, online_rigs, 2)
    record_round(training_job, online_rigs, 3)  # the job's last round (update_rounds = 3): none follows
    assert buttons(ada_browser, training_job) == []


def test_no_button_on_a_job_that_is_not_running(training_job, online_rigs, ada_browser):
    record_round(training_job, online_rigs, 1)
    ada_browser.post(f"/jobs/{training_job.pk}/cancel/")

    assert buttons(ada_browser, training_job) == []


def test_the_buttons_post_is_taken_with_the_session_and_the_pages_token_and_a_refusal_says_why(
    training_job, online_rigs, job_owner
):
    # given: the owner's browser, with CSRF checks on as a real browser's requests have them
    record_round(training_job, online_rigs, 1)
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(job_owner)
    html = browser.get(f"/jobs/{training_job.pk}/").content.decode()
    token = re.search(r'data-csrf-token="([^"]+)"', html).group(1)
    url = f"/api/jobs/{training_job.pk}/rounds/1/discard/"

    # when / then: without the token the session's POST is refused; with it the round is asked to be discarded
    # (a bodiless POST, as the page's fetch() sends it)
    assert browser.generic("POST", url).status_code == 403
    assert Round.objects.get(job=training_job, number=1).discard_requested_at is None
    answer = browser.generic("POST", url, headers={"X-CSRFToken": token})
    assert answer.status_code == 200
    assert Round.objects.get(job=training_job, number=1).discard_requested_at is not None

    # a second click (another tab) is refused with the reason the page shows
    again = browser.generic("POST", url, headers={"X-CSRFToken": token})
    assert (again.status_code, again.json()) == (409, {"detail": "round 1's discard was requested already"})
    assert buttons(browser, training_job) == []
