"""Chromium for the browser tests and ``bench/screenshots.py``: Debian's ``/usr/bin/chromium`` driven by
Playwright (never a downloaded browser), its flags, and the dashboard's login page."""

from __future__ import annotations

from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")

#: Flags for a headless Chromium as root in a container: no sandbox, no GPU, nothing fetched in the background.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def launch(playwright):
    """A headless Debian Chromium from a started ``sync_playwright()``."""
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)


def log_in(page, base: str, username: str, password: str) -> None:
    """Log in through the dashboard's login page and wait for the overview."""
    page.goto(f"{base}/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("#login-form button[type=submit]")
    page.wait_for_url(f"{base}/")
