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


#: The order verdicts are counted and listed in (dashboard.js's ``verdictCell`` writes the same).
VERDICT_ORDER = ("rejected", "down-weighted", "accepted")


def verdict_summary(verdicts, workers) -> tuple[str, str]:
    """A round's verdicts as a short text ("rejected: 1 · down-weighted: 2", "accepted: 3", "—" for none)
    and a tooltip listing each update that was not simply accepted: "rig-a: rejected: its norm is 100x …"."""
    if not isinstance(verdicts, dict) or not verdicts:
        return "—", ""
    workers = workers if isinstance(workers, dict) else {}
    counts = {kind: 0 for kind in VERDICT_ORDER}
    lines = []
    for peer, body in verdicts.items():
        kind = body.get("verdict") if isinstance(body, dict) else None
        if kind not in counts:
            continue
        counts[kind] += 1
        if kind != "accepted":
            reason = body.get("reason") or "no reason given"
            lines.append((VERDICT_ORDER.index(kind), f"{workers.get(peer, str(peer)[:8])}: {kind}: {reason}"))
    shown = [f"{kind}: {counts[kind]}" for kind in VERDICT_ORDER[:2] if counts[kind]]
    text = " · ".join(shown) or f"accepted: {counts['accepted']}"
    return text, "\n".join(line for _, line in sorted(lines)) or "every update accepted"


@register.filter
def verdicts(round_, workers) -> str:
    """``{{ round|verdicts:snapshot.workers }}``: the rounds table's verdicts cell (see :func:`verdict_summary`)."""
    text, title = verdict_summary(round_.get("verdicts") if isinstance(round_, dict) else None, workers)
    if not title:
        return format_html('<td class="num">{}</td>', text)
    error = " error" if text.startswith("rejected") else ""
    return format_html('<td class="verdicts{}"><span title="{}">{}</span></td>', error, title, text)
