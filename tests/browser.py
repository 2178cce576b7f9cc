"""The browser tests' guard: a module that drives Chromium starts with ``sync_api = require_browser()``, which
skips the whole module, with the reason, only when Debian's Chromium or the ``playwright`` package is missing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.browser import CHROMIUM, CHROMIUM_ARGS, launch, log_in  # noqa: E402

__all__ = ["CHROMIUM", "CHROMIUM_ARGS", "launch", "log_in", "require_browser"]


def require_browser():
    """Playwright's ``sync_api``; skips the calling module when it or ``/usr/bin/chromium`` is missing."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -r requirements/test.txt)"
    )
    if not CHROMIUM.exists():
        pytest.skip(
            f"{CHROMIUM} is missing: scripts/test installs Debian's chromium with apt-get when it can "
            "(apt-get install chromium chromium-driver)",
            allow_module_level=True,
        )
    return sync_api
