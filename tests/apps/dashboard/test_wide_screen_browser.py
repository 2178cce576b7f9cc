"""The dashboard at 1280 px (the width of docs/images/): a table wider than its half of a two-column row scrolls
inside it instead of spilling over the other half — in a real browser (Playwright driving Debian's Chromium)
against Django's live test server, with the dashboard tests' running job.

Found by the screenshots (bench/screenshots.py): the market's advertisements table ran under the offers table.

Skipped, with the reason, only when Chromium (``/usr/bin/chromium``) or the ``playwright`` package is missing.
Run it under ``flock /tmp/hypha-e2e.lock`` like the other browser tests.
"""

from __future__ import annotations

import pytest
from django.test import Client

from tests.apps.dashboard.conftest import record_round
from tests.browser import launch, require_browser

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

sync_api = require_browser()

#: The columns (``.columns > *``) whose content is wider than they are and is not scrolled inside them.
SPILLING = """() => [...document.querySelectorAll('.columns > *')]
    .filter((column) => column.scrollWidth > column.clientWidth + 1
        && !['auto', 'scroll'].includes(getComputedStyle(column).overflowX))
    .map((column) => (column.querySelector('h2, h3') || column).textContent.trim())"""


def test_no_table_spills_out_of_its_column_at_1280_px(
    live_server, training_job, online_rigs, staff_user_client
):
    # given: a round recorded (the market has advertisements and offers), a staff user's session
    record_round(training_job, online_rigs, 1)
    session = staff_user_client.cookies["sessionid"].value
    paths = ["/", f"/jobs/{training_job.pk}/", f"/workers/{online_rigs[0].pk}/"]

    with sync_api.sync_playwright() as playwright:
        browser = launch(playwright)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            context.add_cookies([{"name": "sessionid", "value": session, "url": live_server.url}])
            page = context.new_page()
            spilling = {}
            for path in paths:
                # when
                page.goto(f"{live_server.url}{path}", wait_until="load")
                sync_api.expect(page.locator("main")).to_be_visible()
                spilling[path] = page.evaluate(SPILLING)
            page.goto(f"{live_server.url}/", wait_until="load")
            assert page.locator("#market .columns > *").count() == 2
            assert page.locator("#market tbody tr").count() >= 2  # advertisements and offers to show
        finally:
            browser.close()

    # then
    assert spilling == {path: [] for path in paths}


@pytest.fixture
def staff_user_client(db) -> Client:
    from django.contrib.auth import get_user_model

    client = Client()
    client.force_login(get_user_model().objects.create_user(username="root", password=None, is_staff=True))
    return client
