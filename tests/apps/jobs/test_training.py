"""Training workflows: dispatch, the fixed-H sync protocol, slices, rounds, the final model, and job endings
(performance-aware sync: test_sync.py)."""

from __future__ import annotations

import io
import time
import uuid
import zipfile
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from apps.datasets import services as dataset_services
from apps.jobs import services as job_services
from apps.jobs import spec as job_spec
from apps.jobs import training
from apps.jobs.exceptions import TaskRefused
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job, Round, Task
from apps.leases.models import Lease
from tests.apps.conftest import advert, offer_on
from worker_daemon import protocol

SPEC = {
    "model": {
        "source": {
            "type": "config",
            "config": {"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2},
        },
        "type": "causal-lm",
        "input_names": ["input_ids", "labels"],
    },
    "dataset": {"name": "tiny-text"},
    "inner_optimizer": {"learning_rate": 0.001},
    "outer_optimizer": {"learning_rate": 0.7, "momentum": 0.9},
    "rounds": {"update_rounds": 2, "inner_steps": 3, "round_timeout": 30.0},
    "batch_size": 4,
    "num_trainers": 2,
    "evaluation": {"holdout": 1, "batch_size": 8},
    "trainer": {
        "resources": {"cpu": 4, "memory": 16, "storage": 50, "gpu": 16},
        "price": {"bid": 100, "max": 130},
    },
    "parameter_server": {"resources": {"cpu": 2, "memory": 8, "storage": 20, "gpu": 0}},
}


def dispatches(sent) -> dict[str, protocol.DispatchJob]:
    return {message.role: message for _, message in sent if isinstance(message, protocol.DispatchJob)}


def create_running_job(spec: dict, job_owner, online_rigs, capture) -> Job:
    """A DiLoCo job on ``spec`` whose leases are all ACTIVE: rig-a and rig-b train, rig-c is the parameter
    server (``capture`` is pytest-django's ``django_capture_on_commit_callbacks``)."""
    parsed = job_spec.parse_json(spec)
    with capture(execute=True):
        job = job_services.create_job(
            owner=job_owner,
            name="tiny-gpt",
            num_trainers=2,
            requirements=job_spec.to_requirements(parsed),
            spec=parsed.model_dump(mode="json"),
        )
    rig_a, rig_b, rig_c = online_rigs
    with capture(execute=True):
        job_services.offer_made(worker=rig_a, message=offer_on(advert(job, TRAINER), price=120.0))
        job_services.offer_made(worker=rig_b, message=offer_on(advert(job, TRAINER), price=125.0))
        job_services.offer_made(worker=rig_c, message=offer_on(advert(job, PARAMETER_SERVER), price=100.0))
    job.refresh_from_db()
    return job


@pytest.fixture
def running_job(job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings) -> Job:
    """A DiLoCo job on :data:`SPEC` (fixed H = 3) whose leases are all ACTIVE."""
    # Enough offers settle an advert at once; a long window only keeps a slow machine from closing it between
    # the advert and the offers.
    settings.HYPHA_OFFER_WINDOW = 60.0
    return create_running_job(SPEC, job_owner, online_rigs, django_capture_on_commit_callbacks)


def status(worker, task: Task, progress) -> dict:
    message = protocol.StatusReport(request_id=uuid.uuid4(), task_id=task.pk, progress=progress)
    return job_services.status_reported(worker=worker, message=message).reply


def task_of(job: Job, worker) -> Task:
    return Task.objects.get(job=job, lease__worker=worker)


def ready(job, rig_c, *, url: str = "http://10.0.0.3:7070") -> dict:
    return status(rig_c, task_of(job, rig_c), {"ready": {"url": url, "round": 0}})


# --- dispatch ------------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_an_allocated_training_job_dispatches_its_parameter_server_and_trainers(
    running_job, online_rigs, sent
):
    rig_a, rig_b, rig_c = online_rigs

    # then: RUNNING, a task per lease, the parameter server's first, with the held-out slice for eval
    assert running_job.status == Job.Status.RUNNING
    assert running_job.status_reason == (
        "RUNNING: parameter server dispatched to rig-c and 2 trainers; waiting for it to listen"
    )
    server = Task.objects.get(job=running_job, role=PARAMETER_SERVER)
    assert (server.lease.worker_id, server.status) == (rig_c.pk, "dispatched")
    assert Task.objects.filter(job=running_job, role=TRAINER).count() == 2
    kinds = [message.role for _, message in sent if isinstance(message, protocol.DispatchJob)]
    assert kinds == [PARAMETER_SERVER, TRAINER, TRAINER]
    # the trainers start while the parameter server does: its address comes once it listens
    assert dispatches(sent)[TRAINER].peers == {}
    dispatch = dispatches(sent)[PARAMETER_SERVER]
    config = dispatch.spec["executor"]["config"]
    assert dispatch.spec["executor"]["class"] == "aggregate"
    assert sorted(config["updates"]["peers"]) == sorted([str(rig_a.pk), str(rig_b.pk)])
    # an update may claim at most H full batches (3 steps of 4): more is refused by the parameter server
    assert config["rounds"] == {
        "update_rounds": 2,
        "round_timeout": 30.0,
        "weighted": True,
        "max_samples_per_update": 12,
    }
    assert config["model"]["source"]["type"] == "config"
    assert without_tokens(config["eval"]) == {
        "dataset": "tiny-text",
        "batch_size": 8,
        "slices": [
            {
                "index": 3,
                "size": 1003,
                "sha256": "3" * 64,
                "urls": ["http://east.example:8100/datasets/tiny-text/slices/3"],
            }
        ],
    }
    # the held-out slice is never trained on
    assert dataset_services.progress(running_job)["total"] == 3
    # the token verifies with the key the parameter server got, and names its lease and role
    claims = protocol.verify_transfer_token(
        dispatch.transfer_key, dispatch.transfer_token, job_id=str(running_job.pk)
    )
    assert (claims["peer"], claims["role"], claims["lease"]) == (
        str(rig_c.pk),
        PARAMETER_SERVER,
        str(server.lease_id),
    )


@pytest.mark.django_db
def test_the_trainers_are_told_where_the_parameter_server_listens(running_job, online_rigs, sent):
    rig_a, rig_b, rig_c = online_rigs
    key = dispatches(sent)[PARAMETER_SERVER].transfer_key
    sent.clear()

    # when
    reply = ready(running_job, rig_c)

    # then: each trainer's dispatch again, now with the address (the daemon takes the peers of a running task)
    assert reply == {"type": "Ok", "path": "direct"}  # the rigs say they accept connections
    running_job.refresh_from_db()
    assert running_job.status_reason == (
        "RUNNING: parameter server listening at http://10.0.0.3:7070; 2 trainers told"
    )
    assert sorted(worker for worker, message in sent if isinstance(message, protocol.DispatchJob)) == sorted(
        [rig_a.pk, rig_b.pk]
    )
    trainer = dispatches(sent)[TRAINER]
    assert trainer.peers == {str(rig_c.pk): "http://10.0.0.3:7070"}
    config = trainer.spec["executor"]["config"]
    assert config["model"]["artifact"] == {
        "type": "parameter-server",
        "peer": str(rig_c.pk),
        "filenames": ["config.json", "model.safetensors"],
    }
    assert config["data"] == {"type": "scheduler", "peer": "control-plane", "dataset": "tiny-text"}
    assert config["updates"]["peers"] == [str(rig_c.pk)] == config["results"]["peers"]
    assert config["batch_size"] == 4
    claims = protocol.verify_transfer_token(key, trainer.transfer_token, job_id=str(running_job.pk))
    assert claims["role"] == TRAINER
    assert Task.objects.filter(job=running_job, role=TRAINER).count() == 2
    stored = Task.objects.get(pk=trainer.task_id).dispatch_message
    assert stored["peers"] == {str(rig_c.pk): "http://10.0.0.3:7070"}  # what a reconnecting daemon is sent
    # a repeated ready (a restarted parameter server) starts no second trainer task; it re-points them
    ready(running_job, rig_c, url="http://10.0.0.4:7070")
    assert Task.objects.filter(job=running_job, role=TRAINER).count() == 2
    assert dispatches(sent)[TRAINER].peers == {str(rig_c.pk): "http://10.0.0.4:7070"}


@pytest.mark.django_db
def test_an_unknown_parameter_server_url_is_refused(running_job, online_rigs):
    rig_c = online_rigs[2]
    assert ready(running_job, rig_c, url="file:///etc/passwd") == {"type": "Error"}
    assert not Task.objects.filter(job=running_job, role=PARAMETER_SERVER).exclude(url="").exists()


# --- the sync protocol -----------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_trainers_sync_every_h_steps_and_finish_after_the_last_round(running_job, online_rigs):
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    task = task_of(running_job, rig_a)
    step = {"status": {"batch_size": 4, "loss": 2.5, "step_time": 0.1}}

    # round 1: H = 3 steps, then "stop after this batch"
    replies = [status(rig_a, task, step) for _ in range(3)]
    assert replies == [{"type": "Continue"}, {"type": "Continue"}, {"type": "ScheduleUpdate", "counter": 0}]
    assert status(rig_a, task, step) == {"type": "Continue"}  # one more batch in flight: no second schedule
    assert status(rig_a, task, "update") == {"type": "Ok"}
    assert status(rig_a, task, {"metrics": {"round": 1, "metrics": {"loss": 2.25, "junk": "x"}}}) == {
        "type": "Ok"
    }
    assert status(rig_a, task, "update-received") == {"type": "Continue"}
    task.refresh_from_db()
    assert (task.round, task.steps_in_round, task.steps_total, task.samples_total, task.sync_state) == (
        1,
        0,
        4,
        16,
        "training",
    )
    assert Round.objects.get(job=running_job, number=1).trainer_metrics == {str(rig_a.pk): {"loss": 2.25}}

    # round 2, the last: update-received answers Done, and later statuses are errors
    assert [status(rig_a, task, step) for _ in range(3)][-1] == {"type": "ScheduleUpdate", "counter": 0}
    assert status(rig_a, task, {"update": None}) == {"type": "Ok"}
    assert status(rig_a, task, "update-received") == {"type": "Done"}
    assert status(rig_a, task, step) == {"type": "Error"}
    assert status(rig_a, task, {"nonsense": 1}) == {"type": "Error"}


@pytest.mark.django_db
def test_a_repeated_request_is_answered_again_without_counting_twice(running_job, online_rigs):
    # given: a daemon that reconnected repeats its pending status and slice requests with the same ids
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    task = task_of(running_job, rig_a)
    step = protocol.StatusReport(
        request_id=uuid.uuid4(), task_id=task.pk, progress={"status": {"batch_size": 4}}
    )
    fetch = protocol.FetchSlice(request_id=uuid.uuid4(), task_id=task.pk, dataset="tiny-text")

    # when
    first = [job_services.status_reported(worker=rig_a, message=step).reply for _ in range(2)]
    slices = [job_services.slice_requested(worker=rig_a, message=fetch) for _ in range(2)]

    # then
    assert first == [{"type": "Continue"}, {"type": "Continue"}]
    task.refresh_from_db()
    assert (task.steps_total, task.samples_total) == (1, 4)
    assert slices[0] == slices[1] and slices[0].index == 0
    assert dataset_services.progress(running_job)["assigned"] == 1


@pytest.mark.django_db
def test_a_worker_cannot_report_for_another_workers_task(running_job, online_rigs):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    with pytest.raises(TaskRefused):
        status(rig_b, task_of(running_job, rig_a), "update")
    assert task_of(running_job, rig_a).sync_state == "training"


@pytest.mark.django_db
def test_a_round_the_parameter_server_discarded_says_so_on_the_job(running_job, online_rigs):
    # given a parameter server whose round 1 result was not finite (it kept the weights)
    _rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    report = {"round": 1, "participants": [], "discarded": "the round's result is not finite"}

    # when it reports the round
    assert status(rig_c, task_of(running_job, rig_c), {"round": report}) == {"type": "Ok"}

    # then the job's status says the round was discarded, not applied
    running_job.refresh_from_db()
    assert running_job.status_reason == (
        "RUNNING: round 1 of 2 discarded, weights kept (the round's result is not finite) (0 trainers)"
    )


@pytest.mark.django_db
def test_round_reports_are_recorded_and_the_last_one_is_answered_done(running_job, online_rigs):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    server = task_of(running_job, rig_c)
    report = {
        "round": 1,
        "participants": [str(rig_a.pk)],
        "left_out": [str(rig_b.pk)],
        "refused": {},
        "samples": 24,
        "duration": 1.5,
        "bytes_in": 1000,
        "bytes_out": 2000,
        "eval_loss": 4.5,
    }

    assert status(rig_c, server, {"round": report}) == {"type": "Ok"}
    assert status(rig_c, server, {"round": {**report, "round": 2, "eval_loss": 4.0}}) == {"type": "Done"}
    assert status(rig_c, server, {"round": {**report, "round": 3}}) == {"type": "Error"}

    first = Round.objects.get(job=running_job, number=1)
    assert (first.closed, first.participants, first.left_out, first.samples, first.eval_loss) == (
        True,
        [str(rig_a.pk)],
        [str(rig_b.pk)],
        24,
        4.5,
    )
    running_job.refresh_from_db()
    assert (
        running_job.status_reason
        == "RUNNING: round 2 of 2 applied (1 trainers, 1 left out, eval loss 4.0000)"
    )


# --- slices ---------------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_trainers_claim_distinct_slices_and_acknowledge_them(running_job, online_rigs):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)

    def fetch(worker):
        message = protocol.FetchSlice(
            request_id=uuid.uuid4(), task_id=task_of(running_job, worker).pk, dataset="tiny-text"
        )
        return job_services.slice_requested(worker=worker, message=message)

    first, second, third = fetch(rig_a), fetch(rig_b), fetch(rig_a)
    assert [first.index, second.index, third.index] == [0, 1, 2]
    assert untokened(first.urls) == ["http://east.example:8100/datasets/tiny-text/slices/0"]
    assert (first.size, first.sha256) == (1000, "0" * 64)
    # every training slice is assigned (slice 3 is held out): ask again later
    waiting = fetch(rig_b)
    assert (waiting.index, waiting.retry_in, waiting.error) == (None, 1.0, None)

    job_services.slice_acknowledged(
        worker=rig_a, message=protocol.SliceAck(task_id=task_of(running_job, rig_a).pk, index=0)
    )
    assert dataset_services.progress(running_job) == {
        "epoch": 0,
        "available": 0,
        "assigned": 2,
        "used": 1,
        "total": 3,
    }
    other = protocol.FetchSlice(
        request_id=uuid.uuid4(), task_id=task_of(running_job, rig_a).pk, dataset="mnist"
    )
    assert "trains on dataset 'tiny-text'" in job_services.slice_requested(worker=rig_a, message=other).error


# --- endings ------------------------------------------------------------------------------------------------


def finish_rounds(job, rig_c) -> None:
    server = task_of(job, rig_c)
    for number in (1, 2):
        status(rig_c, server, {"round": {"round": number, "participants": [], "eval_loss": 3.0 - number}})


@pytest.mark.django_db(transaction=True)
def test_the_job_completes_when_the_model_is_stored_and_the_parameter_server_exits(
    running_job, online_rigs, client
):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    finish_rounds(running_job, rig_c)
    token = dispatches_token(running_job, rig_c)
    url = f"/api/jobs/{running_job.pk}/model"

    # a trainer's token, a forged one, or none may not upload the model
    trainer_token = training.transfer_token(task_of(running_job, rig_a).lease)
    for header, expected in ((f"Bearer {trainer_token}", 403), ("Bearer forged.token", 401), ("", 401)):
        response = client.put(
            f"{url}/model.safetensors",
            b"x",
            content_type="application/octet-stream",
            HTTP_AUTHORIZATION=header,
        )
        assert response.status_code == expected, response.content
    bad_name = client.put(
        f"{url}/..secret",
        b"x",
        content_type="application/octet-stream",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    # a 400 names the field, like every 400 of the API
    assert (bad_name.status_code, bad_name.json()) == (
        400,
        {"filename": ["'..secret' is not an allowed model file name"]},
    )

    # when: the parameter server uploads its model and exits cleanly
    for name, body in (("config.json", b'{"model_type": "gpt2"}'), ("model.safetensors", b"weights")):
        response = client.put(
            f"{url}/{name}",
            body,
            content_type="application/octet-stream",
            HTTP_AUTHORIZATION=f"Bearer {token}",
        )
        assert response.status_code == 201, response.content
    running_job.refresh_from_db()
    assert running_job.status == Job.Status.RUNNING  # not before the parameter server exits
    job_services.task_exited(
        worker=rig_c, message=protocol.JobExited(task_id=task_of(running_job, rig_c).pk, exit_code=0)
    )
    running_job.refresh_from_db()
    assert running_job.status == Job.Status.RUNNING  # the trainers were told Done and are exiting
    for rig in (rig_a, rig_b):
        job_services.task_exited(
            worker=rig, message=protocol.JobExited(task_id=task_of(running_job, rig).pk, exit_code=0)
        )

    # then
    running_job.refresh_from_db()
    assert (running_job.status, running_job.status_reason) == (
        Job.Status.COMPLETED,
        "COMPLETED: 2 rounds; eval loss 1.0000",
    )
    assert set(Task.objects.filter(job=running_job).values_list("status", flat=True)) == {"exited"}
    assert not running_job.leases.filter(status__in=Lease.LIVE).exists()
    client.force_login(running_job.owner)
    archive = client.get(url)
    assert archive.status_code == 200
    with zipfile.ZipFile(io.BytesIO(b"".join(archive.streaming_content))) as bundle:
        assert {name: bundle.read(name) for name in bundle.namelist()} == {
            "config.json": b'{"model_type": "gpt2"}',
            "model.safetensors": b"weights",
        }


@pytest.mark.django_db
def test_trainers_that_never_report_their_exit_do_not_hold_a_finished_job(running_job, online_rigs, tmp_path):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    finish_rounds(running_job, rig_c)
    Job.objects.filter(pk=running_job.pk).update(model_files={"model.safetensors": {"size": 1, "sha256": ""}})
    server = task_of(running_job, rig_c)
    job_services.task_exited(worker=rig_c, message=protocol.JobExited(task_id=server.pk, exit_code=0))
    job_services.tick_training()
    assert Job.objects.get(pk=running_job.pk).status == Job.Status.RUNNING  # within the grace period

    # when: the grace period has passed
    Task.objects.filter(pk=server.pk).update(
        ended_at=timezone.now() - timedelta(seconds=training.TRAINER_EXIT_GRACE + 1)
    )
    job_services.tick_training()

    # then: completed; the silent trainers' tasks are cancelled and every lease released
    running_job.refresh_from_db()
    assert running_job.status == Job.Status.COMPLETED
    assert sorted(Task.objects.filter(job=running_job).values_list("status", flat=True)) == [
        "cancelled",
        "cancelled",
        "exited",
    ]
    assert not running_job.leases.filter(status__in=Lease.LIVE).exists()


@pytest.mark.django_db
def test_a_parameter_server_that_exits_early_fails_the_job(running_job, online_rigs):
    rig_c = online_rigs[2]
    ready(running_job, rig_c)
    job_services.task_exited(
        worker=rig_c, message=protocol.JobExited(task_id=task_of(running_job, rig_c).pk, exit_code=0)
    )
    running_job.refresh_from_db()
    assert (running_job.status, running_job.status_reason) == (
        Job.Status.FAILED,
        "FAILED: the parameter server exited before the last round was applied and its model stored",
    )


def dispatches_token(job, worker) -> str:
    return training.transfer_token(task_of(job, worker).lease)


@pytest.mark.django_db
def test_tasks_get_a_fresh_short_lived_token_with_each_renewal_of_their_lease(running_job, online_rigs, sent):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    sent.clear()

    # when: every lease of the job is due for renewal
    Lease.objects.filter(job=running_job).update(
        expires_at=timezone.now() + timedelta(seconds=1), renewal_requested_at=None
    )
    before = time.time()
    job_services.tick_leases()

    # then: each daemon is asked to renew, and each task gets a new token for its own lease, expiring soon
    renewals = {message.lease_id for _, message in sent if isinstance(message, protocol.RenewLease)}
    tokens = {
        message.task_id: (worker, message)
        for worker, message in sent
        if isinstance(message, protocol.TransferToken)
    }
    assert renewals == set(Lease.objects.filter(job=running_job).values_list("pk", flat=True))
    assert set(tokens) == set(Task.objects.filter(job=running_job).values_list("pk", flat=True))
    for task_id, (worker, message) in tokens.items():
        task = Task.objects.select_related("lease").get(pk=task_id)
        claims = protocol.verify_transfer_token(
            training.transfer_key(running_job.pk), message.transfer_token, job_id=str(running_job.pk)
        )
        assert (str(worker), claims["lease"], claims["peer"], claims["role"]) == (
            str(task.lease.worker_id),
            str(task.lease_id),
            str(task.lease.worker_id),
            task.role,
        )
        assert before + 15 * 60 - 2 <= claims["exp"] <= time.time() + 15 * 60 + 1
    # and a token past its expiry is refused
    with pytest.raises(protocol.TransferTokenError, match="expired"):
        protocol.verify_transfer_token(
            training.transfer_key(running_job.pk),
            message.transfer_token,
            job_id=str(running_job.pk),
            now=time.time() + 15 * 60 + 5,
        )


@pytest.mark.django_db
def test_a_job_on_an_unregistered_dataset_is_refused_at_submission(alice):
    response = alice.client.post("/api/jobs/diloco/", SPEC, format="json")
    assert response.status_code == 400
    assert list(response.json()) == ["dataset.name"]
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_a_running_tasks_output_becomes_its_log_tail(running_job, online_rigs):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    task = task_of(running_job, rig_a)

    # when: two batches of output arrive, together longer than the kept tail
    first = [f"step {n}" for n in range(60)]
    second = [f"step {n}" for n in range(60, 130)]
    for lines in (first, second):
        job_services.task_output(worker=rig_a, message=protocol.TaskLog(task_id=task.pk, lines=lines))

    # then: the last 100 lines are kept, in order
    task.refresh_from_db()
    assert task.log_tail.splitlines() == [f"step {n}" for n in range(30, 130)]
    # another worker cannot write into it
    with pytest.raises(TaskRefused):
        job_services.task_output(worker=rig_b, message=protocol.TaskLog(task_id=task.pk, lines=["forged"]))
    task.refresh_from_db()
    assert task.log_tail.splitlines()[-1] == "step 129"


@pytest.mark.django_db
def test_a_reconnecting_daemon_is_sent_the_dispatches_of_its_live_tasks_again(running_job, online_rigs, sent):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    originals = dispatches(sent)

    # then: each worker gets exactly the frames it was sent, for its live tasks only
    assert job_services.pending_dispatches(worker=rig_c) == [originals[PARAMETER_SERVER]]
    (again,) = job_services.pending_dispatches(worker=rig_a)
    assert again.task_id == task_of(running_job, rig_a).pk and again.spec["executor"]["class"] == "train"
    job_services.task_exited(
        worker=rig_a, message=protocol.JobExited(task_id=task_of(running_job, rig_a).pk, exit_code=0)
    )
    assert job_services.pending_dispatches(worker=rig_a) == []


# --- slice download tokens --------------------------------------------------------------------------------------


def untokened(urls: list[str]) -> list[str]:
    """``urls`` without their query (the download token, which differs with the clock)."""
    return [url.partition("?")[0] for url in urls]


def without_tokens(evaluation: dict) -> dict:
    return {
        **evaluation,
        "slices": [{**entry, "urls": untokened(entry["urls"])} for entry in evaluation["slices"]],
    }


def token_claims(url: str, *, dataset: str, index: int) -> dict:
    """The claims of ``url``'s download token, verified with the key of the data node it points at."""
    import urllib.parse

    from apps.datasets.models import DataNode
    from data_node import tokens

    split = urllib.parse.urlsplit(url)
    node = DataNode.objects.get(url__startswith=f"{split.scheme}://{split.netloc}")
    (token,) = urllib.parse.parse_qs(split.query)["token"]
    return tokens.verify(dataset_services.download_key(node).encode(), token, dataset=dataset, index=index)


@pytest.mark.django_db
def test_a_claimed_slice_url_carries_a_token_for_that_slice_job_and_worker(running_job, online_rigs):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)

    # when
    assigned = job_services.slice_requested(
        worker=rig_b,
        message=protocol.FetchSlice(
            request_id=uuid.uuid4(), task_id=task_of(running_job, rig_b).pk, dataset="tiny-text"
        ),
    )

    # then: the data node would serve it (its key verifies the token), to rig-b of this job, for 30 minutes
    (url,) = assigned.urls
    claims = token_claims(url, dataset="tiny-text", index=assigned.index)
    assert (claims["job"], claims["peer"], claims["slice"]) == (str(running_job.pk), str(rig_b.pk), 0)
    assert time.time() + 29 * 60 < claims["exp"] <= time.time() + 30 * 60
    # and nothing else: another slice's URL with this token is refused
    from data_node import tokens

    with pytest.raises(tokens.SliceTokenError) as refused:
        token_claims(url.replace("/slices/0?", "/slices/1?"), dataset="tiny-text", index=1)
    assert refused.value.status == 403


@pytest.mark.django_db
def test_eval_slice_urls_carry_long_lived_tokens_for_the_parameter_server(running_job, sent):
    # given
    config = dispatches(sent)[PARAMETER_SERVER].spec["executor"]["config"]

    # when
    ((url,),) = [entry["urls"] for entry in config["eval"]["slices"]]
    claims = token_claims(url, dataset="tiny-text", index=3)

    # then: named for this job's parameter server; valid long enough for it to download them at round 1 or
    # after its daemon restarted it from the stored dispatch
    assert (claims["job"], claims["peer"], claims["slice"]) == (str(running_job.pk), "parameter_server", 3)
    assert claims["exp"] >= time.time() + settings.HYPHA_EVAL_SLICE_TOKEN_LIFETIME - 60
