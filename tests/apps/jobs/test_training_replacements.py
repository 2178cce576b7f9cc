"""A replacement trainer is in step with the job: the rounds it is counted in, the rounds its metrics land in,
``Done`` after the last round, and the job's progress it is dispatched with (its LR schedule starts there).

A replacement is dispatched with the rounds the control plane knows are closed; the parameter server may close
one more before the replacement fetches the weights (it closes a round internally before it saves it with the
control plane), so the replacement may train a round later than the control plane first thinks. These tests
drive that case with the frames the parameter server and the trainers send."""

from __future__ import annotations

import copy
import logging
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.jobs import services as job_services
from apps.jobs.models import TRAINER, Job, Round, Task
from apps.leases.models import Lease
from tests.apps.conftest import _registered, advert, connect, offer_on
from tests.apps.jobs.test_training import SPEC, create_running_job, ready, status, task_of
from worker_daemon import protocol

ROUNDS = 4
STEP = {"status": {"batch_size": 4, "loss": 2.5, "step_time": 0.1}}


def spec_with(**rounds) -> dict:
    spec = copy.deepcopy(SPEC)
    spec["rounds"] = {"update_rounds": ROUNDS, "inner_steps": 3, "round_timeout": 30.0, **rounds}
    spec["inner_optimizer"]["schedule"] = {"type": "cosine", "warmup_steps": 2, "training_steps": 40}
    return spec


@pytest.fixture
def running_job(job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings) -> Job:
    """A DiLoCo job of :data:`ROUNDS` rounds of H = 3 steps, its leases ACTIVE, its parameter server (rig-c)
    listening."""
    settings.HYPHA_OFFER_WINDOW = 60.0
    job = create_running_job(spec_with(), job_owner, online_rigs, django_capture_on_commit_callbacks)
    ready(job, online_rigs[2])
    return job


def close_round(job: Job, server_rig, number: int, participants: list, samples: int = 0) -> dict:
    """The parameter server reports round ``number`` closed with ``participants`` (worker objects)."""
    report = {
        "round": number,
        "participants": [str(rig.pk) for rig in participants],
        "samples": samples,
        "duration": 1.0,
    }
    return status(server_rig, task_of(job, server_rig), {"round": report})


def train_round(rig, task: Task, *, steps: int = 3) -> None:
    for _ in range(steps):
        status(rig, task, STEP)
    assert status(rig, task, "update") == {"type": "Ok"}


def replace_rig_a(job: Job, online_rigs, sent, capture) -> tuple:
    """rig-a's lease runs out; a spare daemon (rig-d) takes the advertised role. Returns (rig-d, its dispatch
    frame)."""
    rig_a = online_rigs[0]
    Lease.objects.filter(job=job, worker=rig_a).update(expires_at=timezone.now() - timedelta(seconds=1))
    with capture(execute=True):
        job_services.tick_leases()
    spare = _registered("rig-d")
    connect(spare)
    sent.clear()
    with capture(execute=True):
        job_services.offer_made(worker=spare, message=offer_on(advert(job, TRAINER), price=110.0))
    (dispatch,) = [message for _, message in sent if isinstance(message, protocol.DispatchJob)]
    return spare, dispatch


@pytest.mark.django_db
def test_a_replacement_that_joins_a_round_later_than_dispatched_is_counted_in_the_rounds_it_trains(
    running_job, online_rigs, sent, django_capture_on_commit_callbacks, caplog
):
    rig_a, rig_b, rig_c = online_rigs
    survivor = task_of(running_job, rig_b)
    train_round(rig_b, survivor)
    close_round(running_job, rig_c, 1, [rig_a, rig_b], samples=24)
    assert status(rig_b, survivor, "update-received") == {"type": "Continue"}

    # given: rig-a is lost after round 1; a spare is dispatched while the control plane knows of 1 round ...
    spare, dispatch = replace_rig_a(running_job, online_rigs, sent, django_capture_on_commit_callbacks)
    replacement = task_of(running_job, spare)
    assert replacement.round == 1
    # ... and the parameter server closes round 2 with rig-b alone before the spare fetches the weights: the
    # spare trains round 3 (its executor, counting from 1 like Hypha's, calls it its round 1)
    train_round(rig_b, survivor)
    status(rig_b, survivor, {"metrics": {"round": 2, "metrics": {"loss": 2.0}}})
    close_round(running_job, rig_c, 2, [rig_b], samples=12)
    assert status(rig_b, survivor, "update-received") == {"type": "Continue"}

    train_round(rig_b, survivor)
    status(rig_b, survivor, {"metrics": {"round": 3, "metrics": {"loss": 1.5}}})
    train_round(spare, replacement)
    with caplog.at_level(logging.INFO, logger="apps.jobs"):
        assert status(spare, replacement, {"metrics": {"round": 1, "metrics": {"loss": 9.0}}}) == {
            "type": "Ok"
        }
    close_round(running_job, rig_c, 3, [rig_b, spare], samples=24)

    # then: round 2's mean loss is rig-b's alone; the spare's metrics are not written into another round
    second = Round.objects.get(job=running_job, number=2)
    assert (second.trainer_metrics, second.mean_loss) == ({str(rig_b.pk): {"loss": 2.0}}, 2.0)
    assert Round.objects.get(job=running_job, number=1).trainer_metrics == {}
    assert "round 1" in caplog.text and str(replacement.pk) in caplog.text

    # then: after it merges round 3 the spare counts 3 rounds done, like rig-b
    assert status(spare, replacement, "update-received") == {"type": "Continue"}
    assert status(rig_b, survivor, "update-received") == {"type": "Continue"}
    replacement.refresh_from_db()
    assert (replacement.round, replacement.sync_state) == (3, "training")

    # round 4 (the last): both are projected (due_in known), their metrics land in round 4, both get Done
    for rig, task in ((rig_b, survivor), (spare, replacement)):
        status(rig, task, STEP)
        status(rig, task, STEP)
    expect = status(rig_c, task_of(running_job, rig_c), {"waiting": {"round": 4}})
    assert expect["peers"] == sorted([str(rig_b.pk), str(spare.pk)])
    assert expect["due_in"] is not None
    assert expect["samples"] == {str(rig_b.pk): 8, str(spare.pk): 8}
    for rig, task in ((rig_b, survivor), (spare, replacement)):
        status(rig, task, STEP)
        assert status(rig, task, "update") == {"type": "Ok"}
    status(rig_b, survivor, {"metrics": {"round": 4, "metrics": {"loss": 1.0}}})
    status(spare, replacement, {"metrics": {"round": 2, "metrics": {"loss": 3.0}}})
    close_round(running_job, rig_c, 4, [rig_b, spare], samples=24)
    assert status(spare, replacement, "update-received") == {"type": "Done"}
    assert status(rig_b, survivor, "update-received") == {"type": "Done"}
    last = Round.objects.get(job=running_job, number=4)
    assert last.trainer_metrics == {str(rig_b.pk): {"loss": 1.0}, str(spare.pk): {"loss": 3.0}}
    assert last.mean_loss == 2.0
    assert Round.objects.get(job=running_job, number=2).mean_loss == 2.0


@pytest.mark.django_db
def test_a_replacement_whose_update_received_comes_before_the_round_report_still_gets_done(
    running_job, online_rigs, sent, django_capture_on_commit_callbacks, client
):
    """The parameter server saves a round with the control plane (closing it, with its participants) before it
    publishes the result; its round report may come after the trainers merged. The last round is the
    replacement's first."""
    rig_a, rig_b, rig_c = online_rigs
    for number in (1, 2):
        close_round(running_job, rig_c, number, [rig_a, rig_b], samples=24)
    spare, _ = replace_rig_a(running_job, online_rigs, sent, django_capture_on_commit_callbacks)
    replacement = task_of(running_job, spare)
    assert replacement.round == 2
    close_round(running_job, rig_c, 3, [rig_b], samples=12)  # closed before the spare fetched the weights

    # when: the spare trains round 4 and round 4 is saved (closed, participants known) but not yet reported
    train_round(spare, replacement)
    Round.objects.create(job=running_job, number=4, closed=True, participants=[str(rig_b.pk), str(spare.pk)])

    # then: the spare merged the last round: Done
    assert status(spare, replacement, "update-received") == {"type": "Done"}
    replacement.refresh_from_db()
    assert (replacement.round, replacement.sync_state) == (4, "done")


@pytest.mark.django_db
def test_a_trainer_left_out_of_a_round_is_not_moved_ahead_and_its_late_metrics_are_ignored(
    running_job, online_rigs, caplog
):
    rig_a, rig_b, rig_c = online_rigs
    slow = task_of(running_job, rig_b)
    # round 1 closes without rig-b (left out at the timeout); its metrics for round 1 arrive after
    close_round(running_job, rig_c, 1, [rig_a], samples=12)
    status(rig_a, task_of(running_job, rig_a), {"metrics": {"round": 1, "metrics": {"loss": 2.0}}})
    train_round(rig_b, slow)
    with caplog.at_level(logging.INFO, logger="apps.jobs"):
        status(rig_b, slow, {"metrics": {"round": 1, "metrics": {"loss": 7.0}}})
    assert Round.objects.get(job=running_job, number=1).mean_loss == 2.0
    assert "ignored" in caplog.text
    # it merges round 1's result: one round done, not two
    assert status(rig_b, slow, "update-received") == {"type": "Continue"}
    slow.refresh_from_db()
    assert slow.round == 1


@pytest.mark.django_db
def test_trainers_are_dispatched_with_the_jobs_progress(
    running_job, online_rigs, sent, django_capture_on_commit_callbacks
):
    rig_a, rig_b, rig_c = online_rigs
    first = task_of(running_job, rig_a).dispatch_message["spec"]["executor"]["config"]
    assert first["progress"] == {"rounds": 0, "steps": 0, "steps_per_round": 3.0}
    for number in (1, 2):
        close_round(running_job, rig_c, number, [rig_a, rig_b], samples=24)

    _, dispatch = replace_rig_a(running_job, online_rigs, sent, django_capture_on_commit_callbacks)

    # fixed H: two rounds of 3 steps each
    assert dispatch.spec["executor"]["config"]["progress"] == {
        "rounds": 2,
        "steps": 6,
        "steps_per_round": 3.0,
    }


@pytest.mark.django_db
def test_with_a_sample_target_the_jobs_step_is_the_mean_steps_per_trainer_of_the_closed_rounds(
    job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings
):
    settings.HYPHA_OFFER_WINDOW = 60.0
    spec = spec_with()
    spec["rounds"] = {"update_rounds": ROUNDS, "avg_samples_between_updates": 40, "round_timeout": 30.0}
    job = create_running_job(spec, job_owner, online_rigs, django_capture_on_commit_callbacks)
    rig_a, rig_b, rig_c = online_rigs
    ready(job, rig_c)
    first = task_of(job, rig_a).dispatch_message["spec"]["executor"]["config"]
    # before any round: the target over the trainers' batches (40 samples / (2 trainers × 4))
    assert first["progress"] == {"rounds": 0, "steps": 0, "steps_per_round": 5.0}
    close_round(job, rig_c, 1, [rig_a, rig_b], samples=48)  # 6 steps each
    close_round(job, rig_c, 2, [rig_a], samples=32)  # 8 steps for the one trainer in it

    _, dispatch = replace_rig_a(job, online_rigs, sent, django_capture_on_commit_callbacks)

    assert dispatch.spec["executor"]["config"]["progress"] == {
        "rounds": 2,
        "steps": 14,
        "steps_per_round": 7.0,
    }


@pytest.mark.django_db
def test_a_trainer_behind_when_the_last_round_closes_is_told_done(running_job, online_rigs):
    """A trainer left out of rounds (or one that skipped rounds by fetching the full global weights after a
    drift) counts fewer rounds than the job: once the job's last round is closed, its next merge is answered
    ``Done`` — there is nothing left for it to train — instead of ``Continue`` into a round that never opens."""
    rig_a, rig_b, rig_c = online_rigs
    behind = task_of(running_job, rig_b)
    for number in range(1, ROUNDS + 1):
        close_round(running_job, rig_c, number, [rig_a], samples=12)
    train_round(rig_b, behind)
    assert status(rig_b, behind, "update-received") == {"type": "Done"}
    behind.refresh_from_db()
    assert behind.sync_state == "done"
