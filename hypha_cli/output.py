"""What the CLI prints: tables for people (rich), JSON for scripts, and the numbers both are made of.

``--json`` output is the API's own JSON (``docs/openapi.yaml``), indented, on stdout; everything for people is
here. Errors go to stderr as ``hypha: error: …`` lines (see ``__main__``).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

#: Final job statuses: ``hypha watch`` stops at these.
FINAL_STATUSES = ("completed", "failed", "cancelled")
STATUS_STYLES = {
    "completed": "green",
    "running": "cyan",
    "failed": "red",
    "cancelled": "yellow",
    "online": "green",
    "offline": "dim",
}


def console(*, stderr: bool = False) -> Console:
    """A console on stdout (or stderr). Not a terminal: no colours, and wide enough that a table piped to
    a file or ``grep`` is not wrapped mid-cell."""
    stream: TextIO = sys.stderr if stderr else sys.stdout
    terminal = stream.isatty()
    width = None if terminal or os.environ.get("COLUMNS") else 200
    return Console(file=stream, width=width, no_color=not terminal, highlight=False, soft_wrap=False)


def print_json(value: Any) -> None:
    """``value`` as indented JSON on stdout (plain text: never styled, never wrapped)."""
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


# --- numbers of a job ---------------------------------------------------------------------------------------


def rounds_total(job: dict[str, Any]) -> int | None:
    """Outer rounds the job will run (``spec.rounds.update_rounds``), if its spec says."""
    total = ((job.get("spec") or {}).get("rounds") or {}).get("update_rounds")
    return total if isinstance(total, int) else None


def closed_rounds(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's closed rounds in order (only a job's detail carries rounds)."""
    return sorted((r for r in job.get("rounds") or [] if r.get("closed")), key=lambda r: r.get("number", 0))


def live_training_loss(job: dict[str, Any]) -> float | None:
    """The mean of the trainers' last reported step losses (a loss per step, between rounds)."""
    losses = [
        task["last_loss"]
        for task in job.get("tasks") or []
        if task.get("role") == "trainer" and isinstance(task.get("last_loss"), int | float)
    ]
    return sum(losses) / len(losses) if losses else None


def round_losses(job: dict[str, Any]) -> list[float]:
    """The closed rounds' mean training losses, in round order (rounds without one left out)."""
    return [r["mean_loss"] for r in closed_rounds(job) if isinstance(r.get("mean_loss"), int | float)]


def last_loss(job: dict[str, Any]) -> float | None:
    """The job's current training loss, the one number every view shows (``hypha jobs``, the ``watch`` bar
    and its summary): the latest closed round's mean training loss, else (before any round has one) the
    trainers' live loss."""
    losses = round_losses(job)
    return losses[-1] if losses else live_training_loss(job)


def last_eval_loss(job: dict[str, Any]) -> float | None:
    """The latest closed round's eval loss, if any round has one."""
    evals = [r["eval_loss"] for r in closed_rounds(job) if isinstance(r.get("eval_loss"), int | float)]
    return evals[-1] if evals else None


def _timestamp(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def elapsed_seconds(job: dict[str, Any], *, now: datetime | None = None) -> float | None:
    """The job's wall time: from its creation to its end (``ended_at``), or to ``now`` while it runs; None
    without a creation time. Never negative (a client clock behind the server's)."""
    started = _timestamp(job.get("created_at"))
    if started is None:
        return None
    ended = _timestamp(job.get("ended_at"))
    if ended is None:
        ended = now or datetime.now(UTC)
    return max((ended - started).total_seconds(), 0.0)


def duration_text(seconds: float | None) -> str:
    """``H:MM:SS`` (hours not capped at 24), ``-:--:--`` when unknown."""
    if seconds is None:
        return "-:--:--"
    whole = int(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def rounds_text(job: dict[str, Any]) -> str:
    """``done/total`` (``done/?`` when the spec does not say; ``-`` for a job without detail)."""
    if "rounds" not in job:
        return "-"
    total = rounds_total(job)
    return f"{len(closed_rounds(job))}/{total if total is not None else '?'}"


def loss_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def time_text(value: str | None) -> str:
    """An API timestamp as local ``YYYY-MM-DD HH:MM:SS`` (``-`` when absent, as sent when unparsable)."""
    if not value:
        return "-"
    try:
        return datetime.fromisoformat(value).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return value


def number_text(value: Any) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, int | float) else str(value)


#: The unit of every price (bids, offers, leases, price floors): credits per hour of a lease, per worker; the
#: control plane's ``worker_daemon.protocol.PRICE_UNIT`` (the CLI imports nothing of the server's packages).
PRICE_UNIT = "credits/h"


def price_text(value: Any) -> str:
    """A price with its unit, ``125 credits/h`` (``-`` when absent)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    return f"{value:g} {PRICE_UNIT}"


def credits_text(value: Any) -> str:
    """An amount of credits (the API's decimal string, to a millionth), ``19.635417 credits``, ``30 credits``;
    ``-`` when absent."""
    try:
        amount = Decimal(str(value)) if value is not None and not isinstance(value, bool) else None
    except InvalidOperation:
        amount = None
    if amount is None or not amount.is_finite():
        return "-"
    return f"{amount.normalize():f} credits" if amount else "0 credits"


def score_text(value: Any) -> str:
    """A benchmark score (samples/s) with one decimal, ``-`` when unknown."""
    return f"{value:.1f}" if isinstance(value, int | float) and not isinstance(value, bool) else "-"


def _status(value: str | None) -> str:
    value = value or "-"
    style = STATUS_STYLES.get(value)
    return f"[{style}]{value}[/]" if style else value


# --- tables -------------------------------------------------------------------------------------------------


def jobs_table(jobs: list[dict[str, Any]]) -> Table:
    """Jobs: id, name, status, rounds done/total, last loss, created."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("ID", "NAME", "STATUS", "ROUNDS", "LAST LOSS", "CREATED"):
        table.add_column(
            column, no_wrap=True, justify="right" if column in ("ROUNDS", "LAST LOSS") else "left"
        )
    for job in jobs:
        table.add_row(
            str(job.get("id", "")),
            job.get("name") or "-",
            _status(job.get("status")),
            rounds_text(job),
            loss_text(last_loss(job)),
            time_text(job.get("created_at")),
        )
    return table


def workers_table(workers: list[dict[str, Any]]) -> Table:
    """Workers: name, status, resources, executors, price floor, benchmark score (samples/s), live leases,
    last seen; its reliability and earnings for the workers in full view."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    columns = (
        "NAME",
        "STATUS",
        "CPU",
        "MEM GB",
        "GPU GB",
        "EXECUTORS",
        "FLOOR CR/H",
        "BENCH/S",
        "LEASES",
        "LAST SEEN",
    )
    # Earnings are in the full view only (the caller's own workers; staff: all): no column when none is.
    earnings = any("earnings" in worker for worker in workers)
    # So is the reputation: its reliability (0 to 1, 0.5 for a new worker; docs/architecture.md, Reputation).
    reputation = any("reputation" in worker for worker in workers)
    if reputation:
        columns = (*columns, "RELIABILITY")
    if earnings:
        columns = (*columns, "EARNED CR")
    for column in columns:
        table.add_column(
            column,
            no_wrap=True,
            justify="right"
            if column in ("CPU", "MEM GB", "GPU GB", "FLOOR CR/H", "BENCH/S", "RELIABILITY", "EARNED CR")
            else "left",
        )
    for worker in workers:
        resources = worker.get("resources") or {}
        executors = ", ".join(
            f"{executor.get('class')}/{executor.get('name')}" for executor in worker.get("executors") or []
        )
        leases = ", ".join(
            f"{lease.get('role')} ({lease.get('status')}, {price_text(lease.get('price'))})"
            for lease in worker.get("leases") or []
        )
        status = "revoked" if worker.get("revoked") else worker.get("status")
        reliability = (worker.get("reputation") or {}).get("reliability")
        reliable = (
            [f"{reliability:.3f}" if isinstance(reliability, int | float) else "-"] if reputation else []
        )
        earned = [credits_text(worker.get("earnings")).removesuffix(" credits")] if earnings else []
        table.add_row(
            worker.get("name") or "-",
            _status(status),
            number_text(resources.get("cpu")),
            number_text(resources.get("memory")),
            number_text(resources.get("gpu")),
            executors or "-",
            number_text(worker.get("price_floor")),
            score_text(worker.get("benchmark_score")),
            leases or "-",
            time_text(worker.get("last_seen_at")),
            *reliable,
            *earned,
        )
    return table


def job_summary(job: dict[str, Any]) -> str:
    """One line on how a job ended (or stands): status, rounds, first → last loss (the last one is
    ``last_loss``, as on the watch bar), eval loss, elapsed (a job that ended), reason."""
    parts = [f"job {job.get('id')} {job.get('status')}", f"rounds {rounds_text(job)}"]
    losses, current = round_losses(job), last_loss(job)
    if len(losses) > 1:
        parts.append(f"loss {losses[0]:.4f} → {current:.4f}")
    elif current is not None:
        parts.append(f"loss {current:.4f}")
    evaluation = last_eval_loss(job)
    if evaluation is not None:
        parts.append(f"eval {evaluation:.4f}")
    if job.get("ended_at") and elapsed_seconds(job) is not None:
        parts.append(f"took {duration_text(elapsed_seconds(job))}")
    if job.get("status") != "completed" and job.get("status_reason"):
        parts.append(job["status_reason"])
    return " · ".join(parts)


def _round_name(round_: dict[str, Any], total: int | None) -> str:
    return f"round {round_.get('number')}/{total if total is not None else '?'}"


def eval_pending(round_: dict[str, Any]) -> bool:
    """A closed round whose eval has not arrived yet: neither an eval loss nor the reason it has none."""
    return round_.get("eval_loss") is None and not round_.get("eval_error")


def _eval_text(round_: dict[str, Any]) -> str | None:
    if isinstance(round_.get("eval_loss"), int | float):
        return f"eval {round_['eval_loss']:.4f}"
    if round_.get("eval_error"):
        return f"no eval loss: {str(round_['eval_error'])[:120]}"
    return None


def round_line(round_: dict[str, Any], total: int | None) -> str:
    """One closed round: its number, losses, trainers and duration, and its encoding when it is lossy. The
    eval loss is left out while it has not arrived (``eval_line`` says it when it does); a round the
    parameter server could not evaluate says why."""
    participants = round_.get("participants") or []
    left_out = round_.get("left_out") or []
    evaluation = _eval_text(round_)
    line = (
        f"{_round_name(round_, total)}: loss {loss_text(round_.get('mean_loss'))} · "
        + (f"{evaluation} · " if evaluation and round_.get("eval_loss") is not None else "")
        + f"{len(participants)} trainer{'s' if len(participants) != 1 else ''}"
    )
    if left_out:
        line += f" ({len(left_out)} left out)"
    if isinstance(round_.get("duration"), int | float):
        line += f" · {round_['duration']:.1f}s"
    encoding = round_.get("encoding")
    if isinstance(encoding, str) and encoding not in ("", "float32"):
        line += f" · {encoding}"
    if evaluation and round_.get("eval_loss") is None:
        line += f" · {evaluation}"
    return line


def eval_line(round_: dict[str, Any], total: int | None) -> str:
    """A round's eval that arrived after its round line: ``round 2/6: eval 3.2000`` (or why there is none)."""
    return f"{_round_name(round_, total)}: {_eval_text(round_) or 'eval -'}"


# --- throughput (samples/s, tokens/s, peak device memory, MFU) -------------------------------------------------


def _rate_text(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 10_000 else f"{value:.1f}"


def throughput_text(facts: dict[str, Any] | None) -> str:
    """``50.0 samples/s · 6.4k tokens/s · peak 3.0 GiB · MFU 42%``: what ``facts`` has, "" when nothing."""
    facts = facts or {}
    parts = []
    for name, unit in (("samples_per_second", "samples/s"), ("tokens_per_second", "tokens/s")):
        if isinstance(facts.get(name), int | float):
            parts.append(f"{_rate_text(facts[name])} {unit}")
    if isinstance(facts.get("peak_memory_bytes"), int | float):
        parts.append(f"peak {facts['peak_memory_bytes'] / 2**30:.1f} GiB")
    if isinstance(facts.get("mfu"), int | float):
        parts.append(f"MFU {facts['mfu'] * 100:.0f}%")
    return " · ".join(parts)


def throughput_line(round_: dict[str, Any], total: int | None) -> str | None:
    """A round's throughput summed over its trainers (``round 2/6 throughput: …``), None when none reported."""
    text = throughput_text(round_.get("throughput"))
    return f"{_round_name(round_, total)} throughput: {text}" if text else None


def trainer_throughput_lines(job: dict[str, Any]) -> list[str]:
    """Each trainer's throughput in the latest round that has any: ``trainer rig-a: 40.0 samples/s · …``."""
    names = {str(task.get("worker_id")): task.get("worker") for task in job.get("tasks") or []}
    for round_ in reversed(job.get("rounds") or []):
        trainers = (round_.get("throughput") or {}).get("trainers") or {}
        if trainers:
            texts = [
                (worker, throughput_text(facts))
                for worker, facts in sorted(
                    trainers.items(), key=lambda item: str(names.get(item[0]) or item[0])
                )
            ]
            return [
                f"trainer {names.get(worker) or worker} (round {round_.get('number')}): {text}"
                for worker, text in texts
                if text
            ]
    return []
