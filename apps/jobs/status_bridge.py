"""Hypha's AIM status bridge (reference §8): one POST per trainer metric to ``http://<bridge>/status``.

With ``HYPHA_STATUS_BRIDGE`` set, each metric a trainer reports for a round becomes one POST with the body
``{"worker_id": "<worker uuid>", "round": r, "metric_name": "loss", "value": 0.42}``, sent after the
transaction that recorded it commits:

* services mode: by the Celery task :func:`apps.jobs.tasks.post_to_status_bridge`;
* embedded mode: by one background thread of the daphne process. Not the embedded task runner: its tasks run
  on the thread every gateway database call uses, and a bridge that does not answer would stall them all
  for the timeout.

The bridge is a convenience, never a dependency (the original panics and shuts the scheduler down when it is
unreachable). Each post has a short timeout (``HYPHA_STATUS_BRIDGE_TIMEOUT``); a non-2xx reply is ignored;
a connection error or timeout is logged (at most once a minute, with a count) and never raised; and for a
few seconds after one, posts are dropped without trying, so a bridge that is down costs one timeout per
pause rather than one per metric.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import httpx
from django.conf import settings
from django.db import transaction

from hypha_site.metrics import STATUS_BRIDGE_POSTS

logger = logging.getLogger(__name__)

#: Seconds posts are dropped after a connection failure before the bridge is tried again.
PAUSE_AFTER_FAILURE = 5.0
#: Seconds between two warnings about an unreachable bridge (the posts failed in between are counted).
WARNING_INTERVAL = 60.0
#: Batches the embedded sender holds before it drops new ones (one batch: one trainer's metrics of a round).
QUEUE_SIZE = 1000


def trainer_metrics(*, worker_id: str, round_number: int, metrics: dict[str, float]) -> None:
    """A trainer's metrics for one round (``{"loss": …, …}``): posted after commit if a bridge is set.

    Called by :mod:`apps.jobs.observers` inside the transaction that recorded the metrics.
    """
    address = settings.HYPHA_STATUS_BRIDGE
    if not address or not metrics:
        return
    posts = [
        {"worker_id": worker_id, "round": round_number, "metric_name": name, "value": value}
        for name, value in metrics.items()
    ]
    if settings.EMBEDDED_TRANSPORTS:
        transaction.on_commit(lambda: _embedded_sender().submit(address, posts))
    else:
        from apps.jobs import tasks
        from hypha_site.runtime import enqueue_on_commit

        # The posts themselves, not ids: they are the message, and the round's record may change meanwhile.
        enqueue_on_commit(tasks.post_to_status_bridge, address, posts)


@dataclass
class _Health:
    """Per process: when the bridge last failed, and what to say in the next warning."""

    paused_until: float = 0.0
    last_warning_at: float = float("-inf")
    failed_since_warning: int = 0


_health = _Health()
_health_lock = threading.Lock()


def post(address: str, posts: list[dict]) -> dict[str, int]:
    """POST each of ``posts`` to ``http://<address>/status``; never raises. Returns the count per outcome."""
    outcomes = {"sent": 0, "rejected": 0, "failed": 0, "dropped": 0}
    if time.monotonic() < _health.paused_until:
        outcomes["dropped"] = len(posts)
        _count(outcomes)
        return outcomes
    url = f"http://{address}/status"
    timeout = settings.HYPHA_STATUS_BRIDGE_TIMEOUT
    try:
        with httpx.Client(timeout=timeout) as client:
            for index, body in enumerate(posts):
                try:
                    response = client.post(url, json=body)
                except httpx.HTTPError as error:  # connect, read and write errors and timeouts
                    outcomes["failed"] += 1
                    # The rest of the batch would wait for the same dead bridge.
                    outcomes["dropped"] += len(posts) - index - 1
                    _failed(address, error)
                    break
                if response.is_success:
                    outcomes["sent"] += 1
                else:
                    # As in the original: the bridge's answer does not matter to training.
                    outcomes["rejected"] += 1
                    logger.debug("status bridge %s answered %d", address, response.status_code)
    except Exception:  # a bug here must not reach the Celery worker's or the daphne process's loop either
        logger.exception("posting to the status bridge %s failed", address)
    _count(outcomes)
    return outcomes


def _count(outcomes: dict[str, int]) -> None:
    for outcome, count in outcomes.items():
        if count:
            STATUS_BRIDGE_POSTS.labels(outcome=outcome).inc(count)


def _failed(address: str, error: Exception) -> None:
    now = time.monotonic()
    with _health_lock:
        _health.paused_until = now + PAUSE_AFTER_FAILURE
        _health.failed_since_warning += 1
        if now - _health.last_warning_at < WARNING_INTERVAL:
            return
        failures, _health.failed_since_warning = _health.failed_since_warning, 0
        _health.last_warning_at = now
    logger.warning(
        "status bridge %s unreachable (%s: %s); %d failed attempt(s) since the last warning; "
        "metrics are dropped until it answers",
        address,
        type(error).__name__,
        error,
        failures,
    )


class _EmbeddedSender:
    """One daemon thread that posts batches in the order they were committed (embedded mode only)."""

    def __init__(self) -> None:
        self.batches: queue.Queue[tuple[str, list[dict]]] = queue.Queue(maxsize=QUEUE_SIZE)
        self.thread = threading.Thread(target=self._run, name="hypha-status-bridge", daemon=True)
        self.thread.start()

    def submit(self, address: str, posts: list[dict]) -> None:
        try:
            self.batches.put_nowait((address, posts))
        except queue.Full:
            STATUS_BRIDGE_POSTS.labels(outcome="dropped").inc(len(posts))

    def _run(self) -> None:
        while True:
            address, posts = self.batches.get()
            try:
                post(address, posts)
            finally:
                self.batches.task_done()


_sender: _EmbeddedSender | None = None
_sender_lock = threading.Lock()


def _embedded_sender() -> _EmbeddedSender:
    global _sender
    with _sender_lock:
        if _sender is None:
            _sender = _EmbeddedSender()
        return _sender


def drain(timeout: float = 10.0) -> bool:
    """Wait until the embedded sender has posted everything queued so far (tests); True if it did."""
    sender = _sender
    if sender is None:
        return True
    deadline = time.monotonic() + timeout
    while sender.batches.unfinished_tasks:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
