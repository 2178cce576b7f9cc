"""Verification of batch inference results (docs/inference.md, "Verification"), through the real endpoints:
the spec's ``verification``, a verified slice computed by two different workers, agreement (JSON Lines
exactly, safetensors within the tolerance), a dispute settled by a third worker and counted against the
loser once, and downloads of accepted results only."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

import numpy
import pytest
from safetensors.numpy import save

from apps.datasets.models import JobSlice
from apps.jobs.inference import verification
from apps.jobs.models import InferenceResult, Job
from apps.workers.models import WorkerRecord
from tests.apps.jobs.inference_helpers import (
    BODY,
    connect_inference_rigs,
    fetch,
    lease_workers,
    submit,
    token_of,
    upload,
)

pytestmark = pytest.mark.django_db

GOOD = b'{"row": 0, "tokens": [5, 6, 7]}\n{"row": 1, "tokens": [8, 9, 10]}\n'
#: The same rows written differently: equal as JSON Lines, not as bytes.
GOOD_SPACED = b'{"row":0,"tokens":[5,6,7]}\n{"row":1,"tokens":[8,9,10]}\n'
WRONG = b'{"row": 0, "tokens": [6, 7, 8]}\n{"row": 1, "tokens": [9, 10, 11]}\n'


@pytest.fixture(autouse=True)
def _data_dir(settings, tmp_path):
    settings.HYPHA_DATA_DIR = tmp_path


@pytest.fixture
def rigs(rig_a, rig_b, rig_c):
    return connect_inference_rigs([rig_a, rig_b, rig_c])


def _verified_job(alice, rigs, capture, *, workers=3, task=None, **verify) -> Job:
    body = {**BODY, "workers": workers, "verification": {"fraction": 1.0, **verify}}
    if task:
        body["task"] = task
    response = submit(alice.client, capture, body)
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    return lease_workers(job, rigs[:workers], capture)


@pytest.fixture
def verified(alice, data_node, rigs, sent, django_capture_on_commit_callbacks) -> Job:
    """Alice's job on tiny-text (4 slices), every slice verified, rig-a, rig-b and rig-c leased."""
    return _verified_job(alice, rigs, django_capture_on_commit_callbacks)


def _state(job: Job, index: int) -> str:
    return JobSlice.objects.get(job=job, slice__index=index).status


def _statuses(job: Job, index: int) -> dict:
    rows = InferenceResult.objects.filter(job=job, index=index)
    return {str(worker): status for worker, status in rows.values_list("worker__name", "status")}


def _progress(alice, job: Job) -> dict:
    return alice.client.get(f"/api/jobs/{job.pk}/").json()["progress"]


# --- the spec -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "errors"),
    [
        ({"verification": {"fraction": 1.5}}, {"verification.fraction"}),
        (
            {"verification": {"fraction": -0.1, "tolerance": -1}},
            {"verification.fraction", "verification.tolerance"},
        ),
        ({"verification": {"fraction": 0.5, "extra": 1}}, {"verification.extra"}),
        ({"verification": {"fraction": "half"}}, {"verification.fraction"}),
        ({"verification": {"fraction": 0.5}, "workers": 1}, {"verification.fraction"}),
    ],
)
def test_a_bad_verification_is_a_400_with_its_field(alice, data_node, change, errors):
    response = alice.client.post("/api/jobs/inference/", {**BODY, **change}, format="json")
    assert response.status_code == 400
    assert set(response.json()) == errors, response.json()


def test_which_slices_are_verified_follows_from_the_job_and_the_index_alone():
    job_id = "4b6f2a4e-0000-4000-8000-000000000001"
    picks = [verification.is_verified(job_id, index, 0.5) for index in range(400)]
    assert picks == [verification.is_verified(job_id, index, 0.5) for index in range(400)]
    assert 150 < sum(picks) < 250
    assert not any(verification.is_verified(job_id, index, 0.0) for index in range(50))
    assert all(verification.is_verified(job_id, index, 1.0) for index in range(50))


def test_an_unverified_jobs_result_is_accepted_at_once(
    alice, data_node, rigs, sent, client, django_capture_on_commit_callbacks
):
    response = submit(alice.client, django_capture_on_commit_callbacks)
    job = lease_workers(
        Job.objects.get(pk=response.json()["id"]), rigs[:2], django_capture_on_commit_callbacks
    )
    rig_a = rigs[0]
    assert fetch(job, rig_a).index == 0
    stored = upload(client, job, 0, GOOD, token=token_of(sent, job, rig_a))
    assert (stored.status_code, stored.json()["status"]) == (201, "accepted")
    assert _state(job, 0) == JobSlice.Status.USED
    assert _progress(alice, job) == {
        "slices_done": 1,
        "slices_total": 4,
        "verified": 0,
        "disputed": 0,
        "rejected": 0,
    }


# --- two workers agree ----------------------------------------------------------------------------------------


def test_a_verified_slice_waits_for_another_worker_and_is_used_once_they_agree(
    verified, rigs, sent, client, alice
):
    rig_a, rig_b, _ = rigs
    assert fetch(verified, rig_a).index == 0

    # when: rig-a's result arrives
    first = upload(client, verified, 0, GOOD, token=token_of(sent, verified, rig_a))

    # then: it is pending, the slice is AVAILABLE again, but not to rig-a, and nothing is downloadable yet
    assert (first.status_code, first.json()["status"]) == (201, "pending")
    assert _state(verified, 0) == JobSlice.Status.AVAILABLE
    assert fetch(verified, rig_a).index == 1
    assert alice.client.get(f"/api/jobs/{verified.pk}/results/0/").status_code == 404
    # a repeat is answered as stored; another result of the same worker is refused
    assert (
        upload(client, verified, 0, GOOD, token=token_of(sent, verified, rig_a)).json()["status"] == "pending"
    )
    assert upload(client, verified, 0, WRONG, token=token_of(sent, verified, rig_a)).status_code == 409

    # when: rig-b computes slice 0 too and writes the same rows (not the same bytes)
    assert fetch(verified, rig_b).index == 0
    second = upload(client, verified, 0, GOOD_SPACED, token=token_of(sent, verified, rig_b))

    # then: both are accepted, the slice is USED, and the first is the slice's result
    assert (second.status_code, second.json()["status"]) == (201, "accepted")
    assert _statuses(verified, 0) == {"rig-a": "accepted", "rig-b": "accepted"}
    assert _state(verified, 0) == JobSlice.Status.USED
    download = alice.client.get(f"/api/jobs/{verified.pk}/results/0/")
    assert b"".join(download.streaming_content) == GOOD
    assert _progress(alice, verified) == {
        "slices_done": 1,
        "slices_total": 4,
        "verified": 1,
        "disputed": 0,
        "rejected": 0,
    }
    assert not WorkerRecord.objects.filter(results_lost__gt=0).exists()


# --- a dispute -----------------------------------------------------------------------------------------------


def test_a_dispute_goes_to_a_third_worker_and_counts_once_against_the_loser(
    verified, rigs, sent, client, alice
):
    rig_a, rig_b, rig_c = rigs
    assert fetch(verified, rig_a).index == 0
    assert upload(client, verified, 0, GOOD, token=token_of(sent, verified, rig_a)).status_code == 201
    assert fetch(verified, rig_b).index == 0

    # when: rig-b's result differs
    disputed = upload(client, verified, 0, WRONG, token=token_of(sent, verified, rig_b))

    # then: both are disputed; neither rig-a nor rig-b gets the slice again, rig-c does
    assert (disputed.status_code, disputed.json()["status"]) == (201, "disputed")
    assert _statuses(verified, 0) == {"rig-a": "disputed", "rig-b": "disputed"}
    assert _state(verified, 0) == JobSlice.Status.AVAILABLE
    assert fetch(verified, rig_a).index == 1
    assert fetch(verified, rig_b).index == 2
    assert _progress(alice, verified)["disputed"] == 1
    assert fetch(verified, rig_c).index == 0

    # when: rig-c agrees with rig-a
    settled = upload(client, verified, 0, GOOD, token=token_of(sent, verified, rig_c))

    # then: rig-a's and rig-c's are accepted, rig-b's rejected and counted against rig-b, once
    assert (settled.status_code, settled.json()["status"]) == (201, "accepted")
    assert _statuses(verified, 0) == {"rig-a": "accepted", "rig-b": "rejected", "rig-c": "accepted"}
    assert _state(verified, 0) == JobSlice.Status.USED
    assert upload(client, verified, 0, GOOD, token=token_of(sent, verified, rig_c)).status_code == 200
    repeat = upload(client, verified, 0, WRONG, token=token_of(sent, verified, rig_b))
    assert (repeat.status_code, repeat.json()["status"]) == (200, "rejected")
    records = {record.worker.name: record for record in WorkerRecord.objects.select_related("worker")}
    assert records["rig-b"].results_lost == 1
    assert records["rig-b"].reliability < 0.5
    assert all(records[name].results_lost == 0 for name in records if name != "rig-b")
    assert _progress(alice, verified) == {
        "slices_done": 1,
        "slices_total": 4,
        "verified": 1,
        "disputed": 0,
        "rejected": 1,
    }
    # and: the downloads serve the accepted result only
    assert b"".join(alice.client.get(f"/api/jobs/{verified.pk}/results/0/").streaming_content) == GOOD
    archive = alice.client.get(f"/api/jobs/{verified.pk}/results/")
    with zipfile.ZipFile(io.BytesIO(b"".join(archive.streaming_content))) as bundle:
        contents = {name: bundle.read(name) for name in bundle.namelist()}
    manifest = json.loads(contents.pop("manifest.json"))
    assert contents == {"0.jsonl": GOOD}
    assert [(entry["index"], entry["worker"]) for entry in manifest["results"]] == [(0, str(rig_a.pk))]


def test_every_slice_verified_completes_the_job_with_one_accepted_result_each(verified, rigs, sent, client):
    rig_a, rig_b, _ = rigs
    bodies = {index: f'{{"row": 0, "tokens": [{index}]}}\n'.encode() for index in range(4)}
    for rig in (rig_a, rig_b):
        while (reply := fetch(verified, rig)).index is not None:
            stored = upload(
                client, verified, reply.index, bodies[reply.index], token=token_of(sent, verified, rig)
            )
            assert stored.status_code == 201
    verified.refresh_from_db()
    assert (verified.status, verified.status_reason) == (
        Job.Status.COMPLETED,
        "COMPLETED: 4 of 4 slices processed",
    )
    accepted = InferenceResult.objects.filter(job=verified, status=InferenceResult.Status.ACCEPTED)
    assert sorted(accepted.values_list("index", flat=True)) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert (
        not InferenceResult.objects.filter(job=verified)
        .exclude(status=InferenceResult.Status.ACCEPTED)
        .exists()
    )


# --- tensors within the tolerance ----------------------------------------------------------------------------


def _embeddings(values) -> bytes:
    return save({"embeddings": numpy.asarray(values, dtype=numpy.float32)})


@pytest.mark.parametrize(
    ("other", "status"),
    [
        ([[1.00005, 2.0], [3.0, 4.00004]], "accepted"),  # within 1e-4 (+ 1e-4 × |b|)
        ([[1.01, 2.0], [3.0, 4.0]], "disputed"),
        ([[1.0, 2.0, 0.0], [3.0, 4.0, 0.0]], "disputed"),  # another shape
    ],
)
def test_tensors_agree_within_the_tolerance(
    alice, data_node, rigs, sent, client, django_capture_on_commit_callbacks, other, status
):
    job = _verified_job(alice, rigs, django_capture_on_commit_callbacks, task={"type": "embed"})
    rig_a, rig_b, _ = rigs
    assert fetch(job, rig_a).index == 0
    first = _embeddings([[1.0, 2.0], [3.0, 4.0]])
    assert (
        upload(client, job, 0, first, token=token_of(sent, job, rig_a), fmt="safetensors").status_code == 201
    )
    assert fetch(job, rig_b).index == 0
    second = upload(client, job, 0, _embeddings(other), token=token_of(sent, job, rig_b), fmt="safetensors")
    assert (second.status_code, second.json()["status"]) == (201, status)


def test_a_malformed_result_agrees_with_nothing(
    alice, data_node, rigs, sent, client, django_capture_on_commit_callbacks
):
    job = _verified_job(alice, rigs, django_capture_on_commit_callbacks, task={"type": "embed"})
    rig_a, rig_b, _ = rigs
    assert fetch(job, rig_a).index == 0
    good = _embeddings([[1.0]])
    assert (
        upload(client, job, 0, good, token=token_of(sent, job, rig_a), fmt="safetensors").status_code == 201
    )
    assert fetch(job, rig_b).index == 0
    broken = upload(client, job, 0, b"not safetensors", token=token_of(sent, job, rig_b), fmt="safetensors")
    assert (broken.status_code, broken.json()["status"]) == (201, "disputed")


def test_the_result_entry_hash_is_the_bodys(verified, rigs, sent, client):
    rig_a = rigs[0]
    assert fetch(verified, rig_a).index == 0
    stored = upload(client, verified, 0, GOOD, token=token_of(sent, verified, rig_a))
    assert stored.json() == {
        "index": 0,
        "sha256": hashlib.sha256(GOOD).hexdigest(),
        "size": len(GOOD),
        "status": "pending",
    }
