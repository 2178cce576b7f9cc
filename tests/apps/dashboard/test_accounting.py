"""The dashboard's figures: the job page gives the job's cost (and max_cost); the worker page gives its earnings
to its owner and staff only. On the fake clock of tests/apps/accounting.

    alice's job "demo": bob's worker (bobs-gpu) holds its trainer lease at 90 credits/h (``leased_job``)
"""

from __future__ import annotations

from django.test import Client

from apps.jobs import tasks
from apps.jobs.models import Job
from tests.apps.accounting.test_accruals import clock  # noqa: F401 (a fixture)


def browser(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_job_page_gives_the_jobs_cost_and_max_cost(clock, leased_job, alice):  # noqa: F811
    # given: the job may spend 100 credits; its trainer lease ran 10 minutes at 90 credits/h
    Job.objects.filter(pk=leased_job.pk).update(spec={**leased_job.spec, "max_cost": 100})
    clock.advance(600)
    tasks.tick_leases()

    # when
    html = browser(alice.user).get(f"/jobs/{leased_job.pk}/").content.decode()

    # then
    assert "Cost <strong>15 credits</strong> of its max_cost of 100 credits</p>" in html


def test_the_worker_page_gives_earnings_to_its_owner_and_staff_only(clock, leased_job, bob, carol, operator):  # noqa: F811
    # given: bobs-gpu's trainer lease ran 20 minutes at 90 credits/h
    clock.advance(1200)
    tasks.tick_leases()
    worker_id = leased_job.leases.get().worker_id

    # when
    pages = {
        name: browser(persona.user).get(f"/workers/{worker_id}/")
        for name, persona in (("bob", bob), ("operator", operator), ("carol", carol))
    }

    # then
    assert {name: page.status_code for name, page in pages.items()} == {
        "bob": 200,
        "operator": 200,
        "carol": 200,
    }
    for name in ("bob", "operator"):
        assert 'id="worker-earnings"' in pages[name].content.decode()
        assert ">30 credits</dd>" in pages[name].content.decode()
    assert 'id="worker-earnings"' not in pages["carol"].content.decode()
    assert "30 credits" not in pages["carol"].content.decode()
