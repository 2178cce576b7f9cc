"""Training workflows when tasks fail or are lost: a failed trainer, replacements, a lost parameter server
restarted from the round it saved with the control plane (dispatch and sync: test_training.py)."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.jobs import services as job_services
from apps.jobs import training
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job, Round, Task
from apps.leases.models import Lease
from tests.apps.conftest import _registered, advert, connect, offer_on
from tests.apps.jobs.test_training import (
    SPEC,
    create_running_job,
    dispatches,
    dispatches_token,
    ready,
    status,
    task_of,
)
from worker_daemon import protocol


@pytest.fixture
def running_job(job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings) -> Job:
    """test_training.py's running job: a DiLoCo job on :data:`SPEC` whose leases are all ACTIVE."""
    settings.HYPHA_OFFER_WINDOW = 60.0
    return create_running_job(SPEC, job_owner, online_rigs, django_capture_on_commit_callbacks)


@pytest.mark.django_db
def test_a_failed_trainer_fails_the_job_and_releases_every_lease(running_job, online_rigs):
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)

    job_services.task_exited(
        worker=rig_a,
        message=protocol.JobExited(
            task_id=task_of(running_job, rig_a).pk, exit_code=1, log_tail="loading\nValueError: bad batch\n"
        ),
    )

    running_job.refresh_from_db()
    assert (running_job.status, running_job.status_reason) == (
        Job.Status.FAILED,
        "FAILED: the trainer on rig-a failed with exit code 1 — last output: ValueError: bad batch",
    )
    assert not running_job.leases.filter(status__in=Lease.LIVE).exists()
    assert set(Task.objects.filter(job=running_job).values_list("status", flat=True)) == {
        "failed",
        "cancelled",
    }
    # a late duplicate report changes nothing
    job_services.task_exited(
        worker=rig_a, message=protocol.JobExited(task_id=task_of(running_job, rig_a).pk, exit_code=0)
    )
    assert task_of(running_job, rig_a).status == "failed"


@pytest.mark.django_db
def test_a_lost_trainer_is_replaced_and_the_replacement_joins_with_the_rounds_done(
    running_job, online_rigs, sent, django_capture_on_commit_callbacks
):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    Round.objects.create(job=running_job, number=1, closed=True)
    lost = task_of(running_job, rig_a)

    # when: rig-a's lease runs out (its daemon died)
    Lease.objects.filter(job=running_job, worker=rig_a).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    with django_capture_on_commit_callbacks(execute=True):
        job_services.tick_leases()

    # then: the job trains on, rig-a's task is over, and a trainer is advertised again
    running_job.refresh_from_db()
    assert running_job.status == Job.Status.RUNNING
    assert running_job.status_reason.startswith("RUNNING: the trainer lease on rig-a expired while training")
    lost.refresh_from_db()
    assert lost.status == Task.Status.CANCELLED
    wanted = advert(running_job, TRAINER)
    assert (wanted.status, wanted.wanted) == ("open", 1)

    # when: a spare worker takes it
    spare = _registered("rig-d")
    connect(spare)
    sent.clear()
    with django_capture_on_commit_callbacks(execute=True):
        job_services.offer_made(worker=spare, message=offer_on(wanted, price=110.0))

    # then: it is dispatched with the parameter server's address, starting after the round already done
    running_job.refresh_from_db()
    assert running_job.status == Job.Status.RUNNING
    assert running_job.status_reason == "RUNNING: 1 replacement trainer(s) joined"
    replacement = task_of(running_job, spare)
    assert (replacement.round, replacement.sync_state) == (1, "training")
    (dispatch,) = [message for _, message in sent if isinstance(message, protocol.DispatchJob)]
    assert dispatch.peers == {str(rig_c.pk): "http://10.0.0.3:7070"}
    # and the parameter server is told to expect it, not the lost one
    reply = status(rig_c, task_of(running_job, rig_c), {"waiting": {"round": 2}})
    assert reply["peers"] == sorted([str(rig_b.pk), str(spare.pk)])


@pytest.mark.django_db
def test_a_parameter_server_lost_before_it_saved_a_round_fails_the_job(running_job, online_rigs):
    rig_c = online_rigs[2]
    ready(running_job, rig_c)
    Lease.objects.filter(job=running_job, worker=rig_c).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )

    job_services.tick_leases()

    running_job.refresh_from_db()
    assert running_job.status == Job.Status.FAILED
    assert running_job.status_reason == (
        "FAILED: the parameter server lease on rig-c expired while training: not renewed before it ran out; "
        "it had saved no round to restart from"
    )


def save_checkpoint(client, job: Job, token: str, number: int, files: dict[str, bytes]) -> list:
    """PUT a round's files, the manifest last, as the parameter server does; the responses."""
    manifest = {"format": 1, "round_number": number, "has_momentum": "momentum.safetensors" in files}
    manifest["has_result"] = "result.safetensors" in files
    bodies = {**files, "round.json": json.dumps(manifest).encode()}
    return [
        client.put(
            f"/api/jobs/{job.pk}/checkpoint/{number}/{name}",
            body,
            content_type="application/octet-stream",
            HTTP_AUTHORIZATION=f"Bearer {token}",
        )
        for name, body in bodies.items()
    ]


@pytest.mark.django_db(transaction=True)
def test_the_parameter_server_saves_rounds_with_the_control_plane_and_only_it(
    running_job, online_rigs, client
):
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    token = dispatches_token(running_job, rig_c)
    trainer_token = training.transfer_token(task_of(running_job, rig_a).lease)
    url = f"/api/jobs/{running_job.pk}/checkpoint"

    # a trainer's token, a forged one or none may not save a round; a file that is not a checkpoint's is a 400
    for header, expected in ((f"Bearer {trainer_token}", 403), ("Bearer forged.token", 401), ("", 401)):
        response = client.put(
            f"{url}/1/weights.safetensors",
            b"w",
            content_type="application/octet-stream",
            HTTP_AUTHORIZATION=header,
        )
        assert response.status_code == expected, response.content
    bad = client.put(
        f"{url}/1/..evil", b"w", content_type="application/octet-stream", HTTP_AUTHORIZATION=f"Bearer {token}"
    )
    assert bad.status_code == 400 and list(bad.json()) == ["filename"]

    # a manifest naming files that were not sent is refused, and nothing is saved
    missing = save_checkpoint(client, running_job, token, 1, {"weights.safetensors": b"w1"})
    assert [response.status_code for response in missing] == [201, 201]
    refused = client.put(
        f"{url}/2/round.json",
        json.dumps({"format": 1, "round_number": 2, "has_momentum": True}).encode(),
        content_type="application/octet-stream",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    assert (
        refused.status_code == 409
        and "missing weights.safetensors, momentum.safetensors" in refused.json()["detail"]
    )
    running_job.refresh_from_db()
    assert running_job.checkpoint["round"] == 1

    # when: round 2 is saved, then round 1 comes again late
    files = {"weights.safetensors": b"w2", "momentum.safetensors": b"m2", "result.safetensors": b"u2"}
    assert [response.status_code for response in save_checkpoint(client, running_job, token, 2, files)] == [
        201
    ] * 4
    late = client.put(
        f"{url}/1/weights.safetensors",
        b"old",
        content_type="application/octet-stream",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )

    # then: round 2 is the job's checkpoint, the late round is refused, and the server can fetch every file
    assert (late.status_code, late.json()) == (409, {"detail": "round 1 is older than the saved round 2"})
    running_job.refresh_from_db()
    assert running_job.checkpoint["round"] == 2
    assert running_job.rounds.get(number=2).closed  # a saved round is applied, reported or not
    # (a manifest without base_round is a round of full weights: its own base; its result is named by round)
    assert running_job.checkpoint["base"] == 2
    downloaded = {"weights.safetensors": b"w2", "momentum.safetensors": b"m2", "result-2.safetensors": b"u2"}
    assert sorted(running_job.checkpoint["files"]) == sorted([*downloaded, "round.json"])
    for name, body in downloaded.items():
        assert running_job.checkpoint["files"][name]["sha256"] == hashlib.sha256(body).hexdigest()
        fetched = client.get(f"{url}/{name}", HTTP_AUTHORIZATION=f"Bearer {token}")
        assert (fetched.status_code, b"".join(fetched.streaming_content)) == (200, body)
    assert (
        client.get(f"{url}/weights.safetensors", HTTP_AUTHORIZATION=f"Bearer {trainer_token}").status_code
        == 403
    )
    directory = training.checkpoint_directory(running_job.pk)
    assert sorted(path.name for path in directory.iterdir()) == ["round-2"]


def chained_manifest(number: int, base: int) -> bytes:
    """round.json of a round on round ``base``'s weights, as parameter_server/checkpoints.py writes it."""
    chain = [{"round": n, "stepped": True} for n in range(base + 1, number + 1)]
    manifest = {"format": 1, "round_number": number, "has_momentum": True, "has_result": number > 0}
    manifest |= {"participants": [], "base_round": base, "chain": chain, "digest": "sha256:" + "0" * 64}
    return json.dumps(manifest).encode()


@pytest.mark.django_db(transaction=True)
def test_an_incremental_copy_keeps_the_base_weights_and_the_results_since(running_job, online_rigs, client):
    rig_c = online_rigs[2]
    ready(running_job, rig_c)
    token = dispatches_token(running_job, rig_c)
    url = f"/api/jobs/{running_job.pk}/checkpoint"

    def put(number: int, name: str, body: bytes):
        return client.put(
            f"{url}/{number}/{name}",
            body,
            content_type="application/octet-stream",
            HTTP_AUTHORIZATION=f"Bearer {token}",
        )

    def entry(body: bytes) -> dict:
        return {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}

    # given round 0 (a base: its weights) and round 1 on it (momentum and result only)
    for number, name, body in (
        (0, "weights.safetensors", b"w0"),
        (0, "momentum.safetensors", b"m0"),
        (0, "round.json", chained_manifest(0, 0)),
        (1, "momentum.safetensors", b"m1"),
        (1, "result.safetensors", b"u1"),
        (1, "round.json", chained_manifest(1, 0)),
    ):
        assert put(number, name, body).status_code == 201, (number, name)
    running_job.refresh_from_db()
    assert running_job.checkpoint == {
        "round": 1,
        "base": 0,
        "files": {
            "weights.safetensors": entry(b"w0"),
            "momentum.safetensors": entry(b"m1"),
            "result-1.safetensors": entry(b"u1"),
            "round.json": entry(chained_manifest(1, 0)),
        },
    }
    saved = dict(running_job.checkpoint)

    # when rounds that could not be replayed on the copy come: one on a base the copy does not hold, one
    # after a round it does not hold, one on an earlier base without its result
    for number, base in ((2, 1), (3, 0)):
        assert put(number, "momentum.safetensors", b"mx").status_code == 201
        assert put(number, "result.safetensors", b"ux").status_code == 201
        refused = put(number, "round.json", chained_manifest(number, base))
        assert refused.status_code == 409
        assert refused.json() == {
            "detail": f"round {number} builds on round {base}'s weights and the results since, but the "
            f"control plane keeps round 1 on round 0's weights: upload round {number} with its weights"
        }
    bad_chain = json.loads(chained_manifest(2, 0)) | {"chain": [{"round": 2, "stepped": True}]}
    assert put(2, "round.json", json.dumps(bad_chain).encode()).json() == {
        "filename": ["round.json: the chain must name rounds 1 to 2"]
    }

    # then nothing changed
    running_job.refresh_from_db()
    assert running_job.checkpoint == saved

    # when round 2 is a new base and round 3 builds on it
    for number, name, body in (
        (2, "weights.safetensors", b"w2"),
        (2, "momentum.safetensors", b"m2"),
        (2, "result.safetensors", b"u2"),
        (2, "round.json", chained_manifest(2, 2)),
        (3, "momentum.safetensors", b"m3"),
        (3, "result.safetensors", b"u3"),
        (3, "round.json", chained_manifest(3, 2)),
    ):
        assert put(number, name, body).status_code == 201, (number, name)

    # then the copy is round 2's weights and round 3's result and momentum; what came before is gone
    running_job.refresh_from_db()
    assert running_job.checkpoint == {
        "round": 3,
        "base": 2,
        "files": {
            "weights.safetensors": entry(b"w2"),
            "momentum.safetensors": entry(b"m3"),
            "result-3.safetensors": entry(b"u3"),
            "round.json": entry(chained_manifest(3, 2)),
        },
    }
    for name, body in (
        ("weights.safetensors", b"w2"),
        ("momentum.safetensors", b"m3"),
        ("result-3.safetensors", b"u3"),
        ("round.json", chained_manifest(3, 2)),
    ):
        fetched = client.get(f"{url}/{name}", HTTP_AUTHORIZATION=f"Bearer {token}")
        assert (fetched.status_code, b"".join(fetched.streaming_content)) == (200, body), name
    assert client.get(f"{url}/result-1.safetensors", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 404
    directory = training.checkpoint_directory(running_job.pk)
    assert sorted(path.name for path in directory.iterdir()) == ["round-2", "round-3"]
    assert sorted(path.name for path in (directory / "round-2").iterdir()) == [
        ".result.safetensors.json",
        ".weights.safetensors.json",
        "result.safetensors",
        "weights.safetensors",
    ]
    assert running_job.rounds.get(number=3).closed


@pytest.mark.django_db(transaction=True)
def test_a_lost_parameter_server_is_replaced_and_resumes_from_the_saved_round(
    running_job, online_rigs, sent, client
):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    token = dispatches_token(running_job, rig_c)
    files = {"weights.safetensors": b"w1", "momentum.safetensors": b"m1", "result.safetensors": b"u1"}
    save_checkpoint(client, running_job, token, 1, files)
    status(rig_c, task_of(running_job, rig_c), {"round": {"round": 1, "participants": [str(rig_a.pk)]}})
    first_server_peer = str(rig_c.pk)

    # when: rig-c's lease runs out (its daemon died)
    Lease.objects.filter(job=running_job, worker=rig_c).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    job_services.tick_leases()

    # then: the job goes on, rig-c's task is over, and a parameter server is advertised again
    running_job.refresh_from_db()
    assert running_job.status == Job.Status.RUNNING
    assert running_job.status_reason == (
        "RUNNING: the parameter server lease on rig-c expired while training: not renewed before it ran out; "
        "a new one is advertised to resume after round 1"
    )
    assert task_of(running_job, rig_c).status == Task.Status.CANCELLED
    wanted = advert(running_job, PARAMETER_SERVER)
    assert (wanted.status, wanted.wanted) == ("open", 1)
    # the lost server's token saves no more rounds
    assert save_checkpoint(client, running_job, token, 2, files)[0].status_code == 403

    # when: a spare worker takes it
    spare = _registered("rig-d")
    connect(spare)
    sent.clear()
    job_services.offer_made(worker=spare, message=offer_on(wanted, price=100.0))

    # then: a server is dispatched to it, naming the saved round and the trainers, with a token of its own
    dispatch = dispatches(sent)[PARAMETER_SERVER]
    config = dispatch.spec["executor"]["config"]
    assert config["checkpoint"] == {
        "round": 1,
        "uri": f"/api/jobs/{running_job.pk}/checkpoint/",
        "files": running_job.checkpoint["files"],
    }
    assert sorted(config["updates"]["peers"]) == sorted([str(rig_a.pk), str(rig_b.pk)])
    running_job.refresh_from_db()
    assert running_job.status_reason == (
        "RUNNING: parameter server dispatched to rig-d, resuming after round 1; waiting for it to listen"
    )
    new_token = dispatch.transfer_token
    fetched = client.get(
        f"/api/jobs/{running_job.pk}/checkpoint/round.json", HTTP_AUTHORIZATION=f"Bearer {new_token}"
    )
    assert fetched.status_code == 200

    # when: it listens
    sent.clear()
    status(spare, task_of(running_job, spare), {"ready": {"url": "http://10.0.0.4:7070", "round": 1}})

    # then: the trainers are told its address under the peer id their specs name
    told = [message for _, message in sent if isinstance(message, protocol.DispatchJob)]
    assert sorted(message.lease_id for message in told) == sorted(
        task_of(running_job, rig).lease_id for rig in (rig_a, rig_b)
    )
    assert {tuple(message.peers.items()) for message in told} == {
        ((first_server_peer, "http://10.0.0.4:7070"),)
    }
    # and when it is done, the job completes on its exit, not on the lost one's
    for number in (1, 2):
        status(spare, task_of(running_job, spare), {"round": {"round": number, "participants": []}})
    running_job.model_files = {"model.safetensors": {"size": 1, "sha256": "0" * 64}}
    running_job.save()
    for worker in (spare, rig_a, rig_b):
        job_services.task_exited(
            worker=worker, message=protocol.JobExited(task_id=task_of(running_job, worker).pk, exit_code=0)
        )
    running_job.refresh_from_db()
    assert running_job.status == Job.Status.COMPLETED
    assert list(running_job.rounds.values_list("number", flat=True)) == [1, 2]
    assert not training.checkpoint_directory(running_job.pk).exists()  # nothing resumes from it any more


@pytest.mark.django_db
def test_a_parameter_server_lost_after_it_stored_the_model_completes_the_job(running_job, online_rigs):
    rig_c = online_rigs[2]
    ready(running_job, rig_c)
    Round.objects.create(job=running_job, number=1, closed=True)
    Round.objects.create(job=running_job, number=2, closed=True)
    Job.objects.filter(pk=running_job.pk).update(
        model_files={"model.safetensors": {"size": 1, "sha256": "0" * 64}},
        checkpoint={"round": 2, "files": {}},
    )

    # when: its lease runs out while it waits for the trainers' last fetches
    Lease.objects.filter(job=running_job, worker=rig_c).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    job_services.tick_leases()

    # then: nothing is left to do: the job completes and nobody is advertised
    running_job.refresh_from_db()
    assert (running_job.status, running_job.status_reason) == (Job.Status.COMPLETED, "COMPLETED: 2 rounds")
    assert not running_job.advertisements.filter(status="open").exists()


@pytest.mark.django_db
def test_a_trainer_lost_after_the_last_round_is_not_replaced(running_job, online_rigs):
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    Round.objects.create(job=running_job, number=1, closed=True)
    Round.objects.create(job=running_job, number=2, closed=True)
    Lease.objects.filter(job=running_job, worker=rig_a).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )

    job_services.tick_leases()

    running_job.refresh_from_db()
    assert running_job.status == Job.Status.RUNNING
    assert not running_job.advertisements.filter(role=TRAINER, status="open").exists()
