"""An inference job's page in a real browser (Playwright driving Debian's Chromium against Django's live test
server): the page's script runs without an error on a page without the training panels, and redraws the bar,
the workers and the result links from the events its socket brings. Django's live server speaks no websocket,
so the page's socket is a stand-in that delivers the snapshot and the ``progress`` event the server would send
(built by the same functions as ``apps.dashboard.live``).

Skipped, with the reason, only when Chromium or the ``playwright`` package is missing. Run it under
``flock /tmp/hypha-e2e.lock`` like the other browser tests.
"""

from __future__ import annotations

import json

import pytest

from apps.dashboard import snapshots
from apps.dashboard.progress import run_progress
from apps.datasets import services as dataset_services
from tests.apps.dashboard.inference_fixtures import running_inference_job, store_result
from tests.browser import launch, require_browser

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

sync_api = require_browser()

#: The page's WebSocket, replaced: it opens at once and window.__push(event) delivers an event to it.
FAKE_SOCKET = """
window.__sockets = [];
window.WebSocket = function () {
  var socket = this;
  window.__sockets.push(socket);
  setTimeout(function () { if (socket.onopen) { socket.onopen(); } }, 0);
};
window.__push = function (event) {
  window.__sockets.forEach(function (socket) { socket.onmessage({ data: JSON.stringify(event) }); });
};
"""


@pytest.fixture
def inference_job(
    job_owner, rig_a, rig_b, tiny_text, sent, django_capture_on_commit_callbacks, settings, tmp_path
):
    settings.HYPHA_DATA_DIR = tmp_path
    return running_inference_job(job_owner, [rig_a, rig_b], django_capture_on_commit_callbacks, settings)


def progress_event(job) -> dict:
    job.refresh_from_db()
    return json.loads(
        snapshots.to_json(
            {
                "type": "progress",
                "trainers": snapshots.trainer_progress(job.pk),
                "data": dataset_services.progress(job),
                "progress": run_progress(job),
                "cost": snapshots.job_cost(job),
                "inference": snapshots.inference_section(job),
            }
        )
    )


def test_the_page_draws_a_stored_result_from_its_live_event(
    live_server, inference_job, ada_browser, rig_a, sent, monkeypatch
):
    # Playwright's sync API runs an event loop in this thread: the test's own queries are synchronous all the same.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    session = ada_browser.cookies["sessionid"].value
    errors: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = launch(playwright)
        try:
            context = browser.new_context()
            context.add_init_script(FAKE_SOCKET)
            context.add_cookies([{"name": "sessionid", "value": session, "url": live_server.url}])
            page = context.new_page()
            page.on("pageerror", lambda error: errors.append(str(error)))
            # given: the page, and its snapshot as the socket's first message
            page.goto(f"{live_server.url}/jobs/{inference_job.pk}/", wait_until="load")
            snapshot = json.loads(snapshots.to_json(snapshots.job_snapshot(inference_job)))
            page.evaluate("(event) => window.__push(event)", snapshot)
            sync_api.expect(page.locator("#progress-text")).to_contain_text("slice 0 of 4 done")
            sync_api.expect(page.locator("#inference-results")).to_contain_text("No result stored yet.")

            # when: a result is stored and its progress event arrives
            index = store_result(inference_job, rig_a, sent)
            page.evaluate("(event) => window.__push(event)", progress_event(inference_job))

            # then: the bar, the worker's count and the result's link, without a reload
            sync_api.expect(page.locator("#progress-text")).to_contain_text("slice 1 of 4 done · 25%")
            assert page.locator("#progress-fill").evaluate("node => node.style.width") == "25%"
            link = page.locator("#inference-results a.result-link")
            sync_api.expect(link).to_have_attribute("href", f"/api/jobs/{inference_job.pk}/results/{index}/")
            sync_api.expect(page.locator("#results-count")).to_have_text("1 stored")
            sync_api.expect(page.locator("#inference-workers")).to_contain_text("rig-a")
            assert page.locator("#live-indicator").get_attribute("data-state") == "open"
        finally:
            browser.close()
    assert errors == []
