"""Which daemons an advertisement is sent to. Pure functions; the market's services feed them from the database.

Sending every advert attempt (and its close) to every connected daemon made each free daemon offer on each
attempt: with 200 daemons that was ≈ 400 frames per attempt, hundreds of offers per job almost all declined,
and the renewal requests queued behind them until leases expired under live daemons (docs/benchmarks.md,
"Fleet"). The control plane knows what a daemon would do with an advert — its hello declared its executors,
capacity, price floor and strategy, and its leases say what is free — so an attempt goes only to daemons
that would offer, and to at most :func:`fanout` of them, the ones that can offer the best price per
capacity first:

1. **Could offer** (:func:`could_offer`): the daemon's own filter (``worker_daemon.arbiter.rejection_reason``:
   every executor configured, ``bid >= floor``, the advert's resources within its capacity) and the rule
   the market checks when the offer arrives (``apps.market.services.record_offer``): what it would offer —
   its whole capacity under strategy ``whole``, the advert's resources under ``flexible`` — is free, i.e. not
   held by its live leases, TEMPORARY ones (open offers elsewhere) included. An advert asking for ``devices``
   also needs that many of the worker's devices of ``device_memory`` GB free (held by none of its live
   leases); a ``whole`` daemon then offers only those devices' share of its capacity
   (:func:`worker_daemon.protocol.device_share`), so it can hold several leases on disjoint devices.
2. **Rank**: first the daemons asked least often by the advert's earlier attempts — so an attempt that
   closed short asks others next instead of the same few again (the best-ranked daemons may be the ones
   that never win: their asking price above the job's maximum, or busy elsewhere by the time the advert
   arrives) — then by :func:`best_score`, the lowest score the daemon can offer, ``bid / weighted(offered)``
   with the capacity its benchmark supports (:func:`supported_share`; its price is at least the bid under
   either strategy; its own asking price is not known here); equal ranks in random order, so that concurrent
   adverts spread over equal daemons instead of all asking the same few.
3. **Cap** (:func:`fanout`): ``max(HYPHA_ADVERT_MIN_TARGETS, HYPHA_ADVERT_FANOUT × wanted)`` daemons;
   ``HYPHA_ADVERT_FANOUT = 0`` sends to every daemon that could offer.

A daemon left out of one attempt is not left out of the market: an attempt that closes short is advertised
again, chosen afresh from who is free then.

**Measured capacity.** What a daemon declares is bounded (``worker_daemon.protocol.MAX_DECLARED``, and the
operator's cap per worker) but not verified; its benchmark (training samples/s on a fixed workload) is
measured. The market counts declared capacity only as far as the benchmark supports it, at the fleet's rate:

* the **yardstick** ``r`` (:func:`yardstick`) is the low median, over the connected workers that have a
  benchmark, of ``weighted capacity / benchmark score`` — what a sample/s of measured speed is worth in
  capacity on this fleet. The *low* median: fewer than half of the fleet cannot raise it by declaring more
  (with two workers it is the smaller ratio);
* a worker's **supported share** (:func:`supported_share`) is ``min(1, r × score / weighted capacity)``; a
  worker without a benchmark counts as fast as the slowest measured one; with no benchmark in the fleet at
  all, declared capacity counts in full (nothing to compare with);
* offers are ranked by ``price / (weighted offered × share)``, and at equal scores (to nine significant
  digits) the better-supported offer first.

So a daemon declaring the maxima with an ordinary benchmark counts as much as an honest worker of the same
speed, and loses the tie; an honest worker whose capacity per speed is above the fleet's median counts at the
median's rate (its extra declared capacity is not what its speed shows). Declared capacity still decides what
fits (:func:`could_offer`); only the ranking is tempered.

**Reachability** (a parameter server's advert; the job's ``parameter_server.reachable``). A worker whose
parameter server trainers cannot connect to is served through the control plane's relay: every update and
result crosses twice, so the job prefers reachable ones. The advert's policy:

* ``any`` — reachability plays no part (every trainer advert);
* ``prefer`` (a job's default) — a worker not declared reachable (``false``, or ``auto``: not said) is ranked
  as if its score were :data:`UNREACHABLE_PENALTY` times its own (5 % dearer), and at equal ranks ``true``
  comes before ``auto`` before ``false``: a reachable worker wins unless another is more than 5 % cheaper per
  capacity. The offer keeps its own score; only the order changes. And when the attempt went to a reachable
  worker, only reachable offers settle the advert before its window closes (an unreachable one must not win
  by coming first: ``apps.market.services``);
* ``require`` — only workers declared reachable (:func:`is_reachable`) are asked and their offers taken.

**Reputation.** A role's ``min_reliability`` (docs/architecture.md, "Reputation") is part of "could offer": a
worker below it is not asked (the market would decline its offer on arrival), and the fleet check counts it
apart so that the job's status says why it waits (``apps.jobs.allocation``).
"""

from __future__ import annotations

import math
import random
import statistics
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from worker_daemon.protocol import Device, Resources, choose_devices, device_share


@dataclass(frozen=True, slots=True)
class Candidate:
    """A connected worker as the market sees it: what its daemon declared and what its leases leave free."""

    worker_id: uuid.UUID
    capacity: Resources
    free: Resources
    executors: frozenset[tuple[str, str]]
    price_floor: float
    strategy: str
    #: Training samples/s on the standard benchmark; None until its daemon reported one.
    benchmark_score: float | None = None
    #: What its daemon declared: "true", "false" or "auto" (``apps.workers.models.Reachable``).
    reachable: str = "auto"
    #: Its devices (GPUs) as its daemon declared them, and the indices its live leases hold.
    devices: tuple[Device, ...] = ()
    held_devices: frozenset[int] = frozenset()
    #: Its reliability (``apps.workers.models.Worker.reliability``); a new worker is at the prior, 0.5.
    reliability: float = 0.5

    def free_devices(self) -> list[Device]:
        return [device for device in self.devices if device.index not in self.held_devices]


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    """What an advert asks in devices: ``count`` per worker of at least ``memory`` GB each (0: none)."""

    count: int = 0
    memory: float = 0.0


NO_DEVICES = DeviceRequest()


@dataclass(frozen=True, slots=True)
class Yardstick:
    """What measured speed is worth in capacity on this fleet (see the module docstring)."""

    #: The low median of ``weighted capacity / benchmark score`` over the measured workers.
    capacity_per_score: float
    #: The slowest measured score: what a worker without a benchmark counts as.
    slowest_score: float


def yardstick(fleet: Iterable[tuple[Resources, float | None]]) -> Yardstick | None:
    """The yardstick of a fleet of ``(capacity, benchmark score or None)``; None when none is measured."""
    measured = [
        (capacity.weighted(), score)
        for capacity, score in fleet
        if score is not None and score > 0 and capacity.weighted() > 0
    ]
    if not measured:
        return None
    return Yardstick(
        capacity_per_score=statistics.median_low(weighted / score for weighted, score in measured),
        slowest_score=min(score for _, score in measured),
    )


def supported_share(capacity: Resources, score: float | None, stick: Yardstick | None) -> float:
    """The share, in (0, 1], of the declared ``capacity`` that the benchmark ``score`` supports at the fleet's
    rate ``stick`` (1 without a yardstick or without capacity)."""
    weighted = capacity.weighted()
    if stick is None or weighted <= 0:
        return 1.0
    measured = score if score is not None and score > 0 else stick.slowest_score
    return min(1.0, stick.capacity_per_score * measured / weighted)


def rank_key(score: float) -> float:
    """``score`` to nine significant digits: scores that differ only by float noise of the yardstick tie."""
    return float(f"{score:.9g}")


#: The advert policies of reachability (``apps.market.models.Advertisement.reachable``).
ANY, PREFER, REQUIRE = "any", "prefer", "require"
#: Under ``prefer``, the factor on the score of a worker not declared reachable when offers are ranked.
UNREACHABLE_PENALTY = 1.05
_TIERS = {"true": 0, "auto": 1, "false": 2}


def is_reachable(declared: str) -> bool:
    """Whether a worker that declared ``declared`` counts as reachable for ``require``: only ``"true"`` (an
    ``auto`` the control plane has verified would count too, once such a state exists)."""
    return declared == "true"


def reachability_rank(score: float, declared: str, policy: str) -> tuple[float, int]:
    """The first two parts of an offer's rank (lower wins) under the advert's ``policy``: its score (to nine
    digits, :func:`rank_key`), :data:`UNREACHABLE_PENALTY` times it under ``prefer`` when the worker is not
    declared reachable; then, under ``prefer``, ``true`` before ``auto`` before ``false``."""
    if policy != PREFER:
        return rank_key(score), 0
    factor = 1.0 if is_reachable(declared) else UNREACHABLE_PENALTY
    return rank_key(score * factor), _TIERS.get(declared, 1)


def offered_resources(
    candidate: Candidate, *, resources: Resources, devices: DeviceRequest = NO_DEVICES
) -> Resources:
    """What the worker's daemon would offer on an advert for ``resources`` (``worker_daemon.arbiter.offer_terms``;
    under ``whole`` with devices, their share of its capacity, at least ``resources``)."""
    if candidate.strategy != "whole":
        return resources
    chosen = choose_devices(candidate.free_devices(), count=devices.count, memory=devices.memory)
    if devices.count > 0 and chosen and candidate.devices:
        share = device_share(candidate.capacity, devices=candidate.devices, chosen=chosen)
        return resources + (share - resources)  # the component-wise maximum, as the daemon offers
    return candidate.capacity


def could_offer(
    candidate: Candidate,
    *,
    resources: Resources,
    executors: Iterable[tuple[str, str]],
    bid: float,
    reachable: str = ANY,
    devices: DeviceRequest = NO_DEVICES,
    min_reliability: float = 0.0,
) -> bool:
    """Whether the worker's daemon would offer on the advert, and the market would take the offer (under the
    advert's reachability policy ``reachable``; ``devices`` free on it; the worker at least at the role's
    ``min_reliability``)."""
    if not could_serve(
        candidate,
        resources=resources,
        executors=executors,
        bid=bid,
        reachable=reachable,
        devices=devices,
        min_reliability=min_reliability,
    ):
        return False
    if choose_devices(candidate.free_devices(), count=devices.count, memory=devices.memory) is None:
        return False
    return offered_resources(candidate, resources=resources, devices=devices).fits_within(candidate.free)


def could_serve(
    candidate: Candidate,
    *,
    resources: Resources,
    executors: Iterable[tuple[str, str]],
    bid: float,
    reachable: str = ANY,
    devices: DeviceRequest = NO_DEVICES,
    min_reliability: float = 0.0,
) -> bool:
    """Whether the worker fits the role at all — :func:`could_offer` once its leases end: the executors, the
    reachability policy, its reliability at least the role's ``min_reliability`` (the market would decline
    its offer on arrival), ``bid`` at least its floor and ``resources`` within its capacity (what it holds now
    does not count). The submission's fleet check (``apps.jobs.allocation``) counts these workers."""
    if not set(executors) <= candidate.executors:
        return False
    if candidate.reliability < min_reliability:
        return False
    if reachable == REQUIRE and not is_reachable(candidate.reachable):
        return False
    if choose_devices(candidate.devices, count=devices.count, memory=devices.memory) is None:
        return False
    return bid >= candidate.price_floor and resources.fits_within(candidate.capacity)


def best_score(
    candidate: Candidate,
    *,
    resources: Resources,
    bid: float,
    stick: Yardstick | None = None,
    devices: DeviceRequest = NO_DEVICES,
) -> float:
    """The lowest price per weighted capacity the worker can offer, its capacity counted as far as its
    benchmark supports it at the fleet's rate ``stick`` (lower wins the market)."""
    offered = offered_resources(candidate, resources=resources, devices=devices)
    weighted = offered.weighted() * share_of(candidate, stick)
    return bid / weighted if weighted > 0 else math.inf


def share_of(candidate: Candidate, stick: Yardstick | None) -> float:
    return supported_share(candidate.capacity, candidate.benchmark_score, stick)


def fanout(*, wanted: int, factor: int, minimum: int) -> int | None:
    """How many daemons an attempt for ``wanted`` workers is sent to; None when unlimited (``factor`` 0)."""
    if factor <= 0:
        return None
    return max(minimum, factor * max(wanted, 1))


def choose_targets(
    candidates: Iterable[Candidate],
    *,
    resources: Resources,
    executors: Iterable[tuple[str, str]],
    bid: float,
    limit: int | None,
    asked: Mapping[str, int] | None = None,
    rng: random.Random | None = None,
    reachable: str = ANY,
    devices: DeviceRequest = NO_DEVICES,
    min_reliability: float = 0.0,
) -> list[uuid.UUID]:
    """The workers to send an advert attempt to, best rank first (see the module docstring).

    ``asked`` counts how many earlier attempts of the advert each worker (by ``str`` of its id) was sent;
    ``reachable`` is the advert's reachability policy; a worker below the role's ``min_reliability`` is not
    asked (its offer would only be declined).
    """
    rng = rng or random.Random()
    asked = asked or {}
    executors = set(executors)
    candidates = list(candidates)
    stick = yardstick((candidate.capacity, candidate.benchmark_score) for candidate in candidates)
    ranked = sorted(
        (
            (
                asked.get(str(candidate.worker_id), 0),
                *reachability_rank(
                    best_score(candidate, resources=resources, bid=bid, stick=stick, devices=devices),
                    candidate.reachable,
                    reachable,
                ),
                -share_of(candidate, stick),
                rng.random(),
                candidate,
            )
            for candidate in candidates
            if could_offer(
                candidate,
                resources=resources,
                executors=executors,
                bid=bid,
                reachable=reachable,
                devices=devices,
                min_reliability=min_reliability,
            )
        ),
        key=lambda item: item[:5],
    )
    chosen = ranked if limit is None else ranked[:limit]
    return [candidate.worker_id for *_, candidate in chosen]


def count_asked(asked: Mapping[str, int], targets: Iterable[uuid.UUID | str]) -> dict[str, int]:
    """``asked`` after one more attempt was sent to ``targets``."""
    counted = dict(asked)
    for worker_id in targets:
        counted[str(worker_id)] = counted.get(str(worker_id), 0) + 1
    return counted
