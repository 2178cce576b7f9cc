"""Throughput you can see (issue 17, part E): the trainers' samples/s, tokens/s, peak device memory and MFU per
round, from real status frames, stored in the round's trainer metrics (hostile values left out) and shown per
round and per job in ``GET /api/jobs/{id}/``."""

from __future__ import annotations

import pytest

from apps.jobs import throughput
from apps.jobs.models import Job, Round
from tests.apps.jobs.test_training import SPEC, create_running_job, ready, status, task_of

GIB = 2**30


@pytest.fixture
def running_job(job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings) -> Job:
    settings.HYPHA_OFFER_WINDOW = 60.0
    return create_running_job(SPEC, job_owner, online_rigs, django_capture_on_commit_callbacks)


def report(worker, job, number: int, metrics: dict) -> dict:
    return status(worker, task_of(job, worker), {"metrics": {"round": number, "metrics": metrics}})


@pytest.mark.django_db
def test_round_throughput_per_trainer_and_summed_is_shown_per_round_and_per_job(
    running_job, online_rigs, client
):
    # given: two trainers report round 1, one on CUDA (memory, MFU), one on CPU (neither)
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    cuda = {
        "loss": 2.5,
        "samples": 12.0,
        "samples_per_second": 40.0,
        "train_seconds": 0.3,
        "tokens": 1536.0,
        "tokens_per_second": 5120.0,
        "peak_memory_bytes": 3.0 * GIB,
        "mfu": 0.42,
    }
    cpu = {"loss": 2.7, "samples": 12.0, "samples_per_second": 10.0, "train_seconds": 1.2, "tokens": 1536.0}

    # when
    assert report(rig_a, running_job, 1, cuda) == {"type": "Ok"}
    assert report(rig_b, running_job, 1, cpu) == {"type": "Ok"}

    # then: stored as sent, and shown per round: each trainer's own and the sums
    stored = Round.objects.get(job=running_job, number=1).trainer_metrics
    assert stored[str(rig_a.pk)]["peak_memory_bytes"] == 3.0 * GIB
    assert "peak_memory_bytes" not in stored[str(rig_b.pk)]
    client.force_login(running_job.owner)
    body = client.get(f"/api/jobs/{running_job.pk}/").json()
    (shown,) = body["rounds"]
    assert shown["throughput"] == {
        "trainers": {
            str(rig_a.pk): {
                "samples_per_second": 40.0,
                "tokens_per_second": 5120.0,
                "peak_memory_bytes": 3.0 * GIB,
                "mfu": 0.42,
            },
            # tokens/s derived from tokens over train time
            str(rig_b.pk): {"samples_per_second": 10.0, "tokens_per_second": 1280.0},
        },
        "samples_per_second": 50.0,
        "tokens_per_second": 6400.0,
        "peak_memory_bytes": 3.0 * GIB,
        "mfu": 0.42,
    }
    assert body["throughput"] == {
        "samples_per_second": 50.0,
        "tokens_per_second": 6400.0,
        "peak_memory_bytes": 3.0 * GIB,
        "mfu": 0.42,
    }


@pytest.mark.django_db
def test_hostile_throughput_values_are_left_out_and_the_rest_kept(running_job, online_rigs, client):
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    hostile = {
        "loss": 2.5,
        "samples_per_second": -5.0,
        "tokens": -1,
        "tokens_per_second": 1e300,
        "peak_memory_bytes": "lots",
        "mfu": 7.0,
    }

    assert report(rig_a, running_job, 1, hostile) == {"type": "Ok"}

    assert Round.objects.get(job=running_job, number=1).trainer_metrics == {str(rig_a.pk): {"loss": 2.5}}
    client.force_login(running_job.owner)
    body = client.get(f"/api/jobs/{running_job.pk}/").json()
    assert body["rounds"][0]["throughput"] == {
        "trainers": {},
        "samples_per_second": None,
        "tokens_per_second": None,
        "peak_memory_bytes": None,
        "mfu": None,
    }
    assert body["throughput"] == {
        "samples_per_second": None,
        "tokens_per_second": None,
        "peak_memory_bytes": None,
        "mfu": None,
    }


def test_the_job_takes_the_latest_round_with_rates_the_highest_memory_and_the_mean_mfu():
    rounds = [
        {"w1": {"samples_per_second": 10.0, "peak_memory_bytes": 5.0, "mfu": 0.2}},
        {"w1": {"samples_per_second": 20.0, "peak_memory_bytes": 3.0, "mfu": 0.4}},
        {"w1": {"loss": 1.0}},  # a round with no throughput yet does not hide the last one that has
    ]

    assert throughput.of_job(rounds) == {
        "samples_per_second": 20.0,
        "tokens_per_second": None,
        "peak_memory_bytes": 5.0,
        "mfu": pytest.approx(0.3),
    }


@pytest.mark.django_db
def test_the_run_charts_body_carries_each_rounds_throughput(running_job, online_rigs, client):
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    assert report(rig_a, running_job, 1, {"loss": 2.5, "samples_per_second": 40.0, "tokens": 600.0}) == {
        "type": "Ok"
    }
    assert report(
        rig_a, running_job, 1, {"loss": 2.5, "samples_per_second": 40.0, "tokens_per_second": 900.0}
    ) == {"type": "Ok"}

    client.force_login(running_job.owner)
    (round_,) = client.get(f"/api/jobs/{running_job.pk}/metrics/").json()["rounds"]

    assert round_["throughput"]["trainers"] == {
        str(rig_a.pk): {"samples_per_second": 40.0, "tokens_per_second": 900.0}
    }
    assert (round_["throughput"]["samples_per_second"], round_["throughput"]["tokens_per_second"]) == (
        40.0,
        900.0,
    )
