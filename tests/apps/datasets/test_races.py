"""Races on a job's slices, run for real: threads with their own PostgreSQL connections, released together by a
barrier.

SQLite serialises every writer of the process (IMMEDIATE transactions), so these tests would prove nothing
there; they run when DATABASE_URL names PostgreSQL.
"""

from __future__ import annotations

from collections import Counter
from functools import partial

from apps.datasets import services
from apps.datasets.models import JobSlice, SliceEvent
from tests.apps.datasets.conftest import active_lease, digest
from tests.apps.races import RACE_TEST_MARKS, run_together

pytestmark = RACE_TEST_MARKS

ITERATIONS = 5
SLICES = 20
LEASES = 8


def claim_index(job, lease) -> tuple[int, int]:
    claimed = services.claim_next(job, lease)
    return claimed.slice.index, claimed.epoch


def test_eight_leases_claiming_at_once_never_share_a_slice(job, rig_a, east):
    # given: 20 slices and 8 active leases of the job on one rig
    services.register_dataset(east, "wide-text", [(index, 10, digest(index)) for index in range(SLICES)])
    services.prepare_job(job, "wide-text")
    leases = [active_lease(rig_a, job) for _ in range(LEASES)]
    claims: list[tuple[int, int]] = []

    for _ in range(ITERATIONS):
        # when: all eight claim together, again and again until the epoch is handed out
        results = run_together(*(partial(services.claim_next, job, lease) for lease in leases))

        # then: every claim succeeded, and no two got the same slice
        assert not [result for result in results if isinstance(result, Exception)], results
        taken = [(result.slice.index, result.epoch) for result in results if result is not None]
        claims.extend(taken)
        assert len(set(taken)) == len(taken)
        if len(claims) >= SLICES:
            break

    # then: the epoch's 20 slices went out once each, lowest indices first, then the caller is told to wait
    assert sorted(claims) == [(index, 0) for index in range(SLICES)]
    assert services.claim_next(job, leases[0]) is None
    holders = dict(JobSlice.objects.filter(job=job).values_list("slice__index", "assigned_lease_id"))
    assert set(holders) == set(range(SLICES))
    assert set(holders.values()) == {lease.pk for lease in leases}
    assignments = Counter(SliceEvent.objects.filter(kind="assigned").values_list("job_slice_id", flat=True))
    assert sorted(assignments.values()) == [1] * SLICES


def test_leases_racing_into_a_new_epoch_each_get_a_distinct_slice(job, rig_a, east):
    # given: every slice of epoch 0 used
    services.register_dataset(east, "wide-text", [(index, 10, digest(index)) for index in range(SLICES)])
    services.prepare_job(job, "wide-text")
    leases = [active_lease(rig_a, job) for _ in range(LEASES)]
    for index in range(SLICES):
        lease = leases[index % LEASES]
        services.claim_next(job, lease)
        services.acknowledge(job, lease, index)

    # when: all eight open epoch 1 at once
    results = run_together(*(partial(claim_index, job, lease) for lease in leases))

    # then: epoch 1 was created once, and its lowest eight slices went out once each
    assert not [result for result in results if isinstance(result, Exception)], results
    assert sorted(results) == [(index, 1) for index in range(LEASES)]
    assert JobSlice.objects.filter(job=job, epoch=1).count() == SLICES
    assert services.progress(job) == {
        "epoch": 1,
        "available": SLICES - LEASES,
        "assigned": LEASES,
        "used": 0,
        "total": SLICES,
    }


def test_leases_racing_at_an_epoch_boundary_never_take_a_held_slice_and_take_released_ones_first(
    job, rig_a, east
):
    # given: one lease holds slices 0..2 of epoch 0 (prefetched, unacknowledged); seven others used the rest
    services.register_dataset(east, "wide-text", [(index, 10, digest(index)) for index in range(SLICES)])
    services.prepare_job(job, "wide-text")
    holder, *others = [active_lease(rig_a, job) for _ in range(LEASES)]
    assert [claim_index(job, holder) for _ in range(3)] == [(0, 0), (1, 0), (2, 0)]
    for index in range(3, SLICES):
        lease = others[index % len(others)]
        assert claim_index(job, lease) == (index, 0)
        services.acknowledge(job, lease, index)

    # when: the seven open epoch 1 at once
    results = run_together(*(partial(claim_index, job, lease) for lease in others))

    # then: each got a distinct slice of epoch 1, none of those the holder has
    assert not [result for result in results if isinstance(result, Exception)], results
    assert sorted(results) == [(index, 1) for index in range(3, 3 + len(others))]

    # when: the holder's lease ends, and the seven claim again at once
    holder.release(reason="worker stopped")
    assert [row.slice.index for row in services.release_for_lease(holder)] == [0, 1, 2]
    results = run_together(*(partial(claim_index, job, lease) for lease in others))

    # then: the released slices go out in their own epoch first, and no slice is held twice
    assert not [result for result in results if isinstance(result, Exception)], results
    assert sorted(results) == [(0, 0), (1, 0), (2, 0), (10, 1), (11, 1), (12, 1), (13, 1)]
    held = Counter(JobSlice.objects.filter(job=job, status="assigned").values_list("slice__index", flat=True))
    assert set(held.values()) == {1}
