"""Races on a job's slices, run for real: threads with their own PostgreSQL connections, released together by a
barrier.

SQLite serialises every writer of the process (IMMEDIATE transactions), so these tests would prove nothing
there; they run when DATABASE_URL names PostgreSQL.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from functools import partial

import pytest
from django.db import connection, connections

from apps.datasets import services
from apps.datasets.models import JobSlice, SliceEvent
from tests.apps.datasets.conftest import active_lease, digest

pytestmark = [
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="race tests need PostgreSQL (set DATABASE_URL): SQLite serialises all writers of a process",
    ),
    pytest.mark.django_db(transaction=True),
]

ITERATIONS = 5
SLICES = 20
LEASES = 8


def run_together(*actions: Callable[[], object]) -> list[object]:
    """Run each action in its own thread, all released at once; return each result or the exception it raised.
    (The same harness as tests/apps/leases/test_races.py.)"""
    barrier = threading.Barrier(len(actions))
    results: list[object] = [None] * len(actions)

    def run(index: int, action: Callable[[], object]) -> None:
        try:
            connection.ensure_connection()  # connect first, so the barrier releases queries, not handshakes
            barrier.wait(timeout=10)
            results[index] = action()
        except Exception as error:  # the test inspects it
            results[index] = error
        finally:
            connections.close_all()  # this thread's connection; the test database is dropped at the end

    threads = [threading.Thread(target=run, args=item) for item in enumerate(actions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a racing thread hung (deadlock?)"
    return results


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
