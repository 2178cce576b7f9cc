"""The owner's Discard button in a real browser (Playwright driving Debian's Chromium, against Django's live test
server): the click asks confirm(), posts to the API with the session and the page's CSRF token, and shows
what happened — the API's 409 reason when it refuses.

Skipped, with the reason, only when Chromium (``/usr/bin/chromium``) or the ``playwright`` package is missing.
Run it under ``flock /tmp/hypha-e2e.lock`` like the other browser tests.
"""

from __future__ import annotations

import pytest
from django.test import Client
from django.utils import timezone

from apps.jobs.models import Round
from tests.apps.dashboard.conftest import record_round
from tests.browser import launch, require_browser

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

sync_api = require_browser()


def test_discard_asks_first_then_posts_and_a_refusal_shows_its_reason(
    live_server, training_job, online_rigs, job_owner, monkeypatch
):
    # Playwright's sync API runs an event loop in this thread: the test's own queries between clicks (another
    # tab's request, simulated) are plain synchronous ones all the same.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    # given: round 1 closed, the owner's session
    record_round(training_job, online_rigs, 1)
    owner = Client()
    owner.force_login(job_owner)
    session = owner.cookies["sessionid"].value
    round_1 = Round.objects.filter(job=training_job, number=1)

    with sync_api.sync_playwright() as playwright:
        browser = launch(playwright)
        try:
            context = browser.new_context()
            context.add_cookies([{"name": "sessionid", "value": session, "url": live_server.url}])
            page = context.new_page()
            page.goto(f"{live_server.url}/jobs/{training_job.pk}/", wait_until="load")
            button = page.locator("#rounds button.discard-round")
            message = page.locator("#discard-message")

            # when: the owner dismisses the confirm, nothing is sent
            page.once("dialog", lambda dialog: dialog.dismiss())
            button.click()
            page.wait_for_timeout(300)
            assert round_1.get().discard_requested_at is None
            assert message.is_hidden()

            # when: another tab asked already, the click is refused with the API's reason
            round_1.update(discard_requested_at=timezone.now())
            page.once("dialog", lambda dialog: dialog.accept())
            button.click()
            sync_api.expect(message).to_have_text(
                "Round 1 was not discarded: round 1's discard was requested already"
            )
            assert message.get_attribute("class") == "small error"

            # when: it is taken
            round_1.update(discard_requested_at=None)
            page.once("dialog", lambda dialog: dialog.accept())
            button.click()
            sync_api.expect(message).to_have_text(
                "Round 1 will be discarded: the next round goes back to the weights and momentum of round 0."
            )
            sync_api.expect(button).to_have_count(0)
        finally:
            browser.close()

    # then
    assert round_1.get().discard_requested_at is not None
