"""Dataset workflows: registration by data nodes, preparing a job, claiming, acknowledging and releasing slices
epoch by epoch, and progress."""

from __future__ import annotations

import pytest

from apps.datasets import services
from apps.datasets.exceptions import (
    DatasetConflict,
    DatasetNotFound,
    InvalidDataset,
    JobAlreadyPrepared,
    JobNotPrepared,
    LeaseNotEligible,
    SliceNotFound,
    SliceTransitionRefused,
)
from apps.datasets.models import DataNode, Dataset, DatasetReplica, JobSlice, Slice, SliceEvent
from apps.jobs.models import TRAINER
from apps.leases import services as lease_services
from tests.apps.conftest import submit_job
from tests.apps.datasets.conftest import (
    SMALL,
    TINY_TEXT_SLICES,
    active_lease,
    digest,
    job_slices,
    snapshot,
)

pytestmark = pytest.mark.django_db


def claim(job, lease) -> tuple[int, int] | None:
    """``(index, epoch)`` of the slice ``lease`` claims, or None."""
    claimed = services.claim_next(job, lease)
    return None if claimed is None else (claimed.slice.index, claimed.epoch)


def registry() -> tuple[list, list, list, list]:
    """Every dataset, slice, replica and node row, to compare before and after a refused registration."""
    return (
        list(Dataset.objects.order_by("pk").values()),
        list(Slice.objects.order_by("pk").values()),
        list(DatasetReplica.objects.order_by("pk").values()),
        list(DataNode.objects.order_by("pk").values()),
    )


# --- register_dataset ---------------------------------------------------------------------------------------


def test_registering_a_dataset_records_its_slices_in_index_order_and_the_replica(east, frozen_now):
    # when: the slices arrive in directory order, not index order
    dataset = services.register_dataset(east, "tiny-text", list(reversed(TINY_TEXT_SLICES)))

    # then
    assert (dataset.name, dataset.slice_count, dataset.total_bytes) == ("tiny-text", 3, 600)
    assert list(dataset.slices.values_list("index", "size_bytes", "sha256")) == TINY_TEXT_SLICES
    assert list(DatasetReplica.objects.values_list("dataset__name", "node__name", "registered_at")) == [
        ("tiny-text", "data-east", frozen_now)
    ]
    east.refresh_from_db()
    assert (east.online, east.last_seen_at) == (True, frozen_now)


def test_registering_again_by_the_same_node_changes_nothing_but_when_it_was_seen(tiny_text, east, frozen_now):
    # given
    datasets, slices, replicas, _nodes = registry()

    # when
    again = services.register_dataset(east, "tiny-text", TINY_TEXT_SLICES)

    # then
    assert again == tiny_text
    assert registry()[:3] == (datasets, slices, replicas)
    east.refresh_from_db()
    assert (east.online, east.last_seen_at) == (True, frozen_now)


def test_a_second_node_with_the_same_slices_becomes_a_replica(tiny_text, west):
    # when
    services.register_dataset(west, "tiny-text", TINY_TEXT_SLICES)

    # then
    assert Slice.objects.count() == 3
    assert [node.name for node in services.replicas(tiny_text)] == ["data-east", "data-west"]


def test_replicas_lists_online_nodes_first(tiny_text, east, west):
    # given
    services.register_dataset(west, "tiny-text", TINY_TEXT_SLICES)
    DataNode.objects.filter(pk=east.pk).update(online=False)

    # then
    assert [node.name for node in services.replicas(tiny_text)] == ["data-west", "data-east"]


def test_a_second_node_with_a_different_checksum_is_refused(tiny_text, west):
    # given
    before = registry()
    changed = [TINY_TEXT_SLICES[0], (1, 200, digest(9)), TINY_TEXT_SLICES[2]]

    # when
    with pytest.raises(DatasetConflict) as refused:
        services.register_dataset(west, "tiny-text", changed)

    # then
    assert str(refused.value) == (
        f"dataset tiny-text is already registered (served by data-east) with different slices: slice 1 is 200 "
        f"bytes with SHA-256 {digest(1)}, data-west announced 200 bytes with SHA-256 {digest(9)}; every replica "
        "must serve identical files: register changed data under a new name"
    )
    assert registry() == before


def test_the_same_node_announcing_changed_slices_is_refused_too(tiny_text, east):
    # given
    before = registry()

    # when
    with pytest.raises(DatasetConflict) as refused:
        services.register_dataset(east, "tiny-text", TINY_TEXT_SLICES[:2])

    # then
    assert str(refused.value) == (
        "dataset tiny-text is already registered (served by data-east) with different slices: it has 3 slices, "
        "data-east announced 2; every replica must serve identical files: register changed data under a new name"
    )
    assert registry() == before


@pytest.mark.parametrize(
    ("name", "slices", "message"),
    [
        (
            "tiny text",
            TINY_TEXT_SLICES,
            "dataset name 'tiny text' must be a slug (letters, digits, '-', '_'; ≤ 200 chars)",
        ),
        ("tiny-text", [], "dataset tiny-text has no slices"),
        (
            "tiny-text",
            [(0, 1, digest(0)), (2, 1, digest(2))],
            "dataset tiny-text: slice indices must be 0..1, each once; got [0, 2]",
        ),
        (
            "tiny-text",
            [(0, 1, digest(0)), (0, 1, digest(0))],
            "dataset tiny-text: slice indices must be 0..1, each once; got [0, 0]",
        ),
        (
            "tiny-text",
            [(1, 1, digest(1))],
            "dataset tiny-text: slice indices must be 0..0, each once; got [1]",
        ),
        (
            "tiny-text",
            [(-1, 1, digest(0))],
            "dataset tiny-text: slice index -1 is not a non-negative integer",
        ),
        (
            "tiny-text",
            [(0, 0, digest(0))],
            "dataset tiny-text: slice 0 has size 0; it must be a positive integer",
        ),
        ("tiny-text", [(0, 1, "ABC")], "dataset tiny-text: slice 0 has no lowercase hex SHA-256 ('ABC')"),
        ("tiny-text", [(0, 1)], "dataset tiny-text: slice (0, 1) is not (index, size, sha256)"),
    ],
    ids=["name", "empty", "gap", "duplicate", "off-by-one", "negative", "empty-file", "digest", "shape"],
)
def test_malformed_announcements_are_refused_and_register_nothing(east, name, slices, message):
    # given
    before = registry()

    # when
    with pytest.raises(InvalidDataset) as refused:
        services.register_dataset(east, name, slices)

    # then
    assert str(refused.value) == message
    assert registry() == before


def test_a_data_node_authenticates_with_its_token(db):
    # given
    node, token = services.create_data_node(name="data-north", url="https://north.example")

    # then
    assert token.startswith("hd_")
    assert services.authenticate_data_node(token) == node
    assert services.authenticate_data_node(token + "x") is None
    assert token not in str(DataNode.objects.values().get())


# --- prepare_job --------------------------------------------------------------------------------------------


def test_prepare_job_creates_epoch_zero_available(job, tiny_text):
    # when
    dataset = services.prepare_job(job, "tiny-text")

    # then
    assert dataset == tiny_text
    assert job_slices(job) == [
        (0, 0, "available", None),
        (0, 1, "available", None),
        (0, 2, "available", None),
    ]
    assert services.progress(job) == {"epoch": 0, "available": 3, "assigned": 0, "used": 0, "total": 3}


def test_prepare_job_again_changes_nothing(prepared_job):
    # given
    before = snapshot(prepared_job)

    # when
    services.prepare_job(prepared_job, "tiny-text")

    # then
    assert snapshot(prepared_job) == before


def test_prepare_job_for_another_dataset_is_refused(prepared_job, east):
    # given
    services.register_dataset(east, "other-text", [(0, 5, digest(5))])
    before = snapshot(prepared_job)

    # when
    with pytest.raises(JobAlreadyPrepared) as refused:
        services.prepare_job(prepared_job, "other-text")

    # then
    assert str(refused.value) == f"job {prepared_job.pk} trains on dataset tiny-text, not other-text"
    assert snapshot(prepared_job) == before


def test_prepare_job_for_an_unknown_dataset_is_refused(job):
    # when
    with pytest.raises(DatasetNotFound) as refused:
        services.prepare_job(job, "nope")

    # then
    assert str(refused.value) == "no dataset 'nope' is registered"
    assert JobSlice.objects.count() == 0


def test_progress_of_an_unprepared_job_is_empty(job):
    assert services.progress(job) == {"epoch": None, "available": 0, "assigned": 0, "used": 0, "total": 0}


# --- claim_next ---------------------------------------------------------------------------------------------


def test_claims_go_in_index_order_and_a_new_epoch_starts_when_the_claimer_holds_none(
    prepared_job, lease_a, lease_b
):
    # when / then: epoch 0 is handed out lowest index first
    assert claim(prepared_job, lease_a) == (0, 0)
    assert claim(prepared_job, lease_b) == (1, 0)
    assert claim(prepared_job, lease_a) == (2, 0)

    # none AVAILABLE, and b still holds one of its own: b waits
    assert claim(prepared_job, lease_b) is None
    assert JobSlice.objects.filter(job=prepared_job, epoch=1).count() == 0
    services.acknowledge(prepared_job, lease_a, 0)
    services.acknowledge(prepared_job, lease_b, 1)

    # b holds none now; a's unacknowledged slice 2 (its prefetch) does not hold b up: epoch 1 starts
    assert claim(prepared_job, lease_b) == (0, 1)
    assert claim(prepared_job, lease_a) == (1, 1)
    # a still acknowledges the slice it claimed in epoch 0
    assert services.acknowledge(prepared_job, lease_a, 2).epoch == 0
    assert services.acknowledge(prepared_job, lease_a, 2).epoch == 0  # idempotent

    # then
    assert job_slices(prepared_job) == [
        (0, 0, "used", lease_a.pk),
        (0, 1, "used", lease_b.pk),
        (0, 2, "used", lease_a.pk),
        (1, 0, "assigned", lease_b.pk),
        (1, 1, "assigned", lease_a.pk),
        (1, 2, "available", None),
    ]
    assert services.progress(prepared_job) == {
        "epoch": 1,
        "available": 1,
        "assigned": 2,
        "used": 0,
        "total": 3,
    }
    assert SliceEvent.objects.count() == 8  # 5 assignments, 3 acknowledgements


def test_a_released_slice_is_claimed_again_before_higher_indices(prepared_job, lease_a, lease_b):
    # given: lease b holds slice 0 and its worker goes away
    assert claim(prepared_job, lease_b) == (0, 0)
    assert claim(prepared_job, lease_a) == (1, 0)
    lease_b.release(reason="worker stopped")
    services.release_for_lease(lease_b)

    # when
    claimed = [claim(prepared_job, lease_a), claim(prepared_job, lease_a)]

    # then
    assert claimed == [(0, 0), (2, 0)]


@pytest.mark.parametrize("kind", ["temporary", "ended", "other-job"])
def test_only_an_active_lease_of_the_job_may_claim(prepared_job, lease_a, job_owner, kind):
    # given
    if kind == "temporary":
        lease = lease_services.reserve(
            worker_id=lease_a.worker_id, job=prepared_job, role=TRAINER, resources=SMALL, price=1.0
        )
        state = f"temporary, of job {prepared_job.pk}"
    elif kind == "ended":
        lease = lease_a
        lease.release(reason="worker stopped")
        state = f"released, of job {prepared_job.pk}"
    else:
        other = submit_job(job_owner, name="other-gpt")
        lease = active_lease(lease_a.worker, other)
        state = f"active, of job {other.pk}"
    before = snapshot(prepared_job)

    # when
    with pytest.raises(LeaseNotEligible) as refused:
        services.claim_next(prepared_job, lease)

    # then
    assert str(refused.value) == f"lease {lease.pk} ({state}) is not an active lease of job {prepared_job.pk}"
    assert snapshot(prepared_job) == before


def test_claiming_for_an_unprepared_job_is_refused(job, lease_a):
    with pytest.raises(JobNotPrepared) as refused:
        services.claim_next(job, lease_a)
    assert str(refused.value) == f"job {job.pk} has no slices; prepare it for a dataset first"


# --- acknowledge --------------------------------------------------------------------------------------------


def test_acknowledge_marks_the_slice_used_once(prepared_job, lease_a):
    # given
    services.claim_next(prepared_job, lease_a)

    # when: the reply was lost and the trainer acknowledges again
    first = services.acknowledge(prepared_job, lease_a, 0)
    second = services.acknowledge(prepared_job, lease_a, 0)

    # then
    assert (first.pk, first.status, second.pk, second.status) == (first.pk, "used", first.pk, "used")
    assert list(SliceEvent.objects.values_list("kind", flat=True)) == ["assigned", "acknowledged"]


def test_acknowledge_by_another_lease_is_refused(prepared_job, lease_a, lease_b):
    # given
    services.claim_next(prepared_job, lease_a)
    before = snapshot(prepared_job)

    # when
    with pytest.raises(SliceTransitionRefused):
        services.acknowledge(prepared_job, lease_b, 0)

    # then
    assert snapshot(prepared_job) == before


def test_acknowledge_of_an_unknown_index_is_refused(prepared_job, lease_a):
    # given
    before = snapshot(prepared_job)

    # when: index 3 is one past the end (the original's node panicked on it)
    with pytest.raises(SliceNotFound) as refused:
        services.acknowledge(prepared_job, lease_a, 3)

    # then
    assert str(refused.value) == f"job {prepared_job.pk} has no slice 3 in epoch 0"
    assert snapshot(prepared_job) == before


# --- release_for_lease --------------------------------------------------------------------------------------


def test_release_for_lease_returns_only_that_leases_unacknowledged_slices(prepared_job, lease_a, lease_b):
    # given: a used 0 and holds 2; b holds 1
    assert claim(prepared_job, lease_a) == (0, 0)
    assert claim(prepared_job, lease_b) == (1, 0)
    assert claim(prepared_job, lease_a) == (2, 0)
    services.acknowledge(prepared_job, lease_a, 0)
    lease_a.release(reason="worker stopped")

    # when
    released = services.release_for_lease(lease_a)

    # then
    assert [(job_slice.slice.index, job_slice.status) for job_slice in released] == [(2, "available")]
    assert job_slices(prepared_job) == [
        (0, 0, "used", lease_a.pk),
        (0, 1, "assigned", lease_b.pk),
        (0, 2, "available", None),
    ]
    assert services.release_for_lease(lease_a) == []


def test_release_for_a_live_lease_is_refused(prepared_job, lease_a):
    # given
    services.claim_next(prepared_job, lease_a)
    before = snapshot(prepared_job)

    # when
    with pytest.raises(SliceTransitionRefused):
        services.release_for_lease(lease_a)

    # then
    assert snapshot(prepared_job) == before


@pytest.mark.django_db
def test_create_data_node_token_prints_a_token_that_authenticates(capsys):
    # when
    from django.core.management import call_command

    call_command("create_data_node_token", "data-north", "--url", "http://north.example:8100")

    # then
    token = capsys.readouterr().out.strip()
    node = services.authenticate_data_node(token)
    assert (node.name, node.url, token[:3]) == ("data-north", "http://north.example:8100", "hd_")


@pytest.mark.django_db
def test_create_data_node_token_refuses_a_bad_url_and_creates_nothing():
    from django.core.management import CommandError, call_command

    from apps.datasets.models import DataNode

    with pytest.raises(CommandError, match="invalid --url"):
        call_command("create_data_node_token", "data-north", "--url", "ftp://north")
    assert DataNode.objects.count() == 0


# --- slice download URLs ------------------------------------------------------------------------------------


def test_slice_urls_carry_a_token_each_node_verifies_with_its_own_key(tiny_text, west, frozen_now):
    # given: west serves tiny-text too, and is offline
    import time
    import urllib.parse

    from data_node import tokens

    services.register_dataset(west, "tiny-text", TINY_TEXT_SLICES)
    DataNode.objects.filter(pk=west.pk).update(online=False)
    east = DataNode.objects.get(name="data-east")

    # when
    urls = services.slice_urls(tiny_text, 2, job_id="job-1", peer="rig-a", lifetime=600)

    # then: online nodes first, each token signed with that node's key
    split = [urllib.parse.urlsplit(url) for url in urls]
    assert [f"{part.scheme}://{part.netloc}{part.path}" for part in split] == [
        "https://east.example/datasets/tiny-text/slices/2",
        "https://west.example/datasets/tiny-text/slices/2",
    ]
    east_token, west_token = (urllib.parse.parse_qs(part.query)["token"][0] for part in split)
    claims = tokens.verify(services.download_key(east).encode(), east_token, dataset="tiny-text", index=2)
    assert claims["dataset"] == "tiny-text" and claims["slice"] == 2
    assert (claims["job"], claims["peer"]) == ("job-1", "rig-a")
    assert time.time() + 590 < claims["exp"] <= time.time() + 600
    tokens.verify(services.download_key(west).encode(), west_token, dataset="tiny-text", index=2)
    with pytest.raises(tokens.SliceTokenError) as refused:
        tokens.verify(services.download_key(west).encode(), east_token, dataset="tiny-text", index=2)
    assert refused.value.status == 401
    with pytest.raises(tokens.SliceTokenError) as other_slice:
        tokens.verify(services.download_key(east).encode(), east_token, dataset="tiny-text", index=1)
    assert other_slice.value.status == 403


def test_download_keys_are_derived_per_node_and_change_with_the_secret_key(east, west, settings):
    # given
    key = services.download_key(east)

    # then
    assert key == services.download_key(DataNode.objects.get(pk=east.pk))  # derived: stable, not stored
    assert key != services.download_key(west)
    settings.SECRET_KEY = "another-secret-key-" + "x" * 40
    assert services.download_key(east) != key
