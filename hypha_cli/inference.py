"""What the CLI knows of batch inference jobs (docs/inference.md): which endpoint a spec file goes to, and the
progress of a running job (slices done of total, and an ETA) for ``hypha watch`` and ``hypha show``.

The kind of a spec is read from the file itself, so one ``hypha submit FILE`` serves both kinds: a TOML job
table with ``type = "inference"``, or a JSON spec with a ``task`` (only an inference spec has one; a DiLoCo
spec with one is refused by the server anyway). The server checks everything else.
"""

from __future__ import annotations

import tomllib
from datetime import UTC, datetime
from typing import Any

from hypha_cli import output

TRAINING = "training"
INFERENCE = "inference"
#: The endpoint each kind of spec is submitted to.
ENDPOINTS = {TRAINING: "/api/jobs/diloco/", INFERENCE: "/api/jobs/inference/"}


def toml_kind(raw: bytes) -> str:
    """The kind of a TOML spec: its job table's (``[scheduler.job]``, ``[job]`` or the document's) ``type``.
    A TOML this cannot read is left to the server, which names the mistake (as training)."""
    try:
        document = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        return TRAINING
    scheduler = document.get("scheduler")
    tables = [
        scheduler.get("job") if isinstance(scheduler, dict) else None,
        document.get("job"),
        document,
    ]
    for table in tables:
        if isinstance(table, dict) and table.get("type") == INFERENCE:
            return INFERENCE
    return TRAINING


def json_kind(spec: dict[str, Any]) -> str:
    """The kind of a JSON spec: inference when it has a ``task``."""
    return INFERENCE if "task" in spec else TRAINING


def is_inference(job: dict[str, Any]) -> bool:
    return job.get("kind") == INFERENCE


def slices(job: dict[str, Any]) -> tuple[int, int] | None:
    """``(slices done, slices total)`` of an inference job's detail; None when it has no progress yet."""
    progress = job.get("progress")
    if not isinstance(progress, dict):
        return None
    done, total = progress.get("slices_done"), progress.get("slices_total")
    if not isinstance(done, int) or not isinstance(total, int):
        return None
    return done, total


def eta_seconds(job: dict[str, Any], *, now: datetime | None = None) -> float | None:
    """Seconds until the last slice is done at the rate so far: slices done since the job was allocated (its
    workers leased; else created) over the time since. None before the first slice and after the job ended.
    The server's own estimate (``progress.eta_seconds``) wins when it sends one."""
    counts = slices(job)
    if counts is None or job.get("status") in output.FINAL_STATUSES:
        return None
    server = (job.get("progress") or {}).get("eta_seconds")
    if isinstance(server, int | float) and server >= 0:
        return float(server)
    done, total = counts
    if done <= 0:
        return None
    if done >= total:
        return 0.0
    started = _timestamp(job.get("allocated_at")) or _timestamp(job.get("created_at"))
    if started is None:
        return None
    elapsed = ((now or datetime.now(UTC)) - started).total_seconds()
    if elapsed <= 0:
        return None
    return (total - done) * elapsed / done


def slices_text(job: dict[str, Any]) -> str:
    """``slices done/total`` (``slices -/-`` before the job has any)."""
    counts = slices(job)
    return f"slices {counts[0]}/{counts[1]}" if counts else "slices -/-"


def progress_line(job: dict[str, Any], *, now: datetime | None = None) -> str:
    """``slices 3/8 · ETA 0:01:10`` (the ETA while it can be told), for watch's lines and ``hypha show``."""
    eta = eta_seconds(job, now=now)
    parts = [slices_text(job)]
    if eta is not None:
        parts.append(f"ETA {output.duration_text(eta)}")
    return " · ".join(parts)


def summary(job: dict[str, Any]) -> str:
    """One line on how an inference job ended (or stands): status, slices, elapsed, reason, and where the
    results are."""
    parts = [f"job {job.get('id')} {job.get('status')}", slices_text(job)]
    if job.get("ended_at") and output.elapsed_seconds(job) is not None:
        parts.append(f"took {output.duration_text(output.elapsed_seconds(job))}")
    if job.get("status") != "completed" and job.get("status_reason"):
        parts.append(job["status_reason"])
    counts = slices(job)
    if counts and counts[0]:
        parts.append(f"results: hypha results {job.get('id')}")
    return " · ".join(parts)


def _timestamp(text: Any) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
