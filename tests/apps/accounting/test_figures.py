"""What a job cost, what a worker earned, what a user spent — and who may see which — from outside (REST bodies),
on a fake clock; and a job's ``max_cost``, which ends it when its running cost reaches it.

    alice's job "demo": bob's worker (bobs-gpu) holds its trainer lease at 90 credits/h (``leased_job``)
    carol: no jobs, no workers; operator: staff
"""

from __future__ import annotations

import pytest

from apps.accounting.models import Accrual
from apps.jobs import tasks
from apps.jobs.models import Job
from apps.leases.models import Lease
from tests.apps.accounting.test_accruals import clock  # noqa: F401 (a fixture)
from tests.apps.jobs.test_api_diloco import (
    SPEC,
    _registered_datasets,  # noqa: F401 (a fixture)
)


def test_the_workers_owner_and_staff_see_its_earnings_no_one_else(clock, leased_job, bob, carol, operator):  # noqa: F811
    # given: the trainer lease on bobs-gpu ran 20 minutes at 90 credits/h
    clock.advance(1200)
    tasks.tick_leases()
    worker_id = leased_job.leases.get().worker_id

    # when: bob (its owner), the operator and carol (another user) look at the worker
    as_bob = bob.client.get(f"/api/workers/{worker_id}/").json()
    as_operator = operator.client.get(f"/api/workers/{worker_id}/").json()
    as_carol = carol.client.get(f"/api/workers/{worker_id}/")
    listed_for_carol = carol.client.get("/api/workers/").json()

    # then
    assert as_bob["earnings"] == as_operator["earnings"] == "30.000000"
    assert as_carol.status_code == 200
    assert as_carol.json()["view"] == "public"
    assert "earnings" not in as_carol.json()
    assert all("earnings" not in entry for entry in listed_for_carol["results"])


def test_each_user_sees_their_own_spend_and_earnings_only(clock, leased_job, alice, bob, carol):  # noqa: F811
    # given: alice's job ran 10 minutes on bob's worker at 90 credits/h
    clock.advance(600)
    tasks.tick_leases()

    # when: each asks who they are
    me = {
        name: persona.client.get("/api/me/")
        for name, persona in (("alice", alice), ("bob", bob), ("carol", carol))
    }

    # then: alice spent 15, bob earned 15, carol neither; nobody sees another's figures
    assert {name: response.status_code for name, response in me.items()} == {
        "alice": 200,
        "bob": 200,
        "carol": 200,
    }
    assert me["alice"].json() == {
        "username": "alice",
        "is_staff": False,
        "spend": "15.000000",
        "earnings": "0.000000",
    }
    assert me["bob"].json() == {
        "username": "bob",
        "is_staff": False,
        "spend": "0.000000",
        "earnings": "15.000000",
    }
    assert me["carol"].json() == {
        "username": "carol",
        "is_staff": False,
        "spend": "0.000000",
        "earnings": "0.000000",
    }
    # and carol cannot read alice's job (and so its cost)
    assert carol.client.get(f"/api/jobs/{leased_job.pk}/").status_code == 404


def test_anonymous_has_no_figures(anonymous):
    assert anonymous.get("/api/me/").status_code == 401


def test_a_job_with_max_cost_ends_when_its_running_cost_reaches_it(clock, leased_job, alice):  # noqa: F811
    # given: alice's job may spend 30 credits; its trainer lease costs 90 credits/h (30 credits in 20 minutes)
    Job.objects.filter(pk=leased_job.pk).update(spec={**leased_job.spec, "max_cost": 30})
    lease = leased_job.leases.get()

    # when: the lease clock runs to a second before 20 minutes (ticks from 19:50 on, a second apart)
    clock.advance(1190)
    for _ in range(9):
        tasks.tick_leases()
        clock.advance(1)
    tasks.tick_leases()

    # then: the job goes on
    assert Job.objects.get(pk=leased_job.pk).status == Job.Status.ALLOCATING
    assert alice.client.get(f"/api/jobs/{leased_job.pk}/").json()["cost"] == "29.975000"

    # when: the next tick, at 20 minutes
    clock.advance(1)
    tasks.tick_leases()

    # then: the job ended, its lease was released, and it cost exactly its max_cost
    body = alice.client.get(f"/api/jobs/{leased_job.pk}/").json()
    assert body["status"] == "cancelled"
    assert body["status_reason"] == (
        "CANCELLED: max_cost reached: the job has cost 30.000000 of its max_cost of 30 credits"
    )
    assert body["cost"] == "30.000000"
    lease.refresh_from_db()
    assert lease.status == Lease.Status.RELEASED
    assert sum(row.amount for row in Accrual.objects.filter(job=leased_job)) == 30


def test_a_job_under_its_max_cost_is_left_alone(clock, leased_job):  # noqa: F811
    # given: a max_cost far above what the job costs
    Job.objects.filter(pk=leased_job.pk).update(spec={**leased_job.spec, "max_cost": 1000})

    # when
    clock.advance(3600)
    tasks.tick_leases()

    # then: 90 credits spent, the job goes on
    assert Job.objects.get(pk=leased_job.pk).status == Job.Status.ALLOCATING
    assert Lease.objects.get(job=leased_job).status == Lease.Status.ACTIVE


@pytest.mark.parametrize(
    ("max_cost", "error"),
    [
        (0, "Input should be greater than 0"),
        (-5, "Input should be greater than 0"),
        ("12", "Input should be a valid number"),
        (1e13, "Input should be less than or equal to 1000000000000"),
    ],
)
@pytest.mark.django_db
def test_a_bad_max_cost_is_a_field_error_and_creates_nothing(alice, max_cost, error):
    response = alice.client.post("/api/jobs/diloco/", {**SPEC, "max_cost": max_cost}, format="json")

    assert response.status_code == 400, response.content
    assert list(response.json()) == ["max_cost"]
    assert error in response.json()["max_cost"][0]
    assert Job.objects.count() == 0


@pytest.mark.django_db(transaction=True)  # the allocation is queued on commit
def test_a_max_cost_is_kept_with_the_job(alice):
    response = alice.client.post("/api/jobs/diloco/", {**SPEC, "max_cost": 250.5}, format="json")

    assert response.status_code == 201, response.content
    body = alice.client.get(f"/api/jobs/{response.json()['id']}/").json()
    assert body["spec"]["max_cost"] == 250.5
    assert body["cost"] == "0.000000"


def test_a_max_cost_from_hyphas_scheduler_toml_is_kept():
    from apps.jobs import spec as job_spec
    from tests.apps.jobs.test_spec import HYPHA_DEFAULT_TOML

    toml = HYPHA_DEFAULT_TOML.replace(
        '[scheduler.job]\ntype = "diloco"\n', '[scheduler.job]\ntype = "diloco"\nmax_cost = 75\n'
    )
    assert "max_cost = 75" in toml

    assert job_spec.parse_toml(toml).max_cost == 75.0


def test_staff_see_the_accruals_in_the_admin(clock, leased_job, operator, alice):  # noqa: F811
    from django.test import Client

    # given: the trainer lease ran 2 minutes and the lease clock accrued it
    clock.advance(120)
    tasks.tick_leases()
    staff, user = Client(), Client()
    staff.force_login(operator.user)
    user.force_login(alice.user)

    # when
    page = staff.get("/admin/accounting/accrual/")

    # then: the row, read-only; not for a user who is not staff
    assert page.status_code == 200
    assert "3.000000" in page.content.decode()
    assert staff.get("/admin/accounting/accrual/add/").status_code == 403
    assert user.get("/admin/accounting/accrual/").status_code == 302
