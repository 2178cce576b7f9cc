"""``hypha watch``: poll a job until it ends, showing its rounds as they close.

Polling backs off (``MIN_INTERVAL`` × 1.5 per unchanged answer, up to ``MAX_INTERVAL``) and returns to the
fast interval whenever the job changed, so a busy job is followed closely and an idle one costs little.
A server that is briefly unreachable or failing (a restart, a proxy hiccup) is retried for up to
``patience`` seconds before the watch gives up with that error; a refused token or a missing job is final.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from hypha_cli import output
from hypha_cli.exceptions import ServerError, WrongServerError

MIN_INTERVAL = 0.5
MAX_INTERVAL = 5.0
BACKOFF = 1.5
#: Seconds a watch keeps retrying a server that cannot be reached or fails, before giving up.
DEFAULT_PATIENCE = 120.0


class Reporter(Protocol):
    def update(self, job: dict[str, Any]) -> None: ...
    def retrying(self, error: Exception, delay: float) -> None: ...
    def close(self) -> None: ...


def follow(
    fetch: Callable[[], dict[str, Any]],
    *,
    reporter: Reporter,
    patience: float = DEFAULT_PATIENCE,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Call ``fetch`` (the job's detail) until the job's status is final; hand every answer to ``reporter``.
    Returns the final job."""
    delay = MIN_INTERVAL
    previous: tuple | None = None
    failing_since: float | None = None
    while True:
        try:
            job = fetch()
        except (WrongServerError, ServerError) as error:
            now = clock()
            failing_since = now if failing_since is None else failing_since
            if now - failing_since >= patience:
                raise
            delay = min(max(delay, MIN_INTERVAL) * BACKOFF, MAX_INTERVAL)
            reporter.retrying(error, delay)
            sleep(delay)
            continue
        failing_since = None
        reporter.update(job)
        if job.get("status") in output.FINAL_STATUSES:
            return job
        state = _fingerprint(job)
        delay = MIN_INTERVAL if state != previous else min(delay * BACKOFF, MAX_INTERVAL)
        previous = state
        sleep(delay)


def _fingerprint(job: dict[str, Any]) -> tuple:
    """What, when it changes, means the job is moving: status, reason, rounds, the trainers' steps."""
    steps = tuple(task.get("steps_total") for task in job.get("tasks") or [])
    return (job.get("status"), job.get("status_reason"), len(output.closed_rounds(job)), steps)


class _Changes:
    """Remembers what was already reported: the status line and the closed rounds."""

    def __init__(self) -> None:
        self.status: tuple[str | None, str | None] | None = None
        self.rounds: set[int] = set()

    def new_status(self, job: dict[str, Any]) -> str | None:
        current = (job.get("status"), job.get("status_reason"))
        if current == self.status:
            return None
        self.status = current
        reason = f": {current[1]}" if current[1] else ""
        return f"{current[0]}{reason}"

    def new_rounds(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        fresh = [r for r in output.closed_rounds(job) if r.get("number") not in self.rounds]
        self.rounds.update(r.get("number") for r in fresh)
        return fresh


class PlainReporter:
    """Line by line, for logs and pipes: a line per status change and per closed round."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stdout
        self.changes = _Changes()

    def update(self, job: dict[str, Any]) -> None:
        status = self.changes.new_status(job)
        if status:
            self._print(status)
        for round_ in self.changes.new_rounds(job):
            self._print(output.round_line(round_, output.rounds_total(job)))

    def retrying(self, error: Exception, delay: float) -> None:
        self._print(f"{error}; retrying in {delay:.1f}s")

    def close(self) -> None:
        pass

    def _print(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


class QuietReporter:
    """Says nothing (``--json``: only the final job is printed)."""

    def update(self, job: dict[str, Any]) -> None:
        pass

    def retrying(self, error: Exception, delay: float) -> None:
        pass

    def close(self) -> None:
        pass


class ProgressReporter:
    """A rich progress bar over the job's rounds with the latest training and eval loss and the status
    reason; status changes and closed rounds are printed above the bar."""

    def __init__(self, console) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.changes = _Changes()
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("rounds"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            transient=False,
        )
        self.task = self.progress.add_task("waiting", total=None, info="")
        self.progress.start()

    def update(self, job: dict[str, Any]) -> None:
        status = self.changes.new_status(job)
        if status:
            self.progress.console.print(status, markup=False, highlight=False)
        total = output.rounds_total(job)
        for round_ in self.changes.new_rounds(job):
            self.progress.console.print(output.round_line(round_, total), markup=False, highlight=False)
        rounds = output.closed_rounds(job)
        evals = [r["eval_loss"] for r in rounds if r.get("eval_loss") is not None]
        info = [f"loss {output.loss_text(output.live_training_loss(job) or output.last_loss(job))}"]
        if evals:
            info.append(f"eval {evals[-1]:.4f}")
        if job.get("status_reason"):
            info.append(str(job["status_reason"])[:80])
        self.progress.update(
            self.task,
            description=str(job.get("status")),
            total=total,
            completed=len(rounds),
            info=" · ".join(info),
        )

    def retrying(self, error: Exception, delay: float) -> None:
        self.progress.console.print(f"{error}; retrying in {delay:.1f}s", markup=False, highlight=False)

    def close(self) -> None:
        self.progress.stop()
