"""The pool as a user sees it through the REST API: every worker's public facts, never a token, an owner's
identity or another user's jobs; a job names the workers that serve it by id, the key of their entries."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.jobs import services as job_services
from apps.leases.models import Lease
from apps.workers import services
from apps.workers.models import Worker
from tests.apps.api_helpers import iso
from tests.apps.workers.test_benchmark import result

#: What any signed-in user sees of a worker they neither own nor administer.
PUBLIC_KEYS = {
    "id",
    "view",
    "name",
    "status",
    "resources",
    "devices",
    "executors",
    "price_floor",
    "reachable",
    "benchmark_score",
    "leases",
}

#: What only its owner and staff see: who owns it, its token's state, its presence log, its benchmark's
#: details (device names, library versions, error text) and its bidding strategy.
PRIVATE_KEYS = {
    "owner",
    "token",
    "token_hint",
    "token_hash",
    "revoked",
    "token_revoked_at",
    "last_seen_at",
    "connected_at",
    "created_at",
    "benchmark",
    "strategy",
    "channel_name",
    "connection_info",
    "max_cpu",
    "max_memory",
    "max_storage",
    "max_gpu",
}


def carols_lease_on(worker: Worker, carol) -> Lease:
    """Carol's job, holding an active lease on ``worker``: what Alice must not learn of."""
    job = job_services.create_job(
        owner=carol.user,
        name="carols-secret-run",
        num_trainers=1,
        spec={"rounds": 3},
        requirements={
            "trainer": {
                "resources": {"cpu": 1.0, "memory": 1.0, "storage": 0.0, "gpu": 1.0},
                "executor": {"class": "train", "name": "diloco-transformer"},
                "bid": 70.0,
                "max": 75.0,
            },
            "parameter_server": {
                "resources": {"cpu": 1.0, "memory": 1.0, "storage": 0.0, "gpu": 0.0},
                "executor": {"class": "aggregate", "name": "parameter-server"},
                "bid": 20.0,
                "max": 30.0,
            },
        },
    )
    return Lease.objects.create(
        job=job,
        worker=worker,
        role="trainer",
        status=Lease.Status.ACTIVE,
        price=71.0,
        expires_at=timezone.now() + timedelta(minutes=5),
    )


@pytest.fixture
def benchmarked(bobs_worker) -> Worker:
    bobs_worker.record_benchmark(result(321.5, device_name="NVIDIA H100 80GB HBM3"))
    return bobs_worker


def test_a_user_who_owns_no_worker_sees_the_pools_public_facts(alice, bob, benchmarked):
    # given: an offline worker nobody owns, beside bob's online one
    services.create_worker(name="lab-box")

    # when
    response = alice.client.get("/api/workers/")

    # then
    assert response.status_code == 200
    body = response.json()
    assert body["count"] == 2
    bobs, lab = body["results"]
    assert bobs == {
        "id": str(benchmarked.pk),
        "view": "public",
        "name": "bobs-gpu",
        "status": "online",
        "resources": {"cpu": 8.0, "memory": 32.0, "storage": 100.0, "gpu": 24.0},
        "devices": [],
        "executors": [
            {"class": "train", "name": "diloco-transformer"},
            {"class": "aggregate", "name": "parameter-server"},
        ],
        "price_floor": 10.0,
        "reachable": "auto",
        "benchmark_score": 321.5,
        "leases": [],
    }
    assert (lab["name"], lab["status"], lab["benchmark_score"]) == ("lab-box", "offline", None)
    for entry in (bobs, lab):
        assert set(entry) == PUBLIC_KEYS
        assert not PRIVATE_KEYS & set(entry), PRIVATE_KEYS & set(entry)
    text = response.content.decode()
    assert benchmarked.token_hint not in text and "bob" not in text.replace("bobs-gpu", "")
    assert "H100" not in text and "2.13.0" not in text and "tiny-gpt" not in text


def test_a_worker_that_serves_your_job_shows_your_leases_and_never_another_users(alice, carol, leased_job):
    # given: bob's worker serves alice's job and carol's
    worker = Worker.objects.get(name="bobs-gpu")
    carols = carols_lease_on(worker, carol)
    alices = Lease.objects.get(job=leased_job)

    # when
    listed = alice.client.get("/api/workers/").json()["results"]
    shown = alice.client.get(f"/api/workers/{worker.pk}/")
    carols_view = carol.client.get(f"/api/workers/{worker.pk}/").json()

    # then
    assert shown.status_code == 200
    assert listed == [shown.json()]
    assert shown.json()["leases"] == [
        {
            "id": str(alices.pk),
            "job": str(leased_job.pk),
            "role": "trainer",
            "status": "active",
            "price": 90.0,
            "resources": {"cpu": 1.0, "memory": 4.0, "storage": 0.0, "gpu": 8.0},
            "devices": [],
            "expires_at": iso(alices.expires_at),
            "renewals": 0,
        }
    ]
    assert str(carols.job_id) not in shown.content.decode()
    assert "carols-secret-run" not in shown.content.decode()
    assert [lease["job"] for lease in carols_view["leases"]] == [str(carols.job_id)]


def test_owners_and_staff_still_see_everything_of_the_workers_they_manage(bob, operator, carol, leased_job):
    # given
    worker = Worker.objects.get(name="bobs-gpu")
    carols_lease_on(worker, carol)

    # when
    bobs = bob.client.get(f"/api/workers/{worker.pk}/").json()
    operators = operator.client.get(f"/api/workers/{worker.pk}/").json()

    # then: every lease on it, whoever's job it is, and the private facts
    for seen in (bobs, operators):
        assert {"owner", "token_hint", "revoked", "benchmark", "last_seen_at"} <= set(seen)
        assert seen["owner"] == "bob"
        assert len(seen["leases"]) == 2


def test_a_list_mixes_the_full_entries_of_your_workers_with_the_pools_public_ones(alice, bob, bobs_worker):
    # given
    services.create_worker(name="alices-box", owner=alice.user)

    # when
    everything = alice.client.get("/api/workers/").json()
    mine = alice.client.get("/api/workers/", {"mine": "true"}).json()

    # then
    assert [(entry["name"], entry["view"], "owner" in entry) for entry in everything["results"]] == [
        ("alices-box", "full", True),
        ("bobs-gpu", "public", False),
    ]
    assert [entry["name"] for entry in mine["results"]] == ["alices-box"]
    assert mine["results"][0]["owner"] == "alice"


@pytest.mark.parametrize("mine", ["maybe", "2"])
def test_a_mine_filter_that_is_not_a_boolean_is_a_400(alice, bobs_worker, mine):
    response = alice.client.get("/api/workers/", {"mine": mine})

    assert response.status_code == 400
    assert set(response.json()) == {"mine"}


def test_seeing_a_worker_does_not_let_a_user_revoke_rotate_or_benchmark_it(alice, bobs_worker):
    # given
    before = Worker.objects.values("token_hash", "token_hint", "token_revoked_at").get(pk=bobs_worker.pk)

    # when
    revoked = alice.client.post(f"/api/workers/{bobs_worker.pk}/revoke/")
    rotated = alice.client.post(f"/api/workers/{bobs_worker.pk}/rotate-token/")
    benchmarked = alice.client.post(f"/api/workers/{bobs_worker.pk}/benchmark/")

    # then
    assert (revoked.status_code, rotated.status_code, benchmarked.status_code) == (404, 404, 403)
    assert "token" not in rotated.json()
    assert (
        Worker.objects.values("token_hash", "token_hint", "token_revoked_at").get(pk=bobs_worker.pk) == before
    )


def test_anonymous_callers_see_no_worker(anonymous, bobs_worker):
    assert anonymous.get("/api/workers/").status_code == 401
    assert anonymous.get(f"/api/workers/{bobs_worker.pk}/").status_code == 401


def test_a_jobs_leases_name_their_workers_by_id_which_opens_their_entries(alice, leased_job):
    # given
    worker = Worker.objects.get(name="bobs-gpu")

    # when
    job = alice.client.get(f"/api/jobs/{leased_job.pk}/").json()
    listed = alice.client.get("/api/jobs/").json()["results"][0]

    # then
    assert [(lease["worker"], lease["worker_id"]) for lease in job["leases"]] == [
        ("bobs-gpu", str(worker.pk))
    ]
    assert [lease["worker_id"] for lease in listed["leases"]] == [str(worker.pk)]
    entry = alice.client.get(f"/api/workers/{job['leases'][0]['worker_id']}/")
    assert (entry.status_code, entry.json()["name"]) == (200, "bobs-gpu")
