"""Accruals raced for real: threads with their own PostgreSQL connections, released together by a barrier. Two
lease clocks accruing the same lease, and an accrual against the lease's end, never count a period twice.

SQLite serialises every writer of the process, so these run when DATABASE_URL names PostgreSQL.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from functools import partial

from django.utils import timezone

from apps.accounting import services as accounting
from apps.accounting.models import Accrual
from apps.leases import services as lease_services
from apps.leases.models import Lease
from tests.apps.races import RACE_TEST_MARKS, run_together

ITERATIONS = 20

pytestmark = RACE_TEST_MARKS


def active_lease(worker, job) -> Lease:
    """An ACTIVE lease, activated two minutes ago at 90 credits/h (a whole-capacity lease, as in the leases' races)."""
    from tests.apps.conftest import CAPACITY

    lease = lease_services.reserve(
        worker_id=worker.pk, job=job, role="trainer", resources=CAPACITY, price=90.0
    )
    lease.activate(ttl=lease_services.lease_ttl())
    Lease.objects.filter(pk=lease.pk).update(activated_at=timezone.now() - timedelta(minutes=2))
    lease.refresh_from_db()
    return lease


def test_two_clocks_accruing_one_lease_write_one_row(job, online_rigs):
    rig_a = online_rigs[0]
    for _ in range(ITERATIONS):
        # given
        lease = active_lease(rig_a, job)
        now = timezone.now()

        # when: two lease clocks accrue it at the same instant
        accrue = partial(accounting.accrue, lease.pk, now=now)
        results = run_together(accrue, accrue)

        # then: one row, of the two minutes
        assert sorted(type(result).__name__ for result in results) == ["Accrual", "NoneType"], results
        rows = list(Accrual.objects.filter(lease=lease))
        assert len(rows) == 1
        assert rows[0].period_end == now
        lease.release(reason="next iteration")
        accounting.accrue(lease.pk)


def test_an_accrual_racing_the_leases_end_counts_its_time_once(job, online_rigs):
    rig_a = online_rigs[0]
    for _ in range(ITERATIONS):
        # given
        lease = active_lease(rig_a, job)

        # when: the lease clock accrues it as the job's owner ends it
        run_together(partial(accounting.accrue, lease.pk), partial(_release, lease))
        accounting.accrue(lease.pk)  # what a tick after the end does: nothing new

        # then: contiguous rows ending in one final row, adding up to the lease's whole cost
        lease.refresh_from_db()
        rows = list(Accrual.objects.filter(lease=lease).order_by("period_start"))
        assert [row.final for row in rows][-1] is True
        assert sum(row.final for row in rows) == 1
        assert rows[0].period_start == lease.activated_at
        assert all(a.period_end == b.period_start for a, b in zip(rows, rows[1:], strict=False))
        end = rows[-1].period_end
        assert end >= lease.ended_at
        seconds = accounting.seconds_between(lease.activated_at, end)
        assert sum((row.amount for row in rows), Decimal(0)) == accounting.lease_cost(90.0, seconds)


def _release(lease: Lease) -> None:
    """The end of a lease as the control plane does it: the transition and the final accrual in one transaction."""
    from django.db import transaction

    with transaction.atomic():
        fresh = Lease.objects.get(pk=lease.pk)
        fresh.release(reason="released by its owner")
        accounting.accrue(fresh.pk)
