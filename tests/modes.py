"""Which of CI's two runs this is: *services* (PostgreSQL and Redis) or *embedded* (SQLite, in-process).

CI runs the whole suite once per mode and must stay under 45 minutes: a slow test whose subject does not
depend on the mode runs in one of them only (:func:`only_in_mode`)."""

from __future__ import annotations

import os

import pytest


def services_mode() -> bool:
    return bool(os.environ.get("DATABASE_URL") and os.environ.get("REDIS_URL"))


def only_in_mode(mode: str, why: str) -> pytest.MarkDecorator:
    """Run a slow test in one of CI's two runs only (``"services"`` or ``"embedded"``); ``why`` says why its
    subject does not depend on the mode."""
    current = "services" if services_mode() else "embedded"
    return pytest.mark.skipif(current != mode, reason=f"runs in {mode} mode only: {why}")
