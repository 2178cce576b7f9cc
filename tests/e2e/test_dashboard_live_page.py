"""The live job page converges on what a fresh load shows (issue 16): a real browser (Playwright driving
Debian's Chromium) follows a small job (2 trainers, 2 rounds) from submission to completion on its page, without
a reload, against a real cluster on loopback (``bench/cluster.py``: control plane, data node, three worker
daemons). Then a second tab loads the page fresh, and the two must show the same: status and reason, the live
badge (``finished``), the trainers' table (each task ``exited``), the rounds, the leases, the data slices and the
status history, row by row and cell by cell.

No wall-clock luck: every wait is for a condition, with generous timeouts. The comparison itself is retried
(fresh tab reloaded) until both agree, because a finished job may still change a little after the page says
"completed" (a daemon's late release of a lease, say) — the live page must follow those changes too, so a page
that stays behind fails after the deadline with both versions in the message.

Skipped, with the reason, only when Chromium (``/usr/bin/chromium``) or the ``playwright`` package is missing.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.browser import launch, log_in, require_browser
from tests.e2e.conftest import only_in_mode, services_mode

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.cluster import SMALL_GPT2  # noqa: E402

ARTIFACTS = REPO_ROOT / "test-artifacts"
PASSWORD = "a-live-page-test-password"

#: What the two tabs must agree on: each element's text (and a few attributes) by CSS selector.
COMPARED = [
    "#job-status",
    "#job-reason",
    "#job-cost",
    "#live-indicator",
    "#trainers",
    "#rounds",
    "#leases",
    "#data",
    "#history-rows",
]
#: Seconds the job has to complete (it needs a few: start-up, allocation, two rounds of three steps).
COMPLETION_TIMEOUT = 240
#: Seconds the live page has to agree with a fresh load once the job completed.
AGREEMENT_TIMEOUT = 60

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

sync_api = require_browser()

# The page's content as the browser shows it: each compared element's text, plus the attributes that say what
# is shown (the badge's state, the hidden cancel form and model link).
READ_PAGE = """(selectors) => {
  const texts = {};
  for (const selector of selectors) {
    const node = document.querySelector(selector);
    texts[selector] = node === null ? null : node.innerText;
  }
  texts["live state"] = document.getElementById("live-indicator").dataset.state;
  texts["cancel hidden"] = document.getElementById("cancel-form").hidden;
  texts["model link hidden"] = document.getElementById("model-link").hidden;
  return texts;
}"""


@only_in_mode("embedded", "the browser test of the other page runs in services mode; the events are the same")
def test_the_live_page_of_a_finished_job_shows_what_a_fresh_load_shows(tmp_path: Path) -> None:
    from bench.cluster import diloco_spec, prepare_stdlib_text, training_cluster

    dataset = prepare_stdlib_text(tmp_path / "stdlib", max_bytes=120_000, samples_per_slice=32)
    spec = diloco_spec(
        dataset="stdlib",
        trainers=2,
        rounds=2,
        inner_steps=3,
        batch_size=8,
        holdout=1,
        round_timeout=60,
        model=SMALL_GPT2,
    )
    with (
        training_cluster(
            root=tmp_path / "cluster",
            dataset_dir=dataset,
            workers=3,
            mode="services" if services_mode() else "embedded",
            settings={"DJANGO_SUPERUSER_PASSWORD": PASSWORD},
            benchmark=False,
        ) as cluster,
        sync_api.sync_playwright() as playwright,
    ):
        cluster.plane.manage(
            "createsuperuser", "--noinput", "--username", "ada", "--email", "ada@example.com"
        )
        cluster.wait_for_dataset("stdlib")
        cluster.wait_for_workers(3)
        browser = launch(playwright)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1800})
            context.set_default_timeout(30_000)
            live = context.new_page()
            try:
                _follow_and_compare(live, context, cluster, spec)
            except Exception:
                ARTIFACTS.mkdir(exist_ok=True)
                for number, page in enumerate(context.pages):
                    page.screenshot(
                        path=str(ARTIFACTS / f"dashboard-live-failure-{number}.png"), full_page=True
                    )
                print(cluster.logs())
                raise
        finally:
            browser.close()


def _follow_and_compare(live, context, cluster, spec: dict) -> None:
    expect = sync_api.expect
    base = cluster.plane.base_url
    log_in(live, base, "ada", PASSWORD)

    # given: the job's page is open from (nearly) its submission, its socket open
    job_id = cluster.submit(spec, name="live-page-e2e")
    live.goto(f"{base}/jobs/{job_id}/")
    expect(live.locator("#live-indicator")).to_have_attribute("data-state", "open")
    expect(live.locator("#live-indicator")).to_have_text("live")
    live.evaluate("window.__sameDocument = true")

    # when: the job runs to its end, followed live
    expect(live.locator("#job-status")).to_have_text("completed", timeout=COMPLETION_TIMEOUT * 1000)

    # then: without a reload, the badge says the job finished, and the trainers' tasks ended
    expect(live.locator("#live-indicator")).to_have_attribute("data-state", "finished")
    expect(live.locator("#live-indicator")).to_have_text("finished")
    expect(live.locator("#trainers tr td:nth-child(2)")).to_have_text(["exited", "exited"])
    expect(live.locator("#rounds tr[data-round]")).to_have_count(2)
    assert live.evaluate("window.__sameDocument") is True
    assert cluster.job(job_id)["status"] == "completed"

    # and a fresh load of the page in a second tab shows the same, section by section
    fresh = context.new_page()
    deadline = time.monotonic() + AGREEMENT_TIMEOUT
    while True:
        fresh.goto(f"{base}/jobs/{job_id}/")
        fresh_content = fresh.evaluate(READ_PAGE, COMPARED)
        live_content = live.evaluate(READ_PAGE, COMPARED)
        if live_content == fresh_content or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert live_content == fresh_content
    assert live.evaluate("window.__sameDocument") is True
    # What they agree on is the job's whole story: every transition up to completed, the newest first.
    history = fresh_content["#history-rows"].splitlines()
    assert history[0].split("\t")[1:3] == ["running", "completed"], history
    assert len(history) >= 3, history
    assert fresh_content["live state"] == "finished"
    # The cost the live page shows came from a live event (issue 18), and the job did cost something.
    assert "(the last live update)" in live.locator("#job-cost").get_attribute("title")
    assert fresh_content["#job-cost"] != "Cost 0 credits", fresh_content["#job-cost"]
    assert (fresh_content["cancel hidden"], fresh_content["model link hidden"]) == (True, False)
    ARTIFACTS.mkdir(exist_ok=True)
    live.screenshot(path=str(ARTIFACTS / "dashboard-live-finished.png"), full_page=True)
