"""Small helpers of the REST API tests."""

from __future__ import annotations

from datetime import datetime


def iso(value: datetime | None) -> str | None:
    """A datetime as the API renders it (ISO 8601, UTC as ``Z``)."""
    if value is None:
        return None
    text = value.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text
