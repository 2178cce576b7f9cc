"""Throughput and device facts of a job's trainers, per round and per job: read from ``Round.trainer_metrics``.

A trainer reports each round's metrics (``{"metrics": {"round": N, "metrics": {…}}}``); besides ``loss``,
``samples``, ``samples_per_second`` and ``train_seconds`` it may send:

* ``tokens``: tokens it trained on in the round (token models only);
* ``tokens_per_second``: the same over its train time (else derived here as ``tokens / train_seconds``);
* ``peak_memory_bytes``: ``torch.cuda.max_memory_allocated()`` over the round (CUDA only; absent on CPU);
* ``mfu``: model FLOPs utilisation, ``6 × parameters × tokens/s ÷ the device's peak FLOPS`` (absent when the
  device's peak is unknown).

:func:`cleaned` drops hostile values of these (negative, or an MFU above 1) before they are stored; the rest
are pure functions of a round's stored metrics, computed on read. No migration: all lives in the JSON field.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: Throughput keys a trainer may report, with the largest value believed (inclusive).
BOUNDS = {
    "samples_per_second": 1e12,
    "tokens": 1e15,
    "tokens_per_second": 1e12,
    "peak_memory_bytes": 1e15,
    "mfu": 1.0,
}
#: The per-trainer fields of a round's throughput, in the order they are shown.
FIELDS = ("samples_per_second", "tokens_per_second", "peak_memory_bytes", "mfu")


def cleaned(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` (finite numbers already) without out-of-bounds throughput values: a negative rate, memory or
    MFU, or one beyond :data:`BOUNDS`, is left out rather than believed."""
    return {
        name: value for name, value in metrics.items() if name not in BOUNDS or 0 <= value <= BOUNDS[name]
    }


def of_trainer(metrics: Any) -> dict[str, float]:
    """One trainer's throughput in one round: the :data:`FIELDS` it has (tokens/s derived when it sent only
    ``tokens`` and ``train_seconds``)."""
    if not isinstance(metrics, dict):
        return {}
    found = {name: float(metrics[name]) for name in FIELDS if _number(metrics.get(name))}
    tokens, seconds = metrics.get("tokens"), metrics.get("train_seconds")
    if "tokens_per_second" not in found and _number(tokens) and _number(seconds) and seconds > 0:
        found["tokens_per_second"] = float(tokens) / float(seconds)
    return found


def of_round(trainer_metrics: Any) -> dict[str, Any]:
    """A round's throughput: per trainer (by worker id) and the totals (rates summed over its trainers, the
    highest peak memory, the mean MFU); a total is None when no trainer reported it."""
    trainers = {
        str(worker): found
        for worker, metrics in (trainer_metrics.items() if isinstance(trainer_metrics, dict) else [])
        if (found := of_trainer(metrics))
    }
    return {"trainers": trainers, **_totals(trainers.values())}


def of_job(rounds: Iterable[Any]) -> dict[str, Any]:
    """A job's throughput over its rounds (``Round`` rows in order, or their ``trainer_metrics``): the total
    rates of the latest closed round with any (the open round's, while none closed has: an open round may have
    heard from only some of its trainers yet), the highest peak memory and the mean MFU over all rounds."""
    latest: dict[str, Any] = {}
    latest_open: dict[str, Any] = {}
    peaks: list[float] = []
    mfus: list[float] = []
    for round_ in rounds:
        metrics = getattr(round_, "trainer_metrics", round_)
        current = of_round(metrics)
        if current["trainers"]:
            if getattr(round_, "closed", True):
                latest = current
            else:
                latest_open = current
        for found in current["trainers"].values():
            if "peak_memory_bytes" in found:
                peaks.append(found["peak_memory_bytes"])
            if "mfu" in found:
                mfus.append(found["mfu"])
    latest = latest or latest_open
    return {
        "samples_per_second": latest.get("samples_per_second"),
        "tokens_per_second": latest.get("tokens_per_second"),
        "peak_memory_bytes": max(peaks) if peaks else None,
        "mfu": sum(mfus) / len(mfus) if mfus else None,
    }


def _totals(trainers: Iterable[dict[str, float]]) -> dict[str, float | None]:
    entries = list(trainers)

    def values(name: str) -> list[float]:
        return [entry[name] for entry in entries if name in entry]

    samples, tokens = values("samples_per_second"), values("tokens_per_second")
    peaks, mfus = values("peak_memory_bytes"), values("mfu")
    return {
        "samples_per_second": sum(samples) if samples else None,
        "tokens_per_second": sum(tokens) if tokens else None,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "mfu": sum(mfus) / len(mfus) if mfus else None,
    }


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
