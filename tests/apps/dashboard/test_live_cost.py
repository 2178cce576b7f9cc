"""The job page's cost follows the job live (issue 18): its snapshot and every live event carry the cost so far,
its max_cost and when it was read, so #job-cost grows while the leases run. On the fake clock of
tests/apps/accounting.

    alice's job "demo": bob's worker (bobs-gpu) holds its trainer lease at 90 credits/h (``leased_job``)
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from django.test import Client

from apps.dashboard import live, snapshots
from apps.jobs import tasks
from apps.jobs.models import Job
from tests.apps.accounting.test_accruals import clock  # noqa: F401 (a fixture)


def _read_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_the_snapshot_and_each_live_event_carry_the_cost_as_it_grows(
    clock,  # noqa: F811
    leased_job,
    alice,
    monkeypatch,
    django_capture_on_commit_callbacks,
):
    # given: the job may spend 100 credits; its trainer lease runs at 90 credits/h; the page is open
    Job.objects.filter(pk=leased_job.pk).update(spec={**leased_job.spec, "max_cost": 100})
    leased_job.refresh_from_db()
    client = Client()
    client.force_login(alice.user)
    html = client.get(f"/jobs/{leased_job.pk}/").content.decode()
    sent: list[tuple[str, dict]] = []
    monkeypatch.setattr(
        live, "group_send", lambda group, message: sent.append((group, json.loads(message["text"])))
    )

    # when: the job changes after 10 minutes, and a round is recorded 10 minutes later
    clock.advance(600)
    tasks.tick_leases()
    with django_capture_on_commit_callbacks(execute=True):
        live.job_changed(leased_job)
    clock.advance(600)
    snapshot = json.loads(snapshots.to_json(snapshots.job_snapshot(leased_job)))

    # then: the page's own snapshot had the cost at load, each event the cost when it was sent
    assert "Cost <strong>0 credits</strong> of its max_cost of 100 credits</p>" in html
    [job_event] = [event for group, event in sent if group == live.job_group(leased_job.pk)]
    assert (job_event["cost"]["credits"], job_event["cost"]["max_cost"]) == ("15", "100")
    sent_at = clock.now - timedelta(seconds=600)
    assert abs(_read_time(job_event["cost"]["as_of"]) - sent_at) < timedelta(seconds=1)
    assert (snapshot["cost"]["credits"], snapshot["cost"]["max_cost"]) == ("30", "100")
    assert abs(_read_time(snapshot["cost"]["as_of"]) - clock.now) < timedelta(seconds=1)


def test_a_job_without_max_cost_says_none(clock, leased_job):  # noqa: F811
    clock.advance(1200)

    cost = snapshots.job_cost(leased_job)

    assert (cost["credits"], cost["max_cost"]) == ("30", None)
