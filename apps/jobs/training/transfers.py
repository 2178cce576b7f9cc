"""How a job's bytes travel: directly to the parameter server's URL, or through the relay (docs/transfers.md).

Decided once per parameter-server task, when it reports ``ready`` with its URL: a worker that says it accepts
no inbound connections (``reachable = false``) gets the relay; one that says it does (``true``), direct;
``auto`` (the default) is decided by a real check — the control plane tries the URL — never by assumption.
"""

from __future__ import annotations

import logging

import httpx

from apps.jobs.models import Task

logger = logging.getLogger(__name__)

DIRECT = "direct"
RELAY = "relay"

#: Seconds the control plane's check of a parameter server's URL may take (connect and answer).
PROBE_TIMEOUT = 3.0


def declared_reachability(worker) -> str:
    """``"true"``, ``"false"`` or ``"auto"``: what the worker's daemon said of itself in its hello."""
    value = getattr(worker, "reachable", "auto")
    if value is True or value == "true":
        return "true"
    if value is False or value == "false":
        return "false"
    return "auto"


def probe(url: str, *, timeout: float = PROBE_TIMEOUT) -> tuple[bool, str]:
    """Whether ``url`` answers HTTP from here (any status counts: the server is there), and what was seen.

    Runs outside any transaction: it may take ``timeout`` seconds."""
    try:
        response = httpx.get(f"{url.rstrip('/')}/healthz", timeout=timeout, follow_redirects=False)
    except httpx.HTTPError as error:
        return False, f"{type(error).__name__}: {error}"[:300] or type(error).__name__
    return True, f"HTTP {response.status_code}"


def choose_path(worker, url: str, probed: tuple[bool, str] | None) -> tuple[str, str]:
    """(path, why) for a parameter server on ``worker`` listening at ``url``; ``probed`` is :func:`probe`'s
    answer for an ``auto`` worker (None if not probed: then the relay, which always works)."""
    declared = declared_reachability(worker)
    if declared == "false":
        return RELAY, "its daemon accepts no inbound connections (reachable = false)"
    if declared == "true":
        return DIRECT, "its daemon accepts inbound connections (reachable = true)"
    if probed is None:
        return RELAY, "its URL was not checked"
    reached, seen = probed
    if reached:
        return DIRECT, f"the control plane reached {url} ({seen})"
    return RELAY, f"the control plane could not reach {url} ({seen})"


def wants_probe(worker) -> bool:
    return declared_reachability(worker) == "auto"


def set_path(task: Task, path: str) -> None:
    Task.objects.filter(pk=task.pk).update(transfer_path=path)
    task.transfer_path = path
