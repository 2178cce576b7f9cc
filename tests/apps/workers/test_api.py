"""The workers API: registration returns a token once; revoke and rotate act through the services."""

from __future__ import annotations

import pytest

from apps.leases.models import Lease
from apps.workers import services
from apps.workers.exceptions import AuthenticationFailed
from apps.workers.models import Worker
from tests.apps.api_helpers import iso
from worker_daemon.protocol import CloseCode


def worker_body(worker: Worker, *, leases: list) -> dict:
    return {
        "id": str(worker.pk),
        "view": "full",
        "name": worker.name,
        "owner": worker.owner.username if worker.owner else None,
        "resources": {
            "cpu": worker.cpu,
            "memory": worker.memory,
            "storage": worker.storage,
            "gpu": worker.gpu,
        },
        "devices": worker.devices,
        "executors": worker.executors,
        "price_floor": worker.price_floor,
        "strategy": worker.strategy,
        "reachable": worker.reachable,
        "benchmark_score": worker.benchmark_score,
        "benchmark": worker.benchmark,
        "status": worker.status,
        "last_seen_at": iso(worker.last_seen_at),
        "connected_at": iso(worker.connected_at),
        "token_hint": worker.token_hint,
        "revoked": worker.is_revoked,
        "token_revoked_at": iso(worker.token_revoked_at),
        "created_at": iso(worker.created_at),
        "leases": leases,
        "earnings": "0.000000",
        # A worker with no record yet: all zero, at the prior (tests/apps/workers/test_reputation.py).
        "reputation": {
            "reliability": 0.5,
            "updates_accepted": 0,
            "updates_down_weighted": 0,
            "updates_rejected": 0,
            "leases_completed": 0,
            "leases_lost": 0,
            "jobs_served": 0,
            "results_lost": 0,
            "speed_vs_benchmark": None,
            "speed_rounds": 0,
        },
    }


def refused_code(token: str) -> int | None:
    try:
        services.authenticate(token)
    except AuthenticationFailed as error:
        return error.code
    return None


# --- register -------------------------------------------------------------------------------------------


def test_registering_a_worker_returns_a_token_that_authenticates_it(bob):
    # when
    response = bob.client.post("/api/workers/", {"name": "gpu-box-1"}, format="json")

    # then
    assert response.status_code == 201
    worker = Worker.objects.get()
    token = response.json()["token"]
    assert services.authenticate(token) == worker
    assert (worker.name, worker.owner, worker.token_hint) == ("gpu-box-1", bob.user, token[:10])
    assert response.json() == {**worker_body(worker, leases=[]), "token": token}
    assert response.json()["status"] == "offline"
    assert "token_hash" not in response.json()


def test_the_token_is_shown_only_at_registration(bob):
    # given
    created = bob.client.post("/api/workers/", {"name": "gpu-box-1"}, format="json").json()

    # when
    shown = bob.client.get(f"/api/workers/{created['id']}/").json()
    listed = bob.client.get("/api/workers/").json()["results"][0]

    # then
    assert "token" not in shown and "token_hash" not in shown
    assert "token" not in listed and "token_hash" not in listed
    assert shown["token_hint"] == created["token"][:10]


@pytest.mark.parametrize(
    ("body", "errors"),
    [
        ({}, {"name": ["This field is required."]}),
        (
            {"name": "gpu box!"},
            {"name": ['Enter a valid "slug" consisting of letters, numbers, underscores or hyphens.']},
        ),
        ({"name": "x" * 101}, {"name": ["Ensure this field has no more than 100 characters."]}),
        ({"name": "bobs-gpu"}, {"name": ["A worker with this name already exists."]}),
        ({"name": "ok", "token": "mine"}, {"token": ["Unknown field."]}),
    ],
)
def test_a_bad_registration_is_a_400_and_creates_nothing(bob, bobs_worker, body, errors):
    # when
    response = bob.client.post("/api/workers/", body, format="json")

    # then
    assert response.status_code == 400
    assert response.json() == errors
    assert list(Worker.objects.values_list("name", flat=True)) == ["bobs-gpu"]


def test_anonymous_callers_cannot_register_or_list_workers(anonymous):
    # when
    registered = anonymous.post("/api/workers/", {"name": "gpu-box-1"}, format="json")
    listed = anonymous.get("/api/workers/")

    # then
    assert (registered.status_code, listed.status_code) == (401, 401)
    assert Worker.objects.count() == 0


# --- visibility -----------------------------------------------------------------------------------------


def test_users_see_the_pool_in_full_for_their_own_workers_and_staff_for_every_worker(
    alice, bob, operator, bobs_worker
):
    # given
    alices_worker, _ = services.create_worker(name="alices-box", owner=alice.user)
    ownerless, _ = services.create_worker(name="lab-box")

    # when
    alices = alice.client.get("/api/workers/").json()
    bobs = bob.client.get("/api/workers/").json()
    operators = operator.client.get("/api/workers/").json()

    # then: everyone lists the pool; the owner's view (with "owner") only of what one manages
    def seen(listed: dict) -> list[tuple[str, bool]]:
        return [(w["name"], "owner" in w) for w in listed["results"]]

    assert seen(alices) == [("alices-box", True), ("bobs-gpu", False), ("lab-box", False)]
    assert seen(bobs) == [("alices-box", False), ("bobs-gpu", True), ("lab-box", False)]
    assert seen(operators) == [("alices-box", True), ("bobs-gpu", True), ("lab-box", True)]
    assert operators["results"][2]["owner"] is None


def test_a_worker_shows_what_its_daemon_reported_and_its_live_leases(frozen_now, bob, leased_job):
    # given
    worker = Worker.objects.get(name="bobs-gpu")
    lease = Lease.objects.get(worker=worker)

    # when
    response = bob.client.get(f"/api/workers/{worker.pk}/")

    # then
    assert response.status_code == 200
    assert response.json() == worker_body(
        worker,
        leases=[
            {
                "id": str(lease.pk),
                "job": str(leased_job.pk),
                "role": "trainer",
                "status": "active",
                "price": 90.0,
                "resources": {"cpu": 1.0, "memory": 4.0, "storage": 0.0, "gpu": 8.0},
                "devices": [],
                "expires_at": iso(lease.expires_at),
                "renewals": 0,
            }
        ],
    )
    assert response.json()["status"] == "online"
    assert response.json()["resources"] == {"cpu": 8.0, "memory": 32.0, "storage": 100.0, "gpu": 24.0}
    assert response.json()["executors"] == [
        {"class": "train", "name": "diloco-transformer"},
        {"class": "aggregate", "name": "parameter-server"},
    ]


def test_another_users_worker_shows_only_its_public_facts_and_cannot_be_revoked_or_rotated(
    alice, bobs_worker
):
    # given
    before = Worker.objects.values("token_hash", "token_hint", "token_revoked_at").get(pk=bobs_worker.pk)

    # when
    shown = alice.client.get(f"/api/workers/{bobs_worker.pk}/")
    revoked = alice.client.post(f"/api/workers/{bobs_worker.pk}/revoke/")
    rotated = alice.client.post(f"/api/workers/{bobs_worker.pk}/rotate-token/")

    # then (tests/apps/workers/test_pool.py has the public view in detail)
    assert (shown.status_code, revoked.status_code, rotated.status_code) == (200, 404, 404)
    assert "owner" not in shown.json() and "token_hint" not in shown.json()
    assert (
        Worker.objects.values("token_hash", "token_hint", "token_revoked_at").get(pk=bobs_worker.pk) == before
    )


# --- revoke and rotate ----------------------------------------------------------------------------------


def test_revoking_refuses_the_token_and_ends_the_workers_leases(bob, leased_job):
    # given
    token = bob.client.post("/api/workers/", {"name": "spare-box"}, format="json").json()["token"]
    worker = Worker.objects.get(name="bobs-gpu")
    bobs_token = worker.rotate_token()

    # when
    response = bob.client.post(f"/api/workers/{worker.pk}/revoke/")

    # then
    assert response.status_code == 200
    worker.refresh_from_db()
    assert response.json()["revoked"] is True
    assert response.json()["token_revoked_at"] == iso(worker.token_revoked_at)
    assert response.json()["leases"] == []
    assert refused_code(bobs_token) == CloseCode.TOKEN_REVOKED
    lease = Lease.objects.get(worker=worker)
    assert (lease.status, lease.status_reason) == ("released", "the worker's token was revoked")
    leased_job.refresh_from_db()
    assert leased_job.status == "allocating"
    assert refused_code(token) is None  # bob's other worker is untouched


def test_revoking_twice_changes_nothing(bob, bobs_worker):
    # given
    bob.client.post(f"/api/workers/{bobs_worker.pk}/revoke/")
    bobs_worker.refresh_from_db()
    revoked_at = bobs_worker.token_revoked_at

    # when
    response = bob.client.post(f"/api/workers/{bobs_worker.pk}/revoke/")

    # then
    assert response.status_code == 200
    bobs_worker.refresh_from_db()
    assert bobs_worker.token_revoked_at == revoked_at


def test_rotating_issues_a_new_token_and_refuses_the_old_one(bob):
    # given
    created = bob.client.post("/api/workers/", {"name": "gpu-box-1"}, format="json").json()
    bob.client.post(f"/api/workers/{created['id']}/revoke/")

    # when
    response = bob.client.post(f"/api/workers/{created['id']}/rotate-token/")

    # then
    assert response.status_code == 200
    new_token = response.json()["token"]
    assert new_token != created["token"]
    assert services.authenticate(new_token).name == "gpu-box-1"
    assert refused_code(created["token"]) == CloseCode.INVALID_TOKEN
    assert (response.json()["revoked"], response.json()["token_hint"]) == (False, new_token[:10])


def test_staff_can_revoke_any_worker(operator, bobs_worker):
    # when
    response = operator.client.post(f"/api/workers/{bobs_worker.pk}/revoke/")

    # then
    assert response.status_code == 200
    bobs_worker.refresh_from_db()
    assert bobs_worker.is_revoked
