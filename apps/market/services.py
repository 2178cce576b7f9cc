"""Market workflows: advertising a role, taking offers, and choosing the winners.

Selection (reference §3.4, improved): offers above the advertisement's private ``max_price``, or from a worker
below the role's ``min_reliability`` (such a worker is not sent the advert either), are declined on arrival;
the rest are ranked by *price per weighted capacity* adjusted by the worker's reliability (lower wins; the
capacity counted is what the worker's benchmark supports at the fleet's rate, within the operator's cap:
:mod:`apps.market.targeting`, "Measured capacity"; the reliability: :func:`offer_score`, docs/architecture.md
"Reputation"), at most one offer per worker per advertisement (a database constraint), and the best ``wanted``
ones have their TEMPORARY leases activated; an advert's reachability policy (``any``, ``prefer``, ``require``:
:mod:`apps.market.targeting`, "Reachability") refuses or re-orders them. An advertisement settles as soon as
it has as many open offers as it wants, or when its window closes; if it is still short it re-advertises after
a bounded exponential backoff.

These functions decide and record; they tell daemons what happened (after commit) but leave the job's
status to :mod:`apps.jobs.services`, which calls them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from apps.leases import services as lease_services
from apps.leases.exceptions import CapacityExceeded, LeaseTransitionRefused
from apps.leases.models import Lease
from apps.market import targeting
from apps.market.exceptions import AdvertisementClosed, OfferRefused, UnknownAdvertisement
from apps.market.models import Advertisement, Offer
from apps.workers import services as worker_services
from apps.workers.models import RELIABILITY_PRIOR, Reachable, Worker
from worker_daemon import protocol

logger = logging.getLogger(__name__)


def offer_score(
    *, price: float, resources: protocol.Resources, share: float = 1.0, reliability: float = RELIABILITY_PRIOR
) -> float:
    """Price per weighted capacity, of which ``share`` counts (what the worker's benchmark supports:
    :func:`apps.market.targeting.supported_share`), adjusted by the worker's reliability; lower is better::

        score = price / (weighted capacity × share × reliability / RELIABILITY_PRIOR)

    A worker at the prior (a new one) scores its plain price per capacity; one at reliability 0.9 scores as if
    it were 0.9 / 0.5 = 1.8 times the capacity (docs/architecture.md, "Reputation"). An offer of no capacity
    never wins."""
    weighted = resources.weighted() * share * reliability / RELIABILITY_PRIOR
    return price / weighted if weighted > 0 else math.inf


def readvertise_delay(attempt: int) -> float:
    """Bounded exponential backoff before attempt ``attempt + 1``."""
    return min(settings.HYPHA_READVERTISE_MAX, settings.HYPHA_READVERTISE_BASE * 2 ** min(attempt, 30))


def advertisement_message(ad: Advertisement) -> protocol.Advertisement:
    window_closes_in = max(0.0, (ad.window_closes_at - timezone.now()).total_seconds())
    return protocol.Advertisement(
        advertisement_id=ad.id,
        attempt=ad.attempt,
        job_id=ad.job_id,
        role=ad.role,
        resources=ad.resources,
        devices=ad.devices,
        device_memory=ad.device_memory,
        executors=ad.executor_descriptors,
        bid=ad.bid,
        wanted=ad.wanted,
        window_closes_in=window_closes_in,
    )


def advertise(
    *,
    job,
    role: str,
    wanted: int,
    resources: protocol.Resources,
    executor: protocol.ExecutorDescriptor,
    bid: float,
    max_price: float,
    reachable: str = Advertisement.Reachability.ANY,
    devices: int = 0,
    device_memory: float = 0.0,
) -> Advertisement:
    """Open an advertisement for ``wanted`` workers of ``role`` and send it to the daemons that could take it
    (``reachable``: its reachability policy, :class:`Advertisement.Reachability`; ``devices`` of
    ``device_memory`` GB each per worker, 0: none)."""
    now = timezone.now()
    ad = Advertisement(
        job=job,
        role=role,
        wanted=wanted,
        **resources.model_dump(),
        executors=[executor.model_dump(by_alias=True)],
        bid=bid,
        max_price=max_price,
        reachable=reachable,
        devices=devices,
        device_memory=device_memory,
        window_closes_at=now + timedelta(seconds=settings.HYPHA_OFFER_WINDOW),
    )
    _choose_targets(ad, now=now)
    ad.save(force_insert=True)
    _send_attempt(ad)
    return ad


def _choose_targets(ad: Advertisement, *, now, exclude: frozenset = frozenset()) -> None:
    """Choose the connected workers (but ``exclude``) the advert's current attempt goes to
    (:mod:`apps.market.targeting`), and count them as asked; the caller saves ``targets`` and ``asked``."""
    targets = targeting.choose_targets(
        (candidate for candidate in connected_candidates(now=now) if candidate.worker_id not in exclude),
        resources=ad.resources,
        executors=ad.executor_keys(),
        bid=ad.bid,
        limit=targeting.fanout(
            wanted=ad.wanted,
            factor=settings.HYPHA_ADVERT_FANOUT,
            minimum=settings.HYPHA_ADVERT_MIN_TARGETS,
        ),
        asked=ad.asked,
        reachable=ad.reachable,
        devices=device_request(ad),
        min_reliability=min_reliability(ad),
    )
    ad.targets = [str(worker_id) for worker_id in targets]
    ad.asked = targeting.count_asked(ad.asked, targets)


def connected_candidates(*, now=None, worker_id=None) -> list[targeting.Candidate]:
    """Every connected worker with a valid token (or only ``worker_id``), with what its live leases leave free
    and its reliability (three queries: its record is joined in)."""
    now = now or timezone.now()
    workers = Worker.objects.filter(status=Worker.Status.ONLINE, token_revoked_at__isnull=True)
    if worker_id is not None:
        workers = workers.filter(pk=worker_id)
    used = lease_services.live_usage_by_worker(workers, now=now)
    held = lease_services.held_devices_by_worker(workers, now=now)
    return [
        targeting.Candidate(
            worker_id=worker.pk,
            capacity=worker.capacity,
            free=worker.capacity - used.get(worker.pk, protocol.ZERO),
            executors=frozenset(worker.executor_keys()),
            price_floor=worker.price_floor,
            strategy=worker.strategy,
            benchmark_score=worker.benchmark_score,
            reachable=worker.reachable,
            devices=tuple(worker.device_list()),
            held_devices=frozenset(held.get(worker.pk, ())),
            reliability=worker.reliability,
        )
        for worker in workers.select_related("record").only(*_CANDIDATE_FIELDS, *_RECORD_FIELDS)
    ]


#: What the market reads of a worker: its declared resources, the operator's caps, its terms and benchmark.
_CAPACITY_FIELDS = ("cpu", "memory", "storage", "gpu", *Worker.CAP_FIELDS.values(), "benchmark_score")
_CANDIDATE_FIELDS = ("id", *_CAPACITY_FIELDS, "executors", "price_floor", "strategy", "reachable", "devices")
#: What its reliability is computed from (``apps.workers.models.WorkerRecord.reliability``).
_RECORD_FIELDS = tuple(
    f"record__{name}"
    for name in (
        "updates_accepted",
        "updates_down_weighted",
        "updates_rejected",
        "leases_completed",
        "leases_lost",
        "results_lost",
    )
)


def fleet_yardstick() -> targeting.Yardstick | None:
    """The yardstick of the connected workers (:func:`apps.market.targeting.yardstick`; one query)."""
    workers = Worker.objects.filter(
        status=Worker.Status.ONLINE, token_revoked_at__isnull=True, benchmark_score__isnull=False
    ).only("id", *_CAPACITY_FIELDS)
    return targeting.yardstick((worker.capacity, worker.benchmark_score) for worker in workers)


def open_advertisements(worker: Worker) -> list[protocol.Advertisement]:
    """Adverts currently collecting offers that ``worker`` could take, for its daemon that just connected.

    Sent in the welcome, not recorded among the adverts' targets: the daemon forgets an advert once its window
    has passed, so a close it does not hear of costs nothing.
    """
    now = timezone.now()
    ads = list(
        Advertisement.objects.filter(
            status=Advertisement.Status.OPEN, next_attempt_at__isnull=True, window_closes_at__gt=now
        )
        .select_related("job")
        .order_by("created_at")[:200]
    )
    if not ads:
        return []
    found = connected_candidates(now=now, worker_id=worker.pk)
    if not found:
        return []
    candidate = found[0]
    return [
        advertisement_message(ad)
        for ad in ads
        if targeting.could_offer(
            candidate,
            resources=ad.resources,
            executors=ad.executor_keys(),
            bid=ad.bid,
            reachable=ad.reachable,
            devices=device_request(ad),
            min_reliability=min_reliability(ad),
        )
    ]


def min_reliability(ad: Advertisement) -> float:
    """The reliability a worker needs for the advert's role (its job's ``min_reliability``; 0: any)."""
    return ad.job.requirement(ad.role).min_reliability


def device_request(ad: Advertisement) -> targeting.DeviceRequest:
    return targeting.DeviceRequest(count=ad.devices, memory=ad.device_memory)


def set_wanted(ad: Advertisement, wanted: int) -> None:
    if ad.wanted != wanted:
        Advertisement.objects.filter(pk=ad.pk).update(wanted=wanted)
        ad.wanted = wanted


@dataclass
class OfferOutcome:
    offer: Offer
    #: True when the advertisement now has enough open offers to settle at once.
    ready: bool


def record_offer(*, worker: Worker, message: protocol.Offer) -> OfferOutcome:
    """Take a daemon's offer: decline it (recorded) or hold the worker with a TEMPORARY lease.

    Raises :class:`OfferRefused` (nothing recorded) when the offer cannot be considered at all: unknown or
    closed advertisement, a stale attempt, a duplicate, or resources that do not meet the advert.
    """
    with transaction.atomic():
        ad = (
            Advertisement.objects.select_for_update()
            .select_related("job")
            .filter(pk=message.advertisement_id)
            .first()
        )
        _check_open(ad, message)
        missing = ad.executor_keys() - worker.executor_keys()
        if missing:
            raise OfferRefused(f"worker does not offer executor(s) {sorted(missing)}")
        if ad.reachable == Advertisement.Reachability.REQUIRE and not targeting.is_reachable(
            worker.reachable
        ):
            raise OfferRefused(
                f"the job requires a {ad.role.replace('_', ' ')} that accepts inbound connections; this worker "
                f"declares reachable = {worker.reachable} ([parameter_server] reachable, --reachable)"
            )
        if not ad.resources.fits_within(message.resources):
            raise OfferRefused("offered resources are below the advertised minimum")
        unfit = protocol.devices_fit(
            worker.device_list(), message.devices, count=ad.devices, memory=ad.device_memory
        )
        if unfit is not None:
            raise OfferRefused(f"offered devices do not meet the advertisement: {unfit}")
        if not message.resources.fits_within(worker.resources):
            raise OfferRefused("offered resources exceed the worker's declared capacity")
        # The operator's cap: the worker is held (and ranked) for no more than it, whatever it offered.
        offered = message.resources.capped(**worker.capacity.model_dump())
        if not ad.resources.fits_within(offered):
            raise OfferRefused("the operator's cap on this worker is below the advertised minimum")
        fields = {
            "advertisement": ad,
            "worker": worker,
            "attempt": ad.attempt,
            "price": message.price,
            **offered.model_dump(),
            "score": offer_score(price=message.price, resources=offered, reliability=worker.reliability),
            "benchmark_score": message.benchmark_score,
        }
        declined = _decline_reason(ad, worker, message)
        if declined:
            now = timezone.now()
            # Recorded (it is market activity) but never held: the daemon is free at once.
            offer = Offer.objects.create(
                **fields, status=Offer.Status.DECLINED, reason=declined, expires_at=now, decided_at=now
            )
            return OfferOutcome(offer=offer, ready=False)
        try:
            with transaction.atomic():
                lease = lease_services.reserve(
                    worker_id=worker.pk,
                    job=ad.job,
                    role=ad.role,
                    resources=offered,
                    price=message.price,
                    devices=message.devices,
                )
                offer = Offer.objects.create(**fields, lease=lease, expires_at=lease.expires_at)
        except CapacityExceeded as error:
            raise OfferRefused(f"worker is leased to capacity: {error}") from None
        except IntegrityError:
            raise OfferRefused("this worker already has an open offer on the advertisement") from None
        open_offers = ad.offers.filter(status=Offer.Status.OPEN, price__lte=ad.max_price)
        if _waits_for_reachable(ad):
            open_offers = open_offers.filter(worker__reachable=Reachable.TRUE)  # targeting.is_reachable
        return OfferOutcome(offer=offer, ready=open_offers.count() >= ad.wanted)


def _decline_reason(ad: Advertisement, worker: Worker, message: protocol.Offer) -> str:
    """Why an otherwise valid offer is declined on arrival: a price above the job's private maximum, or a worker
    below the role's ``min_reliability`` (a new worker is at the prior, 0.5); "" when it is not."""
    if message.price > ad.max_price:
        return "price above what the job pays"
    minimum = min_reliability(ad)
    if worker.reliability < minimum:
        return (
            f"the worker's reliability {worker.reliability:.3f} is below the job's minimum {minimum:g} "
            "(docs/architecture.md, Reputation)"
        )
    return ""


def check_offer_window(message: protocol.Offer) -> None:
    """Refuse, without taking a lock, an offer on an advert that is no longer taking offers.

    Most offers of a busy fleet arrive after their advert filled (every free daemon answers every advert);
    refusing those with one plain read keeps them off the row locks the winners need. The check under the
    lock in :func:`record_offer` stays the authoritative one.
    """
    _check_open(
        Advertisement.objects.select_related("job").filter(pk=message.advertisement_id).first(), message
    )


def _check_open(ad: Advertisement | None, message: protocol.Offer) -> None:
    if ad is None:
        raise UnknownAdvertisement(f"no advertisement {message.advertisement_id}")
    if ad.status != Advertisement.Status.OPEN:
        raise AdvertisementClosed(f"advertisement {ad.id} is {ad.status}")
    if ad.job.is_final:
        raise AdvertisementClosed(f"job {ad.job_id} is {ad.job.status}")
    if (
        message.attempt != ad.attempt
        or ad.window_closes_at <= timezone.now()
        or ad.next_attempt_at is not None
    ):
        raise AdvertisementClosed(f"the offer window of attempt {message.attempt} is closed")


@dataclass
class Settlement:
    advertisement: Advertisement | None
    accepted: list[Offer] = field(default_factory=list)
    declined: list[Offer] = field(default_factory=list)
    filled: bool = False
    #: Seconds until the next attempt, when the window closed short.
    readvertise_in: float | None = None


def settle(advertisement_id, *, closing: bool) -> Settlement:
    """Choose winners among the advert's open offers.

    ``closing=False`` (enough offers arrived) settles only if there are at least ``wanted`` candidates;
    ``closing=True`` (the window ran out) takes what there is, declines the rest and schedules the next
    attempt if still short. Idempotent: a settled or closed advertisement is left alone.
    """
    with transaction.atomic():
        ad = Advertisement.objects.select_for_update().filter(pk=advertisement_id).first()
        if ad is None or ad.status != Advertisement.Status.OPEN or ad.next_attempt_at is not None:
            return Settlement(advertisement=ad)
        now = timezone.now()
        candidates = list(
            ad.offers.filter(
                status=Offer.Status.OPEN, lease__status=Lease.Status.TEMPORARY, lease__expires_at__gt=now
            )
            .select_related("lease", "worker", "worker__record")
            .order_by("score", "created_at")
        )
        if not closing and _settling_count(candidates, ad) < ad.wanted:
            return Settlement(advertisement=ad)
        candidates = _ranked(candidates, reachable=ad.reachable)
        result = Settlement(advertisement=ad)
        for offer in candidates:
            if len(result.accepted) < ad.wanted:
                try:
                    offer.lease.activate(ttl=lease_services.lease_ttl())
                except LeaseTransitionRefused:
                    _decide(
                        offer, Offer.Status.EXPIRED, "its temporary lease ran out before the decision", now
                    )
                    continue
                _decide(offer, Offer.Status.ACCEPTED, "", now)
                result.accepted.append(offer)
            else:
                result.declined.append(offer)
        _decline_and_release(result.declined, "another offer won", now)
        set_wanted(ad, ad.wanted - len(result.accepted))
        if ad.wanted == 0:
            _close(ad, Advertisement.Status.FILLED, "filled", now)
            result.filled = True
        elif closing:
            # Anything still open lost its window; free those workers and try again later.
            late = list(ad.offers.filter(status=Offer.Status.OPEN).select_related("lease"))
            _decline_and_release(late, "the offer window closed", now)
            result.declined.extend(late)
            delay = readvertise_delay(ad.attempt)
            ad.next_attempt_at = now + timedelta(seconds=delay)
            ad.save(update_fields=["next_attempt_at"])
            result.readvertise_in = delay
            # Daemons forget the attempt (an offer on it would only be declined); the next one is advertised.
            _send_close(ad, f"offer window closed short; next attempt in {delay:g} s")
        # Measured from now, not from the settlement's start: activate() set expires_at a little later, and a
        # daemon must never believe its lease lasts longer than the control plane does.
        granted_at = timezone.now()
        worker_services.send_to_workers(
            (
                offer.worker_id,
                protocol.LeaseGranted(
                    lease_id=offer.lease.id,
                    advertisement_id=ad.id,
                    job_id=ad.job_id,
                    role=ad.role,
                    resources=offer.lease.resources,
                    devices=offer.lease.devices,
                    price=offer.lease.price,
                    expires_in=(offer.lease.expires_at - granted_at).total_seconds(),
                ),
            )
            for offer in result.accepted
        )
    return result


def _waits_for_reachable(ad: Advertisement) -> bool:
    """Whether only reachable offers may settle ``ad`` before its window closes: under ``prefer``, when its
    attempt was sent to a worker declared reachable. An unreachable offer must not win just by coming first
    while a reachable one may still come (a window, 1 s by default); with none asked there is nothing to wait
    for."""
    return (
        ad.reachable == Advertisement.Reachability.PREFER
        and Worker.objects.filter(pk__in=ad.targets, reachable=Reachable.TRUE).exists()
    )


def _settling_count(offers: list[Offer], ad: Advertisement) -> int:
    """How many of the open ``offers`` may settle ``ad`` before its window closes (:func:`_waits_for_reachable`)."""
    if not _waits_for_reachable(ad):
        return len(offers)
    return sum(targeting.is_reachable(offer.worker.reachable) for offer in offers)


def _ranked(offers: list[Offer], *, reachable: str = Advertisement.Reachability.ANY) -> list[Offer]:
    """``offers`` best first, each re-scored with the capacity its worker's benchmark supports at the fleet's
    rate and its reliability (the score is saved with the decision), ordered under the advert's reachability
    policy ``reachable``, the better-supported first at equal ranks; see :mod:`apps.market.targeting`,
    "Measured capacity" and "Reachability"."""
    stick = fleet_yardstick()
    keyed = []
    for offer in offers:
        share = targeting.supported_share(offer.worker.capacity, offer.worker.benchmark_score, stick)
        offer.score = offer_score(
            price=offer.price, resources=offer.resources, share=share, reliability=offer.worker.reliability
        )
        rank = targeting.reachability_rank(offer.score, offer.worker.reachable, reachable)
        keyed.append(((*rank, -share, offer.created_at), offer))
    return [offer for _, offer in sorted(keyed, key=lambda item: item[0])]


def readvertise(advertisement_id) -> Advertisement | None:
    """Start the next attempt of a short advertisement whose backoff has passed."""
    with transaction.atomic():
        ad = Advertisement.objects.select_for_update().filter(pk=advertisement_id).first()
        now = timezone.now()
        if ad is None or ad.status != Advertisement.Status.OPEN or ad.next_attempt_at is None:
            return None
        if ad.next_attempt_at > now:
            return None
        ad.attempt += 1
        ad.next_attempt_at = None
        ad.window_closes_at = now + timedelta(seconds=settings.HYPHA_OFFER_WINDOW)
        # Chosen afresh from who is free now; a worker holding a lease of this advert serves the role once.
        holding = frozenset(
            ad.offers.filter(lease__status__in=Lease.LIVE, lease__expires_at__gt=now).values_list(
                "worker_id", flat=True
            )
        )
        _choose_targets(ad, now=now, exclude=holding)
        ad.save(update_fields=["attempt", "next_attempt_at", "window_closes_at", "targets", "asked"])
        _send_attempt(ad)
    return ad


def _send_attempt(ad: Advertisement) -> None:
    message = advertisement_message(ad)
    worker_services.send_to_workers((worker_id, message) for worker_id in ad.targets)


def _send_close(ad: Advertisement, reason: str) -> None:
    """Tell the daemons the current attempt went to that it takes no more offers."""
    message = protocol.AdvertisementClosed(advertisement_id=ad.id, reason=reason)
    worker_services.send_to_workers((worker_id, message) for worker_id in ad.targets)


def cancel(ad: Advertisement, *, reason: str) -> None:
    """Close an open advertisement without filling it; its open offers are declined and their workers freed."""
    with transaction.atomic():
        ad = Advertisement.objects.select_for_update().get(pk=ad.pk)
        if ad.status != Advertisement.Status.OPEN:
            return
        now = timezone.now()
        _decline_and_release(
            list(ad.offers.filter(status=Offer.Status.OPEN).select_related("lease")), reason, now
        )
        _close(ad, Advertisement.Status.CANCELLED, reason, now)


def due_windows(*, limit: int = 200) -> list:
    """Ids of open adverts whose offer window has closed and that have not settled it yet."""
    return list(
        Advertisement.objects.filter(
            status=Advertisement.Status.OPEN,
            next_attempt_at__isnull=True,
            window_closes_at__lte=timezone.now(),
        ).values_list("pk", flat=True)[:limit]
    )


def due_readvertisements(*, limit: int = 200) -> list:
    return list(
        Advertisement.objects.filter(
            status=Advertisement.Status.OPEN, next_attempt_at__lte=timezone.now()
        ).values_list("pk", flat=True)[:limit]
    )


def offer_lease_ended(lease: Lease) -> None:
    """A TEMPORARY lease ended outside a settlement (expired, or its daemon left): its offer is over."""
    now = timezone.now()
    status = Offer.Status.EXPIRED if lease.status == Lease.Status.EXPIRED else Offer.Status.DECLINED
    Offer.objects.filter(lease=lease, status=Offer.Status.OPEN).update(
        status=status, reason=(lease.status_reason or status)[:300], decided_at=now
    )


def _decide(offer: Offer, status: str, reason: str, now) -> None:
    offer.status, offer.reason, offer.decided_at = status, reason[:300], now
    offer.save(update_fields=["status", "reason", "decided_at", "score"])


def _decline_and_release(offers: list[Offer], reason: str, now) -> None:
    """Decline ``offers``, free their workers, and tell their daemons (one batch of frames after commit)."""
    for offer in offers:
        _decide(offer, Offer.Status.DECLINED, reason, now)
        lease = offer.lease
        if lease is not None and lease.is_live:
            try:
                lease.release(reason=f"offer declined: {reason}")
            except LeaseTransitionRefused:
                pass  # it expired in the meantime: the worker is free either way
    worker_services.send_to_workers(
        (
            offer.worker_id,
            protocol.OfferDeclined(
                advertisement_id=offer.advertisement_id, lease_id=offer.lease_id, reason=reason
            ),
        )
        for offer in offers
    )


def _close(ad: Advertisement, status: str, reason: str, now) -> None:
    ad.status, ad.closed_at = status, now
    ad.save(update_fields=["status", "closed_at"])
    _send_close(ad, reason)
