"""Races on the market's rows, run for real: threads with their own PostgreSQL connections, released together
by a barrier, many times over.

SQLite serialises every writer of the process (IMMEDIATE transactions), so these tests would prove nothing
there; they run when DATABASE_URL names PostgreSQL.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from functools import partial

from django.utils import timezone

from apps.jobs import services as job_services
from apps.jobs.models import TRAINER, Job
from apps.leases import services as lease_services
from apps.leases.models import Lease, LeaseClock, LeaseEvent
from apps.market import services as market
from apps.market.exceptions import OfferRefused
from apps.market.models import Advertisement, Offer
from tests.apps.conftest import CAPACITY, REQUIREMENTS, connect, offer_on
from tests.apps.races import RACE_TEST_MARKS, run_together

ITERATIONS = 20

pytestmark = RACE_TEST_MARKS


def at(instant, action: Callable[[], object]) -> Callable[[], object]:
    """``action``, started at ``instant`` rather than as soon as the barrier opens."""

    def run() -> object:
        time.sleep(max(0.0, (instant - timezone.now()).total_seconds()))
        return action()

    return run


def new_trainer_ad(job: Job, *, wanted: int) -> Advertisement:
    requirement = job.requirement(TRAINER)
    return market.advertise(
        job=job,
        role=TRAINER,
        wanted=wanted,
        resources=requirement.resources,
        executor=requirement.executor,
        bid=requirement.bid,
        max_price=requirement.max_price,
    )


def active_lease_of(worker, job: Job) -> Lease:
    """A fresh ACTIVE whole-capacity lease, as a won offer leaves it."""
    lease = lease_services.reserve(
        worker_id=worker.pk, job=job, role=TRAINER, resources=CAPACITY, price=120.0
    )
    lease.activate(ttl=lease_services.lease_ttl())
    return lease


def free(worker) -> None:
    """End whatever the worker still holds, so the next iteration starts from an idle worker."""
    for lease in lease_services.live_leases(worker.pk):
        lease.release(reason="next iteration")


def test_two_jobs_competing_for_one_worker_never_double_book_it(job_owner, online_rigs):
    # given: two jobs, and rig-a offering its whole capacity (it can hold one lease)
    rig_a = online_rigs[0]
    jobs = [
        job_services.create_job(owner=job_owner, name=name, num_trainers=1, requirements=REQUIREMENTS)
        for name in ("first-gpt", "second-gpt")
    ]

    for _ in range(ITERATIONS):
        ads = [new_trainer_ad(job, wanted=1) for job in jobs]

        # when: rig-a offers to both at the same instant
        replies = run_together(
            *(partial(job_services.offer_made, worker=rig_a, message=offer_on(ad, price=120.0)) for ad in ads)
        )

        # then: one offer holds the worker, the other is refused, and the worker has one live lease
        kinds = sorted(type(reply).__name__ for reply in replies)
        assert kinds == ["OfferReceived", "OfferRefused"], replies
        refused = next(reply for reply in replies if isinstance(reply, OfferRefused))
        assert refused.reason.startswith("worker is leased to capacity: worker rig-a holds ")
        live = list(lease_services.live_leases(rig_a.pk))
        assert len(live) == 1
        assert Offer.objects.filter(advertisement__in=ads).count() == 1
        free(rig_a)


def test_renewal_and_expiry_at_the_boundary_have_exactly_one_winner(job, online_rigs):
    # given
    rig_a = online_rigs[0]

    for iteration in range(ITERATIONS):
        lease = active_lease_of(rig_a, job)
        boundary = timezone.now() + timedelta(milliseconds=100)
        Lease.objects.filter(pk=lease.pk).update(expires_at=boundary)
        # The renewal arrives from 15 ms early to 4 ms late, the clock 1 ms after the boundary: both winners occur.
        renewal_offset = timedelta(milliseconds=iteration - 15)

        # when: the daemon's renewal and the lease clock arrive as the lease runs out
        renewed, tick = run_together(
            at(
                boundary + renewal_offset,
                partial(job_services.renewal_confirmed, worker=rig_a, lease_id=lease.pk),
            ),
            at(boundary + timedelta(milliseconds=1), job_services.tick_leases),
        )

        # then: neither raised, and the lease either was renewed and lives on, or expired and stayed expired
        assert not isinstance(renewed, Exception), renewed
        assert not isinstance(tick, Exception), tick
        lease.refresh_from_db()
        kinds = list(LeaseEvent.objects.filter(lease=lease).values_list("kind", flat=True))
        assert renewed is True  # the lease is rig_a's either way
        if lease.status == Lease.Status.ACTIVE:
            assert (lease.status, lease.renewals, kinds) == (
                Lease.Status.ACTIVE,
                1,
                ["created", "activated", "renewed"],
            )
            assert lease.expires_at > boundary
        else:
            assert (lease.status, lease.renewals, kinds) == (
                Lease.Status.EXPIRED,
                0,
                ["created", "activated", "expired"],
            )
        free(rig_a)


def test_two_settlements_of_one_advert_accept_each_offer_at_most_once(job, online_rigs, settings):
    # A window far longer than the three offers take on a loaded machine (the default 1 s closed between
    # them once, under two CPU burners): the race under test is the settlements', not the window's.
    settings.HYPHA_OFFER_WINDOW = 60.0
    settings.HYPHA_OFFER_TTL = max(settings.HYPHA_OFFER_TTL, 120.0)
    for iteration in range(ITERATIONS):
        # given: three offers for two trainers
        ad = new_trainer_ad(job, wanted=2)
        for rig, price in zip(online_rigs, (110.0, 120.0, 130.0), strict=True):
            market.record_offer(worker=rig, message=offer_on(ad, price=price))

        # when: the "enough offers" task and the window clock settle it at once
        results = run_together(
            partial(job_services.settle_advertisement, ad.pk, closing=False),
            partial(job_services.settle_advertisement, ad.pk, closing=iteration % 2 == 0),
        )

        # then
        assert results == [None, None]
        offers = Offer.objects.filter(advertisement=ad).select_related("lease", "worker")
        assert sorted((offer.worker.name, offer.status, offer.lease.status) for offer in offers) == [
            ("rig-a", Offer.Status.ACCEPTED, Lease.Status.ACTIVE),
            ("rig-b", Offer.Status.ACCEPTED, Lease.Status.ACTIVE),
            ("rig-c", Offer.Status.DECLINED, Lease.Status.RELEASED),
        ]
        activations = Counter(
            LeaseEvent.objects.filter(
                lease__offer__advertisement=ad, kind=LeaseEvent.Kind.ACTIVATED
            ).values_list("lease_id", flat=True)
        )
        assert sorted(activations.values()) == [1, 1]
        ad.refresh_from_db()
        assert (ad.status, ad.wanted) == (Advertisement.Status.FILLED, 0)
        for rig in online_rigs:
            free(rig)


def test_release_and_expiry_together_end_the_lease_once(job, online_rigs):
    # given
    rig_a = online_rigs[0]

    for _ in range(ITERATIONS):
        lease = active_lease_of(rig_a, job)
        Lease.objects.filter(pk=lease.pk).update(expires_at=timezone.now() - timedelta(milliseconds=1))

        # when: the daemon gives the run-out lease back while the clock expires it
        given_back, tick = run_together(
            partial(job_services.lease_given_back, worker=rig_a, lease_id=lease.pk, reason="stopping"),
            job_services.tick_leases,
        )

        # then: one final status, one final event
        assert given_back is True, given_back
        assert not isinstance(tick, Exception), tick
        lease.refresh_from_db()
        kinds = list(LeaseEvent.objects.filter(lease=lease).values_list("kind", flat=True))
        assert lease.status in (Lease.Status.RELEASED, Lease.Status.EXPIRED)
        assert kinds == ["created", "activated", lease.status]


def test_two_ticks_and_a_reconnect_after_a_restart_resume_the_clock_once(job, online_rigs):
    # given
    rig_a = online_rigs[0]

    for iteration in range(ITERATIONS):
        lease = active_lease_of(rig_a, job)
        # The control plane stood still for 30 s (its clock last ran then) and the lease ran out meanwhile.
        now = timezone.now()
        LeaseClock.objects.update_or_create(
            pk=LeaseClock.SINGLETON, defaults={"ticked_at": now - timedelta(seconds=30)}
        )
        Lease.objects.filter(pk=lease.pk).update(expires_at=now - timedelta(seconds=1))

        # when: two Celery workers' ticks and the daemon's hello, at the same instant
        first, second, welcome = run_together(
            job_services.tick_leases,
            job_services.tick_leases,
            partial(connect, rig_a, channel_name=f"test.rig-a.{iteration}", leases=(lease.pk,)),
        )

        # then: nothing raised; one resume extended the lease once; nothing expired; the daemon keeps it
        for result in (first, second, welcome):
            assert not isinstance(result, Exception), result
        assert (first.expired, second.expired) == (0, 0)
        lease.refresh_from_db()
        kinds = list(LeaseEvent.objects.filter(lease=lease).values_list("kind", flat=True))
        assert (lease.status, kinds) == (Lease.Status.ACTIVE, ["created", "activated", "extended"])
        assert LeaseClock.objects.get().resumptions == iteration + 1
        assert [info.lease_id for info in welcome.leases] == [lease.pk]
        free(rig_a)
