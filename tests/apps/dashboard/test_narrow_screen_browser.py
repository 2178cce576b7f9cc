"""The dashboard on a 390 px wide phone (issue 16): no page is wider than the screen — wide tables scroll sideways
inside their card or wrapper, grid columns shrink — in a real browser (Playwright driving Debian's Chromium)
against Django's live test server, with the dashboard tests' running job.

Skipped, with the reason, only when Chromium (``/usr/bin/chromium``) or the ``playwright`` package is missing.
Run it under ``flock /tmp/hypha-e2e.lock`` like the other browser tests.
"""

from __future__ import annotations

import pytest
from django.test import Client

from tests.apps.dashboard.conftest import record_round
from tests.browser import launch, require_browser

WIDTH = 390

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

sync_api = require_browser()


def test_no_page_is_wider_than_a_390_px_screen(live_server, training_job, online_rigs, staff_user_client):
    # given: a round recorded, and a staff user's session (staff see every column: owners, the market)
    record_round(training_job, online_rigs, 1)
    session = staff_user_client.cookies["sessionid"].value
    paths = ["/", f"/jobs/{training_job.pk}/", f"/workers/{online_rigs[0].pk}/", "/jobs/new/"]

    with sync_api.sync_playwright() as playwright:
        browser = launch(playwright)
        try:
            context = browser.new_context(viewport={"width": WIDTH, "height": 844})
            context.add_cookies([{"name": "sessionid", "value": session, "url": live_server.url}])
            page = context.new_page()
            widths = {}
            for path in paths:
                # when
                page.goto(f"{live_server.url}{path}", wait_until="load")
                sync_api.expect(page.locator("main")).to_be_visible()
                widths[path] = page.evaluate("document.documentElement.scrollWidth")
            # the lease tables scroll inside their wrappers
            page.goto(f"{live_server.url}/jobs/{training_job.pk}/", wait_until="load")
            wrappers = page.locator("#leases .table-scroll")
            assert wrappers.count() == 2
            assert page.evaluate(
                "(width) => [...document.querySelectorAll('#leases .table-scroll')].every("
                "(box) => getComputedStyle(box).overflowX === 'auto' && box.clientWidth <= width)",
                WIDTH,
            )
        finally:
            browser.close()

    # then
    assert widths == {path: WIDTH for path in paths}


@pytest.fixture
def staff_user_client(db) -> Client:
    from django.contrib.auth import get_user_model

    client = Client()
    client.force_login(get_user_model().objects.create_user(username="root", password=None, is_staff=True))
    return client
