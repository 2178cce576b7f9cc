"""Performance-aware sync: when should each trainer stop its round so that all of them finish together?

Pure functions, no Django: :mod:`apps.jobs.training` feeds them the trainers' rows. The idea is Hypha's
(reference §6): a round ends after about ``avg_samples_between_updates`` samples over all trainers; the
control plane keeps, per trainer, an estimate of the time between its step reports, and at each report of a
trainer still TRAINING it simulates the coming step completions of every trainer. When the simulation
covers the remaining samples within a few steps of each trainer, the reporting trainer is told how many
more steps to run (``ScheduleUpdate{counter}``); the others get their own count at their next report. Fast
trainers run more steps than slow ones, and all send their update at about the same time.

Differences from the original, each a flaw it has (reference §6.3, §9):

* The time cap is a horizon **from now**, not an absolute time since the round started (there, once a round
  ran longer than 10 s every projection was capped and trainers ran on until the counter hit 0).
* The interval estimate is an exponential moving average of the time between a trainer's reports *within*
  a round; the first report of a round (which includes the merge, or the start-up) only counts while there
  is no estimate at all.
* A trainer that has not reported yet is not simply "never": its interval is estimated from the trainers
  that have, scaled by the benchmark scores of the workers and the batch sizes (:func:`seed_intervals`), so
  heterogeneity is accounted for from the first round.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: A projection that needs a trainer to report this many more steps is too far ahead to act on (Hypha's 3:
#: an update is scheduled only when every trainer is projected to run at most two more steps).
STEPS_CAP = 3
#: ... and one whose last step is further away than this (seconds from now) too.
HORIZON = 300.0
#: Weight of a new interval in the moving estimate.
SMOOTHING = 0.3


@dataclass(frozen=True)
class Trainer:
    """One trainer as the projection sees it: when it last reported (seconds, on the caller's clock), how
    long its steps take (``None``: unknown, it never fires), and how many samples each step covers."""

    key: str
    batch_size: int
    last_report: float
    interval: float | None


@dataclass(frozen=True)
class Projection:
    """The result of :func:`project`: ``time`` is seconds from now of the last simulated step, ``to_go`` the
    samples still missing then, ``steps`` each trainer's projected further steps, and ``capped`` whether the
    simulation stopped at a cap (then it says nothing about when the round will end)."""

    time: float
    to_go: int
    steps: dict[str, int]
    capped: bool

    @property
    def reaches_target(self) -> bool:
        return self.to_go == 0 and not self.capped


def project(
    trainers: Sequence[Trainer],
    *,
    to_go: int,
    now: float,
    horizon: float = HORIZON,
    steps_cap: int = STEPS_CAP,
) -> Projection:
    """Simulate the trainers' coming step reports until ``to_go`` samples are covered (reference §6.3).

    Each trainer's next report is due at ``last_report + interval`` (or now, if that has passed), then every
    ``interval`` after; reports
    due at the same time happen together. The simulation stops, *capped*, when the next report is more than
    ``horizon`` seconds from ``now``, or when a trainer has reached ``steps_cap`` projected steps (even if the
    target was covered by the same reports).
    """
    steps = {trainer.key: 0 for trainer in trainers}
    # A trainer already overdue reports now at the earliest (its step is slower than estimated).
    due = {
        trainer.key: max(now, trainer.last_report + trainer.interval)
        for trainer in trainers
        if trainer.interval is not None and trainer.interval > 0 and math.isfinite(trainer.interval)
    }
    by_key = {trainer.key: trainer for trainer in trainers}
    time = 0.0
    capped = False
    while to_go > 0:
        if not due:
            capped = True
            break
        next_time = min(due.values())
        if next_time - now > horizon:
            capped = True
            break
        time = max(0.0, next_time - now)
        for key in [key for key, at in due.items() if at == next_time]:
            trainer = by_key[key]
            to_go = max(0, to_go - trainer.batch_size)
            steps[key] += 1
            due[key] = next_time + trainer.interval
            if steps[key] >= steps_cap:
                capped = True
        if capped:
            break
    return Projection(time=time, to_go=to_go, steps=steps, capped=capped)


def next_interval(previous: float | None, sample: float, *, first_of_round: bool) -> float | None:
    """The trainer's interval estimate after a report ``sample`` seconds after its previous one (or after the
    round started, when ``first_of_round``: such a sample includes the merge and counts only while there is
    no estimate)."""
    if not math.isfinite(sample) or sample < 0:
        return previous
    if previous is None:
        return sample
    if first_of_round:
        return previous
    return previous + SMOOTHING * (sample - previous)


def seed_intervals(
    intervals: Mapping[str, float | None],
    *,
    scores: Mapping[str, float | None],
    batch_sizes: Mapping[str, int],
) -> dict[str, float | None]:
    """Fill in the interval of trainers that have not reported yet from those that have.

    A step of trainer ``i`` is expected to take ``interval_j · (score_j / score_i) · (b_i / b_j)`` — the
    benchmark score is samples per second on a standard workload — and the median over the trainers ``j``
    with both an interval and a score is taken. Without a score for ``i``, or no such ``j``, it stays unknown.
    """
    known = [
        (intervals[key], scores.get(key), batch_sizes.get(key, 1))
        for key in intervals
        if intervals[key] is not None and _positive(scores.get(key))
    ]
    seeded: dict[str, float | None] = {}
    for key, interval in intervals.items():
        score = scores.get(key)
        if interval is not None or not known or not _positive(score):
            seeded[key] = interval
            continue
        size = max(1, batch_sizes.get(key, 1))
        seeded[key] = statistics.median(
            other_interval * (other_score / score) * (size / max(1, other_size))
            for other_interval, other_score, other_size in known
        )
    return seeded


def _positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def due_in(
    trainers: Iterable[Trainer], *, remaining_steps: Mapping[str, int | None], now: float, default: int
) -> float | None:
    """Seconds until the last of ``trainers`` is projected to finish its round's steps (``remaining_steps``;
    ``None`` means not yet scheduled: ``default`` more), or ``None`` when some interval is unknown."""
    latest = 0.0
    for trainer in trainers:
        if trainer.interval is None:
            return None
        remaining = remaining_steps.get(trainer.key)
        remaining = default if remaining is None else max(0, remaining)
        latest = max(latest, trainer.last_report + remaining * trainer.interval - now)
    return latest


def steps_before(trainers: Sequence[Trainer], *, key: str, slack: float, limit: float) -> int:
    """How many steps trainer ``key`` may run without reporting: as many as fit in the time the whole fleet
    (at its estimated rates; a trainer without an estimate counted as fast as the fastest) needs to report
    ``slack`` more samples, and in at most ``limit`` seconds. 0 when its own step time is unknown."""
    me = next((trainer for trainer in trainers if trainer.key == key), None)
    known = [trainer.interval for trainer in trainers if _positive(trainer.interval)]
    if slack <= 0 or me is None or not _positive(me.interval) or not known:
        return 0
    fastest = min(known)
    rate = sum(
        trainer.batch_size / (trainer.interval if _positive(trainer.interval) else fastest)
        for trainer in trainers
    )
    seconds = min(slack / rate, limit)
    return max(0, math.floor(seconds / me.interval))
