"""The jobs API: submission (validated, created by the service, advertised after commit), visibility, cancel."""

from __future__ import annotations

import json

import pytest

from apps.jobs.models import Job, JobEvent
from apps.leases.models import Lease
from apps.market.models import Advertisement
from tests.apps.api_helpers import iso

SUBMISSION = {
    "name": "demo",
    "num_trainers": 2,
    "trainer": {
        "resources": {"cpu": 2, "memory": 8, "storage": 10, "gpu": 16},
        "price": {"bid": 80, "max": 120},
        "executor": {"class": "train", "name": "diloco-transformer"},
    },
    "parameter_server": {
        "resources": {"cpu": 1, "memory": 4, "storage": 0, "gpu": 0},
        "price": {"bid": 10, "max": 15},
        "executor": {"class": "aggregate", "name": "parameter-server"},
    },
    # Empty: a job that only leases workers (a non-empty spec is a training job, checked as a DiLoCo spec:
    # tests/apps/jobs/test_api_plain_spec.py).
    "spec": {},
}


def job_body(job: Job, *, trainer: dict, parameter_server: dict, leases: list, events: list) -> dict:
    return {
        "id": str(job.pk),
        "name": job.name,
        "owner": job.owner.username,
        "status": job.status,
        "status_reason": job.status_reason,
        "kind": "training",
        "num_trainers": job.num_trainers,
        "trainer": trainer,
        "parameter_server": parameter_server,
        "inference": None,
        "spec": job.spec,
        "leases": leases,
        "created_at": iso(job.created_at),
        "allocated_at": iso(job.allocated_at),
        "ended_at": iso(job.ended_at),
        "allocation_timeout": job.allocation_timeout,
        # A job without a DiLoCo spec is never dispatched: no tasks, rounds, slices or model.
        "transfer_problems": [],
        "tasks": [],
        "rounds": [],
        "throughput": {
            "samples_per_second": None,
            "tokens_per_second": None,
            "peak_memory_bytes": None,
            "mfu": None,
        },
        "data": {"epoch": None, "available": 0, "assigned": 0, "used": 0, "total": 0},
        "progress": None,  # an inference job's (tests/apps/jobs/test_inference_api.py)
        "model_files": {},
        "cost": "0.000000",
        "below_min_since": None,
        "paused_at": None,
        "events": events,
    }


def event_bodies(job: Job) -> list[dict]:
    return [
        {"from_status": e.from_status, "to_status": e.to_status, "reason": e.reason, "at": iso(e.at)}
        for e in job.events.all()
    ]


# --- create ---------------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)  # the allocation is queued on commit
def test_submitting_a_job_creates_it_and_advertises_every_role(alice):
    # when
    response = alice.client.post("/api/jobs/", SUBMISSION, format="json")

    # then
    assert response.status_code == 201
    job = Job.objects.get()
    assert job.owner == alice.user
    assert job.status == Job.Status.ALLOCATING
    assert job.status_reason == (
        "ALLOCATING: 0 of 2 trainers, 0 of 1 parameter server leased; "
        "advertising 1 parameter server (attempt 1; no connected worker can take it); "
        "advertising 2 trainers (attempt 1; no connected worker can take it)"
    )
    assert job.requirements == {
        "trainer": {
            "resources": {"cpu": 2.0, "memory": 8.0, "storage": 10.0, "gpu": 16.0},
            "executor": {"class": "train", "name": "diloco-transformer"},
            "bid": 80.0,
            "max": 120.0,
        },
        "parameter_server": {
            "resources": {"cpu": 1.0, "memory": 4.0, "storage": 0.0, "gpu": 0.0},
            "executor": {"class": "aggregate", "name": "parameter-server"},
            "bid": 10.0,
            "max": 15.0,
            "reachable": "prefer",
        },
    }
    # no worker is connected: the job is accepted with a warning (tests/apps/jobs/test_allocation.py)
    warnings = [
        "2 of the 2 trainers cannot be served now: no connected worker fits the trainer role",
        "the parameter server cannot be served now: no connected worker fits the parameter server role",
    ]
    warned, advertised = job.events.all()
    assert response.json() == {"warnings": warnings} | job_body(
        job,
        trainer={
            "resources": {"cpu": 2.0, "memory": 8.0, "storage": 10.0, "gpu": 16.0},
            "price": {"bid": 80.0, "max": 120.0},
            "executor": {"class": "train", "name": "diloco-transformer"},
        },
        parameter_server={
            "resources": {"cpu": 1.0, "memory": 4.0, "storage": 0.0, "gpu": 0.0},
            "price": {"bid": 10.0, "max": 15.0},
            "executor": {"class": "aggregate", "name": "parameter-server"},
            "reachable": "prefer",
        },
        leases=[],
        events=[
            {
                "from_status": "pending",
                "to_status": "pending",
                "reason": f"PENDING: warning: {'; '.join(warnings)}",
                "at": iso(warned.at),
            },
            {
                "from_status": "pending",
                "to_status": "allocating",
                "reason": job.status_reason,
                "at": iso(advertised.at),
            },
        ],
    )
    assert response.json()["spec"] == {}
    adverts = {
        ad.role: (
            ad.status,
            ad.wanted,
            ad.attempt,
            ad.bid,
            ad.max_price,
            ad.cpu,
            ad.memory,
            ad.storage,
            ad.gpu,
            ad.executors,
        )
        for ad in Advertisement.objects.filter(job=job)
    }
    assert adverts == {
        "trainer": (
            "open",
            2,
            0,
            80.0,
            120.0,
            2.0,
            8.0,
            10.0,
            16.0,
            [{"class": "train", "name": "diloco-transformer"}],
        ),
        "parameter_server": (
            "open",
            1,
            0,
            10.0,
            15.0,
            1.0,
            4.0,
            0.0,
            0.0,
            [{"class": "aggregate", "name": "parameter-server"}],
        ),
    }


@pytest.mark.django_db(transaction=True)
def test_an_empty_submission_gets_every_default(alice):
    # when
    response = alice.client.post("/api/jobs/", {}, format="json")

    # then
    assert response.status_code == 201
    body = response.json()
    assert (body["name"], body["num_trainers"], body["spec"], body["status"]) == ("", 2, {}, "allocating")
    assert body["trainer"] == {
        "resources": {"cpu": 1.0, "memory": 1.0, "storage": 0.0, "gpu": 0.0},
        "price": {"bid": 100.0, "max": 100.0},
        "executor": {"class": "train", "name": "diloco-transformer"},
    }
    assert body["parameter_server"] == {
        "resources": {"cpu": 1.0, "memory": 1.0, "storage": 0.0, "gpu": 0.0},
        "price": {"bid": 100.0, "max": 100.0},
        "executor": {"class": "aggregate", "name": "parameter-server"},
        "reachable": "prefer",
    }
    assert Job.objects.get().requirements["parameter_server"] == {
        "resources": {"cpu": 1.0, "memory": 1.0, "storage": 0.0, "gpu": 0.0},
        "executor": {"class": "aggregate", "name": "parameter-server"},
        "bid": 100.0,
        "max": 100.0,
        "reachable": "prefer",
    }
    assert Advertisement.objects.filter(job_id=body["id"], status="open").count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_partial_role_block_keeps_the_defaults_of_what_it_omits(alice):
    # when
    response = alice.client.post(
        "/api/jobs/",
        {"num_trainers": 1, "trainer": {"resources": {"gpu": 24}, "price": {"max": 150}}},
        format="json",
    )

    # then
    assert response.status_code == 201
    assert response.json()["trainer"] == {
        "resources": {"cpu": 1.0, "memory": 1.0, "storage": 0.0, "gpu": 24.0},
        "price": {"bid": 100.0, "max": 150.0},
        "executor": {"class": "train", "name": "diloco-transformer"},
    }


def test_a_submission_reports_every_error_at_once_and_creates_nothing(alice):
    # given
    body = {
        "name": "x" * 201,
        "num_trainers": 0,
        "num_trainer": 3,
        "trainer": {
            "resources": {"cpu": -1, "memory": True, "storage": "__1e999__", "gpu": "lots"},
            "price": {"bid": 150, "max": 100},
        },
        "parameter_server": {"executor": {"class": ""}, "price": {"bid": -5}},
        "spec": ["not", "an", "object"],
    }

    # when (1e999 is valid JSON that Python reads as infinity; the test client would refuse to encode it)
    raw = json.dumps(body).replace('"__1e999__"', "1e999")
    response = alice.client.post("/api/jobs/", raw, content_type="application/json")

    # then
    assert response.status_code == 400
    assert response.json() == {
        "name": ["Ensure this field has no more than 200 characters."],
        "num_trainers": ["Ensure this value is greater than or equal to 1."],
        "num_trainer": ["Unknown field."],
        "trainer": {
            "resources": {
                "cpu": ["Ensure this value is greater than or equal to 0."],
                "memory": ["A valid number is required."],
                "storage": ["A valid number is required."],
                "gpu": ["A valid number is required."],
            },
            "price": {"max": ["Must be at least the bid (150)."]},
        },
        "parameter_server": {
            "executor": {"class": ["This field may not be blank."], "name": ["This field is required."]},
            "price": {"bid": ["Ensure this value is greater than or equal to 0."]},
        },
        "spec": ['Expected a dictionary of items but got type "list".'],
    }
    assert Job.objects.count() == 0
    assert Advertisement.objects.count() == 0


@pytest.mark.parametrize(
    ("body", "errors"),
    [
        ({"num_trainers": 257}, {"num_trainers": ["Ensure this value is less than or equal to 256."]}),
        ({"num_trainers": 2.5}, {"num_trainers": ["A valid integer is required."]}),
        ({"trainer": None}, {"trainer": ["This field may not be null."]}),
        (
            {"trainer": "big"},
            {"trainer": {"non_field_errors": ["Invalid data. Expected a dictionary, but got str."]}},
        ),
        ({"trainer": {"gpus": 1}}, {"trainer": {"gpus": ["Unknown field."]}}),
        ({"spec": "none"}, {"spec": ['Expected a dictionary of items but got type "str".']}),
    ],
)
def test_each_kind_of_bad_submission_is_a_400(alice, body, errors):
    # when
    response = alice.client.post("/api/jobs/", body, format="json")

    # then
    assert response.status_code == 400
    assert response.json() == errors
    assert Job.objects.count() == 0


def test_a_submission_that_is_not_an_object_is_a_400(alice):
    # when
    response = alice.client.post("/api/jobs/", ["demo"], format="json")

    # then
    assert response.status_code == 400
    assert response.json() == {"non_field_errors": ["Invalid data. Expected a dictionary, but got list."]}
    assert Job.objects.count() == 0


def test_malformed_json_is_a_400(alice):
    # when
    response = alice.client.post("/api/jobs/", '{"name": ', content_type="application/json")

    # then
    assert response.status_code == 400
    assert response.json()["detail"].startswith("JSON parse error")
    assert Job.objects.count() == 0


def test_anonymous_callers_cannot_submit_or_list_jobs(anonymous):
    # when
    submitted = anonymous.post("/api/jobs/", SUBMISSION, format="json")
    listed = anonymous.get("/api/jobs/")

    # then
    assert (submitted.status_code, listed.status_code) == (401, 401)
    assert submitted.json() == {"detail": "Authentication credentials were not provided."}
    assert Job.objects.count() == 0


def test_a_wrong_token_is_a_401(alice):
    # given
    alice.client.credentials(HTTP_AUTHORIZATION="Token not-a-token")

    # when
    response = alice.client.get("/api/jobs/")

    # then
    assert response.status_code == 401
    assert response.json() == {"detail": "Invalid token."}


# --- visibility -----------------------------------------------------------------------------------------


def test_users_list_their_own_jobs_and_staff_list_every_job(alice, bob, operator, alices_job):
    # given
    bobs_job = Job.objects.create(owner=bob.user, name="bobs", requirements=alices_job.requirements)

    # when
    alices_list = alice.client.get("/api/jobs/").json()
    bobs_list = bob.client.get("/api/jobs/").json()
    operators_list = operator.client.get("/api/jobs/").json()

    # then
    assert (alices_list["count"], [job["id"] for job in alices_list["results"]]) == (1, [str(alices_job.pk)])
    assert (bobs_list["count"], [job["id"] for job in bobs_list["results"]]) == (1, [str(bobs_job.pk)])
    assert operators_list["count"] == 2
    assert {job["id"] for job in operators_list["results"]} == {str(alices_job.pk), str(bobs_job.pk)}
    assert "events" not in alices_list["results"][0]


def test_lists_are_paginated(alice, alices_job):
    # given
    for number in range(2):
        Job.objects.create(owner=alice.user, name=f"more-{number}", requirements=alices_job.requirements)

    # when
    page = alice.client.get("/api/jobs/?limit=2&offset=1").json()

    # then
    assert page["count"] == 3
    assert len(page["results"]) == 2
    assert page["next"] is None
    assert page["previous"] == "http://testserver/api/jobs/?limit=2"


def test_another_users_job_is_not_found_and_cannot_be_cancelled(bob, alices_job):
    # given
    before = (
        alices_job.status,
        alices_job.status_reason,
        list(JobEvent.objects.values_list("pk", flat=True)),
    )

    # when
    shown = bob.client.get(f"/api/jobs/{alices_job.pk}/")
    cancelled = bob.client.post(f"/api/jobs/{alices_job.pk}/cancel/")

    # then
    assert (shown.status_code, cancelled.status_code) == (404, 404)
    assert shown.json() == {"detail": "No Job matches the given query."}
    alices_job.refresh_from_db()
    after = (alices_job.status, alices_job.status_reason, list(JobEvent.objects.values_list("pk", flat=True)))
    assert after == before
    assert set(alices_job.advertisements.values_list("status", flat=True)) == {"open"}


@pytest.mark.parametrize("job_id", ["00000000-0000-0000-0000-000000000000", "not-a-uuid"])
def test_an_unknown_or_malformed_job_id_is_a_404(alice, job_id):
    # when
    response = alice.client.get(f"/api/jobs/{job_id}/")

    # then
    assert response.status_code == 404


def test_the_detail_shows_leases_and_events(alice, leased_job):
    # given
    lease = Lease.objects.get(job=leased_job)

    # when
    response = alice.client.get(f"/api/jobs/{leased_job.pk}/")

    # then
    assert response.status_code == 200
    body = response.json()
    assert body["leases"] == [
        {
            "id": str(lease.pk),
            "role": "trainer",
            "worker": "bobs-gpu",
            "worker_id": str(lease.worker_id),
            "status": "active",
            "devices": [],
            "expires_at": iso(lease.expires_at),
            "renewals": 0,
            "price": 90.0,
        }
    ]
    assert body["events"] == event_bodies(leased_job)
    assert [(e["from_status"], e["to_status"]) for e in body["events"]] == [
        ("pending", "pending"),  # submitted while no worker was connected: a warning
        ("pending", "allocating"),
        ("allocating", "allocating"),
    ]
    assert body["status_reason"] == (
        "ALLOCATING: 1 of 1 trainer, 0 of 1 parameter server leased; "
        "advertising 1 parameter server (attempt 1; no connected worker can take it)"
    )


# --- cancel ---------------------------------------------------------------------------------------------


def test_cancelling_a_job_releases_its_leases_and_a_second_cancel_is_a_409(alice, leased_job):
    # when
    first = alice.client.post(f"/api/jobs/{leased_job.pk}/cancel/")

    # then
    assert first.status_code == 200
    leased_job.refresh_from_db()
    assert first.json()["status"] == "cancelled"
    assert first.json()["status_reason"] == "CANCELLED: cancelled by its owner"
    assert first.json()["ended_at"] == iso(leased_job.ended_at)
    assert first.json()["leases"][0]["status"] == "released"
    assert Lease.objects.get(job=leased_job).status_reason == "job cancelled"
    assert dict(leased_job.advertisements.values_list("role", "status")) == {
        "trainer": "filled",
        "parameter_server": "cancelled",
    }

    # given
    events_before = event_bodies(leased_job)

    # when
    second = alice.client.post(f"/api/jobs/{leased_job.pk}/cancel/")

    # then
    assert second.status_code == 409
    assert second.json() == {"detail": f"job {leased_job.pk} is already cancelled"}
    leased_job.refresh_from_db()
    assert leased_job.status == Job.Status.CANCELLED
    assert event_bodies(leased_job) == events_before


def test_staff_can_see_and_cancel_any_job(operator, alices_job):
    # when
    shown = operator.client.get(f"/api/jobs/{alices_job.pk}/")
    cancelled = operator.client.post(f"/api/jobs/{alices_job.pk}/cancel/")

    # then
    assert (shown.status_code, cancelled.status_code) == (200, 200)
    assert shown.json()["owner"] == "alice"
    assert cancelled.json()["status_reason"] == "CANCELLED: cancelled by operator"
