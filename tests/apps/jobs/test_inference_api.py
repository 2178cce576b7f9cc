"""Batch inference jobs through the REST API (docs/inference.md): submission, the job JSON its workers get,
slice claims, per-slice result uploads (transfer token, SHA-256, idempotent repeats, conflicts), completion
with the last slice, and the downloads."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

import pytest

from apps.datasets.models import JobSlice
from apps.jobs import training
from apps.jobs.inference import results_directory
from apps.jobs.models import INFERENCE, InferenceResult, Job, Task
from apps.leases.models import Lease
from apps.market.models import Advertisement
from tests.apps.jobs.inference_helpers import (
    BODY,
    fetch,
    submit,
    task_of,
    token_of,
    upload,
)
from worker_daemon import protocol

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _data_dir(settings, tmp_path):
    settings.HYPHA_DATA_DIR = tmp_path


# --- submission ---------------------------------------------------------------------------------------------


def test_a_submission_creates_an_inference_job_with_its_slices_and_advertises_its_workers(
    alice, data_node, inference_rigs, django_capture_on_commit_callbacks
):
    # when
    response = submit(alice.client, django_capture_on_commit_callbacks)

    # then
    assert response.status_code == 201, response.content
    body = response.json()
    job = Job.objects.get(pk=body["id"])
    assert (body["kind"], body["name"], body["progress"]) == (
        "inference",
        "embed-tiny",
        {"slices_done": 0, "slices_total": 4, "verified": 0, "disputed": 0, "rejected": 0},
    )
    assert job.kind == Job.Kind.INFERENCE
    assert (body["trainer"], body["parameter_server"]) == (None, None)
    assert body["inference"] == {
        "resources": {"cpu": 2.0, "memory": 4.0, "storage": 0.0, "gpu": 0.0},
        "price": {"bid": 60.0, "max": 90.0},
        "executor": {"class": "inference", "name": "batch-inference"},
    }
    assert job.requirements == {
        "inference": {
            "resources": {
                "cpu": 2.0,
                "memory": 4.0,
                "storage": 0.0,
                "gpu": 0.0,
                "devices": 0,
                "device_memory": 0.0,
            },
            "executor": {"class": "inference", "name": "batch-inference"},
            "bid": 60.0,
            "max": 90.0,
        }
    }
    assert job.requirement(INFERENCE).count == 2
    assert list(JobSlice.objects.filter(job=job).values_list("slice__index", "epoch", "status")) == [
        (index, 0, "available") for index in range(4)
    ]
    (ad,) = Advertisement.objects.filter(job=job)
    assert (ad.role, ad.wanted, ad.status) == (INFERENCE, 2, Advertisement.Status.OPEN)
    assert ad.executors == [{"class": "inference", "name": "batch-inference"}]
    assert job.status == Job.Status.ALLOCATING
    assert job.status_reason.startswith("ALLOCATING: 0 of 2 inference workers leased")


@pytest.mark.parametrize(
    ("change", "errors"),
    [
        ({"task": {"type": "translate"}}, {"task": ["Input tag 'translate' found using 'type' does not match any of the expected tags: 'generate', 'classify', 'embed'"]}),  # noqa: E501
        ({"task": {"type": "generate", "max_new_tokens": 0}}, {"task.max_new_tokens": ["Input should be greater than or equal to 1"]}),  # noqa: E501
        ({"task": {"type": "generate", "max_new_tokens": 1025}}, {"task.max_new_tokens": ["Input should be less than or equal to 1024"]}),  # noqa: E501
        ({"task": {"type": "generate", "temperature": -0.5}}, {"task.temperature": ["Input should be greater than or equal to 0"]}),  # noqa: E501
        ({"task": {"type": "classify", "top_k": 0}}, {"task.top_k": ["Input should be greater than or equal to 1"]}),
        ({"task": {"type": "embed", "pooling": "max"}}, {"task.pooling": ["Unknown key."]}),
        ({"workers": 0}, {"workers": ["Input should be greater than or equal to 1"]}),
        ({"workers": 65}, {"workers": ["Input should be less than or equal to 64"]}),
        ({"workers": "2"}, {"workers": ["Input should be a valid integer"]}),
        ({"batch_size": 0}, {"batch_size": ["Input should be greater than or equal to 1"]}),
        ({"worker": {"price": {"bid": 100, "max": 50}}}, {"worker.price.max": ["Must be at least the bid (100)."]}),
        ({"dataset": {"name": "nowhere"}}, {"dataset.name": ["No data node has registered a dataset named 'nowhere'; start `hypha-data-node --dataset DIR` first (see GET /api/datasets/)."]}),  # noqa: E501
        ({"model": {"source": {"type": "upload", "file": "missing.zip"}}}, {"model.source.file": ["You have no upload 'missing.zip' (POST the file to /api/uploads/ first)."]}),  # noqa: E501
        ({"name": "x" * 201}, {"name": ["A string of at most 200 characters."]}),
        ({"rounds": 3}, {"rounds": ["Unknown key."]}),
    ],
)  # fmt: skip
def test_an_invalid_submission_is_a_400_with_field_errors_and_creates_nothing(
    alice, data_node, inference_rigs, django_capture_on_commit_callbacks, change, errors
):
    # when
    response = submit(alice.client, django_capture_on_commit_callbacks, {**BODY, **change})

    # then
    assert (response.status_code, response.json()) == (400, errors)
    assert not Job.objects.exists()
    assert not JobSlice.objects.exists()


def test_a_submission_missing_its_task_or_not_an_object_is_a_400(alice, data_node):
    body = {key: value for key, value in BODY.items() if key != "task"}
    response = alice.client.post("/api/jobs/inference/", body, format="json")
    assert (response.status_code, response.json()) == (400, {"task": ["Field required"]})
    response = alice.client.post("/api/jobs/inference/", [BODY], format="json")
    assert (response.status_code, response.json()) == (
        400,
        {"non_field_errors": ["A specification must be a JSON object."]},
    )
    assert not Job.objects.exists()


def test_a_submission_needs_a_user(anonymous, data_node):
    response = anonymous.post("/api/jobs/inference/", BODY, format="json")
    assert response.status_code == 401
    assert not Job.objects.exists()


# --- dispatch -----------------------------------------------------------------------------------------------


def test_leased_workers_are_dispatched_with_the_inference_job_json(running, inference_rigs, sent):
    rig_a, rig_b, _ = inference_rigs

    # then: RUNNING, one task per lease, each sent the job JSON of docs/inference.md
    assert running.status == Job.Status.RUNNING
    assert running.status_reason == "RUNNING: 2 inference workers dispatched; 0 of 4 slices done"
    dispatches = [message for _, message in sent if isinstance(message, protocol.DispatchJob)]
    assert sorted(message.role for message in dispatches) == [INFERENCE, INFERENCE]
    assert {task.lease.worker_id for task in Task.objects.filter(job=running)} == {rig_a.pk, rig_b.pk}
    assert dispatches[0].spec == {
        "job_id": str(running.pk),
        "executor": {
            "class": "inference",
            "descriptor": {"name": "batch-inference"},
            "config": {
                "model": {
                    "task": "causal-lm",
                    "artifact": {
                        "type": "huggingface",
                        "repository": "hypha-space/tiny",
                        "revision": None,
                        "filenames": ["config.json"],
                        "token": None,
                    },
                },
                "data": {"type": "scheduler", "peer": "control-plane", "dataset": "tiny-text"},
                "results": {
                    "type": "peers",
                    "peers": ["control-plane"],
                    "strategy": {"type": "One"},
                    "resource": None,
                },
                "task": {"type": "generate", "max_new_tokens": 4, "temperature": 0.0, "seed": 0},
                "batch_size": 2,
                "input_names": ["input_ids"],
            },
        },
    }
    claims = protocol.verify_transfer_token(
        training.transfer_key(running.pk), dispatches[0].transfer_token, job_id=str(running.pk)
    )
    assert claims["role"] == INFERENCE


# --- slice claims -------------------------------------------------------------------------------------------


def test_workers_claim_each_slice_once_then_wait_for_held_ones_then_are_done(
    running, inference_rigs, sent, client
):
    rig_a, rig_b, _ = inference_rigs

    # when: the four slices go out in order, to whoever asks
    claimed = [(rig, fetch(running, rig).index) for rig in (rig_a, rig_b, rig_a, rig_b)]

    # then
    assert [index for _, index in claimed] == [0, 1, 2, 3]
    assert JobSlice.objects.filter(job=running, status=JobSlice.Status.ASSIGNED).count() == 4
    # rig-b still holds slices: rig-a is told to ask again, not that it is done
    waiting = fetch(running, rig_a)
    assert (waiting.index, waiting.retry_in, waiting.done, waiting.error) == (None, 1.0, False, None)

    # when: rig-b's results are stored
    token = token_of(sent, running, rig_b)
    for index in (1, 3):
        assert upload(client, running, index, b'{"row": 0}\n', token=token).status_code == 201

    # then: only rig-a's own slices are left: it is done (its results are on their way)
    finished = fetch(running, rig_a)
    assert (finished.index, finished.retry_in, finished.done) == (None, None, True)
    # while rig-b waits: rig-a may yet be lost, and its slices go back out
    assert (fetch(running, rig_b).retry_in, fetch(running, rig_b).done) == (1.0, False)


def test_a_fetch_for_another_dataset_is_refused(running, inference_rigs):
    reply = fetch(running, inference_rigs[0], dataset="other")
    assert reply.error == f"job {running.pk} runs on dataset 'tiny-text', not 'other'"
    assert not JobSlice.objects.filter(job=running, status=JobSlice.Status.ASSIGNED).exists()


# --- result uploads -----------------------------------------------------------------------------------------


def test_a_result_is_stored_and_its_slice_used_and_a_repeat_changes_nothing(
    running, inference_rigs, sent, client
):
    rig_a = inference_rigs[0]
    assert fetch(running, rig_a).index == 0
    body = b'{"row": 0, "tokens": [5, 6]}\n{"row": 1, "tokens": [7, 8]}\n'
    digest = hashlib.sha256(body).hexdigest()

    # when
    first = upload(client, running, 0, body, token=token_of(sent, running, rig_a))
    again = upload(client, running, 0, body, token=token_of(sent, running, rig_a))

    # then
    entry = {"index": 0, "sha256": digest, "size": len(body), "status": "accepted"}
    assert (first.status_code, first.json()) == (201, entry)
    assert (again.status_code, again.json()) == (200, entry)
    (stored,) = InferenceResult.objects.filter(job=running)
    assert (stored.index, stored.sha256, stored.size, stored.format, stored.worker_id) == (
        0,
        digest,
        len(body),
        "jsonl",
        rig_a.pk,
    )
    assert stored.lease_id == task_of(running, rig_a).lease_id
    assert (results_directory(running.pk) / "0.jsonl").read_bytes() == body
    assert JobSlice.objects.get(job=running, slice__index=0).status == JobSlice.Status.USED
    assert not [path.name for path in results_directory(running.pk).iterdir() if path.name.startswith(".")]


def test_a_body_that_is_not_the_declared_sha256_is_a_400_and_nothing_is_kept(
    running, inference_rigs, sent, client
):
    rig_a = inference_rigs[0]
    fetch(running, rig_a)

    response = upload(client, running, 0, b"tampered", token=token_of(sent, running, rig_a), sha256="a" * 64)

    assert response.status_code == 400
    assert response.json() == {
        "result": [
            f"the body's SHA-256 is {hashlib.sha256(b'tampered').hexdigest()}, not the declared {'a' * 64}"
        ]
    }
    assert not InferenceResult.objects.exists()
    assert JobSlice.objects.get(job=running, slice__index=0).status == JobSlice.Status.ASSIGNED
    assert not list(results_directory(running.pk).glob("*"))


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"sha256": "not-hex"}, "X-Content-SHA256 must be the body's SHA-256, 64 hex digits"),
        ({"fmt": "csv"}, "X-Result-Format must be one of safetensors, jsonl"),
    ],
)
def test_bad_result_headers_are_a_400(running, inference_rigs, sent, client, headers, message):
    rig_a = inference_rigs[0]
    fetch(running, rig_a)
    response = upload(client, running, 0, b"x", token=token_of(sent, running, rig_a), **headers)
    assert (response.status_code, response.json()) == (400, {"result": [message]})
    assert not InferenceResult.objects.exists()


def test_a_result_for_a_slice_not_assigned_to_the_sender_is_a_409(running, inference_rigs, sent, client):
    rig_a, rig_b, _ = inference_rigs
    fetch(running, rig_a)  # slice 0
    fetch(running, rig_b)  # slice 1

    # when: rig-a sends slice 1 (rig-b's), and slice 2 (nobody's yet)
    taken = upload(client, running, 1, b"x", token=token_of(sent, running, rig_a))
    unassigned = upload(client, running, 2, b"x", token=token_of(sent, running, rig_a))

    # then
    assert (taken.status_code, taken.json()) == (409, {"detail": "slice 1 is not assigned to this worker"})
    assert (unassigned.status_code, unassigned.json()) == (
        409,
        {"detail": "slice 2 is not assigned to this worker"},
    )
    assert not InferenceResult.objects.exists()
    # and once rig-b stored slice 1, rig-a's copy of it is a conflict too, not a repeat
    assert upload(client, running, 1, b"b", token=token_of(sent, running, rig_b)).status_code == 201
    again = upload(client, running, 1, b"b", token=token_of(sent, running, rig_a))
    assert (again.status_code, again.json()) == (409, {"detail": "slice 1 has a stored result already"})


def test_a_slice_the_dataset_does_not_have_is_a_404(running, inference_rigs, sent, client):
    response = upload(client, running, 9, b"x", token=token_of(sent, running, inference_rigs[0]))
    assert (response.status_code, response.json()) == (404, {"detail": f"job {running.pk} has no slice 9"})


def test_uploads_without_a_valid_token_of_this_jobs_inference_worker_are_refused(
    running, inference_rigs, sent, client, alice, leased_job
):
    rig_a = inference_rigs[0]
    fetch(running, rig_a)
    lease = task_of(running, rig_a).lease
    key = training.transfer_key(running.pk)
    claims = {"job": str(running.pk), "peer": str(rig_a.pk), "lease": str(lease.pk), "exp": 2**40}
    cases = {
        "none": (None, 401),
        "forged": (protocol.sign_transfer_token("f" * 64, {**claims, "role": INFERENCE}), 401),
        "another job's": (training.transfer_token(leased_job.leases.get()), 401),
        "another role's": (protocol.sign_transfer_token(key, {**claims, "role": "trainer"}), 403),
        "a user's": (alice.token, 401),
    }

    for name, (token, code) in cases.items():
        response = upload(client, running, 0, b"x", token=token)
        assert response.status_code == code, (name, response.content)
    assert not InferenceResult.objects.exists()
    assert JobSlice.objects.get(job=running, slice__index=0).status == JobSlice.Status.ASSIGNED


def test_a_result_over_the_limit_is_a_413_and_nothing_is_kept(
    running, inference_rigs, sent, client, settings
):
    settings.HYPHA_MAX_RESULT_BYTES = 1024
    rig_a = inference_rigs[0]
    fetch(running, rig_a)

    response = upload(
        client, running, 0, b"x" * 2000, token=token_of(sent, running, rig_a), fmt="safetensors"
    )

    assert (response.status_code, response.json()) == (413, {"detail": "the result exceeds 1024 bytes"})
    assert not InferenceResult.objects.exists()
    assert not list(results_directory(running.pk).glob("*"))


# --- completion and downloads ---------------------------------------------------------------------------------


def test_the_job_completes_with_its_last_result_and_every_result_downloads(
    running, inference_rigs, sent, client, alice, carol, anonymous, operator
):
    rig_a, rig_b, _ = inference_rigs
    bodies = {}
    for rig in (rig_a, rig_b, rig_a, rig_b):
        index = fetch(running, rig).index
        bodies[index] = f'{{"row": 0, "tokens": [{index}]}}\n'.encode()

    # when: three results, then the job's detail, then the last
    for index in (0, 1, 2):
        rig = rig_a if index % 2 == 0 else rig_b
        assert (
            upload(client, running, index, bodies[index], token=token_of(sent, running, rig)).status_code
            == 201
        )
    detail = alice.client.get(f"/api/jobs/{running.pk}/").json()
    running.refresh_from_db()
    assert running.status == Job.Status.RUNNING
    last = upload(client, running, 3, bodies[3], token=token_of(sent, running, rig_b))

    # then: COMPLETED, its leases released, its tasks over
    assert (detail["kind"], detail["progress"]) == (
        "inference",
        {"slices_done": 3, "slices_total": 4, "verified": 0, "disputed": 0, "rejected": 0},
    )
    assert last.status_code == 201
    running.refresh_from_db()
    assert (running.status, running.status_reason) == (
        Job.Status.COMPLETED,
        "COMPLETED: 4 of 4 slices processed",
    )
    assert set(Lease.objects.filter(job=running).values_list("status", flat=True)) == {Lease.Status.RELEASED}
    assert set(Task.objects.filter(job=running).values_list("status", flat=True)) == {Task.Status.CANCELLED}
    assert alice.client.get(f"/api/jobs/{running.pk}/").json()["progress"] == {
        "slices_done": 4,
        "slices_total": 4,
        "verified": 0,
        "disputed": 0,
        "rejected": 0,
    }
    # a repeat of the last upload after completion is still answered as stored
    assert upload(client, running, 3, bodies[3], token=token_of(sent, running, rig_b)).status_code == 200

    # and: the zip holds every result and a manifest of them
    archive = alice.client.get(f"/api/jobs/{running.pk}/results/")
    assert archive.status_code == 200
    assert archive["Content-Type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(b"".join(archive.streaming_content))) as bundle:
        contents = {name: bundle.read(name) for name in bundle.namelist()}
    manifest = json.loads(contents.pop("manifest.json"))
    assert contents == {f"{index}.jsonl": body for index, body in bodies.items()}
    assert (manifest["job"], manifest["slices_done"], manifest["slices_total"]) == (str(running.pk), 4, 4)
    assert [
        (entry["index"], entry["file"], entry["sha256"], entry["worker"]) for entry in manifest["results"]
    ] == [
        (
            index,
            f"{index}.jsonl",
            hashlib.sha256(body).hexdigest(),
            str((rig_a if index % 2 == 0 else rig_b).pk),
        )
        for index, body in sorted(bodies.items())
    ]
    # and each result on its own, to its owner and staff only
    one = alice.client.get(f"/api/jobs/{running.pk}/results/2/")
    assert (one.status_code, b"".join(one.streaming_content)) == (200, bodies[2])
    assert operator.client.get(f"/api/jobs/{running.pk}/results/2/").status_code == 200
    assert carol.client.get(f"/api/jobs/{running.pk}/results/2/").status_code == 404
    assert carol.client.get(f"/api/jobs/{running.pk}/results/").status_code == 404
    assert anonymous.get(f"/api/jobs/{running.pk}/results/2/").status_code == 401
    assert anonymous.get(f"/api/jobs/{running.pk}/results/").status_code == 401
    assert alice.client.get(f"/api/jobs/{running.pk}/results/7/").status_code == 404


def test_the_archive_of_a_running_job_holds_the_results_so_far(running, inference_rigs, sent, client, alice):
    rig_a = inference_rigs[0]
    empty = alice.client.get(f"/api/jobs/{running.pk}/results/")
    with zipfile.ZipFile(io.BytesIO(b"".join(empty.streaming_content))) as bundle:
        assert bundle.namelist() == ["manifest.json"]
    fetch(running, rig_a)
    upload(client, running, 0, b"tensor bytes", token=token_of(sent, running, rig_a), fmt="safetensors")

    archive = alice.client.get(f"/api/jobs/{running.pk}/results/")

    with zipfile.ZipFile(io.BytesIO(b"".join(archive.streaming_content))) as bundle:
        assert sorted(bundle.namelist()) == ["0.safetensors", "manifest.json"]
        assert bundle.read("0.safetensors") == b"tensor bytes"


def test_a_training_job_has_no_results_archive(alice, leased_job):
    response = alice.client.get(f"/api/jobs/{leased_job.pk}/results/")
    assert (response.status_code, response.json()) == (
        409,
        {"detail": f"job {leased_job.pk} is not an inference job"},
    )
    detail = alice.client.get(f"/api/jobs/{leased_job.pk}/").json()
    assert (detail["kind"], detail["progress"], detail["inference"]) == ("training", None, None)
