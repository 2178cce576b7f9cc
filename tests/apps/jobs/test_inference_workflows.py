"""Inference job workflows beyond the API: a lost worker's slices and its replacement, task exits, a
repeated slice request, an uploaded model's artifact, cancellation and the allocation deadline."""

from __future__ import annotations

import uuid

import pytest

from apps.datasets.models import JobSlice
from apps.jobs import allocation, training
from apps.jobs import services as job_services
from apps.jobs.exceptions import TransferRefused
from apps.jobs.models import INFERENCE, Job, Task, Upload
from apps.jobs.training.plans import is_training_job
from apps.jobs.training.uploads import authorise_upload_download
from apps.leases.models import Lease
from apps.market.models import Advertisement
from tests.apps.conftest import advert, offer_on
from tests.apps.jobs.inference_helpers import (
    BODY,
    fetch,
    lease_workers,
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


def test_a_lost_workers_slices_go_back_and_a_replacement_joins_while_the_others_go_on(
    running, inference_rigs, sent, client, django_capture_on_commit_callbacks
):
    rig_a, rig_b, rig_c = inference_rigs
    assert [fetch(running, rig).index for rig in (rig_a, rig_b, rig_a)] == [0, 1, 2]
    assert upload(client, running, 0, b"done", token=token_of(sent, running, rig_a)).status_code == 201
    lost_lease = task_of(running, rig_a).lease

    # when: rig-a's daemon gives its lease back (shut down) with slice 2 unfinished
    with django_capture_on_commit_callbacks(execute=True):
        assert job_services.lease_given_back(worker=rig_a, lease_id=lost_lease.pk, reason="shutdown")

    # then: its stored result stays, its unfinished slice is AVAILABLE again, the job RUNS on, and one worker
    # is advertised again
    states = dict(JobSlice.objects.filter(job=running).values_list("slice__index", "status"))
    assert states == {0: "used", 1: "assigned", 2: "available", 3: "available"}
    running.refresh_from_db()
    assert running.status == Job.Status.RUNNING
    assert Task.objects.get(lease=lost_lease).status == Task.Status.CANCELLED
    ad = Advertisement.objects.get(job=running, status=Advertisement.Status.OPEN)
    assert (ad.role, ad.wanted) == (INFERENCE, 1)
    # its token uploads nothing more (the task is over)
    rejected = upload(client, running, 2, b"late", token=token_of(sent, running, rig_a))
    assert (rejected.status_code, rejected.json()) == (
        403,
        {"detail": "this inference task is cancelled; it uploads no more"},
    )
    assert running.status_reason == (
        "RUNNING: the inference lease on rig-a released while running: released by the worker: shutdown; "
        "a replacement is advertised"
    )

    # when: rig-c takes the advert
    sent.clear()
    with django_capture_on_commit_callbacks(execute=True):
        job_services.offer_made(worker=rig_c, message=offer_on(advert(running, INFERENCE), price=70.0))

    # then: it is dispatched at once and gets the lost worker's slice first
    running.refresh_from_db()
    assert running.status == Job.Status.RUNNING
    assert running.status_reason == "RUNNING: 1 replacement inference worker(s) joined; 1 of 4 slices done"
    (dispatch,) = [message for _, message in sent if isinstance(message, protocol.DispatchJob)]
    assert dispatch.task_id == task_of(running, rig_c).pk
    assert fetch(running, rig_c).index == 2


def test_a_clean_task_exit_neither_completes_nor_fails_the_job_and_its_last_results_are_taken(
    running, inference_rigs, sent, client
):
    rig_a = inference_rigs[0]
    task = task_of(running, rig_a)
    assert fetch(running, rig_a).index == 0

    job_services.task_exited(
        worker=rig_a, message=protocol.JobExited(task_id=task.pk, exit_code=0, signal=None, reason="exited")
    )

    running.refresh_from_db()
    assert running.status == Job.Status.RUNNING
    assert Task.objects.get(pk=task.pk).status == Task.Status.EXITED
    # its daemon delivers the result it sent before the executor exited
    assert upload(client, running, 0, b"last", token=token_of(sent, running, rig_a)).status_code == 201


def test_a_repeated_slice_request_gets_the_same_answer_not_a_second_slice(running, inference_rigs):
    rig_a = inference_rigs[0]
    message = protocol.FetchSlice(
        request_id=uuid.uuid4(), task_id=task_of(running, rig_a).pk, dataset="tiny-text"
    )

    first = job_services.slice_requested(worker=rig_a, message=message)
    again = job_services.slice_requested(worker=rig_a, message=message)

    assert (first.index, again.index) == (0, 0)
    assert JobSlice.objects.filter(job=running, status=JobSlice.Status.ASSIGNED).count() == 1


def test_another_workers_task_gets_no_slice(running, inference_rigs):
    rig_a, _, rig_c = inference_rigs
    message = protocol.FetchSlice(
        request_id=uuid.uuid4(), task_id=task_of(running, rig_a).pk, dataset="tiny-text"
    )
    reply = job_services.slice_requested(worker=rig_c, message=message)
    assert reply.error == f"task {message.task_id} is not a task of this worker"
    assert not JobSlice.objects.filter(job=running, status=JobSlice.Status.ASSIGNED).exists()


def test_an_inference_job_is_not_a_training_job_and_cancelling_it_releases_its_leases(running, alice):
    assert not is_training_job(running)

    response = alice.client.post(f"/api/jobs/{running.pk}/cancel/")

    assert response.status_code == 200
    running.refresh_from_db()
    assert running.status == Job.Status.CANCELLED
    assert set(Lease.objects.filter(job=running).values_list("status", flat=True)) == {Lease.Status.RELEASED}


def test_a_job_on_an_upload_sends_its_workers_to_the_control_plane_for_it(
    alice, data_node, inference_rigs, sent, django_capture_on_commit_callbacks
):
    # given
    upload_row = training.store_upload(alice.user, "tiny.zip", iter([b"PK model"]), limit=1 << 20)
    body = {**BODY, "model": {"source": {"type": "upload", "file": "tiny.zip"}}}

    # when
    response = submit(alice.client, django_capture_on_commit_callbacks, body)
    job = lease_workers(
        Job.objects.get(pk=response.json()["id"]), inference_rigs[:2], django_capture_on_commit_callbacks
    )

    # then: the stored spec names the upload by id, the job JSON points at its content
    assert job.spec["model"]["source"] == {"type": "upload", "file": str(upload_row.pk)}
    dispatch = next(message for _, message in sent if isinstance(message, protocol.DispatchJob))
    assert dispatch.spec["executor"]["config"]["model"]["artifact"] == {
        "type": "uri",
        "value": f"/api/uploads/{upload_row.pk}/content/",
    }
    # and the workers' transfer tokens may download it; another upload stays closed to them
    authorise_upload_download(upload_row, user=None, token=dispatch.transfer_token)
    other = Upload.objects.create(owner=alice.user, name="other.zip", size=1, sha256="0" * 64)
    with pytest.raises(TransferRefused):
        authorise_upload_download(other, user=None, token=dispatch.transfer_token)


def test_an_inference_job_past_its_deadline_says_how_many_workers_it_had(
    alice, data_node, inference_rigs, django_capture_on_commit_callbacks
):
    response = submit(alice.client, django_capture_on_commit_callbacks, {**BODY, "workers": 3})
    job = Job.objects.get(pk=response.json()["id"])
    lease_workers(job, inference_rigs[:1], django_capture_on_commit_callbacks)
    with django_capture_on_commit_callbacks(execute=True):
        job_services.settle_advertisement(advert(job, INFERENCE).pk, closing=True)

    assert (
        allocation.timeout_reason(job)
        == "FAILED: not fully allocated within 600 s: 1 of 3 inference workers leased"
    )


def test_an_inference_tasks_progress_is_counted_on_the_task_and_answered_ok(running, inference_rigs):
    rig_a = inference_rigs[0]
    task = task_of(running, rig_a)

    def report(progress, request_id=None):
        message = protocol.StatusReport(
            request_id=request_id or uuid.uuid4(), task_id=task.pk, progress=progress
        )
        return job_services.status_reported(worker=rig_a, message=message).reply

    # when: two slices' reports (the executor's shape), one repeated after a reconnect, and a bare value
    first = uuid.uuid4()
    replies = [
        report(
            {"metrics": {"round": 1, "metrics": {"slices_done": 1.0, "samples": 8.0, "seconds": 0.5}}}, first
        ),
        report(
            {"metrics": {"round": 1, "metrics": {"slices_done": 1.0, "samples": 8.0, "seconds": 0.5}}}, first
        ),
        report({"metrics": {"round": 2, "metrics": {"slices_done": 2.0, "samples": 3.0, "seconds": 0.2}}}),
        report("anything"),
    ]

    # then
    assert replies == [{"type": "Ok"}] * 4
    task.refresh_from_db()
    assert (task.status, task.samples_total, task.steps_total) == (Task.Status.RUNNING, 11, 2)
    running.refresh_from_db()
    assert running.status == Job.Status.RUNNING


def test_a_worker_that_asks_after_the_job_completed_is_told_it_is_done_not_refused(
    running, inference_rigs, sent, client
):
    # A CI-like e2e run: one worker stored the job's last result; the other's next claim was refused ("not a
    # running inference task"), which its bridge turned into a 500 and its executor into exit code 3.
    rig_a, rig_b, _ = inference_rigs
    token = token_of(sent, running, rig_a)
    for _ in range(4):
        index = fetch(running, rig_a).index
        assert upload(client, running, index, b"done", token=token).status_code == 201
    running.refresh_from_db()
    assert running.status == Job.Status.COMPLETED

    reply = fetch(running, rig_b)

    assert (reply.done, reply.error, reply.index) == (True, None, None)
