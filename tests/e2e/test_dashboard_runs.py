"""The run pages in a real browser (Playwright driving Debian's Chromium) against a real control plane and data
node on loopback (``bench/cluster.py``, no workers: nothing here needs a job to train).

A user submits a job through the form, sees its progress bar ("not started"), clones it from its page (the
form opens filled in with its settings), renames the copy and submits it: the copy has the same spec. With a
few rounds of each recorded, they tick both jobs in the overview's list, open "Compare selected", and see
one line per job on each chart. A screenshot of the compare page is saved to ``test-artifacts/``.

Skipped, with the reason, only when Chromium (``/usr/bin/chromium``) or the ``playwright`` package is missing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.browser import launch, log_in  # noqa: E402
from tests.e2e.conftest import services_mode  # noqa: E402
from tests.e2e.test_dashboard_browser import ARTIFACTS, PASSWORD, sync_api  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

#: Rounds recorded for the two jobs (mean training loss, eval loss), as the parameter server's reports would.
SEED_ROUNDS = """
from apps.jobs.models import Job, Round
curves = {CURVES}
for job_id, losses in curves.items():
    for number, (mean_loss, eval_loss) in enumerate(losses, start=1):
        Round.objects.create(job_id=job_id, number=number, closed=True, mean_loss=mean_loss, eval_loss=eval_loss)
"""


def test_clone_a_job_and_compare_two_runs_in_the_browser(tmp_path: Path) -> None:
    from bench.cluster import prepare_stdlib_text, training_cluster

    dataset = prepare_stdlib_text(tmp_path / "stdlib", max_bytes=100_000, samples_per_slice=32)
    with (
        training_cluster(
            root=tmp_path / "cluster",
            dataset_dir=dataset,
            workers=0,
            mode="services" if services_mode() else "embedded",
            settings={"DJANGO_SUPERUSER_PASSWORD": PASSWORD},
            benchmark=False,
        ) as cluster,
        sync_api.sync_playwright() as playwright,
    ):
        cluster.plane.manage(
            "createsuperuser", "--noinput", "--username", "ada", "--email", "ada@example.com"
        )
        browser = launch(playwright)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1400})
            page.set_default_timeout(30_000)
            try:
                _drive(page, cluster)
            except Exception:
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "dashboard-runs-failure.png"), full_page=True)
                print(cluster.logs())
                raise
        finally:
            browser.close()


def _drive(page, cluster) -> None:
    expect = sync_api.expect
    base = cluster.plane.base_url

    log_in(page, base, "ada", PASSWORD)

    # Submit a job through the form; no worker is connected, so it waits: the bar says it has not started.
    page.goto(f"{base}/jobs/new/")
    page.fill("#id_job-name", "base")
    page.select_option("#id_job-dataset", "stdlib")
    page.fill("#id_job-update_rounds", "4")
    page.fill("#id_job-inner_learning_rate", "0.002")
    page.click("#submit-fields")
    page.wait_for_url(f"{base}/jobs/*/")
    original_id = page.url.rstrip("/").rsplit("/", 1)[-1]
    expect(page.locator("#progress-text")).to_contain_text("round 0 of 4 done")
    expect(page.locator("#progress-text")).to_contain_text("not started: waiting for its workers")

    # Clone it: the form opens with its settings; rename the copy and submit it.
    page.click("#clone-link")
    page.wait_for_url(f"{base}/jobs/new/?clone={original_id}")
    expect(page.locator("#clone-note")).to_be_visible()
    expect(page.locator("#id_job-name")).to_have_value("base (copy)")
    expect(page.locator("#id_job-update_rounds")).to_have_value("4")
    expect(page.locator("#id_job-inner_learning_rate")).to_have_value("0.002")
    page.fill("#id_job-name", "copy")
    page.click("#submit-fields")
    page.wait_for_url(f"{base}/jobs/*/")
    copy_id = page.url.rstrip("/").rsplit("/", 1)[-1]
    assert copy_id != original_id
    with cluster.api() as client:
        original, copy = (client.get(f"/api/jobs/{job_id}/").json() for job_id in (original_id, copy_id))
    assert copy["name"] == "copy"
    assert copy["spec"] == original["spec"]

    # Rounds for both (as the parameter server would record them), then compare them from the job list.
    curves = {original_id: [(4.0, 4.1), (3.6, 3.7), (3.3, 3.4)], copy_id: [(4.1, 4.2), (3.5, 3.6)]}
    cluster.plane.manage("shell", "-c", SEED_ROUNDS.replace("{CURVES}", json.dumps(curves)))
    page.goto(f"{base}/")
    expect(page.locator("#compare-button")).to_be_disabled()
    page.check(f"input.compare-pick[value='{original_id}']")
    page.check(f"input.compare-pick[value='{copy_id}']")
    page.click("#compare-button")
    page.wait_for_url(f"{base}/jobs/compare/?*")
    page.wait_for_function("window.hyphaCompareCharts !== undefined")
    for chart in ("train", "eval"):
        labels = page.evaluate(f"window.hyphaCompareCharts.{chart}.data.datasets.map((set) => set.label)")
        assert sorted(labels) == ["base", "copy"]
    by_label = page.evaluate(
        "Object.fromEntries(window.hyphaCompareCharts.train.data.datasets.map((set) => [set.label, set.data]))"
    )
    assert by_label == {"base": [4.0, 3.6, 3.3], "copy": [4.1, 3.5, None]}
    expect(page.locator("#compare-runs tbody tr")).to_have_count(2)
    # No trainer ran, so the per-step chart has a line per job but no points, and says so.
    assert page.evaluate("window.hyphaCompareCharts.steps.data.datasets.length") == 2
    expect(page.locator("#compare-steps-empty")).to_be_visible()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-compare.png"), full_page=True)
