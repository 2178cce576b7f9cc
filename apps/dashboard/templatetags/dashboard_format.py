"""How the dashboard writes times and prices, the same on every page (and in dashboard.js's ``when``).

* ``{{ value|when }}``: a ``<time>`` with the absolute UTC time, ``2026-11-26 13:20:01 UTC``, its ISO form in
  ``datetime`` and the relative time ("3 minutes ago", "in 40 seconds") as its tooltip; "—" for none.
* ``{{ value|price }}``: a price with its unit, ``120 credits/h``, and what that is as its tooltip.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django import template
from django.template.defaultfilters import floatformat
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.html import format_html
from django.utils.timesince import timesince, timeuntil

from worker_daemon.protocol import PRICE_MEANING, PRICE_UNIT

register = template.Library()

#: The one format of every absolute time on the dashboard (dashboard.js writes the same).
TIME_FORMAT = "%Y-%m-%d %H:%M:%S UTC"


def relative(moment: datetime, now: datetime | None = None) -> str:
    """``moment`` relative to now: "3 minutes ago", "in 40 seconds", "just now"."""
    now = now or timezone.now()
    if abs((now - moment).total_seconds()) < 1:
        return "just now"
    if moment <= now:
        return f"{timesince(moment, now)} ago"
    return f"in {timeuntil(moment, now)}"


@register.filter
def when(value) -> str:
    if isinstance(value, str):
        value = parse_datetime(value)
    if not isinstance(value, datetime):
        return "—"
    if timezone.is_naive(value):
        value = timezone.make_aware(value, UTC)
    value = value.astimezone(UTC)
    return format_html(
        '<time datetime="{}" title="{}">{}</time>',
        value.isoformat(),
        relative(value),
        value.strftime(TIME_FORMAT),
    )


@register.filter
def price(value) -> str:
    if value is None or value == "":
        return "—"
    return format_html(
        '<span class="price" title="{}">{} {}</span>', PRICE_MEANING, floatformat(value, "-2"), PRICE_UNIT
    )
