"""The leases API (read-only): who sees which leases, the event log, and validated filters."""

from __future__ import annotations

import pytest

from apps.leases.models import Lease
from tests.apps.api_helpers import iso


def test_a_lease_shows_its_history(alice, leased_job):
    # given
    lease = Lease.objects.get()
    created, activated = lease.events.all()

    # when
    response = alice.client.get(f"/api/leases/{lease.pk}/")

    # then
    assert response.status_code == 200
    assert response.json() == {
        "id": str(lease.pk),
        "job": str(leased_job.pk),
        "role": "trainer",
        "worker": "bobs-gpu",
        "status": "active",
        "status_reason": "",
        "price": 90.0,
        "resources": {"cpu": 1.0, "memory": 4.0, "storage": 0.0, "gpu": 8.0},
        "devices": [],
        "expires_at": iso(lease.expires_at),
        "renewals": 0,
        "created_at": iso(lease.created_at),
        "activated_at": iso(lease.activated_at),
        "ended_at": None,
        "events": [
            {
                "kind": "created",
                "from_status": "",
                "to_status": "temporary",
                "expires_at": iso(created.expires_at),
                "detail": "offer made",
                "at": iso(created.at),
            },
            {
                "kind": "activated",
                "from_status": "temporary",
                "to_status": "active",
                "expires_at": iso(activated.expires_at),
                "detail": "",
                "at": iso(activated.at),
            },
        ],
    }


def test_a_lease_is_seen_by_the_jobs_owner_and_the_workers_owner_only(
    alice, bob, carol, operator, leased_job
):
    # given
    lease = Lease.objects.get()

    # when
    seen = {
        persona.user.username: persona.client.get("/api/leases/").json()["count"]
        for persona in (alice, bob, carol, operator)
    }

    # then
    assert seen == {"alice": 1, "bob": 1, "carol": 0, "operator": 1}
    assert bob.client.get(f"/api/leases/{lease.pk}/").status_code == 200
    assert carol.client.get(f"/api/leases/{lease.pk}/").status_code == 404
    assert "events" not in alice.client.get("/api/leases/").json()["results"][0]


def test_leases_filter_by_job_worker_status_and_role(alice, bobs_worker, leased_job):
    # given
    lease = Lease.objects.get()
    matching = [
        {"job": str(leased_job.pk)},
        {"worker": str(bobs_worker.pk)},
        {"status": "active"},
        {"role": "trainer"},
        {"job": str(leased_job.pk), "worker": str(bobs_worker.pk), "status": "active", "role": "trainer"},
    ]
    missing = [
        {"job": "00000000-0000-0000-0000-000000000000"},
        {"status": "expired"},
        {"role": "parameter_server"},
    ]

    # when / then
    for query in matching:
        assert [item["id"] for item in alice.client.get("/api/leases/", query).json()["results"]] == [
            str(lease.pk)
        ], query
    for query in missing:
        assert alice.client.get("/api/leases/", query).json()["count"] == 0, query


@pytest.mark.parametrize(
    ("query", "errors"),
    [
        ({"job": "12"}, {"job": ["Must be a valid UUID."]}),
        ({"worker": "bobs-gpu"}, {"worker": ["Must be a valid UUID."]}),
        ({"status": "alive"}, {"status": ['"alive" is not a valid choice.']}),
        ({"role": "r" * 33}, {"role": ["Ensure this field has no more than 32 characters."]}),
    ],
)
def test_a_bad_lease_filter_is_a_400(alice, leased_job, query, errors):
    # when
    response = alice.client.get("/api/leases/", query)

    # then
    assert response.status_code == 400
    assert response.json() == errors


def test_anonymous_callers_see_no_leases(anonymous):
    assert anonymous.get("/api/leases/").status_code == 401
