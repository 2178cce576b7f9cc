"""The arbiter: which advertisements a worker offers on, in which order, at what price. Pure functions.

Rules (the original's arbiter, reference §3.3, with one deliberate change):

1. **Filter.** An advertisement is dropped unless every executor it lists (class + name) is configured on
   this worker, its ``bid >= floor``, and its resources fit within the worker's capacity component-wise.
   (The original only dropped requests *strictly greater* than capacity, so incomparable vectors passed
   and then failed the reservation; ``fits_within`` drops them up front with the same end result.)
   Ours: an advertisement asking for ``devices`` is dropped unless that many of the worker's *free* devices
   (those no lease or reservation holds) have at least ``device_memory`` GB each.
2. **Score.** ``bid / weighted(resources)`` with the weights of :data:`protocol.RESOURCE_WEIGHTS`, i.e. the
   price per unit of capacity; 0 when the weighted size is 0.
3. **Order.** Highest score first; equal scores in random order (``tie_breaker``). Daemons that see the
   same adverts then spread over them instead of all offering on the first one and, all but the winners,
   being declined before they try the next (measured in docs/benchmarks.md: it halves the offers per job).
4. **Terms.** Strategy ``whole``: offer all configured resources at ``max(price, bid)``. Strategy
   ``flexible``: offer exactly the advertised resources at ``bid``. Under both, devices are offered exactly as
   many as asked (:func:`protocol.choose_devices`: the smallest free ones that fit), so one daemon can hold
   several leases on disjoint devices; ``whole`` then offers the devices' share of the other resources
   (``k`` of ``n`` devices: ``k/n`` of the cores, memory and storage, and the chosen devices' VRAM), not all.

Whether the offered resources are actually free is the lease book's business, not the arbiter's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from worker_daemon.protocol import Advertisement, Device, Resources, choose_devices, device_share

Strategy = Literal["whole", "flexible"]


@dataclass(frozen=True, slots=True)
class PlannedOffer:
    """An offer the arbiter would make: on ``advertisement``, ``resources`` at ``price``."""

    advertisement: Advertisement
    score: float
    price: float
    resources: Resources
    devices: tuple[int, ...] = ()


def rejection_reason(
    advertisement: Advertisement,
    *,
    executors: Collection[tuple[str, str]],
    floor: float,
    capacity: Resources,
    free_devices: Sequence[Device] = (),
) -> str | None:
    """Why this worker does not offer on ``advertisement``, or ``None`` if it passes the filter.

    ``executors`` are the configured executors as ``(class, name)`` pairs; ``free_devices`` the worker's
    devices that no lease or reservation holds.
    """
    missing = [
        f"{descriptor.executor_class}/{descriptor.name}"
        for descriptor in advertisement.executors
        if descriptor.key() not in executors
    ]
    if missing:
        return f"executor not configured: {', '.join(missing)}"
    if advertisement.bid < floor:
        return f"bid {advertisement.bid:g} is below the floor {floor:g}"
    if not advertisement.resources.fits_within(capacity):
        return "needs more resources than this worker has"
    if choose_devices(free_devices, count=advertisement.devices, memory=advertisement.device_memory) is None:
        return (
            f"needs {advertisement.devices} free devices of {advertisement.device_memory:g} GB; "
            f"this worker has {len(free_devices)} free"
        )
    return None


def score(advertisement: Advertisement) -> float:
    """The bid per weighted unit of the requested resources; 0 when they weigh nothing."""
    weighted = advertisement.resources.weighted()
    if weighted <= 0:
        return 0.0
    return advertisement.bid / weighted


def offer_terms(
    advertisement: Advertisement, *, strategy: Strategy, capacity: Resources, price: float
) -> tuple[float, Resources]:
    """The ``(price, resources)`` to offer on ``advertisement`` under ``strategy``."""
    if strategy == "whole":
        return max(price, advertisement.bid), capacity
    return advertisement.bid, advertisement.resources


def plan_offers(
    advertisements: Iterable[Advertisement],
    *,
    executors: Collection[tuple[str, str]],
    capacity: Resources,
    floor: float,
    price: float,
    strategy: Strategy,
    free_devices: Sequence[Device] = (),
    devices: Sequence[Device] = (),
    tie_breaker: Callable[[], float] | None = None,
) -> list[PlannedOffer]:
    """The offers to try, best score first, for the advertisements that pass the filter.

    ``devices`` are all the worker's devices, ``free_devices`` those no lease or reservation holds.
    Equal scores are ordered by ``tie_breaker()`` (default :func:`random.random`); pass ``lambda: 0.0`` to
    keep arrival order.
    """
    tie_breaker = tie_breaker or random.random
    planned = []
    for advertisement in advertisements:
        reason = rejection_reason(
            advertisement, executors=executors, floor=floor, capacity=capacity, free_devices=free_devices
        )
        if reason is not None:
            continue
        chosen = choose_devices(free_devices, count=advertisement.devices, memory=advertisement.device_memory)
        offer_price, offer_resources = offer_terms(
            advertisement, strategy=strategy, capacity=capacity, price=price
        )
        if strategy == "whole" and chosen and devices:
            # Never less than the advertisement's minimum (``a + (b - a)`` is the component-wise maximum).
            share = device_share(capacity, devices=devices, chosen=chosen)
            offer_resources = advertisement.resources + (share - advertisement.resources)
        planned.append(
            PlannedOffer(
                advertisement=advertisement,
                score=score(advertisement),
                price=offer_price,
                resources=offer_resources,
                devices=tuple(chosen or ()),
            )
        )
    keyed = [(-offer.score, tie_breaker(), offer) for offer in planned]
    # sorted() is stable, so a constant tie_breaker keeps arrival order.
    return [offer for *_, offer in sorted(keyed, key=lambda item: (item[0], item[1]))]
