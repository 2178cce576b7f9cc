"""Per-step training metrics: one bounded series per trainer task, kept as packed binary points.

A point is a bucket of consecutive steps (``count`` of them, ending at ``step``): the Unix time of its last
step (the control plane's clock), the count-weighted mean, minimum and maximum of the steps' losses, the
learning rate, and the training throughput (samples and tokens per second of step time). Missing values are
NaN in storage and ``null`` in the API.

Bounded like TensorBoard's and W&B's histories, but deterministic: a series holds at most
``HYPHA_METRICS_MAX_POINTS`` points. Appended points merge into the last one while it covers fewer than
``stride`` steps; when the series passes the bound, neighbours merge pairwise and ``stride`` doubles. The
resolution stays uniform (the newest points are as coarse as the oldest, give or take one bucket) and a
series never passes ``POINT.size * HYPHA_METRICS_MAX_POINTS`` bytes, however many steps the job runs.

Written by :func:`record_step_report` from the sync protocol (``apps.jobs.training.status``), inside the
transaction that counted the steps (the task row is locked there, so two reports of one trainer never race):
one UPDATE per forwarded report, of the series' tail (its newest points, at most :data:`TAIL_POINTS`); the
body (the rest) is rewritten once per :data:`TAIL_POINTS` points, and when the series is merged.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from typing import Any

from django.conf import settings

from apps.jobs import throughput
from apps.jobs.models import MetricSeries, Task

#: step (uint32), time (float64), count (uint32), loss, loss_min, loss_max, lr, samples/s, tokens/s (float32).
POINT = struct.Struct("<IdIffffff")
FIELDS = (
    "step",
    "time",
    "count",
    "loss",
    "loss_min",
    "loss_max",
    "lr",
    "samples_per_second",
    "tokens_per_second",
)
MAX_STEP = 2**32 - 1
_FLOAT32_MAX = 3.4e38
#: A daemon's summary of the steps it answered itself: at most this many points per forwarded report.
MAX_COVERED_POINTS = 64
#: Points a series' tail holds before they are moved into its body (40 bytes each: the tail is what a step
#: report writes).
TAIL_POINTS = 128
#: ``covered_points`` ages beyond this (seconds) are not believed: such a point is timed as the report.
MAX_AGE = 86_400.0
NAN = math.nan

Point = tuple  # (step, time, count, loss, loss_min, loss_max, lr, samples_per_second, tokens_per_second)


def _value(value: Any, *, signed: bool = False) -> float:
    """A storable float32 value, or NaN: not a number, not finite, beyond float32, or negative (unless
    ``signed``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return NAN
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        return NAN
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX or (value < 0 and not signed):
        return NAN
    return value


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def unpack(blob: bytes | memoryview | None) -> list[Point]:
    data = bytes(blob or b"")
    usable = len(data) - len(data) % POINT.size  # a torn blob (never written so) loses its tail, not the rest
    return list(POINT.iter_unpack(data[:usable]))


def pack(points: Iterable[Point]) -> bytes:
    return b"".join(POINT.pack(*point) for point in points)


def _mean(pairs: Sequence[tuple[float, int]]) -> float:
    """The count-weighted mean of the values that are not NaN (NaN when none is)."""
    total = weight = 0
    for value, count in pairs:
        if not math.isnan(value):
            total += value * count
            weight += count
    return total / weight if weight else NAN


def merge(first: Point, second: Point) -> Point:
    """One point for two neighbouring buckets (``second`` the later): its step and time, summed counts,
    count-weighted means, the minimum of the minima and the maximum of the maxima."""
    count = first[2] + second[2]
    weights = (max(first[2], 1), max(second[2], 1))

    def mean(index: int) -> float:
        return _mean([(first[index], weights[0]), (second[index], weights[1])])

    minima = [value for value in (first[4], second[4]) if not math.isnan(value)]
    maxima = [value for value in (first[5], second[5]) if not math.isnan(value)]
    return (
        second[0],
        second[1],
        min(count, MAX_STEP),
        mean(3),
        min(minima) if minima else NAN,
        max(maxima) if maxima else NAN,
        mean(6),
        mean(7),
        mean(8),
    )


def halve(points: list[Point]) -> list[Point]:
    """Neighbours merged pairwise (an odd last point stays as it is)."""
    merged = [merge(points[index], points[index + 1]) for index in range(0, len(points) - 1, 2)]
    if len(points) % 2:
        merged.append(points[-1])
    return merged


def append(points: list[Point], new: Iterable[Point], *, stride: int, max_points: int) -> tuple[list, int]:
    """``points`` with ``new`` appended (each merged into the last point while that covers fewer than
    ``stride`` steps), halved as often as needed to hold at most ``max_points``; and the new stride."""
    for point in new:
        if points and point[0] <= points[-1][0]:
            continue  # steps only grow: a point behind the series would fold it back on itself
        if points and points[-1][2] + point[2] <= stride:
            points[-1] = merge(points[-1], point)
        else:
            points.append(point)
        points, stride = bounded(points, stride=stride, max_points=max_points)
    return points, stride


def bounded(points: list[Point], *, stride: int, max_points: int) -> tuple[list, int]:
    """``points`` halved as often as needed to hold at most ``max_points``, and the stride that makes."""
    while len(points) > max(1, max_points):
        points = halve(points)
        stride *= 2
    return points, stride


# --- the sync protocol's side -------------------------------------------------------------------------------


def report_points(body: dict, *, first_step: int, last_step: int, now: float) -> list[Point]:
    """The points one forwarded step report stands for: steps ``first_step`` … ``last_step`` (as the control
    plane counted them). The report's own values (``loss``, ``lr``, ``step_time``, ``batch_size``, ``tokens``)
    are the last step's; the daemon's ``covered_points`` (the steps it answered itself, oldest first:
    ``{"steps", "loss", "loss_min", "loss_max", "lr", "seconds", "samples", "tokens", "age"}``) are those
    before it. A summary that claims more steps than were counted, or is not a list of such objects, is
    dropped whole: the report's own point then stands for all the steps."""
    if last_step < first_step or last_step > MAX_STEP:
        return []
    points: list[Point] = []
    summary = body.get("covered_points")
    if isinstance(summary, list) and 0 < len(summary) <= MAX_COVERED_POINTS:
        step = first_step - 1
        for entry in summary:
            steps = _count(entry.get("steps")) if isinstance(entry, dict) else None
            if not steps or step + steps >= last_step:
                points = []  # garbage, or more steps than counted: believe none of it
                break
            step += steps
            seconds = _value(entry.get("seconds"))
            samples, tokens = _count(entry.get("samples")), _count(entry.get("tokens"))
            age = _value(entry.get("age"))
            loss = _value(entry.get("loss"), signed=True)
            low, high = _value(entry.get("loss_min"), signed=True), _value(entry.get("loss_max"), signed=True)
            if math.isnan(loss) or math.isnan(low) or math.isnan(high) or not low <= loss <= high:
                low = high = loss
            points.append(
                (
                    step,
                    now - age if not math.isnan(age) and age <= MAX_AGE else now,
                    steps,
                    loss,
                    low,
                    high,
                    _value(entry.get("lr")),
                    _rate(samples, seconds),
                    _rate(tokens, seconds),
                )
            )
    covered = last_step - (points[-1][0] if points else first_step - 1)
    step_time = _value(body.get("step_time"))
    loss = _value(body.get("loss"), signed=True)
    points.append(
        (
            last_step,
            now,
            covered,
            loss,
            loss,
            loss,
            _value(body.get("lr")),
            _rate(_count(body.get("batch_size")), step_time),
            _rate(_count(body.get("tokens")), step_time),
        )
    )
    return points


def _rate(amount: int | None, seconds: float) -> float:
    if amount is None or math.isnan(seconds) or seconds <= 0:
        return NAN
    try:
        return _value(amount / seconds)
    except OverflowError:  # an int beyond any float, from a hostile report
        return NAN


def record_step_report(task: Task, body: dict, *, first_step: int, last_step: int, now: float) -> None:
    """Append a counted step report to ``task``'s series (the caller holds the task's row lock)."""
    new = report_points(body, first_step=first_step, last_step=last_step, now=now)
    if not new:
        return
    series, _ = MetricSeries.objects.get_or_create(
        task=task, defaults={"job_id": task.job_id, "worker_id": str(task.lease.worker_id)}
    )
    # The body is unpacked only when it is rewritten: per report, its length and last step are all it takes.
    body_blob, tail = bytes(series.points or b""), unpack(series.tail)
    body_length = len(body_blob) // POINT.size
    if tail:
        last = tail[-1][0]
    elif body_length:
        last = POINT.unpack_from(body_blob, (body_length - 1) * POINT.size)[0]
    else:
        last = 0
    # New points go to the tail (merged there while its last bucket has room), and only the tail is written
    # (at most TAIL_POINTS points): the body is rewritten when the tail is full, or when the series passed its
    # bound and is merged pairwise as a whole.
    tail, _ = append(
        tail, [point for point in new if point[0] > last], stride=series.stride, max_points=1 << 62
    )
    steps = max(series.steps, last_step)
    update = MetricSeries.objects.filter(pk=series.pk).update
    if body_length + len(tail) > settings.HYPHA_METRICS_MAX_POINTS:
        points, stride = bounded(
            unpack(body_blob) + tail, stride=series.stride, max_points=settings.HYPHA_METRICS_MAX_POINTS
        )
        update(points=pack(points), tail=b"", stride=stride, steps=steps)
    elif len(tail) >= TAIL_POINTS:
        update(points=body_blob[: body_length * POINT.size] + pack(tail), tail=b"", steps=steps)
    else:
        update(tail=pack(tail), steps=steps)


def stored_points(series: MetricSeries) -> list[Point]:
    """A series' points, oldest first (its body, then its tail)."""
    return unpack(series.points) + unpack(series.tail)


# --- the read side ------------------------------------------------------------------------------------------


def _json(value: float) -> float | None:
    return None if math.isnan(value) else value


def columns(points: list[Point]) -> dict[str, list]:
    """The points as one list per field (``null`` for NaN)."""
    return {
        name: [point[index] if index in (0, 2) else _json(point[index]) for point in points]
        for index, name in enumerate(FIELDS)
    }


def mean_loss(series: list[tuple[list[Point], int]]) -> dict[str, list]:
    """The trainers' mean loss per step bucket: buckets as wide as the coarsest series' stride, each
    trainer's count-weighted loss in it, then the mean over the trainers that have one."""
    width = max((stride for _, stride in series), default=1)
    buckets: dict[int, list[float]] = {}
    for points, _ in series:
        own: dict[int, list[tuple[float, int]]] = {}
        for point in points:
            key = -(-point[0] // width) * width  # the bucket's last step
            own.setdefault(key, []).append((point[3], max(point[2], 1)))
        for key, pairs in own.items():
            loss = _mean(pairs)
            if not math.isnan(loss):
                buckets.setdefault(key, []).append(loss)
    steps = sorted(buckets)
    return {
        "step": steps,
        "loss": [sum(buckets[step]) / len(buckets[step]) for step in steps],
        "trainers": [len(buckets[step]) for step in steps],
    }


def job_metrics(job, *, trainer: str | None = None, max_points: int | None = None) -> dict[str, Any]:
    """What ``GET /api/jobs/{id}/metrics/`` answers (docs/dashboard.md)."""
    rows = (
        MetricSeries.objects.filter(job=job)
        .select_related("task__lease__worker")
        .order_by("task__dispatched_at", "id")
    )
    if trainer:
        rows = [row for row in rows if trainer in (str(row.task_id), row.worker_id)]
    shown = []
    trainers = []
    for row in rows:
        points = stored_points(row)
        stride = row.stride
        if max_points is not None:
            points, stride = bounded(points, stride=stride, max_points=max_points)
        shown.append((points, stride))
        worker = row.task.lease.worker if row.task.lease_id else None
        trainers.append(
            {
                "task": str(row.task_id),
                "worker_id": row.worker_id,
                "worker": worker.name if worker is not None else row.worker_id,
                "stride": stride,
                "steps": row.steps,
                "points": columns(points),
            }
        )
    rounds = [
        {
            "number": round_.number,
            "closed": round_.closed,
            "closed_at": round_.closed_at,
            "mean_loss": round_.mean_loss,
            "eval_loss": round_.eval_loss,
            "bytes_in": round_.bytes_in,
            "bytes_out": round_.bytes_out,
            "samples": round_.samples,
            "duration": round_.duration,
            "throughput": throughput.of_round(round_.trainer_metrics),
        }
        for round_ in job.rounds.order_by("number")
    ]
    return {
        "job": str(job.pk),
        "status": job.status,
        "final": job.is_final,
        "max_points": settings.HYPHA_METRICS_MAX_POINTS,
        "trainers": trainers,
        "mean": mean_loss(shown),
        "rounds": rounds,
    }
