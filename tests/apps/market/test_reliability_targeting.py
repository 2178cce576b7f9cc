"""A role's min_reliability in targeting: a worker below it hears of no advert (its offer would only be declined),
and a job that waits or fails for want of reliable workers says so (apps.market.services, apps.jobs.allocation)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.jobs import services as job_services
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job
from apps.market import services as market
from apps.workers.models import WorkerRecord
from tests.apps.conftest import REQUIREMENTS, advert, connect
from tests.apps.market.test_advertising import adverts_sent, online
from worker_daemon import protocol

pytestmark = pytest.mark.django_db

BELOW = "2 connected workers that fit the trainer role are below its min_reliability 0.6"


def picky_job(owner, *, minimum: float = 0.6) -> Job:
    """A job whose trainers must be at least ``minimum`` reliable, allocated as the queued task would."""
    requirements = {
        TRAINER: {**REQUIREMENTS[TRAINER], "min_reliability": minimum},
        PARAMETER_SERVER: REQUIREMENTS[PARAMETER_SERVER],
    }
    created = job_services.create_job(owner=owner, name="picky", num_trainers=2, requirements=requirements)
    job_services.allocate(created.pk)
    return Job.objects.get(pk=created.pk)


def proven(*rigs) -> None:
    """Given: a record of 8 leases that lasted until their jobs' ends (reliability 0.9)."""
    for rig in rigs:
        WorkerRecord.objects.create(worker=rig, leases_completed=8, jobs_served=8)


def test_a_worker_below_the_roles_minimum_is_not_sent_its_advert(job_owner, rig_a, rig_b, sent):
    # given: rig-a is proven (0.9), rig-b is new (0.5)
    online(rig_a, rig_b)
    proven(rig_a)

    # when
    job = picky_job(job_owner)

    # then: the trainer advert goes to rig-a only; the parameter server asks no minimum and goes to both
    trainer_ad, ps_ad = advert(job, TRAINER), advert(job, PARAMETER_SERVER)
    assert adverts_sent(sent, trainer_ad) == {str(rig_a.pk): [0]}
    assert trainer_ad.targets == [str(rig_a.pk)]
    assert set(adverts_sent(sent, ps_ad)) == {str(rig_a.pk), str(rig_b.pk)}


def test_a_connecting_daemon_below_the_minimum_is_not_welcomed_with_the_advert(job_owner, rig_a):
    job = picky_job(job_owner)

    welcome = connect(rig_a)

    told = {(ad.job_id, ad.role) for ad in welcome.advertisements}
    assert told == {(job.pk, PARAMETER_SERVER)}


def test_the_job_waiting_for_reliable_workers_says_why(job_owner, rig_a, rig_b):
    # given: two connected workers, both new (0.5)
    online(rig_a, rig_b)

    # when
    job = picky_job(job_owner)

    # then: its submission warning and its allocating status name the minimum, in its reason and its events
    assert job.status == Job.Status.ALLOCATING
    assert f"no connected worker fits the trainer role ({BELOW}" in job.events.earliest("at").reason
    assert job.status_reason == (
        "ALLOCATING: 0 of 2 trainers, 0 of 1 parameter server leased; advertising 1 parameter server "
        "(attempt 1); advertising 2 trainers (attempt 1; no connected worker can take it); "
        f"{BELOW} (docs/architecture.md, Reputation)"
    )
    assert job.events.filter(reason=job.status_reason).count() == 1


def test_a_job_failing_its_deadline_for_want_of_reliable_workers_says_why(job_owner, rig_a, rig_b):
    online(rig_a, rig_b)
    job = picky_job(job_owner)
    Job.objects.filter(pk=job.pk).update(allocation_deadline=timezone.now() - timedelta(seconds=1))

    job_services.tick_market()

    job.refresh_from_db()
    assert job.status == Job.Status.FAILED
    assert job.status_reason.startswith("FAILED: not fully allocated within 600 s: 0 of 2 trainers")
    assert f"the 2 trainers cannot be served now: no connected worker fits the trainer role ({BELOW}" in (
        job.status_reason
    )


def test_a_proven_worker_lifts_the_note(job_owner, rig_a, rig_b):
    online(rig_a, rig_b)
    proven(rig_a, rig_b)

    job = picky_job(job_owner)

    assert "min_reliability" not in job.status_reason
    assert not job.events.filter(reason__contains="min_reliability").exists()


def test_the_candidates_reliabilities_cost_one_query_for_any_number_of_workers(
    rig_a, rig_b, rig_c, django_assert_num_queries
):
    online(rig_a, rig_b, rig_c)
    proven(rig_a)
    WorkerRecord.objects.create(worker=rig_b, leases_lost=3)

    with django_assert_num_queries(3):
        candidates = market.connected_candidates()

    reliability = {candidate.worker_id: candidate.reliability for candidate in candidates}
    assert reliability == {rig_a.pk: 0.9, rig_b.pk: 0.2, rig_c.pk: 0.5}


def test_an_offer_from_below_the_minimum_is_still_declined_on_arrival(job_owner, rig_a):
    # a daemon that heard of the advert another way (an earlier welcome) gains nothing by offering
    online(rig_a)
    job = picky_job(job_owner)

    outcome = market.record_offer(
        worker=rig_a,
        message=protocol.Offer(
            advertisement_id=advert(job, TRAINER).pk,
            attempt=0,
            price=100.0,
            resources=rig_a.capacity,
        ),
    )

    assert outcome.offer.lease_id is None
    assert "below the job's minimum 0.6" in outcome.offer.reason
