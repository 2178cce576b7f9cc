"""Job workflows: allocation through the market, the lease and market clocks, and what daemons say.

Tests that need the after-commit side effects (queued tasks, which run eagerly outside a server) either use
``django_capture_on_commit_callbacks(execute=True)`` or a transactional database.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.datasets import services as dataset_services
from apps.jobs import services as job_services
from apps.jobs.exceptions import JobNotCancellable
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job, JobEvent
from apps.leases import services as lease_services
from apps.leases.models import Lease, LeaseEvent
from apps.market.models import Advertisement, Offer
from apps.workers import services as worker_services
from apps.workers.exceptions import AuthenticationFailed
from apps.workers.models import Worker
from tests.apps.conftest import (
    PARAMETER_SERVER_MINIMUM,
    REQUIREMENTS,
    TRAINER_MINIMUM,
    advert,
    connect,
    market_rows,
    offer_on,
    submit_job,
)
from tests.apps.datasets.conftest import TINY_TEXT_SLICES, active_lease, job_slices
from worker_daemon import protocol

ALLOCATED = "ALLOCATED: all 3 leases active (2 of 2 trainers, 1 of 1 parameter server)"
ADVERTISED = (
    "ALLOCATING: 0 of 2 trainers, 0 of 1 parameter server leased; "
    "advertising 1 parameter server (attempt 1); advertising 2 trainers (attempt 1)"
)


def job_events(job: Job) -> list[tuple[str, str, str]]:
    return list(JobEvent.objects.filter(job=job).values_list("from_status", "to_status", "reason"))


@pytest.fixture
def allocated_job(job, online_rigs, django_capture_on_commit_callbacks) -> Job:
    """tiny-gpt, ALLOCATED: rig-a (120) and rig-b (125) train, rig-c (100) is the parameter server."""
    rig_a, rig_b, rig_c = online_rigs
    with django_capture_on_commit_callbacks(execute=True):  # the settle tasks run "after commit"
        job_services.offer_made(worker=rig_a, message=offer_on(advert(job, TRAINER), price=120.0))
        job_services.offer_made(worker=rig_b, message=offer_on(advert(job, TRAINER), price=125.0))
        job_services.offer_made(worker=rig_c, message=offer_on(advert(job, PARAMETER_SERVER), price=100.0))
    job.refresh_from_db()
    assert (job.status, job.status_reason) == (Job.Status.ALLOCATED, ALLOCATED)
    return job


def lease_of(worker: Worker) -> Lease:
    return Lease.objects.get(worker=worker, status__in=Lease.LIVE)


# --- creating and allocating -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_create_job_advertises_both_roles_after_commit(
    job_owner, django_capture_on_commit_callbacks, frozen_now, settings
):
    # when
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        job = job_services.create_job(
            owner=job_owner, name="tiny-gpt", num_trainers=3, requirements=REQUIREMENTS
        )

    # then: nothing is advertised before the commit; no worker is connected, which the reason says
    assert (job.status, job.status_reason) == (
        Job.Status.PENDING,
        "PENDING: warning: 3 of the 3 trainers cannot be served now: no connected worker fits the trainer "
        "role; the parameter server cannot be served now: no connected worker fits the parameter server role",
    )
    assert Advertisement.objects.count() == 0

    # when: the transaction commits
    with django_capture_on_commit_callbacks(execute=True):
        for callback in callbacks:
            callback()

    # then
    job.refresh_from_db()
    assert (job.status, job.status_reason) == (
        Job.Status.ALLOCATING,
        "ALLOCATING: 0 of 3 trainers, 0 of 1 parameter server leased; "
        "advertising 1 parameter server (attempt 1; no connected worker can take it); "
        "advertising 3 trainers (attempt 1; no connected worker can take it)",
    )
    ads = {
        ad["role"]: ad
        for ad in Advertisement.objects.filter(job=job).values(
            "role",
            "wanted",
            "cpu",
            "memory",
            "storage",
            "gpu",
            "executors",
            "bid",
            "max_price",
            "status",
            "attempt",
            "window_closes_at",
            "next_attempt_at",
        )
    }
    window = frozen_now + timedelta(seconds=settings.HYPHA_OFFER_WINDOW)
    assert ads == {
        TRAINER: {
            "role": TRAINER,
            "wanted": 3,
            "cpu": 4.0,
            "memory": 16.0,
            "storage": 50.0,
            "gpu": 16.0,
            "executors": [{"class": "train", "name": "diloco-transformer"}],
            "bid": 100.0,
            "max_price": 150.0,
            "status": "open",
            "attempt": 0,
            "window_closes_at": window,
            "next_attempt_at": None,
        },
        PARAMETER_SERVER: {
            "role": PARAMETER_SERVER,
            "wanted": 1,
            "cpu": 2.0,
            "memory": 8.0,
            "storage": 20.0,
            "gpu": 0.0,
            "executors": [{"class": "aggregate", "name": "parameter-server"}],
            "bid": 80.0,
            "max_price": 120.0,
            "status": "open",
            "attempt": 0,
            "window_closes_at": window,
            "next_attempt_at": None,
        },
    }


@pytest.mark.django_db
def test_allocate_is_idempotent(job):
    # given
    before = market_rows()

    # when
    job_services.allocate(job.pk)

    # then: only the job's updated_at moved (its status was refreshed to the same value)
    after = market_rows()
    for row in before["jobs"] + after["jobs"]:
        row.pop("updated_at")
    assert after == before


@pytest.mark.django_db(transaction=True)
def test_the_full_allocation_flow_ends_allocated(job_owner, rig_a, rig_b, rig_c, settings):
    # A window no loaded machine outlasts between the advert and the offers (the default 1 s did under two CPU
    # burners): the adverts settle as soon as they have enough offers, which is what this test is about.
    settings.HYPHA_OFFER_WINDOW = 10.0
    settings.HYPHA_OFFER_TTL = 30.0
    # given: three daemons said hello
    for rig in (rig_a, rig_b, rig_c):
        welcome = connect(rig)
        assert (welcome.worker_name, welcome.leases, welcome.advertisements) == (rig.name, [], [])

    # when: Ada submits tiny-gpt (allocated after commit) and the daemons offer
    job = job_services.create_job(owner=job_owner, name="tiny-gpt", num_trainers=2, requirements=REQUIREMENTS)
    trainer_ad, ps_ad = advert(job, TRAINER), advert(job, PARAMETER_SERVER)
    assert (trainer_ad.wanted, ps_ad.wanted) == (2, 1)
    replies = [
        job_services.offer_made(worker=rig_a, message=offer_on(trainer_ad, price=120.0)),
        job_services.offer_made(worker=rig_b, message=offer_on(trainer_ad, price=125.0)),
        job_services.offer_made(worker=rig_c, message=offer_on(ps_ad, price=100.0)),
    ]

    # then: every offer was held, then settled as soon as each advert had enough
    assert [type(reply) for reply in replies] == [protocol.OfferReceived] * 3
    for reply, rig in zip(replies, (rig_a, rig_b, rig_c), strict=True):
        offer = Offer.objects.get(pk=reply.offer_id)
        assert (offer.worker_id, offer.lease_id, offer.status) == (
            rig.pk,
            reply.lease_id,
            Offer.Status.ACCEPTED,
        )
        # The offer TTL (30 s here) less the time since the offer was held: generous for a loaded machine.
        assert 20.0 < reply.expires_in <= 30.0
    job.refresh_from_db()
    assert (job.status, job.status_reason) == (Job.Status.ALLOCATED, ALLOCATED)
    assert job.allocated_at is not None
    assert job_events(job) == [
        ("pending", "allocating", ADVERTISED),
        (
            "allocating",
            "allocating",
            "ALLOCATING: 2 of 2 trainers, 0 of 1 parameter server leased; advertising 1 parameter server (attempt 1)",
        ),
        ("allocating", "allocated", ALLOCATED),
    ]
    leases = sorted(Lease.objects.values_list("worker__name", "role", "status", "price"))
    assert leases == [
        ("rig-a", TRAINER, "active", 120.0),
        ("rig-b", TRAINER, "active", 125.0),
        ("rig-c", PARAMETER_SERVER, "active", 100.0),
    ]
    assert set(Advertisement.objects.values_list("status", "wanted")) == {("filled", 0)}


# --- the lease clock --------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_an_unrenewed_lease_expires_and_its_role_is_advertised_again(
    allocated_job, rig_a, django_capture_on_commit_callbacks
):
    # given: rig-a's trainer lease ran out
    lease = lease_of(rig_a)
    old_ad = advert(allocated_job, TRAINER)
    Lease.objects.filter(pk=lease.pk).update(expires_at=lease.expires_at - timedelta(seconds=11))

    # when
    with django_capture_on_commit_callbacks(execute=True):
        tick = job_services.tick_leases()

    # then
    assert (tick.expired, tick.renewals_requested) == (1, 0)
    lease.refresh_from_db()
    assert (lease.status, lease.status_reason) == (Lease.Status.EXPIRED, "not renewed before it ran out")
    assert list(LeaseEvent.objects.filter(lease=lease).values_list("kind", flat=True)) == [
        "created",
        "activated",
        "expired",
    ]
    allocated_job.refresh_from_db()
    lost = f"trainer lease on rig-a expired at {lease.ended_at:%H:%M:%S} UTC: not renewed before it ran out"
    assert (allocated_job.status, allocated_job.status_reason) == (
        Job.Status.ALLOCATING,
        f"ALLOCATING: 1 of 2 trainers, 1 of 1 parameter server leased; advertising 1 trainer (attempt 1) — {lost}",
    )
    assert job_events(allocated_job)[-2:] == [
        ("allocated", "allocating", f"ALLOCATING: 1 of 2 trainers, 1 of 1 parameter server leased — {lost}"),
        ("allocating", "allocating", allocated_job.status_reason),
    ]
    new_ad = advert(allocated_job, TRAINER)
    assert new_ad.pk != old_ad.pk
    assert (new_ad.status, new_ad.wanted, new_ad.attempt) == (Advertisement.Status.OPEN, 1, 0)
    assert Lease.objects.filter(status=Lease.Status.ACTIVE).count() == 2


@pytest.mark.django_db
def test_a_confirmed_renewal_extends_the_lease(allocated_job, rig_a, frozen_now):
    # given: a renewal was requested a second ago; two seconds are left
    lease = lease_of(rig_a)
    Lease.objects.filter(pk=lease.pk).update(
        expires_at=frozen_now + timedelta(seconds=2), renewal_requested_at=frozen_now - timedelta(seconds=1)
    )

    # when
    renewed = job_services.renewal_confirmed(worker=rig_a, lease_id=lease.pk)

    # then
    assert renewed is True
    lease.refresh_from_db()
    assert (lease.status, lease.renewals, lease.renewal_requested_at) == (Lease.Status.ACTIVE, 1, None)
    assert lease.expires_at == frozen_now + timedelta(seconds=10)


@pytest.mark.django_db
def test_a_renewal_confirmed_too_late_expires_the_lease(allocated_job, rig_a, frozen_now):
    # given
    lease = lease_of(rig_a)
    Lease.objects.filter(pk=lease.pk).update(expires_at=frozen_now - timedelta(milliseconds=1))

    # when
    found = job_services.renewal_confirmed(worker=rig_a, lease_id=lease.pk)

    # then: the lease is this worker's (no unknown-lease error), but it ended instead of being renewed
    assert found is True
    lease.refresh_from_db()
    assert (lease.status, lease.status_reason, lease.renewals) == (
        Lease.Status.EXPIRED,
        "renewal confirmed after the lease ran out",
        0,
    )
    allocated_job.refresh_from_db()
    assert allocated_job.status == Job.Status.ALLOCATING


@pytest.mark.django_db
def test_claim_due_renewals_picks_only_due_leases_of_online_workers(allocated_job, online_rigs, frozen_now):
    # given: with a 10 s TTL a lease is due once 6.7 s or less are left
    rig_a, rig_b, rig_c = online_rigs
    a, b, c = lease_of(rig_a), lease_of(rig_b), lease_of(rig_c)
    Lease.objects.filter(pk=a.pk).update(expires_at=frozen_now + timedelta(seconds=6.6))
    Lease.objects.filter(pk=b.pk).update(expires_at=frozen_now + timedelta(seconds=6.8))  # not yet
    Lease.objects.filter(pk=c.pk).update(expires_at=frozen_now + timedelta(seconds=1))
    job_services.worker_disconnected(worker=rig_c, channel_name="test.rig-c")  # due, but offline

    # when
    due = lease_services.claim_due_renewals()

    # then
    assert [lease.pk for lease in due] == [a.pk]
    assert dict(Lease.objects.values_list("pk", "renewal_requested_at")) == {
        a.pk: frozen_now,
        b.pk: None,
        c.pk: None,
    }


@pytest.mark.django_db
def test_a_renewal_request_is_repeated_after_a_quarter_ttl(allocated_job, rig_a, frozen_now):
    # given: rig-a's lease is due and was asked 2.4 s ago (a quarter TTL is 2.5 s)
    lease = lease_of(rig_a)
    Lease.objects.filter(pk=lease.pk).update(
        expires_at=frozen_now + timedelta(seconds=5), renewal_requested_at=frozen_now - timedelta(seconds=2.4)
    )

    # when / then: not asked again yet
    assert lease_services.claim_due_renewals() == []

    # when: 2.6 s ago
    Lease.objects.filter(pk=lease.pk).update(renewal_requested_at=frozen_now - timedelta(seconds=2.6))
    due = lease_services.claim_due_renewals()

    # then
    assert [item.pk for item in due] == [lease.pk]
    lease.refresh_from_db()
    assert lease.renewal_requested_at == frozen_now


@pytest.mark.django_db
def test_claim_due_renewals_ignores_temporary_and_run_out_leases(job, online_rigs, frozen_now):
    # given: a temporary lease due by its time, and an active one already past its expiry
    rig_a, rig_b, _ = online_rigs
    job_services.offer_made(worker=rig_a, message=offer_on(advert(job, TRAINER), price=120.0))
    run_out = lease_services.reserve(
        worker_id=rig_b.pk, job=job, role=TRAINER, resources=TRAINER_MINIMUM, price=120.0
    )
    run_out.activate(ttl=timedelta(seconds=10))
    Lease.objects.filter(pk=run_out.pk).update(expires_at=frozen_now)

    # when
    due = lease_services.claim_due_renewals()

    # then
    assert due == []
    assert list(Lease.objects.values_list("renewal_requested_at", flat=True)) == [None, None]


@pytest.mark.django_db
def test_tick_leases_asks_daemons_to_renew_due_leases(allocated_job, rig_a, frozen_now):
    # given
    lease = lease_of(rig_a)
    Lease.objects.filter(pk=lease.pk).update(expires_at=frozen_now + timedelta(seconds=3))

    # when
    tick = job_services.tick_leases()

    # then
    assert (tick.expired, tick.renewals_requested) == (0, 1)
    lease.refresh_from_db()
    assert (lease.status, lease.renewal_requested_at) == (Lease.Status.ACTIVE, frozen_now)


# --- the market clock ---------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_tick_market_settles_closed_windows_and_readvertises_after_the_backoff(job, rig_a, frozen_now):
    # given: one trainer offered; both windows closed
    connect(rig_a)
    job_services.offer_made(worker=rig_a, message=offer_on(advert(job, TRAINER), price=120.0))
    Advertisement.objects.update(window_closes_at=frozen_now)

    # when
    job_services.tick_market()

    # then: the trainer is taken, both roles wait for their next attempt
    job.refresh_from_db()
    again_at = (frozen_now + timedelta(seconds=1)).strftime("%H:%M:%S")
    assert job.status_reason == (
        "ALLOCATING: 1 of 2 trainers, 0 of 1 parameter server leased; "
        f"not enough offers for 1 parameter server after attempt 1 (no connected worker could take it); "
        f"re-advertising at {again_at} UTC; "
        f"not enough offers for 1 trainer after attempt 1 (no connected worker could take it); "
        f"re-advertising at {again_at} UTC"
    )
    assert Lease.objects.get().status == Lease.Status.ACTIVE

    # when: the backoff passed
    Advertisement.objects.update(next_attempt_at=frozen_now)
    job_services.tick_market()

    # then: rig-a, the only worker, holds its trainer lease
    job.refresh_from_db()
    assert job.status_reason == (
        "ALLOCATING: 1 of 2 trainers, 0 of 1 parameter server leased; "
        "advertising 1 parameter server (attempt 2; no connected worker can take it); "
        "advertising 1 trainer (attempt 2; no connected worker can take it)"
    )
    assert sorted(Advertisement.objects.values_list("role", "attempt", "wanted", "next_attempt_at")) == [
        (PARAMETER_SERVER, 1, 1, None),
        (TRAINER, 1, 1, None),
    ]


# --- what daemons say ----------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_lease_given_back_is_released_at_once(allocated_job, rig_a, django_capture_on_commit_callbacks):
    # given
    lease = lease_of(rig_a)

    # when
    with django_capture_on_commit_callbacks(execute=True):
        found = job_services.lease_given_back(worker=rig_a, lease_id=lease.pk, reason="shutting down")

    # then
    assert found is True
    lease.refresh_from_db()
    assert (lease.status, lease.status_reason) == (
        Lease.Status.RELEASED,
        "released by the worker: shutting down",
    )
    allocated_job.refresh_from_db()
    assert (allocated_job.status, allocated_job.status_reason) == (
        Job.Status.ALLOCATING,
        "ALLOCATING: 1 of 2 trainers, 1 of 1 parameter server leased; advertising 1 trainer (attempt 1) "
        f"— trainer lease on rig-a released at {lease.ended_at:%H:%M:%S} UTC: released by the worker: shutting down",
    )
    assert advert(allocated_job, TRAINER).status == Advertisement.Status.OPEN


@pytest.mark.django_db
def test_giving_back_an_ended_lease_changes_nothing(allocated_job, rig_a):
    # given
    lease = lease_of(rig_a)
    job_services.lease_given_back(worker=rig_a, lease_id=lease.pk, reason="")
    before = market_rows()

    # when
    found = job_services.lease_given_back(worker=rig_a, lease_id=lease.pk, reason="again")

    # then
    assert found is True
    assert market_rows() == before


@pytest.mark.django_db
@pytest.mark.parametrize("lease_owner", ["another worker", "nobody"])
def test_a_worker_cannot_answer_for_a_lease_it_does_not_hold(allocated_job, rig_a, rig_b, lease_owner):
    # given: rig-b speaks about rig-a's lease, or about a lease that does not exist
    lease_id = lease_of(rig_a).pk if lease_owner == "another worker" else uuid.uuid4()
    before = market_rows()

    # when
    renewed = job_services.renewal_confirmed(worker=rig_b, lease_id=lease_id)
    given_back = job_services.lease_given_back(worker=rig_b, lease_id=lease_id, reason="not mine")

    # then
    assert (renewed, given_back) == (False, False)
    assert market_rows() == before


@pytest.mark.django_db
def test_cancel_job_releases_every_lease_and_cancels_its_adverts(job, online_rigs, frozen_now):
    # given: the parameter server is leased and rig-a's trainer offer is open
    rig_a, _, rig_c = online_rigs
    job_services.offer_made(worker=rig_c, message=offer_on(advert(job, PARAMETER_SERVER), price=100.0))
    job_services.settle_advertisement(advert(job, PARAMETER_SERVER).pk, closing=False)
    job_services.offer_made(worker=rig_a, message=offer_on(advert(job, TRAINER), price=120.0))

    # when
    cancelled = job_services.cancel_job(job)

    # then
    assert (cancelled.status, cancelled.status_reason, cancelled.ended_at) == (
        Job.Status.CANCELLED,
        "CANCELLED: cancelled by its owner",
        frozen_now,
    )
    assert dict(Advertisement.objects.values_list("role", "status")) == {
        TRAINER: Advertisement.Status.CANCELLED,
        PARAMETER_SERVER: Advertisement.Status.FILLED,
    }
    assert sorted(Lease.objects.values_list("worker__name", "status", "status_reason")) == [
        ("rig-a", "released", "offer declined: job cancelled"),
        ("rig-c", "released", "job cancelled"),
    ]
    assert sorted(Offer.objects.values_list("worker__name", "status", "reason")) == [
        ("rig-a", "declined", "job cancelled"),
        ("rig-c", "accepted", ""),
    ]
    assert job_events(job)[-1] == ("allocating", "cancelled", "CANCELLED: cancelled by its owner")

    # when: cancelled again
    before = market_rows()
    with pytest.raises(JobNotCancellable):
        job_services.cancel_job(job)

    # then
    assert market_rows() == before


@pytest.mark.django_db
def test_reconnecting_keeps_the_active_leases_both_sides_hold_and_ends_the_rest(job, rig_a, frozen_now):
    # given: rig-a holds three small leases of tiny-gpt: two active, one temporary
    connect(rig_a)
    kept, forgotten, temporary = (
        lease_services.reserve(
            worker_id=rig_a.pk,
            job=job,
            role=PARAMETER_SERVER,
            resources=PARAMETER_SERVER_MINIMUM,
            price=100.0,
        )
        for _ in range(3)
    )
    kept.activate(ttl=timedelta(seconds=10))
    forgotten.activate(ttl=timedelta(seconds=10))

    # when: its daemon reconnects, holding the first active one and the temporary one
    welcome = connect(rig_a, channel_name="test.rig-a.again", leases=(kept.pk, temporary.pk))

    # then
    assert welcome == protocol.Welcome(
        worker_id=rig_a.pk,
        worker_name="rig-a",
        lease_ttl=10.0,
        offer_ttl=3.0,
        leases=[
            protocol.LeaseInfo(
                lease_id=kept.pk,
                job_id=job.pk,
                role=PARAMETER_SERVER,
                status="active",
                resources=PARAMETER_SERVER_MINIMUM,
                price=100.0,
                expires_in=10.0,
            )
        ],
        # The job's adverts are open, but rig-a offers its whole capacity and holds a lease: it cannot take them.
        advertisements=[],
    )
    reason = "the worker's daemon no longer holds it (reconnected without it)"
    assert {lease.pk: (lease.status, lease.status_reason) for lease in Lease.objects.all()} == {
        kept.pk: (Lease.Status.ACTIVE, ""),
        forgotten.pk: (Lease.Status.RELEASED, reason),
        temporary.pk: (Lease.Status.RELEASED, reason),
    }
    rig_a.refresh_from_db()
    assert (rig_a.status, rig_a.channel_name) == (Worker.Status.ONLINE, "test.rig-a.again")


@pytest.mark.django_db
def test_a_disconnect_voids_open_offers_but_keeps_active_leases(job, job_owner, rig_a):
    # given: rig-a serves tiny-gpt's parameter server and has an open offer on another job
    connect(rig_a)
    job_services.offer_made(
        worker=rig_a,
        message=offer_on(advert(job, PARAMETER_SERVER), price=100.0, resources=PARAMETER_SERVER_MINIMUM),
    )
    job_services.settle_advertisement(advert(job, PARAMETER_SERVER).pk, closing=False)
    active = lease_of(rig_a)
    other_job = submit_job(job_owner, name="other-gpt")
    job_services.offer_made(
        worker=rig_a, message=offer_on(advert(other_job, TRAINER), price=120.0, resources=TRAINER_MINIMUM)
    )
    temporary = Lease.objects.get(worker=rig_a, status=Lease.Status.TEMPORARY)
    active_before = Lease.objects.filter(pk=active.pk).values().get()

    # when
    job_services.worker_disconnected(worker=rig_a, channel_name="test.rig-a")

    # then
    reason = "the worker disconnected while its offer was open"
    temporary.refresh_from_db()
    assert (temporary.status, temporary.status_reason) == (Lease.Status.RELEASED, reason)
    assert (temporary.offer.status, temporary.offer.reason) == (Offer.Status.DECLINED, reason)
    assert Lease.objects.filter(pk=active.pk).values().get() == active_before
    rig_a.refresh_from_db()
    assert (rig_a.status, rig_a.channel_name) == (Worker.Status.OFFLINE, "")


@pytest.mark.django_db
def test_the_disconnect_of_a_superseded_connection_changes_nothing(allocated_job, rig_a):
    # given: rig-a reconnected on a new channel, holding its lease
    connect(rig_a, channel_name="test.rig-a.new", leases=(lease_of(rig_a).pk,))
    before = market_rows()

    # when: the old connection's close arrives late
    job_services.worker_disconnected(worker=rig_a, channel_name="test.rig-a")

    # then
    assert market_rows() == before


@pytest.mark.django_db
def test_revoking_a_worker_ends_its_leases_and_its_token(
    allocated_job, rig_a, django_capture_on_commit_callbacks
):
    # given
    lease = lease_of(rig_a)

    # when
    with django_capture_on_commit_callbacks(execute=True):
        job_services.revoke_worker(rig_a)

    # then
    lease.refresh_from_db()
    assert (lease.status, lease.status_reason) == (Lease.Status.RELEASED, "the worker's token was revoked")
    allocated_job.refresh_from_db()
    assert allocated_job.status == Job.Status.ALLOCATING
    with pytest.raises(AuthenticationFailed) as refused:
        worker_services.authenticate(rig_a.token)
    assert refused.value.code == protocol.CloseCode.TOKEN_REVOKED


@pytest.mark.django_db
def test_a_trainer_lease_that_expires_returns_its_unacknowledged_slices(job, rig_a, rig_b):
    # given: a prepared job whose two trainers each claimed a slice; rig-a acknowledged its own
    node, _token = dataset_services.create_data_node(name="data-east", url="https://east.example")
    dataset_services.register_dataset(node, "tiny-text", TINY_TEXT_SLICES)
    dataset_services.prepare_job(job, "tiny-text")
    lease_a, lease_b = active_lease(rig_a, job), active_lease(rig_b, job)
    dataset_services.claim_next(job, lease_a)
    dataset_services.claim_next(job, lease_b)
    dataset_services.acknowledge(job, lease_a, 0)
    Lease.objects.filter(pk=lease_b.pk).update(expires_at=timezone.now() - timedelta(seconds=1))

    # when: the lease clock expires rig-b's lease
    job_services.tick_leases()

    # then: its slice is available again; rig-a's acknowledged slice stays used
    assert job_slices(job) == [
        (0, 0, "used", lease_a.pk),
        (0, 1, "available", None),
        (0, 2, "available", None),
    ]
