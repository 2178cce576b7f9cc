"""What the steps a daemon answered itself said: a bounded summary sent with the next forwarded step report.

A trainer's daemon answers most step reports ``Continue`` itself (the control plane's ``continue_for``); the
next report it forwards stands for all of them (``covered_steps``). So that the job's per-step charts still see
those steps, it also carries ``covered_points``: the steps' values in at most :data:`MAX_POINTS` buckets, oldest
first — ``{"steps", "loss", "loss_min", "loss_max", "lr", "seconds", "samples", "tokens", "age"}`` (``loss``
the mean of the bucket's losses; ``seconds`` its summed ``step_time``; ``age`` seconds from the bucket's last
step to the forwarding; a value no step reported is left out). When the buckets run out, neighbours merge
pairwise and each bucket holds twice the steps, so a report stays small however long the grant
(``apps.jobs.metrics`` on the control plane reads it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

#: At most this many buckets per forwarded report (the control plane ignores a longer summary).
MAX_POINTS = 64


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _merge(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One bucket for two neighbours (``second`` the later)."""
    merged = {
        "steps": first["steps"] + second["steps"],
        "loss_steps": first["loss_steps"] + second["loss_steps"],
        "loss_sum": first["loss_sum"] + second["loss_sum"],
        "seconds": first["seconds"] + second["seconds"],
        "samples": first["samples"] + second["samples"],
        "tokens": None
        if first["tokens"] is None or second["tokens"] is None
        else first["tokens"] + second["tokens"],
        "lr": second["lr"] if second["lr"] is not None else first["lr"],
        "at": second["at"],
    }
    lows = [value for value in (first["loss_min"], second["loss_min"]) if value is not None]
    highs = [value for value in (first["loss_max"], second["loss_max"]) if value is not None]
    merged["loss_min"] = min(lows) if lows else None
    merged["loss_max"] = max(highs) if highs else None
    return merged


class StepSummary:
    """The steps answered since the last forwarded report, bucketed (see the module's docstring)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.buckets: list[dict[str, Any]] = []
        #: Steps per bucket: doubles each time the buckets are merged.
        self.stride = 1

    def add(self, status: dict[str, Any], *, batch_size: int) -> None:
        """One step answered here (``status``: the step report's ``{"status": …}`` body)."""
        loss = _finite(status.get("loss"))
        seconds = _finite(status.get("step_time"))
        tokens = status.get("tokens")
        bucket = {
            "steps": 1,
            "loss_steps": 0 if loss is None else 1,
            "loss_sum": loss or 0.0,
            "loss_min": loss,
            "loss_max": loss,
            "seconds": seconds if seconds is not None and seconds >= 0 else 0.0,
            "samples": batch_size,
            "tokens": tokens
            if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0
            else None,
            "lr": _finite(status.get("lr")),
            "at": self.clock(),
        }
        if self.buckets and self.buckets[-1]["steps"] < self.stride:
            self.buckets[-1] = _merge(self.buckets[-1], bucket)
        else:
            self.buckets.append(bucket)
        if len(self.buckets) > MAX_POINTS:
            pairs = [_merge(*self.buckets[index : index + 2]) for index in range(0, len(self.buckets) - 1, 2)]
            self.buckets = pairs + (self.buckets[-1:] if len(self.buckets) % 2 else [])
            self.stride *= 2

    def take(self) -> list[dict[str, Any]]:
        """The buckets as sent (oldest first), and forget them."""
        now = self.clock()
        points = []
        for bucket in self.buckets:
            point: dict[str, Any] = {
                "steps": bucket["steps"],
                "seconds": round(bucket["seconds"], 6),
                "samples": bucket["samples"],
                "age": round(max(0.0, now - bucket["at"]), 3),
            }
            if bucket["loss_steps"]:
                point.update(
                    loss=bucket["loss_sum"] / bucket["loss_steps"],
                    loss_min=bucket["loss_min"],
                    loss_max=bucket["loss_max"],
                )
            if bucket["lr"] is not None:
                point["lr"] = bucket["lr"]
            if bucket["tokens"] is not None:
                point["tokens"] = bucket["tokens"]
            points.append(point)
        self.clear()
        return points

    def clear(self) -> None:
        self.buckets = []
        self.stride = 1
