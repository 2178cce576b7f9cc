"""A job's progress as the job page shows it: a bar over rounds and steps, elapsed time, an ETA while it runs,
and its end time and duration once it ended. Computed here, from the rows, so that the page's first render, the
websocket's snapshot and every live event (``apps.dashboard.live``) carry the same numbers.

The fraction done counts closed rounds and, within the round in progress, the trainers' mean share of its inner
steps: ``(rounds_done + mean(min(steps_in_round, inner_steps) / inner_steps)) / update_rounds``. The ETA is a
straight line through it: the elapsed training time × (1 − fraction) / fraction. Training starts when the
job's first task was dispatched; a job that never got that far has no elapsed time and no ETA.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import Min
from django.utils import timezone

from apps.jobs.models import TRAINER, Job, Task


def _rounds_spec(job: Job) -> dict:
    rounds = job.spec.get("rounds") if isinstance(job.spec, dict) else None
    return rounds if isinstance(rounds, dict) else {}


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def run_progress(job: Job, *, now: datetime | None = None) -> dict:
    """The job's progress (docs/dashboard.md, "Progress"): counts, the fraction done, and its times.

    ``fraction`` is ``None`` when the spec gives no round count; a COMPLETED job is 1.0. Times are datetimes,
    durations whole seconds (floats rounded to 0.1 s)."""
    # An inference job counts slices with a stored result, not rounds (apps/dashboard/inference.py).
    if job.kind == Job.Kind.INFERENCE:
        from apps.dashboard.inference import inference_progress

        return inference_progress(job, now=now)
    now = now or timezone.now()
    rounds_spec = _rounds_spec(job)
    rounds_total = _positive_int(rounds_spec.get("update_rounds"))
    inner_steps = _positive_int(rounds_spec.get("inner_steps"))
    rounds_done = job.rounds.filter(closed=True).count()
    if rounds_total is not None:
        rounds_done = min(rounds_done, rounds_total)
    trainers = list(
        Task.objects.filter(job=job, role=TRAINER, status__in=Task.LIVE).values_list(
            "steps_in_round", flat=True
        )
    )
    in_round = 0.0
    if inner_steps and trainers and not job.is_final:
        in_round = sum(min(steps, inner_steps) / inner_steps for steps in trainers) / len(trainers)
    fraction = None
    if job.status == Job.Status.COMPLETED:
        fraction = 1.0
    elif rounds_total is not None:
        fraction = min(1.0, (rounds_done + in_round) / rounds_total)
    steps_total = rounds_total * inner_steps if rounds_total and inner_steps else None
    steps_done = None
    if inner_steps:
        # Whole steps done (floored; the epsilon keeps 2.9999… from a float sum at 3).
        steps_done = int((rounds_done + in_round) * inner_steps + 1e-9)
        if steps_total is not None:
            steps_done = steps_total if job.status == Job.Status.COMPLETED else min(steps_done, steps_total)

    started_at = Task.objects.filter(job=job).aggregate(first=Min("dispatched_at"))["first"]
    until = job.ended_at if job.is_final and job.ended_at else now
    elapsed = max(0.0, (until - started_at).total_seconds()) if started_at else None
    eta = eta_at = None
    running = job.status == Job.Status.RUNNING
    if running and elapsed and fraction and 0 < fraction < 1:
        eta = elapsed * (1 - fraction) / fraction
        eta_at = now + timedelta(seconds=eta)
    ended_at = job.ended_at if job.is_final else None
    progress = {
        "rounds_done": rounds_done,
        "rounds_total": rounds_total,
        "steps_done": steps_done,
        "steps_total": steps_total,
        "fraction": None if fraction is None else round(fraction, 4),
        "started_at": started_at,
        "elapsed": None if elapsed is None else round(elapsed, 1),
        "eta": None if eta is None else round(eta, 1),
        "eta_at": eta_at,
        "ended_at": ended_at,
        # From submission to its end: the queue for workers included.
        "duration": round((ended_at - job.created_at).total_seconds(), 1) if ended_at else None,
        "final": job.is_final,
        "status": job.status,
    }
    progress["percent"] = None if fraction is None else int(fraction * 100)
    progress["text"] = summary(progress)
    return progress


def format_seconds(seconds: float) -> str:
    """``3725`` → ``"1 h 02 m"``, ``245`` → ``"4 m 05 s"``, ``12.4`` → ``"12 s"``."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} m"
    if minutes:
        return f"{minutes} m {seconds:02d} s"
    return f"{seconds} s"


def _clock(moment: datetime) -> str:
    return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M:%S %Z")


def summary(progress: dict) -> str:
    """The one line under the job page's bar, e.g. "round 1 of 3 done · step 75 of 150 · 50% · elapsed
    1 m 40 s · ETA 1 m 40 s (2026-11-26 14:05:00 UTC)"."""
    parts = []
    if progress["rounds_total"]:
        parts.append(f"round {progress['rounds_done']} of {progress['rounds_total']} done")
    if progress["steps_total"]:
        parts.append(f"step {progress['steps_done']} of {progress['steps_total']}")
    if progress["percent"] is not None:
        parts.append(f"{progress['percent']}%")
    if progress["final"]:
        if progress["ended_at"]:
            parts.append(f"{progress['status']} at {_clock(progress['ended_at'])}")
        if progress["elapsed"] is not None:
            parts.append(f"trained {format_seconds(progress['elapsed'])}")
        if progress["duration"] is not None:
            parts.append(f"{format_seconds(progress['duration'])} from submission to end")
    elif progress["elapsed"] is None:
        parts.append("not started: waiting for its workers")
    else:
        parts.append(f"elapsed {format_seconds(progress['elapsed'])}")
        if progress["eta"] is not None:
            parts.append(f"ETA {format_seconds(progress['eta'])} ({_clock(progress['eta_at'])})")
    return " · ".join(parts)
