"""The job page's run charts in a real browser (Playwright driving Debian's Chromium) against Django's live
server: a running job with stored per-step metrics (written through ``apps.jobs.metrics.record_step_report``,
as the sync protocol writes them) and recorded rounds; the page fetches ``GET /api/jobs/{id}/metrics/`` and
draws every chart from it; the smoothing slider, the log-scale toggle and the drag zoom with its reset work;
and a point stored while the page is open appears without a reload (the poll).

Skipped, with the reason, only when Chromium (``/usr/bin/chromium``) or the ``playwright`` package is missing.
Run under ``flock /tmp/hypha-e2e.lock``, like every e2e test.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from apps.jobs import metrics
from apps.jobs.models import TRAINER, Job, MetricSeries, Round, Task
from apps.leases.models import Lease
from apps.workers import services as worker_services
from tests.browser import launch, require_browser

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
PASSWORD = "a-browser-test-password"
REQUIREMENTS = {
    role: {
        "resources": {"cpu": 1.0, "memory": 1.0, "storage": 0.0, "gpu": 0.0},
        "executor": {"class": executor, "name": name},
        "bid": 100.0,
        "max": 100.0,
    }
    for role, executor, name in (
        ("trainer", "train", "diloco-transformer"),
        ("parameter_server", "aggregate", "parameter-server"),
    )
}

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180), pytest.mark.django_db(transaction=True)]

sync_api = require_browser()


def _trainer(job: Job, name: str) -> Task:
    worker, _ = worker_services.create_worker(name=name)
    lease = Lease.objects.create(
        worker=worker,
        job=job,
        role=TRAINER,
        status=Lease.Status.ACTIVE,
        price=100.0,
        expires_at=timezone.now() + timedelta(hours=1),
    )
    return Task.objects.create(job=job, lease=lease, role=TRAINER, status=Task.Status.RUNNING)


def _off_the_loop(work):
    """Run ORM work in a thread of its own: Playwright's sync API keeps an event loop running in this one,
    where Django refuses database calls."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(work).result()


def _steps(task: Task, first: int, last: int, *, loss_at) -> None:
    for step in range(first, last + 1):
        metrics.record_step_report(
            task,
            {
                "batch_size": 8,
                "loss": loss_at(step),
                "step_time": 0.05,
                "lr": 0.001 * 0.99**step,
                "tokens": 1024,
            },
            first_step=step,
            last_step=step,
            now=1_764_000_000.0 + step * 0.1,
        )


@pytest.fixture
def job_with_metrics(settings):
    settings.HYPHA_METRICS_MAX_POINTS = 100  # 150 steps: the series is merged once, as a long job's would be
    owner = get_user_model().objects.create_user(username="ada", password=PASSWORD)
    job = Job.objects.create(
        owner=owner, name="charts", num_trainers=2, requirements=REQUIREMENTS, status=Job.Status.RUNNING
    )
    first, second = _trainer(job, "rig-a"), _trainer(job, "rig-b")
    _steps(first, 1, 150, loss_at=lambda step: 5.0 / (1 + step / 20))
    _steps(second, 1, 150, loss_at=lambda step: 5.5 / (1 + step / 25))
    for number in (1, 2, 3):
        Round.objects.create(
            job=job,
            number=number,
            closed=True,
            closed_at=timezone.now(),
            eval_loss=4.0 - number,
            mean_loss=4.2 - number,
            bytes_in=4096 * number,
            bytes_out=2048 * number,
            # what rig-a reported with the round's metrics: its throughput (the round-throughput chart)
            trainer_metrics={
                str(first.lease.worker_id): {"samples_per_second": 100.0 * number, "tokens": 1000.0 * number,
                                             "train_seconds": 1.0}
            },
        )  # fmt: skip
    return job, first


def test_the_job_page_draws_its_run_charts_from_the_stored_metrics(live_server, job_with_metrics) -> None:
    job, first = job_with_metrics
    with sync_api.sync_playwright() as playwright:
        browser = launch(playwright)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2200})
            page.set_default_timeout(20_000)
            try:
                _drive(page, live_server.url, job, first)
            except Exception:
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "run-charts-failure.png"), full_page=True)
                raise
        finally:
            browser.close()


def _count(page, chart: str, label: str) -> int:
    return page.evaluate(
        "([chart, label]) => window.hyphaRunCharts[chart].data.datasets.find(d => d.label === label).data.length",
        [chart, label],
    )


def _drive(page, base: str, job: Job, first: Task) -> None:
    expect = sync_api.expect
    page.goto(f"{base}/login/?next=/jobs/{job.pk}/")
    page.fill("#id_username", "ada")
    page.fill("#id_password", PASSWORD)
    page.click("#login-form button[type=submit]")

    # Every chart is drawn from the API's data: 150 steps per trainer, stored in at most 100 points each.
    card = page.locator("#run-charts")
    expect(card).to_have_attribute("data-loaded", "1")
    for canvas in (
        "step-loss-chart",
        "lr-chart",
        "samples-chart",
        "tokens-chart",
        "bytes-chart",
        "round-throughput-chart",
    ):
        expect(page.locator(f"#{canvas}")).to_be_visible()
    stored = _off_the_loop(lambda: len(metrics.stored_points(MetricSeries.objects.get(task=first))))
    assert 50 <= stored <= 100
    assert card.get_attribute("data-trainers") == "2"
    assert _count(page, "loss", "trainer rig-a") == stored
    assert _count(page, "loss", "mean") == int(card.get_attribute("data-points")) > 0
    assert _count(page, "lr", "trainer rig-b") == stored
    assert _count(page, "samples", "trainer rig-a") == stored
    assert page.evaluate("window.hyphaRunCharts.samples.data.datasets[0].data[0].y") == pytest.approx(160.0)
    assert page.evaluate("window.hyphaRunCharts.tokens.data.datasets[0].data[0].y") == pytest.approx(20480.0)
    assert page.evaluate("window.hyphaRunCharts.bytes.data.datasets[0].data") == [4096, 8192, 12288]
    throughput = page.evaluate(
        "window.hyphaRunCharts.throughput.data.datasets.map(d => [d.label, d.yAxisID, d.data.map(p => p.y)])"
    )
    assert throughput == [
        ["trainer rig-a samples/s", "y", [100.0, 200.0, 300.0]],
        ["trainer rig-a tokens/s", "y1", [1000.0, 2000.0, 3000.0]],
    ]
    expect(page.locator("#run-charts-empty")).to_be_hidden()

    # Smoothing: the mean's smoothed line moves with the slider; the raw mean does not.
    def mean_line(label: str) -> list:
        return page.evaluate(
            "(label) => window.hyphaRunCharts.loss.data.datasets.find(d => d.label === label).data.map(p => p.y)",
            label,
        )

    raw = mean_line("mean (raw)")
    smoothed = mean_line("mean")
    assert smoothed != raw
    page.locator("#smoothing").fill("0")
    expect(page.locator("#smoothing-value")).to_have_text("0.00")
    assert mean_line("mean") == pytest.approx(raw)
    assert mean_line("mean (raw)") == raw

    # Log scale for loss and lr.
    page.check("#log-scale")
    assert page.evaluate("window.hyphaRunCharts.loss.scales.y.type") == "logarithmic"
    assert page.evaluate("window.hyphaRunCharts.lr.scales.y.type") == "logarithmic"
    page.uncheck("#log-scale")
    assert page.evaluate("window.hyphaRunCharts.loss.scales.y.type") == "linear"

    # Zoom: drag across the middle of the loss chart, then reset.
    canvas = page.locator("#step-loss-chart")
    box = canvas.bounding_box()
    area = page.evaluate(
        "(() => { const a = window.hyphaRunCharts.loss.chartArea; return [a.left, a.right]; })()"
    )
    y = box["y"] + box["height"] / 3
    page.mouse.move(box["x"] + area[0] + (area[1] - area[0]) * 0.25, y)
    page.mouse.down()
    page.mouse.move(box["x"] + area[0] + (area[1] - area[0]) * 0.5, y, steps=5)
    page.mouse.up()
    expect(canvas).to_have_attribute("data-zoomed", "true")
    low, high = page.evaluate(
        "[window.hyphaRunCharts.loss.scales.x.min, window.hyphaRunCharts.loss.scales.x.max]"
    )
    assert 20 < low < high < 100
    page.click("#reset-zoom")
    expect(canvas).to_have_attribute("data-zoomed", "false")
    assert page.evaluate("window.hyphaRunCharts.loss.scales.x.max") >= 150

    # Live: a step stored now is drawn at the next poll, without a reload.
    _off_the_loop(lambda: _steps(first, 151, 160, loss_at=lambda step: 1.0))
    page.wait_for_function(
        "() => { const d = window.hyphaRunCharts.loss.data.datasets.find(d => d.label === 'trainer rig-a');"
        " return d.data[d.data.length - 1].x === 160; }"
    )
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#run-charts").screenshot(path=str(ARTIFACTS / "run-charts.png"))
