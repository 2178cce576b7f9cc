"""Jobs the fleet cannot serve: the warning at submission, and the allocation deadline (``allocation_timeout``).

From outside: submissions are POSTed to the REST API and read back from its 201 body and the job's events;
the deadline is passed by moving a fake clock (``timezone.now`` patched, as the lease clock's tests do) and
running the market clock's tick, so no test depends on how fast the machine is.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from apps.datasets import services as dataset_services
from apps.jobs import services as job_services
from apps.jobs.allocation import fleet_warnings
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job, JobEvent
from apps.market.models import Advertisement
from apps.market.targeting import Candidate
from apps.workers import services as worker_services
from apps.workers.models import Worker
from tests.apps.conftest import advert, connect, offer_on, submit_job
from tests.apps.jobs.test_api_diloco import SPEC as DILOCO_SPEC
from tests.apps.jobs.test_spec import HYPHA_DEFAULT_TOML
from worker_daemon import protocol

#: Both roles fit every rig of the fleet below (8 cores, 32 GB, 100 GB, 24 GB VRAM, floor 50).
SUBMISSION = {
    "name": "too-big",
    "num_trainers": 6,
    "trainer": {
        "resources": {"cpu": 2, "memory": 8, "storage": 10, "gpu": 16},
        "price": {"bid": 80, "max": 120},
    },
    "parameter_server": {"resources": {"cpu": 1, "memory": 4}, "price": {"bid": 60, "max": 90}},
}
SIX_ON_FOUR = "2 of the 6 trainers cannot be served now: 4 connected workers fit the trainer role"


@dataclass
class FakeClock:
    now: datetime

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


@pytest.fixture
def clock(monkeypatch, settings) -> FakeClock:
    """``timezone.now`` stopped, moved only by the test; leases last an hour (no lease clock runs here, but a
    lease must not look run out while the job's deadline is what the test is about)."""
    settings.HYPHA_LEASE_TTL = 3600.0
    settings.HYPHA_OFFER_WINDOW = 1.0  # the fake clock closes it: no wall-clock luck
    fake = FakeClock(now=timezone.now().replace(microsecond=0))
    monkeypatch.setattr(timezone, "now", lambda: fake.now)
    return fake


def fleet(count: int, **hello_fields) -> list[Worker]:
    """``count`` registered workers, connected as their daemons would (strategy whole, both executors)."""
    workers = []
    for index in range(count):
        worker, _token = worker_services.create_worker(name=f"rig-{index + 1}")
        connect(worker, **hello_fields)
        worker.refresh_from_db()
        workers.append(worker)
    return workers


def job_events(job_id) -> list[tuple[str, str, str]]:
    return list(JobEvent.objects.filter(job_id=job_id).values_list("from_status", "to_status", "reason"))


# --- the warning at submission ------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)  # the allocation runs after commit, as it does outside a server
def test_six_trainers_on_four_workers_are_accepted_with_a_warning_in_the_body_and_the_events(alice):
    # given: four connected workers
    fleet(4)

    # when
    response = alice.client.post("/api/jobs/", SUBMISSION, format="json")

    # then: accepted, and it says plainly what cannot be served
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["warnings"] == [SIX_ON_FOUR]
    assert body["allocation_timeout"] == 600.0
    assert [event["reason"] for event in body["events"]][0] == f"PENDING: warning: {SIX_ON_FOUR}"
    assert job_events(body["id"])[0] == ("pending", "pending", f"PENDING: warning: {SIX_ON_FOUR}")
    # …and is advertised all the same: workers may still come
    job = Job.objects.get(pk=body["id"])
    assert job.status == Job.Status.ALLOCATING
    assert sorted(job.advertisements.values_list("role", "wanted")) == [(PARAMETER_SERVER, 1), (TRAINER, 6)]
    assert abs((job.allocation_deadline - job.created_at).total_seconds() - 600) < 1
    # the job's page (GET) keeps the warning in its history
    detail = alice.client.get(f"/api/jobs/{job.pk}/").json()
    assert detail["events"][0]["reason"] == f"PENDING: warning: {SIX_ON_FOUR}"
    assert "warnings" not in detail


@pytest.mark.django_db
def test_a_fleet_that_can_serve_the_job_gives_no_warning(alice):
    # given: seven workers for six trainers and a parameter server
    fleet(7)

    # when
    response = alice.client.post("/api/jobs/", SUBMISSION, format="json")

    # then
    assert response.status_code == 201, response.content
    assert response.json()["warnings"] == []
    assert job_events(response.json()["id"]) == []
    assert Job.objects.get().status_reason == "PENDING: waiting to be advertised"


@pytest.mark.django_db
def test_the_roles_together_can_need_more_workers_than_each_role_alone(alice):
    # given: two workers that each fit both roles, but hold one lease at a time (strategy whole)
    fleet(2)

    # when: two trainers and a parameter server
    response = alice.client.post("/api/jobs/", {**SUBMISSION, "num_trainers": 2}, format="json")

    # then
    assert response.json()["warnings"] == [
        "the job needs 3 workers at once (2 trainers and the parameter server) and the connected workers "
        "that fit its roles can hold 2 of its leases (a worker offering its whole capacity holds one)"
    ]


@pytest.mark.django_db
def test_workers_that_do_not_fit_a_role_are_not_counted_for_it(alice):
    # given: three workers too small for a trainer (4 GB of VRAM) and none declared reachable
    fleet(3, resources=protocol.Resources(cpu=8, memory=32, storage=100, gpu=4), reachable="false")
    submission = {
        **SUBMISSION,
        "num_trainers": 2,
        "parameter_server": {**SUBMISSION["parameter_server"], "reachable": "require"},
    }

    # when
    response = alice.client.post("/api/jobs/", submission, format="json")

    # then: one warning per role, each with its count
    assert response.json()["warnings"] == [
        "2 of the 2 trainers cannot be served now: no connected worker fits the trainer role",
        "the parameter server cannot be served now: no connected worker fits the parameter server role",
    ]


@pytest.mark.django_db
def test_a_diloco_spec_says_its_warning_and_keeps_its_allocation_timeout(alice, data_node):
    # given: no worker connected at all
    spec = {**DILOCO_SPEC, "dataset": {"name": "tiny-text"}, "allocation_timeout": 30}

    # when
    response = alice.client.post("/api/jobs/diloco/", spec, format="json")

    # then
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["warnings"] == [
        "3 of the 3 trainers cannot be served now: no connected worker fits the trainer role",
        "the parameter server cannot be served now: no connected worker fits the parameter server role",
    ]
    job = Job.objects.get(pk=body["id"])
    assert (job.allocation_timeout, body["allocation_timeout"], job.spec["allocation_timeout"]) == (
        30,
        30,
        30,
    )
    assert abs((job.allocation_deadline - job.created_at).total_seconds() - 30) < 1


@pytest.mark.django_db
def test_a_toml_spec_sets_the_allocation_timeout(alice, data_node):
    # given: the dataset Hypha's default TOML trains on, and the key in its job table
    dataset_services.register_dataset(data_node, "mnist", [(index, 100, "a" * 64) for index in range(4)])
    toml = HYPHA_DEFAULT_TOML.replace("[scheduler.job]\n", "[scheduler.job]\nallocation_timeout = 120\n", 1)
    assert toml != HYPHA_DEFAULT_TOML

    # when
    response = alice.client.generic(
        "POST", "/api/jobs/diloco/?name=lenet", toml.encode(), content_type="application/toml"
    )

    # then
    assert response.status_code == 201, response.content
    assert response.json()["allocation_timeout"] == 120
    assert Job.objects.get().allocation_timeout == 120


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("url", "value", "message"),
    [
        ("/api/jobs/", 5, "Ensure this value is greater than or equal to 10."),
        ("/api/jobs/", 86_401, "Ensure this value is less than or equal to 86400."),
        ("/api/jobs/", "soon", "A valid number is required."),
        ("/api/jobs/diloco/", 9.5, "Input should be greater than or equal to 10"),
        ("/api/jobs/diloco/", 100_000, "Input should be less than or equal to 86400"),
        ("/api/jobs/diloco/", True, "Input should be a valid number"),
    ],
)
def test_a_bad_allocation_timeout_is_a_400_with_its_field_and_creates_nothing(
    alice, data_node, url, value, message
):
    body = {**(SUBMISSION if url == "/api/jobs/" else DILOCO_SPEC), "allocation_timeout": value}

    response = alice.client.post(url, body, format="json")

    assert response.status_code == 400
    assert response.json() == {"allocation_timeout": [message]}
    assert not Job.objects.exists()


def test_a_flexible_worker_counts_once_for_each_role_it_fits():
    # given: one trainer and a parameter server; one worker that fits both, offering what is asked
    capacity = protocol.Resources(cpu=8, memory=32, storage=100, gpu=24)
    keys = frozenset({("train", "diloco-transformer"), ("aggregate", "parameter-server")})
    worker = Candidate(uuid.uuid4(), capacity, capacity, keys, price_floor=50.0, strategy="flexible")
    job = Job(num_trainers=1, requirements=SUBMISSION_REQUIREMENTS)
    roles = [job.requirement(TRAINER), job.requirement(PARAMETER_SERVER)]

    # then: it may hold both leases; the same worker offering its whole capacity cannot
    assert fleet_warnings(roles, [worker]) == []
    assert fleet_warnings(roles, [dataclasses.replace(worker, strategy="whole")]) == [
        "the job needs 2 workers at once (1 trainer and the parameter server) and the connected workers that "
        "fit its roles can hold 1 of its leases (a worker offering its whole capacity holds one)"
    ]


# --- the deadline -------------------------------------------------------------------------------------------


def short_job(owner, workers: list[Worker]) -> Job:
    """Six trainers on four workers: three train, the fourth is the parameter server, three trainers are
    missing (the trainer advert closed short and is re-advertised to no one: everyone is busy)."""
    job = submit_job(owner, name="too-big", num_trainers=6)
    for worker in workers[:3]:
        job_services.offer_made(worker=worker, message=offer_on(advert(job, TRAINER), price=120.0))
    job_services.offer_made(worker=workers[3], message=offer_on(advert(job, PARAMETER_SERVER), price=100.0))
    return job


@pytest.mark.django_db
def test_a_job_not_fully_allocated_in_time_gives_back_its_leases_and_fails(clock, job_owner, sent):
    # given: 3 of 6 trainers and the parameter server leased, the trainer advert's window closed short
    workers = fleet(4)
    job = short_job(job_owner, workers)
    clock.advance(2)
    job_services.tick_market()
    job.refresh_from_db()
    assert job.status == Job.Status.ALLOCATING
    assert sorted(job.leases.values_list("role", "status")) == [
        (PARAMETER_SERVER, "active"),
        *[(TRAINER, "active")] * 3,
    ]

    # when: the clock ticks just before the deadline, nothing happens
    clock.advance(597.9)
    job_services.tick_market()
    job.refresh_from_db()
    assert job.status == Job.Status.ALLOCATING

    # when: and at the deadline (600 s after the submission)
    del sent[:]
    clock.advance(0.1)
    job_services.tick_market()

    # then: FAILED with what it had, every lease released (the daemons told), the adverts closed
    job.refresh_from_db()
    reason = (
        "FAILED: not fully allocated within 600 s: 3 of 6 trainers and the parameter server leased "
        f"({SIX_ON_FOUR})"
    )
    assert (job.status, job.status_reason, job.ended_at) == (Job.Status.FAILED, reason, clock.now)
    assert job_events(job.pk)[-1] == ("allocating", "failed", reason)
    leases = list(job.leases.order_by("created_at"))
    assert [(lease.status, lease.status_reason) for lease in leases] == [("released", "job failed")] * 4
    ended = {
        (worker_id, message.lease_id, message.status, message.reason)
        for worker_id, message in sent
        if isinstance(message, protocol.LeaseEnded)
    }
    assert ended == {(lease.worker_id, lease.pk, "released", "job failed") for lease in leases}
    assert set(job.advertisements.values_list("role", "status")) == {
        (TRAINER, Advertisement.Status.CANCELLED),
        (PARAMETER_SERVER, Advertisement.Status.FILLED),
    }

    # when: the clock ticks again, nothing changes
    events = job_events(job.pk)
    clock.advance(60)
    job_services.tick_market()
    assert job_events(job.pk) == events
    job.refresh_from_db()
    assert (job.status, job.status_reason) == (Job.Status.FAILED, reason)


@pytest.mark.django_db
def test_a_job_never_advertised_fails_at_its_deadline_too(clock, job_owner):
    # given: a job whose allocation never ran (no worker, the task queue down)
    job = job_services.create_job(
        owner=job_owner,
        name="stuck",
        num_trainers=2,
        requirements=SUBMISSION_REQUIREMENTS,
        allocation_timeout=10,
    )

    # when
    clock.advance(10)
    job_services.tick_market()

    # then
    job.refresh_from_db()
    assert (job.status, job.status_reason) == (
        Job.Status.FAILED,
        "FAILED: not fully allocated within 10 s: 0 of 2 trainers leased, the parameter server not ("
        "2 of the 2 trainers cannot be served now: no connected worker fits the trainer role; the parameter "
        "server cannot be served now: no connected worker fits the parameter server role)",
    )


@pytest.mark.django_db
def test_a_fully_allocated_job_is_never_failed_by_the_deadline(clock, job_owner):
    # given: two trainers and a parameter server, all leased
    workers = fleet(3)
    job = submit_job(job_owner, name="fits")
    for worker in workers[:2]:
        job_services.offer_made(worker=worker, message=offer_on(advert(job, TRAINER), price=120.0))
    job_services.offer_made(worker=workers[2], message=offer_on(advert(job, PARAMETER_SERVER), price=100.0))
    job.refresh_from_db()
    assert job.status == Job.Status.ALLOCATED

    # when: long past its deadline
    clock.advance(10_000)
    job_services.tick_market()

    # then
    job.refresh_from_db()
    assert job.status == Job.Status.ALLOCATED
    assert set(job.leases.values_list("status", flat=True)) == {"active"}

    # when: it loses a trainer (ALLOCATING again) and the clock runs on
    lease = job.leases.filter(role=TRAINER).first()
    job_services.lease_given_back(worker=lease.worker, lease_id=lease.pk, reason="shutting down")
    clock.advance(10_000)
    job_services.tick_market()

    # then: the deadline was for its first allocation; the lost trainer is re-advertised as before
    job.refresh_from_db()
    assert job.status == Job.Status.ALLOCATING
    assert job.leases.filter(status="active").count() == 2


#: The ``Job.requirements`` of :data:`SUBMISSION`, for jobs created through the service.
SUBMISSION_REQUIREMENTS = {
    TRAINER: {
        "resources": {"cpu": 2.0, "memory": 8.0, "storage": 10.0, "gpu": 16.0},
        "executor": {"class": "train", "name": "diloco-transformer"},
        "bid": 80.0,
        "max": 120.0,
    },
    PARAMETER_SERVER: {
        "resources": {"cpu": 1.0, "memory": 4.0, "storage": 0.0, "gpu": 0.0},
        "executor": {"class": "aggregate", "name": "parameter-server"},
        "bid": 60.0,
        "max": 90.0,
    },
}
