"""Accounting from outside: leases accrue their price per hour of ACTIVE time, on a fake clock.

The clock is ``timezone.now`` patched and moved only by the test; the lease clock is the Celery task beat runs
(``apps.jobs.tasks.tick_leases``), called here directly. Figures are read back through the REST API.

    alice's job "demo": bob's worker holds its trainer lease at 90 credits/h (``leased_job``), and, where a test
    adds it, carol's worker its parameter-server lease at 25 credits/h.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from apps.accounting import services as accounting
from apps.accounting.models import Accrual
from apps.jobs import services as job_services
from apps.jobs import tasks
from apps.jobs.models import Job
from apps.leases.models import Lease
from worker_daemon import protocol


class FakeClock:
    def __init__(self) -> None:
        self.now = timezone.now()

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock(monkeypatch, settings) -> FakeClock:
    """``timezone.now`` stopped and moved by the test. Leases last a day (renewals are not what is tested) and
    a running lease accrues a row every minute of the clock."""
    settings.HYPHA_LEASE_TTL = 86_400.0
    settings.HYPHA_ACCRUAL_INTERVAL = 60.0
    fake = FakeClock()
    monkeypatch.setattr(timezone, "now", lambda: fake.now)
    return fake


def lease_server(job: Job, owner, *, price: float) -> Lease:
    """A worker of ``owner`` takes the job's parameter-server advert at ``price``: its lease is ACTIVE."""
    from apps.workers import services as worker_services

    worker, _ = worker_services.create_worker(name=f"{owner.username}-ps", owner=owner)
    worker.mark_online(
        channel_name=f"test-{owner.username}",
        resources=protocol.Resources(cpu=8, memory=32, storage=100, gpu=0),
        executors=[
            protocol.ExecutorDescriptor.model_validate({"class": "aggregate", "name": "parameter-server"})
        ],
        price_floor=1.0,
        strategy="whole",
        info={},
    )
    advertisement = job.advertisements.get(role="parameter_server")
    job_services.offer_made(
        worker=worker,
        message=protocol.Offer(
            advertisement_id=advertisement.pk,
            attempt=advertisement.attempt,
            price=price,
            resources=protocol.Resources(cpu=1, memory=2, storage=0, gpu=0),
        ),
    )
    job_services.settle_advertisement(advertisement.pk, closing=False)
    lease = Lease.objects.get(job=job, role="parameter_server", status=Lease.Status.ACTIVE)
    assert lease.price == price
    return lease


def job_cost(client, job: Job) -> str:
    response = client.get(f"/api/jobs/{job.pk}/")
    assert response.status_code == 200
    return response.json()["cost"]


def test_a_finished_jobs_cost_is_each_leases_price_times_its_active_time(clock, leased_job, alice, carol):
    # given: the trainer lease (90 credits/h, ACTIVE since now) and a parameter-server lease (25 credits/h)
    # that becomes ACTIVE 5 minutes later
    trainer = Lease.objects.get(job=leased_job, role="trainer")
    Job.objects.filter(pk=leased_job.pk).update(spec={})  # a job without a DiLoCo spec: nothing to dispatch
    clock.advance(300)
    server = lease_server(leased_job, carol.user, price=25.0)

    # when: the lease clock ticks every 7.25 s for 47 minutes and 7.5 s
    for _ in range(390):
        clock.advance(7.25)
        tasks.tick_leases()
    # and alice cancels the job
    response = alice.client.post(f"/api/jobs/{leased_job.pk}/cancel/")
    assert response.status_code == 200

    # then: each lease accrued price × ACTIVE time, and the job's cost is their sum
    trainer.refresh_from_db()
    server.refresh_from_db()
    assert trainer.ended_at - trainer.activated_at == timedelta(seconds=300 + 390 * 7.25)
    assert server.ended_at - server.activated_at == timedelta(seconds=390 * 7.25)
    trainer_cost = Decimal("90") * Decimal("3127.5") / 3600  # 78.1875
    server_cost = (Decimal("25") * Decimal("2827.5") / 3600).quantize(Decimal("0.000001"))  # 19.635417
    assert trainer_cost == Decimal("78.1875")
    assert server_cost == Decimal("19.635417")
    assert sum(row.amount for row in Accrual.objects.filter(lease=trainer)) == trainer_cost
    assert sum(row.amount for row in Accrual.objects.filter(lease=server)) == server_cost
    assert job_cost(alice.client, leased_job) == str(trainer_cost + server_cost) == "97.822917"
    # a row at the first tick (307.25 s), then one every 9 ticks (65.25 s: the first at least a minute after the
    # last row) up to 3127.5 s — 43 of them — and the final row
    assert Accrual.objects.filter(lease=trainer, final=True).count() == 1
    assert Accrual.objects.filter(lease=server, final=True).count() == 1
    assert Accrual.objects.filter(lease=trainer).count() == 1 + 43 + 1
    # the rows of a lease are contiguous periods from its activation to its end
    rows = list(Accrual.objects.filter(lease=trainer).order_by("period_start"))
    assert rows[0].period_start == trainer.activated_at
    assert rows[-1].period_end == trainer.ended_at
    assert all(a.period_end == b.period_start for a, b in zip(rows, rows[1:], strict=False))
    assert sum(row.active_seconds for row in rows) == Decimal("3127.5")


def test_repeated_ticks_and_accruals_never_count_twice(clock, leased_job, alice):
    # given: the trainer lease ran 2 minutes and the lease clock accrued it
    lease = Lease.objects.get(job=leased_job, role="trainer")
    clock.advance(120)
    tasks.tick_leases()
    assert Accrual.objects.filter(lease=lease).count() == 1

    # when: the tick repeats at the same instant, and the lease is accrued again by hand
    tasks.tick_leases()
    tasks.tick_leases()
    again = accounting.accrue(lease.pk)

    # then: nothing new
    assert again is None
    assert Accrual.objects.filter(lease=lease).count() == 1
    assert job_cost(alice.client, leased_job) == "3.000000"

    # when: the job ends, and the lease is accrued again after its final row
    job_services.cancel_job(leased_job)
    assert accounting.accrue(lease.pk) is None
    tasks.tick_leases()

    # then: exactly one final row, and the cost is unchanged (the job ended at the same instant)
    assert Accrual.objects.filter(lease=lease, final=True).count() == 1
    assert Accrual.objects.filter(lease=lease).count() == 2
    assert job_cost(alice.client, leased_job) == "3.000000"


def test_a_running_jobs_cost_is_known_between_accruals(clock, leased_job, alice):
    # given: the trainer lease ran 90 s; the lease clock accrued at 60 s only
    clock.advance(60)
    tasks.tick_leases()
    clock.advance(30)

    # when / then: the cost is exact to the instant: 90 credits/h × 90 s
    assert job_cost(alice.client, leased_job) == "2.250000"
    assert sum(row.amount for row in Accrual.objects.filter(job=leased_job)) == Decimal("1.5")


def test_a_temporary_lease_costs_nothing(clock, alices_job, bobs_worker, alice):
    # given: bob's worker holds a TEMPORARY lease on the job (an open offer)
    from apps.leases import services as lease_services

    lease = lease_services.reserve(
        worker_id=bobs_worker.pk,
        job=alices_job,
        role="trainer",
        resources=protocol.Resources(cpu=1, memory=4, storage=0, gpu=8),
        price=90.0,
    )

    # when: time passes and the clock runs, and then the job is cancelled
    clock.advance(300)
    tasks.tick_leases()
    job_services.cancel_job(alices_job)

    # then: no accrual, no cost
    lease.refresh_from_db()
    assert lease.status in (Lease.Status.RELEASED, Lease.Status.EXPIRED)
    assert not Accrual.objects.filter(lease=lease).exists()
    assert job_cost(alice.client, alices_job) == "0.000000"


def test_an_expired_lease_accrues_until_the_clock_expired_it(clock, leased_job, alice, settings):
    # given: the trainer lease runs out after its TTL without a renewal
    lease = Lease.objects.get(job=leased_job, role="trainer")
    Lease.objects.filter(pk=lease.pk).update(expires_at=clock.now + timedelta(seconds=100))

    # when: the lease clock runs past its expiry
    clock.advance(100.5)
    tasks.tick_leases()

    # then: it accrued its ACTIVE time, activation to expiry (the clock's tick), in one final row
    lease.refresh_from_db()
    assert lease.status == Lease.Status.EXPIRED
    rows = list(Accrual.objects.filter(lease=lease))
    assert [(row.final, row.active_seconds, row.amount) for row in rows] == [
        (True, Decimal("100.5"), Decimal("2.5125"))
    ]
