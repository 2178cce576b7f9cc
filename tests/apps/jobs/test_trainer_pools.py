"""Elastic trainer pools (docs/training.md, "Elastic pools"): the spec's ``trainers = {min, target, grace}`` and
Hypha's ``[scheduler.job.resources.worker_pool]``; a job starts at ``min`` trainers and grows toward ``target``."""

from __future__ import annotations

import copy
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.jobs import services as job_services
from apps.jobs import spec as job_spec
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job, Task
from apps.leases.models import Lease
from apps.market.models import Advertisement
from tests.apps.conftest import _registered, advert, connect, offer_on
from tests.apps.jobs.test_spec import HYPHA_DEFAULT_TOML, errors_of
from tests.apps.jobs.test_training import SPEC, ready, status, task_of
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


# --- below min while running: grace, pause, resume, failure -------------------------------------------------


def lose(job: Job, worker, capture) -> None:
    """``worker``'s trainer lease runs out (its daemon died) and the lease clock notices."""
    Lease.objects.filter(job=job, worker=worker, status=Lease.Status.ACTIVE).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    with capture(execute=True):
        job_services.tick_leases()


def fetch_slice(job: Job, worker) -> protocol.SliceAssigned:
    message = protocol.FetchSlice(
        request_id=uuid.uuid4(), task_id=task_of(job, worker).pk, dataset="tiny-text"
    )
    return job_services.slice_requested(worker=worker, message=message)


def expected_by_server(job: Job, server_rig, number: int = 1) -> dict:
    return status(server_rig, task_of(job, server_rig), {"waiting": {"round": number}})


def backdate(job: Job, field: str, seconds: float) -> None:
    """The job's ``field`` timer started ``seconds`` ago (the tick reads the wall clock)."""
    Job.objects.filter(pk=job.pk).update(
        **{field: getattr(Job.objects.get(pk=job.pk), field) - timedelta(seconds=seconds)}
    )


def paused_pool(job_owner, online_rigs, capture, *, grace: float = 5.0) -> Job:
    """A pool of min 2 / target 3 training on rig-a and rig-b (rig-c serves), paused after rig-a was lost."""
    rig_a, _rig_b, rig_c = online_rigs
    job = submit(pool_spec(min=2, target=3, grace=grace), job_owner, capture)
    offer_two_trainers_and_a_server(job, online_rigs, capture)
    ready(job, rig_c)
    lose(job, rig_a, capture)
    backdate(job, "below_min_since", grace + 1)
    with capture(execute=True):
        job_services.tick_training()
    job.refresh_from_db()
    return job


@pytest.mark.django_db
def test_below_min_a_pool_trains_on_during_its_grace(
    job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings
):
    settings.HYPHA_OFFER_WINDOW = 60.0
    capture = django_capture_on_commit_callbacks
    rig_a, rig_b, rig_c = online_rigs
    job = submit(pool_spec(min=2, target=3, grace=30), job_owner, capture)
    offer_two_trainers_and_a_server(job, online_rigs, capture)
    ready(job, rig_c)

    # when: rig-a is lost, leaving one trainer of the two the pool needs, and the clock ticks within the grace
    lose(job, rig_a, capture)
    with capture(execute=True):
        job_services.tick_training()

    # then: the job goes on with rig-b: it gets data, and the round waits for it alone
    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING
    assert job.below_min_since is not None and job.paused_at is None
    assert job.status_reason.startswith("RUNNING: the trainer lease on rig-a expired while training")
    assert fetch_slice(job, rig_b).index is not None
    assert expected_by_server(job, rig_c)["peers"] == [str(rig_b.pk)]


@pytest.mark.django_db
def test_a_pool_below_min_past_its_grace_pauses_holding_its_round_and_resumes_when_a_trainer_joins(
    job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings
):
    settings.HYPHA_OFFER_WINDOW = 60.0
    capture = django_capture_on_commit_callbacks
    rig_a, rig_b, rig_c = online_rigs

    # when: rig-a was lost more than the grace (5 s) ago and the clock ticks
    job = paused_pool(job_owner, online_rigs, capture)

    # then: the job is paused, says why and until when, and keeps the leases it holds
    assert job.status == Job.Status.RUNNING
    assert job.paused_at is not None
    assert job.status_reason.startswith(
        "RUNNING: paused: 1 of the pool's min 2 trainers for over 5 s; the round in progress is held and the "
        "leases kept while replacements are advertised; fails at "
    ), job.status_reason
    assert job.status_reason.endswith("UTC (allocation_timeout 600 s) unless 1 more join")
    assert job.events.filter(reason__startswith="RUNNING: paused: ").count() == 1
    # and its owner sees the pause in the API, not only in the reason
    from rest_framework.test import APIClient

    owner = APIClient()
    owner.force_authenticate(job.owner)
    shown = owner.get(f"/api/jobs/{job.pk}/").json()
    assert shown["paused_at"] is not None and shown["below_min_since"] is not None, shown
    assert set(job.leases.filter(status=Lease.Status.ACTIVE).values_list("worker__name", flat=True)) == {
        "rig-b",
        "rig-c",
    }
    # the round is held: the parameter server keeps waiting for the lost trainer, with no due time
    assert expected_by_server(job, rig_c) == {
        "type": "Expect",
        "peers": [str(rig_b.pk), str(rig_a.pk)],
        "due_in": None,
        "samples": {str(rig_b.pk): 0},
    }
    # the trainer left gets no new data (asked again later) and keeps its task
    held = fetch_slice(job, rig_b)
    assert (held.index, held.retry_in, held.error) == (None, 1.0, None)
    assert task_of(job, rig_b).status == Task.Status.DISPATCHED
    # a replacement is advertised toward the target
    (open_ad,) = job.advertisements.filter(role=TRAINER, status=Advertisement.Status.OPEN)
    assert open_ad.wanted == 2
    # a further tick changes nothing
    with capture(execute=True):
        job_services.tick_training()
    assert job.events.filter(reason__startswith="RUNNING: paused: ").count() == 1

    # when: a newcomer takes the advert
    newcomer = _registered("rig-d")
    connect(newcomer)
    Advertisement.objects.filter(pk=open_ad.pk).update(next_attempt_at=timezone.now() - timedelta(seconds=1))
    with capture(execute=True):
        job_services.tick_market()
    open_ad.refresh_from_db()
    with capture(execute=True):
        job_services.offer_made(worker=newcomer, message=offer_on(open_ad, price=110.0))
    with capture(execute=True):
        job_services.settle_advertisement(open_ad.pk, closing=True)

    # then: the job resumes: the held round waits for the trainers it has, the newcomer among them, and data
    # flows again
    job.refresh_from_db()
    assert (job.status, job.paused_at, job.below_min_since) == (Job.Status.RUNNING, None, None)
    assert owner.get(f"/api/jobs/{job.pk}/").json()["paused_at"] is None
    assert job.events.filter(reason__startswith="RUNNING: resumed after ").count() == 1
    resumed = job.events.get(reason__startswith="RUNNING: resumed after ").reason
    assert resumed.endswith("s paused: 2 trainers again (the pool's min is 2)"), resumed
    assert expected_by_server(job, rig_c)["peers"] == sorted([str(rig_b.pk), str(newcomer.pk)])
    assert fetch_slice(job, rig_b).index is not None


@pytest.mark.django_db
def test_a_pool_paused_longer_than_its_allocation_timeout_fails_saying_why(
    job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings
):
    settings.HYPHA_OFFER_WINDOW = 60.0
    capture = django_capture_on_commit_callbacks
    job = paused_pool(job_owner, online_rigs, capture)

    # when: a tick within the allocation timeout, then one past it
    backdate(job, "paused_at", 599)
    with capture(execute=True):
        job_services.tick_training()
    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING
    backdate(job, "paused_at", 2)
    with capture(execute=True):
        job_services.tick_training()

    # then: it fails with the reason, and gives back every lease
    job.refresh_from_db()
    assert job.status == Job.Status.FAILED
    assert job.status_reason == (
        "FAILED: paused below the pool's min for 601 s, more than its allocation_timeout (600 s): 1 of the 2 "
        "trainers it needs hold leases"
    )
    assert not job.leases.filter(status__in=Lease.LIVE).exists()


@pytest.mark.django_db
def test_a_job_without_a_pool_trains_on_with_fewer_trainers_and_never_pauses(
    job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings
):
    settings.HYPHA_OFFER_WINDOW = 60.0
    capture = django_capture_on_commit_callbacks
    rig_a, rig_b, rig_c = online_rigs
    job = submit(copy.deepcopy(SPEC), job_owner, capture)
    offer_two_trainers_and_a_server(job, online_rigs, capture)
    ready(job, rig_c)

    lose(job, rig_a, capture)
    with capture(execute=True):
        job_services.tick_training()

    job.refresh_from_db()
    assert (job.status, job.below_min_since, job.paused_at) == (Job.Status.RUNNING, None, None)
    assert fetch_slice(job, rig_b).index is not None


# --- the replacement limit: losses without progress -------------------------------------------------------


@pytest.mark.django_db
def test_the_replacement_limit_counts_the_trainers_lost_since_the_last_round_closed(
    job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings
):
    settings.HYPHA_OFFER_WINDOW = 60.0
    capture = django_capture_on_commit_callbacks
    rig_a, rig_b, rig_c = online_rigs
    # a fixed count of 2 trainers: the limit is 2 × 2 = 4 losses without progress
    job = submit(copy.deepcopy(SPEC), job_owner, capture)
    offer_two_trainers_and_a_server(job, online_rigs, capture)
    ready(job, rig_c)
    spares = iter(range(100))

    def lose_and_replace(worker):
        lose(job, worker, capture)
        job.refresh_from_db()
        if job.status != Job.Status.RUNNING:
            return None
        spare = _registered(f"spare-{next(spares)}")
        connect(spare)
        with capture(execute=True):
            job_services.offer_made(worker=spare, message=offer_on(advert(job, TRAINER), price=110.0))
        return spare

    # when: four trainers are lost (churn), then round 1 closes, then four more are lost
    trainer = rig_a
    for _ in range(4):
        trainer = lose_and_replace(trainer)
    status(rig_c, task_of(job, rig_c), {"round": {"round": 1, "participants": [str(rig_b.pk)]}})
    for _ in range(4):
        trainer = lose_and_replace(trainer)

    # then: eight lost in all, never more than four without progress: the job trains on
    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING
    assert Task.objects.filter(job=job, role=TRAINER, status=Task.Status.CANCELLED).count() == 8

    # when: a fifth is lost before another round closes
    lose_and_replace(trainer)

    # then: it fails on the limit, saying so
    job.refresh_from_db()
    assert job.status == Job.Status.FAILED
    assert job.status_reason.endswith(
        "5 trainers lost since round 1 closed, more than the 4 this job replaces without progress"
    ), job.status_reason


@pytest.mark.django_db
def test_a_dispatch_refused_because_the_daemon_does_not_hold_the_lease_loses_the_trainer_not_the_job(
    job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings
):
    # Seen under churn (tests/e2e/test_churn.py): a daemon killed and restarted answers a trainer dispatch for a
    # lease it no longer holds with a refusal; the job failed on it as if the trainer had crashed.
    settings.HYPHA_OFFER_WINDOW = 60.0
    capture = django_capture_on_commit_callbacks
    rig_a, rig_b, rig_c = online_rigs
    job = submit(pool_spec(min=1, target=2), job_owner, capture)
    offer_two_trainers_and_a_server(job, online_rigs, capture)
    ready(job, rig_c)
    refused = task_of(job, rig_a)

    # when: rig-a's daemon refuses the dispatch (what worker_daemon/jobs.py answers)
    with capture(execute=True):
        job_services.task_exited(
            worker=rig_a,
            message=protocol.JobExited(
                task_id=refused.pk, reason=f"lease {refused.lease_id} is not held (active) by this worker"
            ),
        )

    # then: the job trains on; the task is cancelled, its lease released and a trainer advertised again
    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING, job.status_reason
    refused.refresh_from_db()
    assert refused.status == Task.Status.CANCELLED
    lease = Lease.objects.get(pk=refused.lease_id)
    assert lease.status == Lease.Status.RELEASED
    assert lease.status_reason.startswith("its daemon does not hold it: lease "), lease.status_reason
    (open_ad,) = job.advertisements.filter(role=TRAINER, status=Advertisement.Status.OPEN)
    assert open_ad.wanted == 1
