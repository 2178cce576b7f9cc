"""Simulated worker daemons for the control-plane benchmarks, and the report helpers they share.

A :class:`SimulatedDaemon` is the real thing: a :class:`worker_daemon.connection.WorkerDaemon` (2 cpu, 4 GB,
strategy ``whole``: each holds exactly one role of a default job) on its own websocket, run as a task in the
benchmark's asyncio process. The benchmark only listens in on its session, the daemon's protocol state
machine: every message it receives and every frame it answers or offers goes to a :class:`Listener`.

Used by ``bench/allocation.py`` and ``bench/fleet.py``.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/<benchmark>.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

from worker_daemon import protocol  # noqa: E402
from worker_daemon.config import WorkerConfig  # noqa: E402
from worker_daemon.connection import WorkerDaemon  # noqa: E402
from worker_daemon.jobs import JobManager  # noqa: E402
from worker_daemon.leases import LeaseBook  # noqa: E402

#: The daemons' shape: each can hold exactly one role of a default job (1 cpu, 1 GB), like the e2e test's.
DAEMON_CONFIG = {
    "resources": {"cpu": 2, "memory": 4, "storage": 10, "gpu": 0},
    "offer": {"price": 100, "floor": 50},
}


class Listener(Protocol):
    """What a benchmark hears from its daemons' sessions."""

    def received(self, message: protocol.ServerMessage) -> None: ...

    def sent(self, message: protocol.DaemonMessage) -> None: ...


#: Makes a daemon's job manager from its config, lease book and websocket URL (default: the real one).
JobsFactory = Callable[[WorkerConfig, LeaseBook, str], JobManager]


class SimulatedDaemon:
    """A real :class:`WorkerDaemon` whose session reports what it receives and sends to ``recorder``.

    ``jobs`` replaces the daemon's job manager (e.g. one that answers a dispatch without starting a
    process); ``daemon_options`` go to :class:`WorkerDaemon` (its timing parameters).
    """

    def __init__(
        self,
        *,
        name: str,
        token: str,
        server_url: str,
        work_dir: Path,
        recorder: Listener,
        jobs: JobsFactory | None = None,
        **daemon_options,
    ) -> None:
        config = WorkerConfig.model_validate({**DAEMON_CONFIG, "work_dir": str(work_dir)})
        self.name = name
        self.daemon = WorkerDaemon(config=config, server_url=server_url, token=token, **daemon_options)
        if jobs is not None:
            # The job manager reads the session's lease book, which the daemon makes: replace it before run().
            self.daemon.jobs = jobs(config, self.daemon.session.book, self.daemon.url)
        self.task: asyncio.Task[int] | None = None
        # Listen in on the session, the daemon's protocol state machine: every received message goes
        # through handle(), every reply comes out of it, and every offer comes out of evaluate().
        session = self.daemon.session
        handle, evaluate = session.handle, session.evaluate

        def listening_handle(message: protocol.ServerMessage):
            recorder.received(message)
            outcome = handle(message)
            for reply in outcome.replies:
                recorder.sent(reply)
            return outcome

        def listening_evaluate():
            offers = evaluate()
            for offer in offers:
                recorder.sent(offer)
            return offers

        session.handle = listening_handle
        session.evaluate = listening_evaluate

    def start(self) -> None:
        self.task = asyncio.create_task(self.daemon.run(), name=f"daemon-{self.name}")

    @property
    def welcomed(self) -> bool:
        return self.daemon.session.welcomed

    @property
    def free(self) -> bool:
        book = self.daemon.session.book
        return not book.leases and not book.reservations

    @property
    def holds_lease(self) -> bool:
        return bool(self.daemon.session.book.leases)

    async def stop(self, *, timeout: float = 10.0) -> int | None:
        self.daemon.request_shutdown(reason="benchmark finished")
        if self.task is None:
            return None
        try:
            return await asyncio.wait_for(self.task, timeout)
        except TimeoutError:
            self.task.cancel()
            return None


async def wait_for(predicate: Callable[[], bool], *, timeout: float, interval: float = 0.005) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` seconds passed (False)."""
    deadline = time.perf_counter() + timeout
    while not predicate():
        if time.perf_counter() > deadline:
            return False
        await asyncio.sleep(interval)
    return True


# --- the report --------------------------------------------------------------------------------------------


def percentile(values: list[float], fraction: float) -> float:
    """The ``fraction`` quantile by linear interpolation (``statistics.quantiles``' inclusive method)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = (len(ordered) - 1) * fraction
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def milliseconds(value: float) -> str:
    return f"{value * 1000:.0f}"


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
