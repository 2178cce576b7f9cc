"""Epoch accounting of a job's slices: every training slice is handed out exactly once per epoch, also when a
lease holding slices ends at an epoch boundary, and one slice is never held by two trainers at once.

The guarantee under test is stated in :mod:`apps.datasets.services` (and docs/training.md, step 6).
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest

from apps.datasets import services
from apps.datasets.models import JobSlice, SliceEvent
from tests.apps.datasets.conftest import active_lease, digest, job_slices

pytestmark = pytest.mark.django_db


def claim(job, lease) -> tuple[int, int] | None:
    """``(index, epoch)`` of the slice ``lease`` claims, or None (ask again later)."""
    claimed = services.claim_next(job, lease)
    return None if claimed is None else (claimed.slice.index, claimed.epoch)


def end(lease) -> list[tuple[int, int]]:
    """End ``lease`` (its worker went away) as the control plane does: the lease first, then its slices."""
    lease.release(reason="worker stopped")
    return [(row.slice.index, row.epoch) for row in services.release_for_lease(lease)]


def assert_consistent(job) -> None:
    """The invariants that hold at every moment: per slice, its rows are USED in epoch order and only its
    first unused row may be held (so no slice is ever held twice)."""
    rows = defaultdict(list)
    for epoch, index, status, _lease in job_slices(job):
        rows[index].append((epoch, status))
    for index, history in rows.items():
        statuses = [status for _epoch, status in history]
        unused = statuses[statuses.count("used") :]
        assert statuses[: statuses.count("used")] == ["used"] * statuses.count("used"), (index, history)
        assert "assigned" not in unused[1:], (index, history)


def assert_each_slice_once_per_epoch(job, *, training: list[int], epochs: int) -> None:
    """Epochs ``0..epochs-1`` each used every training slice exactly once, and each slice's epoch e + 1 was
    handed out only after its epoch e was used."""
    used = Counter(
        (epoch, index)
        for epoch, index, status, _lease in job_slices(job)
        if status == "used" and epoch < epochs
    )
    assert used == Counter((epoch, index) for epoch in range(epochs) for index in training)
    acknowledgements = Counter(
        SliceEvent.objects.filter(job_slice__job=job, kind="acknowledged").values_list(
            "job_slice_id", flat=True
        )
    )
    assert set(acknowledgements.values()) <= {1}
    order = defaultdict(list)
    for index, epoch, kind in (
        SliceEvent.objects.filter(job_slice__job=job)
        .order_by("pk")
        .values_list("job_slice__slice__index", "job_slice__epoch", "kind")
    ):
        order[index].append((epoch, kind))
    for index, events in order.items():
        # Between two events of a slice its epoch never goes down, and an assignment in epoch e + 1 follows
        # the acknowledgement of epoch e.
        for (epoch, kind), (next_epoch, next_kind) in zip(events, events[1:], strict=False):
            assert next_epoch >= epoch, (index, events)
            if next_epoch > epoch:
                assert (kind, next_kind) == ("acknowledged", "assigned"), (index, events)


@pytest.fixture
def five_slices(east):
    """Dataset "five-text": slices 0..4; jobs hold slice 4 out (evaluation), so 0..3 are the training slices."""
    return services.register_dataset(east, "five-text", [(index, 10, digest(index)) for index in range(5)])


def test_slices_of_a_lease_lost_at_the_epoch_boundary_are_trained_in_their_own_epoch(
    job, rig_a, rig_b, tiny_text
):
    # given: a trains slice 0 and prefetches slices 1 and 2 (claimed, not acknowledged); b finds epoch 0 handed
    # out and starts epoch 1
    services.prepare_job(job, "tiny-text")
    lease_a, lease_b = active_lease(rig_a, job), active_lease(rig_b, job)
    assert claim(job, lease_a) == (0, 0)
    services.acknowledge(job, lease_a, 0)
    assert [claim(job, lease_a), claim(job, lease_a)] == [(1, 0), (2, 0)]
    assert claim(job, lease_b) == (0, 1)
    services.acknowledge(job, lease_b, 0)

    # when: a's lease ends before it trained its prefetched slices
    assert end(lease_a) == [(1, 0), (2, 0)]

    # then: b trains them in epoch 0 first, then epoch 1 goes on
    claimed = []
    for _ in range(4):
        claimed.append(claim(job, lease_b))
        services.acknowledge(job, lease_b, claimed[-1][0])
        assert_consistent(job)
    assert claimed == [(1, 0), (2, 0), (1, 1), (2, 1)]
    assert job_slices(job) == [
        (0, 0, "used", lease_a.pk),
        (0, 1, "used", lease_b.pk),
        (0, 2, "used", lease_b.pk),
        (1, 0, "used", lease_b.pk),
        (1, 1, "used", lease_b.pk),
        (1, 2, "used", lease_b.pk),
    ]
    assert_each_slice_once_per_epoch(job, training=[0, 1, 2], epochs=2)


def test_a_slice_one_trainer_holds_is_not_handed_to_another_in_the_next_epoch(job, rig_a, rig_b, tiny_text):
    # given: a prefetched slices 1 and 2 of epoch 0 while it waits for the round to close; b used 0 twice
    services.prepare_job(job, "tiny-text")
    lease_a, lease_b = active_lease(rig_a, job), active_lease(rig_b, job)
    assert claim(job, lease_b) == (0, 0)
    services.acknowledge(job, lease_b, 0)
    assert [claim(job, lease_a), claim(job, lease_a)] == [(1, 0), (2, 0)]
    assert claim(job, lease_b) == (0, 1)
    services.acknowledge(job, lease_b, 0)

    # when: b asks for more while every other slice is held by a (a waits for its round to close, which may
    # wait for b's update)
    got = claim(job, lease_b)

    # then: b is not kept waiting on a's prefetch, nor given slices 1 or 2 while a holds them: slice 0 goes on
    # in epoch 2, and slices 1 and 2 stay behind, in order
    assert got == (0, 2)
    assert_consistent(job)
    assert job_slices(job) == [
        (0, 0, "used", lease_b.pk),
        (0, 1, "assigned", lease_a.pk),
        (0, 2, "assigned", lease_a.pk),
        (1, 0, "used", lease_b.pk),
        (1, 1, "available", None),
        (1, 2, "available", None),
        (2, 0, "assigned", lease_b.pk),
        (2, 1, "available", None),
        (2, 2, "available", None),
    ]
    assert claim(job, lease_b) is None  # b holds slice 0 of epoch 2, unacknowledged: it has data

    # when: a hands slice 1 to its executor; b acknowledges slice 0 and asks again
    services.acknowledge(job, lease_a, 1)
    services.acknowledge(job, lease_b, 0)

    # then: b gets slice 1 of epoch 1 (the lowest epoch first), a still holds slice 2 of epoch 0
    assert claim(job, lease_b) == (1, 1)
    assert_consistent(job)


def test_a_lease_never_holds_the_same_slice_twice(job, rig_a, east):
    # given: a one-slice dataset
    services.register_dataset(east, "one-text", [(0, 10, digest(0))])
    services.prepare_job(job, "one-text")
    lease = active_lease(rig_a, job)

    # when / then: the slice is handed out once per epoch, the next epoch only after the last was used
    assert claim(job, lease) == (0, 0)
    assert claim(job, lease) is None
    services.acknowledge(job, lease, 0)
    assert claim(job, lease) == (0, 1)
    assert claim(job, lease) is None
    assert job_slices(job) == [(0, 0, "used", lease.pk), (1, 0, "assigned", lease.pk)]


@pytest.mark.parametrize("holds", [3, 4])
@pytest.mark.parametrize("seed", range(3))
def test_epoch_accounting_under_lost_leases_at_the_boundaries(job, rig_a, rig_b, five_slices, seed, holds):
    """Three trainers prefetching, leases lost now and then (often while holding slices at an epoch boundary)
    and replaced: every training slice is used exactly once per epoch. A trainer holds up to ``holds``
    unacknowledged slices (a bridge's three prefetch places for small slices; one more, as a prefetched slice
    that failed its download stays claimed until the lease ends)."""
    # given
    services.prepare_job(job, "five-text", exclude=[4])
    rigs = [rig_a, rig_b, rig_a]
    leases = [active_lease(rig, job) for rig in rigs]
    held: dict[int, list[tuple[int, int]]] = {lease.pk: [] for lease in leases}
    chance = random.Random(seed)
    losses = boundary_losses = 0

    # when: trainers claim (up to ``holds`` unacknowledged) and hand their oldest slice out; a lease is lost now
    # and then, and often when it holds slices of an epoch before the newest one (at the boundary)
    for _step in range(240):
        position = chance.randrange(len(leases))
        lease = leases[position]
        at_boundary = any(epoch < services.current_epoch(job) for _index, epoch in held[lease.pk])
        action = chance.random()
        if action < (0.3 if at_boundary else 0.03):
            assert end(lease) == sorted(held[lease.pk], key=lambda claimed: (claimed[1], claimed[0]))
            losses += 1
            boundary_losses += at_boundary
            leases[position] = active_lease(rigs[position], job)
            held[leases[position].pk] = []
        elif action < 0.6 and len(held[lease.pk]) < holds:
            claimed = claim(job, lease)
            if claimed is not None:
                held[lease.pk].append(claimed)
        elif held[lease.pk]:
            services.acknowledge(job, lease, held[lease.pk].pop(0)[0])
        assert_consistent(job)

    # then: draining what is left (one trainer, every other lease ended), every epoch before the last is complete
    for lease in leases[1:]:
        end(lease)
    survivor = leases[0]
    for index, _epoch in held[survivor.pk]:
        services.acknowledge(job, survivor, index)
    last = services.current_epoch(job)
    while JobSlice.objects.filter(job=job, epoch__lte=last).exclude(status="used").exists():
        index, _epoch = claim(job, survivor)
        services.acknowledge(job, survivor, index)
        assert_consistent(job)
    assert (boundary_losses >= 2, losses >= boundary_losses, last >= 3) == (True, True, True)
    assert_each_slice_once_per_epoch(job, training=[0, 1, 2, 3], epochs=last + 1)
    assert not JobSlice.objects.filter(job=job, slice__index=4).exists()
