"""Workers' reputation (issue 18): the record that round reports and lease ends move, the reliability the market
ranks and filters offers by, and who may see it.

    tiny-gpt (8 rounds): rig-a and rig-b train, rig-c is the parameter server (``running_job``)
"""

from __future__ import annotations

import uuid

import pytest

from apps.jobs import services as job_services
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job
from apps.market import services as market
from apps.market.models import Offer
from apps.workers.models import RELIABILITY_PRIOR, Worker, WorkerRecord
from tests.apps.conftest import REQUIREMENTS, advert, benchmark, offer_on
from tests.apps.dashboard.conftest import browser
from tests.apps.jobs.conftest import data_node  # noqa: F401 (a fixture)
from tests.apps.jobs.test_round_verdicts import EIGHT_ROUNDS, verdict
from tests.apps.jobs.test_training import create_running_job, ready, status, task_of


@pytest.fixture
def running_job(job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings) -> Job:  # noqa: F811
    settings.HYPHA_OFFER_WINDOW = 60.0
    job = create_running_job(EIGHT_ROUNDS, job_owner, online_rigs, django_capture_on_commit_callbacks)
    ready(job, online_rigs[2])
    return job


def report(number: int, **fields) -> dict:
    """A parameter server's round report, as its bridge sends it."""
    return {"round": {"round": number, "participants": [], "duration": 1.5, **fields}}


def record(worker: Worker) -> dict:
    found = WorkerRecord.objects.filter(worker=worker).first()
    if found is None:
        return {}
    return {
        "accepted": found.updates_accepted,
        "down_weighted": found.updates_down_weighted,
        "rejected": found.updates_rejected,
        "completed": found.leases_completed,
        "lost": found.leases_lost,
        "served": found.jobs_served,
    }


def counts(accepted=0, down_weighted=0, rejected=0, completed=0, lost=0, served=0) -> dict:
    return {
        "accepted": accepted,
        "down_weighted": down_weighted,
        "rejected": rejected,
        "completed": completed,
        "lost": lost,
        "served": served,
    }


# --- the record, moved by the workflows ----------------------------------------------------------------------


@pytest.mark.django_db
def test_a_round_report_counts_each_trainers_verdict_once(running_job, online_rigs):
    rig_a, rig_b, rig_c = online_rigs
    server = task_of(running_job, rig_c)
    stranger = uuid.uuid4()  # a worker id that never trained for this job
    verdicts = {
        str(rig_a.pk): verdict("rejected", "its norm is 100x the round's median norm", 100.0),
        str(rig_b.pk): verdict("accepted"),
        str(stranger): verdict("rejected"),
        str(rig_c.pk): verdict("rejected"),  # the parameter server holds no trainer lease
    }

    # when: the report of round 1 arrives, then the same report again
    assert status(rig_c, server, report(1, verdicts=verdicts)) == {"type": "Ok"}
    assert status(rig_c, server, report(1, verdicts=verdicts)) == {"type": "Ok"}
    # and round 2 down-weights rig-b's update
    assert status(rig_c, server, report(2, verdicts={str(rig_b.pk): verdict("down-weighted")})) == {
        "type": "Ok"
    }

    # then
    assert record(rig_a) == counts(rejected=1)
    assert record(rig_b) == counts(accepted=1, down_weighted=1)
    assert record(rig_c) == {}
    assert not WorkerRecord.objects.filter(worker_id=stranger).exists()
    assert Worker.objects.get(pk=rig_a.pk).reliability == pytest.approx((0 + 1) / (1 + 2))
    assert Worker.objects.get(pk=rig_b.pk).reliability == pytest.approx((1 + 0.5 + 1) / (2 + 2))


@pytest.mark.django_db
def test_in_an_unverified_round_averaged_counts_as_accepted_and_refused_as_rejected(running_job, online_rigs):
    rig_a, rig_b, rig_c = online_rigs

    body = report(1, participants=[str(rig_b.pk)], refused={str(rig_a.pk): "update norm is not finite"})
    assert status(rig_c, task_of(running_job, rig_c), body) == {"type": "Ok"}

    assert record(rig_a) == counts(rejected=1)
    assert record(rig_b) == counts(accepted=1)


@pytest.mark.django_db
def test_speed_against_the_benchmark_is_measured_relative_to_the_co_trainers(running_job, online_rigs):
    rig_a, rig_b, rig_c = online_rigs
    # given: both benchmarked at 100 samples/s; in round 1 rig-a trains at 40 samples/s and rig-b at 20
    for rig in (rig_a, rig_b):
        Worker.objects.get(pk=rig.pk).record_benchmark(benchmark(100.0))
    for rig, rate in ((rig_a, 40.0), (rig_b, 20.0)):
        metrics = {"loss": 2.5, "samples": 80.0, "samples_per_second": rate}
        assert status(rig, task_of(running_job, rig), {"metrics": {"round": 1, "metrics": metrics}}) == {
            "type": "Ok"
        }

    # when: the round is reported
    accepted = {str(rig.pk): verdict("accepted") for rig in (rig_a, rig_b)}
    assert status(rig_c, task_of(running_job, rig_c), report(1, verdicts=accepted)) == {"type": "Ok"}

    # then: each against the median ratio (0.3): rig-a 0.4/0.3, rig-b 0.2/0.3
    a, b = (WorkerRecord.objects.get(worker=rig) for rig in (rig_a, rig_b))
    assert (a.speed_rounds, a.speed_vs_benchmark) == (1, pytest.approx(4 / 3))
    assert (b.speed_rounds, b.speed_vs_benchmark) == (1, pytest.approx(2 / 3))


@pytest.mark.django_db
def test_a_lease_given_back_is_lost_and_the_jobs_end_completes_the_rest(running_job, online_rigs):
    rig_a, rig_b, rig_c = online_rigs
    lease_a = task_of(running_job, rig_a).lease

    # when: rig-a's daemon gives its lease back while the job trains, then the owner cancels the job
    assert job_services.lease_given_back(worker=rig_a, lease_id=lease_a.pk, reason="shutting down")
    job_services.cancel_job(Job.objects.get(pk=running_job.pk))

    # then: rig-a lost its lease; rig-b and rig-c held theirs to the job's end, and served it
    assert record(rig_a) == counts(lost=1)
    assert record(rig_b) == counts(completed=1, served=1)
    assert record(rig_c) == counts(completed=1, served=1)


# --- the market ----------------------------------------------------------------------------------------------


def _reliable(worker: Worker, completed: int = 8) -> None:
    """Given: a record of ``completed`` leases that lasted until their jobs' ends."""
    WorkerRecord.objects.create(worker=worker, leases_completed=completed, jobs_served=completed)


@pytest.mark.django_db
def test_at_equal_price_the_more_reliable_worker_wins(job, online_rigs):
    rig_a, rig_b, rig_c = online_rigs
    ps_ad = advert(job, PARAMETER_SERVER)
    _reliable(rig_b)
    WorkerRecord.objects.create(worker=rig_c, leases_lost=3)
    # offered in this order: at equal scores the earlier offer would win
    for rig in (rig_a, rig_c, rig_b):
        market.record_offer(worker=Worker.objects.get(pk=rig.pk), message=offer_on(ps_ad, price=100.0))

    settlement = market.settle(ps_ad.pk, closing=True)

    assert [offer.worker.name for offer in settlement.accepted] == ["rig-b"]
    scores = {offer.worker.name: offer.score for offer in Offer.objects.select_related("worker")}
    # rig-a is new (at the prior): its plain price per capacity; the others scaled by prior / reliability
    assert scores["rig-b"] == pytest.approx(scores["rig-a"] * RELIABILITY_PRIOR / (9 / 10))
    assert scores["rig-c"] == pytest.approx(scores["rig-a"] * RELIABILITY_PRIOR / (1 / 5))


@pytest.mark.django_db
def test_a_worker_below_the_jobs_minimum_reliability_is_declined_with_the_reason(job_owner, online_rigs):
    rig_a, rig_b, rig_c = online_rigs
    requirements = {
        TRAINER: {**REQUIREMENTS[TRAINER], "min_reliability": 0.6},
        PARAMETER_SERVER: REQUIREMENTS[PARAMETER_SERVER],
    }
    created = job_services.create_job(
        owner=job_owner, name="picky", num_trainers=2, requirements=requirements
    )
    job_services.allocate(created.pk)
    ad = advert(created, TRAINER)
    _reliable(rig_b)

    # a new worker (at the prior, 0.5) is below 0.6; a worker with 8 completed leases (0.9) is not
    new = market.record_offer(worker=Worker.objects.get(pk=rig_a.pk), message=offer_on(ad, price=100.0))
    proven = market.record_offer(worker=Worker.objects.get(pk=rig_b.pk), message=offer_on(ad, price=100.0))

    assert (new.offer.status, new.offer.reason, new.offer.lease_id) == (
        Offer.Status.DECLINED,
        "the worker's reliability 0.500 is below the job's minimum 0.6 (docs/architecture.md, Reputation)",
        None,
    )
    assert proven.offer.status == Offer.Status.OPEN and proven.offer.lease_id is not None


def test_the_spec_takes_a_minimum_reliability_per_role_within_0_and_1():
    from apps.jobs import spec as job_spec
    from apps.jobs.exceptions import SpecError
    from tests.apps.jobs.test_training import SPEC

    parsed = job_spec.parse_json({**SPEC, "trainer": {"min_reliability": 0.8}})
    assert job_spec.to_requirements(parsed)[TRAINER]["min_reliability"] == 0.8
    assert "min_reliability" not in job_spec.to_requirements(parsed)[PARAMETER_SERVER]
    with pytest.raises(SpecError, match="trainer.min_reliability: Input should be less than or equal to 1"):
        job_spec.parse_json({**SPEC, "trainer": {"min_reliability": 1.5}})


# --- who sees it -------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_workers_reputation_is_shown_to_its_owner_and_staff_only(leased_job, bob, carol, operator):
    worker_id = leased_job.leases.get().worker_id
    job_services.cancel_job(leased_job)  # its trainer lease completes with the job

    as_bob = bob.client.get(f"/api/workers/{worker_id}/").json()
    as_operator = operator.client.get(f"/api/workers/{worker_id}/").json()
    as_carol = carol.client.get(f"/api/workers/{worker_id}/").json()
    listed = {
        name: persona.client.get("/api/workers/").json()["results"]
        for name, persona in (("bob", bob), ("carol", carol))
    }

    expected = {
        "reliability": pytest.approx(2 / 3),
        "updates_accepted": 0,
        "updates_down_weighted": 0,
        "updates_rejected": 0,
        "leases_completed": 1,
        "leases_lost": 0,
        "jobs_served": 1,
        "results_lost": 0,
        "speed_vs_benchmark": None,
        "speed_rounds": 0,
    }
    assert as_bob["reputation"] == as_operator["reputation"] == expected
    assert "reputation" not in as_carol and as_carol["view"] == "public"
    assert [entry["reputation"] for entry in listed["bob"]] == [expected]
    assert all("reputation" not in entry for entry in listed["carol"])
    page = {
        name: browser(persona.user).get(f"/workers/{worker_id}/").content.decode()
        for name, persona in (("bob", bob), ("carol", carol))
    }
    assert 'id="worker-reputation"' in page["bob"] and "1 job served" in page["bob"]
    assert 'id="worker-reputation"' not in page["carol"]


@pytest.mark.django_db
def test_a_new_worker_shows_the_prior(bobs_worker, bob):
    body = bob.client.get(f"/api/workers/{bobs_worker.pk}/").json()

    assert body["reputation"]["reliability"] == RELIABILITY_PRIOR
    assert body["reputation"]["leases_completed"] == 0


@pytest.mark.django_db
def test_another_workers_owner_sees_neither_its_earnings_nor_its_reputation(leased_job, carol, bob):
    # given: carol runs a worker of her own; bob's worker holds alice's lease
    from apps.workers import services as worker_services

    carols_worker, carols_token = worker_services.create_worker(name="carols-gpu", owner=carol.user)
    bobs_worker_id = leased_job.leases.get().worker_id

    # when: carol (an owner herself) looks at bob's worker and at her own
    theirs = carol.client.get(f"/api/workers/{bobs_worker_id}/").json()
    own = carol.client.get(f"/api/workers/{carols_worker.pk}/").json()
    # and a worker's own token is no key to the REST API at all
    with_worker_token = carol.client.__class__().get(
        f"/api/workers/{bobs_worker_id}/", HTTP_AUTHORIZATION=f"Token {carols_token}"
    )

    # then
    assert theirs["view"] == "public" and "earnings" not in theirs and "reputation" not in theirs
    assert own["view"] == "full" and "earnings" in own and "reputation" in own
    assert with_worker_token.status_code == 401


@pytest.mark.django_db
def test_a_user_cannot_see_another_users_spend(leased_job, alice, carol):
    # alice's job runs on bob's worker: alice's spend is hers alone
    as_alice = alice.client.get("/api/me/").json()
    as_carol = carol.client.get("/api/me/").json()

    assert as_carol["username"] == "carol" and as_carol["spend"] == "0.000000"
    assert as_alice["username"] == "alice"
    # no endpoint takes another user: a query naming alice still answers carol's own figures
    assert carol.client.get("/api/me/?user=alice").json() == as_carol
    assert carol.client.get(f"/api/jobs/{leased_job.pk}/").status_code == 404


def test_a_toml_spec_sets_the_minimum_under_resources_and_names_its_key_in_errors():
    from apps.jobs.spec_toml import parse_toml
    from tests.apps.jobs.test_spec import HYPHA_DEFAULT_TOML, errors_of

    text = HYPHA_DEFAULT_TOML.replace("num_workers = 2", "num_workers = 2\nworker_min_reliability = 0.7")
    assert parse_toml(text).trainer.min_reliability == 0.7
    assert parse_toml(text).parameter_server.min_reliability == 0.0

    wrong = HYPHA_DEFAULT_TOML.replace("num_workers = 2", "num_workers = 2\nworker_min_reliability = 2.0")
    assert errors_of(parse_toml, wrong) == [
        {
            "field": "scheduler.job.resources.worker_min_reliability",
            "message": "Input should be less than or equal to 1",
        }
    ]


@pytest.mark.django_db
def test_the_admin_shows_the_record_read_only(leased_job, operator):
    worker_id = leased_job.leases.get().worker_id
    job_services.cancel_job(leased_job)
    admin = browser(operator.user)

    listing = admin.get("/admin/workers/worker/").content.decode()
    page = admin.get(f"/admin/workers/worker/{worker_id}/change/").content.decode()

    assert "column-reliability" in listing and "0.667" in listing
    assert (
        "reliability 0.667; updates 0 accepted, 0 down-weighted, 0 rejected; leases 1 completed, 0 lost"
        in page
    )
    assert 'name="leases_completed"' not in page  # shown, never a form field
