"""Elastic trainer pools (docs/training.md, "Elastic pools"): the spec's ``trainers = {min, target, grace}`` and
Hypha's ``[scheduler.job.resources.worker_pool]``; a job starts at ``min`` trainers and grows toward ``target``."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.jobs import services as job_services
from apps.jobs import spec as job_spec
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job, Task
from apps.market.models import Advertisement
from tests.apps.conftest import _registered, advert, connect, offer_on
from tests.apps.jobs.test_spec import HYPHA_DEFAULT_TOML, errors_of
from tests.apps.jobs.test_training import SPEC, ready, task_of
from worker_daemon import protocol


def pool_spec(**trainers) -> dict:
    spec = copy.deepcopy(SPEC)
    del spec["num_trainers"]
    spec["trainers"] = trainers
    return spec


# --- the spec and Hypha's TOML ---------------------------------------------------------------------------------


def test_a_pool_sets_the_trainer_count_to_its_target_and_keeps_its_min():
    parsed = job_spec.parse_json(pool_spec(min=2, target=3, grace=5))

    assert (parsed.num_trainers, parsed.min_trainers, parsed.trainers.grace) == (3, 2, 5.0)


def test_without_a_pool_min_and_target_are_num_trainers():
    parsed = job_spec.parse_json(SPEC)

    assert (parsed.trainers, parsed.num_trainers, parsed.min_trainers) == (None, 2, 2)


def test_a_pool_is_validated():
    assert errors_of(job_spec.parse_json, pool_spec(min=3, target=2)) == [
        {"field": "trainers", "message": "min (3) must be at most target (2)."}
    ]
    assert errors_of(job_spec.parse_json, pool_spec(min=0, target=300)) == [
        {"field": "trainers.min", "message": "Input should be greater than or equal to 1"},
        {"field": "trainers.target", "message": "Input should be less than or equal to 256"},
    ]
    both = {**pool_spec(min=1, target=3), "num_trainers": 2}
    assert errors_of(job_spec.parse_json, both) == [
        {"field": "", "message": "num_trainers (2) differs from trainers.target (3); give one."}
    ]


def test_hyphas_worker_pool_keys_are_read():
    text = HYPHA_DEFAULT_TOML.replace(
        "[scheduler.job.resources]\nnum_workers = 2\n",
        "[scheduler.job.resources]\n\n"
        "[scheduler.job.resources.worker_pool]\nmin = 2\ntarget = 4\ngrace_ms = 30000\n\n"
        "[scheduler.job.resources.parameter_server_pool]\nmin = 1\ntarget = 1\n",
    )

    parsed = job_spec.parse_toml(text)

    assert (parsed.min_trainers, parsed.num_trainers, parsed.trainers.grace) == (2, 4, 30.0)


def test_a_worker_pool_mistake_names_the_toml_key_and_a_second_parameter_server_is_refused():
    text = HYPHA_DEFAULT_TOML.replace(
        "[scheduler.job.resources]\nnum_workers = 2\n",
        "[scheduler.job.resources]\n\n"
        "[scheduler.job.resources.worker_pool]\nmin = 0\ntarget = 2\nsize = 3\n\n"
        "[scheduler.job.resources.parameter_server_pool]\nmin = 1\ntarget = 2\n",
    )

    assert errors_of(job_spec.parse_toml, text) == [
        {"field": "scheduler.job.resources.worker_pool.size", "message": "Unknown key."},
        {
            "field": "scheduler.job.resources.parameter_server_pool.target",
            "message": "A job has exactly one parameter server: must be 1.",
        },
        {
            "field": "scheduler.job.resources.worker_pool.min",
            "message": "Input should be greater than or equal to 1",
        },
    ]


# --- allocation: start at min, grow toward target ----------------------------------------------------------


def submit(spec: dict, job_owner, capture) -> Job:
    parsed = job_spec.parse_json(spec)
    with capture(execute=True):
        return job_services.create_job(
            owner=job_owner,
            name="pool",
            num_trainers=parsed.num_trainers,
            requirements=job_spec.to_requirements(parsed),
            spec=parsed.model_dump(mode="json"),
        )


def offer_two_trainers_and_a_server(job: Job, online_rigs, capture) -> None:
    """rig-a and rig-b offer to train, rig-c to serve; the trainer advert's window then closes."""
    rig_a, rig_b, rig_c = online_rigs
    with capture(execute=True):
        job_services.offer_made(worker=rig_a, message=offer_on(advert(job, TRAINER), price=120.0))
        job_services.offer_made(worker=rig_b, message=offer_on(advert(job, TRAINER), price=125.0))
        job_services.offer_made(worker=rig_c, message=offer_on(advert(job, PARAMETER_SERVER), price=100.0))
    with capture(execute=True):
        job_services.settle_advertisement(advert(job, TRAINER).pk, closing=True)
    job.refresh_from_db()


@pytest.mark.django_db
def test_a_pool_starts_at_min_and_a_newcomer_joins_with_the_jobs_progress(
    job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings
):
    settings.HYPHA_OFFER_WINDOW = 60.0
    capture = django_capture_on_commit_callbacks
    rig_a, rig_b, rig_c = online_rigs
    job = submit(pool_spec(min=2, target=3), job_owner, capture)

    # when: two of three trainers and the parameter server hold leases
    offer_two_trainers_and_a_server(job, online_rigs, capture)

    # then: it trains with two, and goes on advertising for the third
    assert job.status == Job.Status.RUNNING
    assert Task.objects.filter(job=job, role=TRAINER).count() == 2
    assert (
        "at least the 2 trainers the job starts with" in job.events.filter(to_status="allocated").get().reason
    )
    (open_ad,) = job.advertisements.filter(role=TRAINER, status=Advertisement.Status.OPEN)
    assert open_ad.wanted == 1
    ready(job, rig_c)

    # when: a third daemon connects, the advert's next attempt goes out and the daemon takes it
    newcomer = _registered("rig-d")
    connect(newcomer)
    Advertisement.objects.filter(pk=open_ad.pk).update(next_attempt_at=timezone.now() - timedelta(seconds=1))
    with capture(execute=True):
        job_services.tick_market()
    open_ad.refresh_from_db()
    sent.clear()
    with capture(execute=True):
        job_services.offer_made(worker=newcomer, message=offer_on(open_ad, price=110.0))

    # then: it is dispatched as a trainer pointed at the listening parameter server, from the job's progress
    (dispatch,) = [message for _, message in sent if isinstance(message, protocol.DispatchJob)]
    assert dispatch.role == TRAINER
    assert dispatch.peers == {str(rig_c.pk): "http://10.0.0.3:7070"}
    assert dispatch.spec["executor"]["config"]["progress"] == {
        "rounds": 0,
        "steps": 0,
        "steps_per_round": 3.0,
    }
    assert task_of(job, newcomer).status == Task.Status.DISPATCHED
    assert Task.objects.filter(job=job, role=TRAINER).count() == 3
    assert not job.advertisements.filter(role=TRAINER, status=Advertisement.Status.OPEN).exists()


@pytest.mark.django_db
def test_below_min_a_pool_does_not_start(
    job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings
):
    settings.HYPHA_OFFER_WINDOW = 60.0
    job = submit(pool_spec(min=3, target=4), job_owner, django_capture_on_commit_callbacks)

    offer_two_trainers_and_a_server(job, online_rigs, django_capture_on_commit_callbacks)

    assert job.status == Job.Status.ALLOCATING
    assert not Task.objects.filter(job=job).exists()


@pytest.mark.django_db
def test_without_a_pool_the_job_waits_for_all_its_trainers(
    job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings
):
    settings.HYPHA_OFFER_WINDOW = 60.0
    spec = {**copy.deepcopy(SPEC), "num_trainers": 3}
    job = submit(spec, job_owner, django_capture_on_commit_callbacks)

    offer_two_trainers_and_a_server(job, online_rigs, django_capture_on_commit_callbacks)

    assert job.status == Job.Status.ALLOCATING
    assert not Task.objects.filter(job=job).exists()


@pytest.mark.django_db
def test_a_pool_is_warned_about_only_when_the_fleet_cannot_serve_its_min(
    job_owner, online_rigs, data_node, django_capture_on_commit_callbacks
):
    # given: three connected workers, each holding one lease at a time

    # when: a pool of min 2 and target 5, and a fixed count of 5, are submitted
    pool = submit(pool_spec(min=2, target=5), job_owner, django_capture_on_commit_callbacks)
    fixed = submit({**copy.deepcopy(SPEC), "num_trainers": 5}, job_owner, django_capture_on_commit_callbacks)

    # then: the pool can start (two trainers and the parameter server); the fixed count cannot
    assert pool.submission_warnings == []
    assert fixed.submission_warnings == [
        "2 of the 5 trainers cannot be served now: 3 connected workers fit the trainer role"
    ]


@pytest.mark.django_db
def test_a_pool_that_never_reaches_its_min_fails_at_its_deadline_saying_so(
    job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings
):
    settings.HYPHA_OFFER_WINDOW = 60.0
    job = submit(pool_spec(min=3, target=4), job_owner, django_capture_on_commit_callbacks)
    offer_two_trainers_and_a_server(job, online_rigs, django_capture_on_commit_callbacks)

    Job.objects.filter(pk=job.pk).update(allocation_deadline=timezone.now() - timedelta(seconds=1))
    with django_capture_on_commit_callbacks(execute=True):
        job_services.tick_market()

    job.refresh_from_db()
    assert job.status == Job.Status.FAILED
    assert job.status_reason.startswith(
        "FAILED: not fully allocated within 600 s: 2 of 3 trainers (the pool's min; target 4) and the "
        "parameter server leased"
    ), job.status_reason
