"""The job slice state machine: every allowed transition records its event; every refused one raises and leaves
the rows and the event log exactly as they were."""

from __future__ import annotations

import pytest

from apps.datasets.exceptions import SliceTransitionRefused
from apps.datasets.models import JobSlice, SliceEvent
from tests.apps.datasets.conftest import snapshot

pytestmark = pytest.mark.django_db


def slice_of(job, index: int, epoch: int = 0) -> JobSlice:
    return JobSlice.objects.get(job=job, epoch=epoch, slice__index=index)


def events_of(job_slice: JobSlice) -> list[tuple]:
    return list(
        SliceEvent.objects.filter(job_slice=job_slice).values_list(
            "kind", "from_status", "to_status", "lease_id", "detail"
        )
    )


def state_of(job_slice: JobSlice) -> tuple:
    row = JobSlice.objects.get(pk=job_slice.pk)
    return row.status, row.assigned_lease_id, row.assigned_at, row.used_at


# --- allowed transitions ------------------------------------------------------------------------------------


def test_prepared_slices_start_available_with_no_events(prepared_job):
    # then
    first = slice_of(prepared_job, 0)
    assert state_of(first) == ("available", None, None, None)
    assert SliceEvent.objects.count() == 0


def test_assign_gives_an_available_slice_to_the_lease(prepared_job, lease_a, frozen_now):
    # given
    job_slice = slice_of(prepared_job, 0)

    # when
    job_slice.assign(lease_a)

    # then
    assert job_slice.status == "assigned"
    assert state_of(job_slice) == ("assigned", lease_a.pk, frozen_now, None)
    assert events_of(job_slice) == [("assigned", "available", "assigned", lease_a.pk, "")]


def test_ack_by_the_assigned_lease_marks_the_slice_used(prepared_job, lease_a, frozen_now):
    # given
    job_slice = slice_of(prepared_job, 1)
    job_slice.assign(lease_a)

    # when
    job_slice.ack(lease_a)

    # then
    assert state_of(job_slice) == ("used", lease_a.pk, frozen_now, frozen_now)
    assert events_of(job_slice) == [
        ("assigned", "available", "assigned", lease_a.pk, ""),
        ("acknowledged", "assigned", "used", lease_a.pk, ""),
    ]


@pytest.mark.parametrize("end", ["release", "expire"])
def test_release_after_the_lease_ended_makes_the_slice_available_again(prepared_job, lease_a, end):
    # given
    job_slice = slice_of(prepared_job, 2)
    job_slice.assign(lease_a)
    if end == "release":
        lease_a.release(reason="worker stopped")
    else:
        type(lease_a).objects.filter(pk=lease_a.pk).update(expires_at=lease_a.created_at)
        lease_a.expire()

    # when
    job_slice.release(lease_a)

    # then
    assert state_of(job_slice) == ("available", None, None, None)
    assert events_of(job_slice) == [
        ("assigned", "available", "assigned", lease_a.pk, ""),
        ("released", "assigned", "available", lease_a.pk, "lease ended before the acknowledgement"),
    ]


# --- refused transitions ------------------------------------------------------------------------------------


def assigned(job, lease_a, lease_b) -> JobSlice:
    job_slice = slice_of(job, 0)
    job_slice.assign(lease_a)
    return job_slice


def used(job, lease_a, lease_b) -> JobSlice:
    job_slice = assigned(job, lease_a, lease_b)
    job_slice.ack(lease_a)
    return job_slice


def available(job, lease_a, lease_b) -> JobSlice:
    return slice_of(job, 0)


REFUSED = [
    # (state the slice is put in, transition attempted, message)
    (
        assigned,
        lambda s, a, b: s.assign(b),
        "assigned refused: only an available slice can be assigned (slice is assigned)",
    ),
    (
        assigned,
        lambda s, a, b: s.assign(a),
        "assigned refused: only an available slice can be assigned (slice is assigned)",
    ),
    (
        used,
        lambda s, a, b: s.assign(b),
        "assigned refused: only an available slice can be assigned (slice is used)",
    ),
    (
        available,
        lambda s, a, b: s.ack(a),
        "acknowledged refused: only a slice assigned to lease {a} can be acknowledged by it (slice is available)",
    ),
    (
        assigned,
        lambda s, a, b: s.ack(b),
        "acknowledged refused: only a slice assigned to lease {b} can be acknowledged by it (slice is assigned)",
    ),
    (
        used,
        lambda s, a, b: s.ack(a),
        "acknowledged refused: only a slice assigned to lease {a} can be acknowledged by it (slice is used)",
    ),
    (assigned, lambda s, a, b: s.release(a), "released refused: lease {a} is still live"),
]


@pytest.mark.parametrize(
    ("given", "when", "message"),
    REFUSED,
    ids=[
        "assign-assigned-to-other",
        "assign-assigned-to-same",
        "assign-used",
        "ack-available",
        "ack-by-another-lease",
        "ack-used",
        "release-while-lease-live",
    ],
)
def test_refused_transitions_raise_and_change_nothing(prepared_job, lease_a, lease_b, given, when, message):
    # given
    job_slice = given(prepared_job, lease_a, lease_b)
    before = snapshot(prepared_job)

    # when
    with pytest.raises(SliceTransitionRefused) as refused:
        when(job_slice, lease_a, lease_b)

    # then
    assert str(refused.value) == f"job slice {job_slice.pk}: " + message.format(a=lease_a.pk, b=lease_b.pk)
    assert snapshot(prepared_job) == before


@pytest.mark.parametrize("state", ["available", "used", "assigned-to-another"])
def test_release_by_an_ended_lease_the_slice_is_not_assigned_to_is_refused(
    prepared_job, lease_a, lease_b, state
):
    # given
    job_slice = slice_of(prepared_job, 0)
    if state != "available":
        job_slice.assign(lease_b)
    if state == "used":
        job_slice.ack(lease_b)
    lease_a.release(reason="worker stopped")
    before = snapshot(prepared_job)

    # when
    with pytest.raises(SliceTransitionRefused) as refused:
        job_slice.release(lease_a)

    # then
    current = "available" if state == "available" else ("used" if state == "used" else "assigned")
    assert str(refused.value) == (
        f"job slice {job_slice.pk}: released refused: only a slice assigned to lease {lease_a.pk} "
        f"can be released from it (slice is {current})"
    )
    assert snapshot(prepared_job) == before
