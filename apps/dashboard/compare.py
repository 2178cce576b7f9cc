"""Compare runs: two or more of the user's jobs side by side (``/jobs/compare/?ids=<id>,<id>``): their loss
curves overlaid, per round and per step (the page's script draws them, ``static/dashboard/compare.js``), a summary row each,
and the settings in which their specs differ."""

from __future__ import annotations

import uuid

from apps.dashboard.progress import run_progress
from apps.dashboard.snapshots import visible_jobs
from apps.jobs import metrics

#: The most jobs one comparison draws (more lines than this are unreadable anyway).
MAX_JOBS = 12
#: Points per trainer series the per-step chart draws of each job (neighbours merged pairwise down to this).
STEP_POINTS = 500


def requested_ids(values: list[str]) -> tuple[list[uuid.UUID], int]:
    """The job ids of ``?ids=a,b`` or ``?ids=a&ids=b`` in the order given, without repeats; and how many of
    the values were not ids at all."""
    ids: list[uuid.UUID] = []
    unreadable = 0
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                job_id = uuid.UUID(part)
            except ValueError:
                unreadable += 1
                continue
            if job_id not in ids:
                ids.append(job_id)
    return ids, unreadable


def _flatten(value, path: str = "") -> dict:
    if isinstance(value, dict) and value:
        flat = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{path}.{key}" if path else str(key)))
        return flat
    return {path: value}


def spec_differences(specs: list[dict]) -> list[dict]:
    """The dotted spec paths whose values differ between ``specs``, each with the values in order (``None``
    where a spec lacks the path)."""
    flats = [_flatten(spec if isinstance(spec, dict) else {}) for spec in specs]
    paths = sorted({path for flat in flats for path in flat})
    rows = []
    for path in paths:
        values = [flat.get(path) for flat in flats]
        if any(value != values[0] for value in values[1:]):
            rows.append({"path": path, "values": values})
    return rows


def comparison(user, ids: list[uuid.UUID]) -> dict:
    """The runs of ``ids`` that ``user`` may see (their own; staff any), in the order asked, and how many of
    the ids were left out (another user's or unknown: the same to the user)."""
    found = {job.pk: job for job in visible_jobs(user).filter(pk__in=ids[:MAX_JOBS])}
    jobs = [found[job_id] for job_id in ids[:MAX_JOBS] if job_id in found]
    runs = []
    for job in jobs:
        rounds = [
            {"number": number, "mean_loss": mean_loss, "eval_loss": eval_loss}
            for number, mean_loss, eval_loss in job.rounds.order_by("number").values_list(
                "number", "mean_loss", "eval_loss"
            )
        ]
        eval_losses = [entry["eval_loss"] for entry in rounds if entry["eval_loss"] is not None]
        mean_losses = [entry["mean_loss"] for entry in rounds if entry["mean_loss"] is not None]
        # The trainers' mean loss per step bucket, as GET /api/jobs/{id}/metrics/ gives it ("mean").
        per_step = metrics.job_metrics(job, max_points=STEP_POINTS)["mean"]
        runs.append(
            {
                "id": str(job.pk),
                "name": job.name or str(job.pk)[:8],
                "status": job.status,
                "rounds": rounds,
                "steps": {"step": per_step["step"], "loss": per_step["loss"]},
                "last_mean_loss": mean_losses[-1] if mean_losses else None,
                "best_eval_loss": min(eval_losses) if eval_losses else None,
                "progress": run_progress(job),
            }
        )
    return {
        "jobs": jobs,
        "runs": runs,
        "left_out": len(ids) - len(jobs),
        "differences": spec_differences([job.spec for job in jobs]),
    }
