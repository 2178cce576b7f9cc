"""Refresh the dashboard screenshots in ``docs/images/`` (shown in docs/dashboard.md, "Screenshots").

Starts a small cluster on loopback (``bench/cluster.py``: embedded control plane, one data node, three worker
daemons), gives a user ``ada`` an API token and a dashboard password (``manage.py create_user_token
--password-stdin``, as the README says), runs one short job to the end and a second, long one, and while the
second runs drives Debian's Chromium (Playwright, ``/usr/bin/chromium``) through the pages: the overview, the
running job (also at 390 px), the finished job, the compare page, the submit form filled by "Clone" and a
worker's page. The long job is cancelled at the end and everything is stopped.

    flock /tmp/hypha-e2e.lock python bench/screenshots.py [--output docs/images] [--no-benchmark]

Each image is a PNG of the viewport (or of one part of the page); one over ``--max-kb`` (250) is written as a
JPEG (quality 80) instead. Prints one line per file and its size.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.browser import launch, log_in  # noqa: E402
from bench.cluster import SMALL_GPT2, diloco_spec, prepare_stdlib_text, training_cluster  # noqa: E402

USER, PASSWORD = "ada", "screenshots-password-1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "docs" / "images")
    parser.add_argument("--max-kb", type=int, default=250)
    parser.add_argument("--no-benchmark", action="store_true", help="daemons skip the start-up benchmark")
    parser.add_argument("--keep", action="store_true", help="keep the cluster's temp dir")
    options = parser.parse_args()
    from playwright.sync_api import sync_playwright

    options.output.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="hypha-screenshots-"))
    dataset = prepare_stdlib_text(root / "stdlib", max_bytes=200_000, samples_per_slice=32)
    with training_cluster(
        root=root / "cluster",
        dataset_dir=dataset,
        workers=3,
        settings={"HYPHA_LEASE_TTL": "10"},
        benchmark=not options.no_benchmark,
    ) as cluster:
        # The README's path: a user, their token, their dashboard password (from stdin).
        cluster.api_token = cluster.plane.manage("create_user_token", USER)
        subprocess.run(
            [sys.executable, str(REPO_ROOT / "manage.py"), "create_user_token", USER, "--password-stdin"],
            input=PASSWORD + "\n", env=cluster.plane.env, cwd=REPO_ROOT, check=True,
            capture_output=True, text=True,
        )  # fmt: skip
        short = dict(model=SMALL_GPT2, batch_size=8, holdout=1, round_timeout=60.0)
        finished = cluster.submit(
            diloco_spec(dataset="stdlib", trainers=2, rounds=4, inner_steps=5, **short),
            name="gpt2-bytes-lr3e-3",
        )
        cluster.follow(finished, timeout=300)
        running_spec = diloco_spec(
            dataset="stdlib", trainers=2, rounds=200, inner_steps=5, learning_rate=1e-3, **short
        )
        running = cluster.submit(running_spec, name="gpt2-bytes-lr1e-3")
        rounds: list[dict] = []
        try:
            cluster.follow(running, timeout=300, on_round=_stop_after(rounds, 4))
        except _Enough:
            pass
        with sync_playwright() as playwright:
            browser = launch(playwright)
            try:
                _shoot(browser, cluster.plane.base_url, finished, running, options)
            finally:
                browser.close()
        with cluster.api() as client:
            client.post(f"/api/jobs/{running}/cancel/")
    if not options.keep:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    return 0


class _Enough(Exception):
    pass


def _stop_after(rounds: list[dict], count: int):
    def on_round(round_: dict) -> None:
        rounds.append(round_)
        if len(rounds) >= count:
            raise _Enough

    return on_round


def _save(page, path: Path, max_kb: int, **kwargs) -> Path:
    """A PNG of the page (``clip`` or ``full_page`` in kwargs), or a JPEG (quality 80) when the PNG is too big."""
    png = path.with_suffix(".png")
    jpeg = path.with_suffix(".jpg")
    page.screenshot(path=str(png), **kwargs)
    if png.stat().st_size > max_kb * 1024:
        png.unlink()
        page.screenshot(path=str(jpeg), type="jpeg", quality=80, **kwargs)
        print(f"{jpeg.relative_to(REPO_ROOT)}  {jpeg.stat().st_size // 1024} KB (jpeg: the png was too big)")
        return jpeg
    jpeg.unlink(missing_ok=True)
    print(f"{png.relative_to(REPO_ROOT)}  {png.stat().st_size // 1024} KB")
    return png


def _section(page, selector: str, path: Path, max_kb: int, *, height: int = 1400) -> Path:
    """The part of the page from ``selector``'s top, at most ``height`` px tall."""
    page.locator(selector).scroll_into_view_if_needed()
    box = page.locator(selector).bounding_box()
    width = page.viewport_size["width"]
    page_height = page.evaluate("document.documentElement.scrollHeight")
    scroll = page.evaluate("window.scrollY")
    top = box["y"] + scroll
    clip = {"x": 0, "y": top, "width": width, "height": min(height, page_height - top)}
    return _save(page, path, max_kb, clip=clip, full_page=True)


def _shoot(browser, base: str, finished: str, running: str, options) -> None:
    out, max_kb = options.output, options.max_kb
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    log_in(page, base, USER, PASSWORD)

    # The overview: the job list (filter, page, compare boxes ticked) and the pool.
    page.locator(".compare-pick").first.wait_for()
    for box in page.locator(".compare-pick").all():
        box.check()
    _save(page, out / "dashboard-overview", max_kb, full_page=False)
    _section(page, "#workers", out / "dashboard-pool", max_kb, height=700)

    # The running job: status, progress bar, run charts, then its logs with the full-log links.
    page.goto(f"{base}/jobs/{running}/")
    page.wait_for_function("Number(document.getElementById('loss-chart').dataset.points) > 0")
    page.locator("#logs a.task-log").first.wait_for()
    time.sleep(2)  # the charts' animation
    _save(page, out / "dashboard-job-running", max_kb, full_page=False)
    _section(page, "#run-charts", out / "dashboard-run-charts", max_kb, height=900)
    _section(page, "#logs-card", out / "dashboard-job-logs", max_kb, height=700)

    # The running job at 390 px (a phone).
    phone = browser.new_context(viewport={"width": 390, "height": 844}, storage_state=context.storage_state())
    narrow = phone.new_page()
    narrow.goto(f"{base}/jobs/{running}/")
    narrow.wait_for_function("Number(document.getElementById('loss-chart').dataset.points) > 0")
    time.sleep(2)
    _save(narrow, out / "dashboard-job-390px", max_kb, full_page=False)
    phone.close()

    # The finished job.
    page.goto(f"{base}/jobs/{finished}/")
    page.locator("#model-link").wait_for()
    time.sleep(2)
    _save(page, out / "dashboard-job-finished", max_kb, full_page=False)

    # Compare the two.
    page.goto(f"{base}/jobs/compare/?ids={finished}&ids={running}")
    time.sleep(2)
    _save(page, out / "dashboard-compare", max_kb, full_page=False)

    # The submit form, filled in by the finished job's Clone button.
    page.goto(f"{base}/jobs/{finished}/")
    page.click("#clone-link")
    page.wait_for_url(f"{base}/jobs/new/?clone=*")
    _save(page, out / "dashboard-submit-clone", max_kb, full_page=False)

    # A worker's page (a trainer of the finished job).
    page.goto(f"{base}/jobs/{finished}/")
    href = page.locator("#trainers a[href^='/workers/']").first.get_attribute("href")
    page.goto(f"{base}{href}")
    time.sleep(1)
    _save(page, out / "dashboard-worker", max_kb, full_page=False)
    context.close()


if __name__ == "__main__":
    sys.exit(main())
