"""``hypha watch``: poll a job until it ends, showing its rounds as they close (an inference job: its slices
done of total, with an ETA).

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

from hypha_cli import inference, output
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
    """What, when it changes, means the job is moving: status, reason, rounds, evals, the trainers' steps."""
    steps = tuple(task.get("steps_total") for task in job.get("tasks") or [])
    rounds = output.closed_rounds(job)
    evaluated = sum(1 for round_ in rounds if not output.eval_pending(round_))
    return (job.get("status"), job.get("status_reason"), len(rounds), evaluated, steps, inference.slices(job))


class _Changes:
    """Remembers what was already reported: the status line, the closed rounds, and the rounds whose eval
    was still to come when they were reported (the parameter server may evaluate a round after closing it)."""

    def __init__(self) -> None:
        self.status: tuple[str | None, str | None] | None = None
        self.rounds: set[int] = set()
        self.pending_evals: set[int] = set()
        self.slices: tuple[int, int] | None = None

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
        self.pending_evals.update(r.get("number") for r in fresh if output.eval_pending(r))
        return fresh

    def new_evals(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        """Rounds reported without their eval whose eval (or the reason there is none) has arrived since."""
        arrived = [
            r
            for r in output.closed_rounds(job)
            if r.get("number") in self.pending_evals and not output.eval_pending(r)
        ]
        self.pending_evals.difference_update(r.get("number") for r in arrived)
        return arrived

    def new_slices(self, job: dict[str, Any]) -> str | None:
        """An inference job's ``slices done/total · ETA`` when its count of done slices changed."""
        current = inference.slices(job)
        if current is None or current == self.slices:
            return None
        self.slices = current
        return inference.progress_line(job)

    def lines(self, job: dict[str, Any]) -> list[str]:
        """What to print for this answer: the status when it changed, each newly closed round, each eval
        that arrived after its round was printed; an inference job's slices when more are done."""
        if inference.is_inference(job):
            status, slices = self.new_status(job), self.new_slices(job)
            return [line for line in (status, slices) if line]
        total = output.rounds_total(job)
        status = self.new_status(job)
        late = [output.eval_line(round_, total) for round_ in self.new_evals(job)]  # older rounds first
        return (
            ([status] if status else []) + late + [output.round_line(r, total) for r in self.new_rounds(job)]
        )


class PlainReporter:
    """Line by line, for logs and pipes: a line per status change, per closed round and per late eval."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stdout
        self.changes = _Changes()

    def update(self, job: dict[str, Any]) -> None:
        for line in self.changes.lines(job):
            self._print(line)

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
    """A rich progress bar over the job's rounds: status, bar, ``round done/total``, the job's elapsed time
    and its loss (``output.last_loss``, the summary's number) and eval loss, sized to fit the console's width
    (80 columns included). Status changes (with their reason), closed rounds and late evals are printed above
    the bar."""

    #: Columns between the bar line's cells (rich's grid pads each cell by one).
    GAPS = 6
    #: The narrowest bar drawn; below it the line may wrap on a very narrow terminal.
    MIN_BAR = 8

    def __init__(self, console) -> None:
        from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn
        from rich.text import Text

        class JobElapsedColumn(ProgressColumn):
            """The job's own elapsed time (created → ended, or → now while it runs), not the watch's."""

            def render(self, task) -> Text:
                job = task.fields.get("job") or {}
                return Text(output.duration_text(output.elapsed_seconds(job)), style="progress.elapsed")

        self.changes = _Changes()
        self.console = console
        self.bar = BarColumn(bar_width=self.MIN_BAR)
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            self.bar,
            TextColumn("{task.fields[rounds]}"),
            JobElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            transient=False,
        )
        self.task = self.progress.add_task("waiting", total=None, rounds="", info="", job={})
        self.progress.start()

    def update(self, job: dict[str, Any]) -> None:
        for line in self.changes.lines(job):
            self.progress.console.print(line, markup=False, highlight=False)
        if inference.is_inference(job):
            self._update_slices(job)
            return
        total = output.rounds_total(job)
        rounds = output.closed_rounds(job)
        info = f"loss {output.loss_text(output.last_loss(job))}"
        evaluation = output.last_eval_loss(job)
        description = str(job.get("status"))
        rounds_done = f"round {len(rounds)}/{total if total is not None else '?'}"
        # spinner (1), the texts, the elapsed time (H:MM:SS, wider after 9 hours) and the gaps between cells
        elapsed = len(output.duration_text(output.elapsed_seconds(job)))
        fixed = 1 + len(description) + len(rounds_done) + max(elapsed, 8) + len(info) + self.GAPS
        if (
            evaluation is not None
            and fixed + len(f" · eval {evaluation:.4f}") + self.MIN_BAR <= self.console.width
        ):
            # the eval loss only where it fits (it is on the round lines above the bar too)
            info += f" · eval {evaluation:.4f}"
            fixed += len(f" · eval {evaluation:.4f}")
        self.bar.bar_width = max(self.MIN_BAR, min(40, self.console.width - fixed))
        self.progress.update(
            self.task,
            description=description,
            total=total,
            completed=len(rounds),
            rounds=rounds_done,
            info=info,
            job=job,
        )
        self.progress.refresh()  # drawn now, not at the next tick: each answer is seen, however fast they come

    def _update_slices(self, job: dict[str, Any]) -> None:
        """An inference job's bar: ``slices done/total``, the elapsed time and the ETA."""
        counts = inference.slices(job)
        description = str(job.get("status"))
        done = inference.slices_text(job)
        eta = inference.eta_seconds(job)
        info = f"ETA {output.duration_text(eta)}" if eta is not None else ""
        elapsed = len(output.duration_text(output.elapsed_seconds(job)))
        fixed = 1 + len(description) + len(done) + max(elapsed, 8) + len(info) + self.GAPS
        self.bar.bar_width = max(self.MIN_BAR, min(40, self.console.width - fixed))
        self.progress.update(
            self.task,
            description=description,
            total=counts[1] if counts else None,
            completed=counts[0] if counts else 0,
            rounds=done,
            info=info,
            job=job,
        )
        self.progress.refresh()

    def retrying(self, error: Exception, delay: float) -> None:
        self.progress.console.print(f"{error}; retrying in {delay:.1f}s", markup=False, highlight=False)

    def close(self) -> None:
        self.progress.stop()
