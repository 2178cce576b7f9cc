"""The dashboard in a real browser (Playwright driving Debian's Chromium) against a real cluster on loopback:
control plane, data node and three worker daemons (``bench/cluster.py``).

A user logs in on the login page, submits a bad form (its errors are shown next to the fields, no job is
made), submits a small DiLoCo job through the form, sees it reach RUNNING, sees the loss chart gain a point
without a reload (the websocket), and cancels it. A screenshot of the job page is saved to
``test-artifacts/dashboard-job.png``.

Skipped, with the reason, only when Chromium (``/usr/bin/chromium``, installed by ``scripts/test``) or the
``playwright`` package is missing.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.browser import launch, require_browser
from tests.e2e.conftest import only_in_mode, services_mode

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.cluster import SMALL_GPT2  # noqa: E402

ARTIFACTS = REPO_ROOT / "test-artifacts"
PASSWORD = "a-browser-test-password"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

sync_api = require_browser()


@only_in_mode("services", "its live updates travel over channels_redis there, the path a deployment uses")
def test_a_user_submits_watches_and_cancels_a_job_in_the_browser(tmp_path: Path) -> None:
    from bench.cluster import prepare_stdlib_text, training_cluster

    dataset = prepare_stdlib_text(tmp_path / "stdlib", max_bytes=200_000, samples_per_slice=32)
    with (
        training_cluster(
            root=tmp_path / "cluster",
            dataset_dir=dataset,
            workers=3,
            mode="services" if services_mode() else "embedded",
            settings={"HYPHA_LEASE_TTL": "10", "DJANGO_SUPERUSER_PASSWORD": PASSWORD},
            benchmark=False,
        ) as cluster,
        sync_api.sync_playwright() as playwright,
    ):
        cluster.plane.manage(
            "createsuperuser", "--noinput", "--username", "ada", "--email", "ada@example.com"
        )
        browser = launch(playwright)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            page.set_default_timeout(30_000)
            try:
                _drive(page, cluster)
            except Exception:
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "dashboard-failure.png"), full_page=True)
                print(cluster.logs())
                raise
        finally:
            browser.close()


def _drive(page, cluster) -> None:
    expect = sync_api.expect
    base = cluster.plane.base_url

    # Log in through the login page (a page that needs a login sends us there first).
    page.goto(f"{base}/jobs/new/")
    assert page.url.startswith(f"{base}/login/?next=/jobs/new/")
    page.fill("#id_username", "ada")
    page.fill("#id_password", PASSWORD)
    page.click("#login-form button[type=submit]")
    expect(page.locator("h1")).to_have_text("Submit a DiLoCo job")

    # A bad form: each error next to its field, and no job is made.
    page.fill("#id_job-inner_steps", "0")
    page.fill("#id_job-trainer_max", "1")
    page.click("#submit-fields")
    expect(page.locator("#errors-job-inner_steps")).to_have_text("Input should be greater than or equal to 1")
    expect(page.locator("#errors-job-trainer_max")).to_have_text("Must be at least the bid (100).")
    expect(page.locator("#field-job-inner_steps.invalid")).to_be_visible()
    assert _jobs(cluster) == []

    # A good one: two trainers, many short rounds, so it keeps running while we watch.
    page.fill("#id_job-name", "browser-e2e")
    page.fill("#id_job-model_config", json.dumps(SMALL_GPT2))
    page.select_option("#id_job-dataset", "stdlib")
    for field, value in {
        "num_trainers": "2",
        "batch_size": "8",
        "update_rounds": "200",
        "inner_steps": "3",
        "round_timeout": "60",
        "holdout": "1",
        "trainer_max": "100",
    }.items():
        page.fill(f"#id_job-{field}", value)
    page.click("#submit-fields")
    page.wait_for_url(f"{base}/jobs/*/")
    job_id = page.url.rstrip("/").rsplit("/", 1)[-1]
    assert [job["id"] for job in _jobs(cluster)] == [job_id]
    expect(page.locator("#live-indicator")).to_have_attribute("data-state", "open")

    # RUNNING, then the chart gains a point: live, without a reload (the marker survives).
    expect(page.locator("#job-status")).to_have_text("running", timeout=90_000)
    expect(page.locator("#model-link")).to_be_hidden()
    page.evaluate("window.__sameDocument = true")
    chart = page.locator("#loss-chart")
    before = int(chart.get_attribute("data-points") or "0")
    page.wait_for_function(
        f"Number(document.getElementById('loss-chart').dataset.points) > {before}", timeout=90_000
    )
    assert page.evaluate("window.__sameDocument") is True
    assert page.evaluate("window.hyphaChart.data.datasets[0].data.length") > before
    expect(page.locator("#rounds tr[data-round='1']")).to_be_visible()
    expect(page.locator("#trainers tr")).to_have_count(2)
    # The workers serving the job link to their pages, also in the rows the script re-drew from live events.
    expect(page.locator("#trainers tr td:first-child a[href^='/workers/']")).to_have_count(2)
    linked = "[...document.querySelectorAll('#leases tbody tr:not(.empty) td:first-child')]"
    assert page.evaluate(f"{linked}.length") >= 3
    assert page.evaluate(f"{linked}.every((cell) => cell.querySelector(\"a[href^='/workers/']\"))")
    # The parameter server's report closes the round: the table says so and the eval line gets its point.
    expect(page.locator("#rounds tr[data-round='1'] td").nth(1)).to_have_text("yes", timeout=60_000)
    assert page.evaluate("window.hyphaChart.data.datasets[1].data[0]") is not None
    assert page.evaluate("window.__sameDocument") is True
    # Each task's log streams while it runs, and its "full log" link (drawn by the script from live events)
    # serves all of it with the page's session: the trainers' round lines, and no warning of accelerate's or
    # transformers' filling it (issue 16, item 8).
    expect(page.locator("#logs a.task-log").first).to_be_visible(timeout=30_000)
    fetch_logs = (
        "Promise.all([...document.querySelectorAll('#logs a.task-log')]"
        ".map((link) => fetch(link.href).then((response) => response.text())))"
    )
    deadline = time.monotonic() + 30
    while not any("round 1" in log for log in page.evaluate(fetch_logs)):
        assert time.monotonic() < deadline, page.evaluate(fetch_logs)
        time.sleep(0.5)
    assert not [log for log in page.evaluate(fetch_logs) if "loss_type=" in log or "accelerate launch" in log]
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-job.png"), full_page=True)

    # Cancel (the button asks for a confirmation first).
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#cancel-button")
    expect(page.locator("#job-status")).to_have_text("cancelled")
    expect(page.locator(".message.success")).to_contain_text("Job cancelled")
    expect(page.locator("#cancel-form")).to_be_hidden()
    assert cluster.job(job_id)["status"] == "cancelled"

    # The overview lists it with its status.
    page.goto(f"{base}/")
    expect(page.locator(f"tr[data-job='{job_id}'] .badge[class*='status-']")).to_have_text("cancelled")
    expect(page.locator("#workers tbody tr")).to_have_count(3)


def _jobs(cluster) -> list[dict]:
    with cluster.api() as client:
        payload = client.get("/api/jobs/").json()
    return payload["results"] if isinstance(payload, dict) else payload
