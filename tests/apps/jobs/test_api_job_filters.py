"""``GET /api/jobs/?status=…&name=…``: the list filtered like the dashboard's, still paginated; a bad status
or name is a 400, and another user's jobs never show."""

from __future__ import annotations

import pytest

from apps.jobs.models import Job

pytestmark = pytest.mark.django_db


def ids(page: dict) -> list[str]:
    return [job["id"] for job in page["results"]]


def test_the_list_filters_by_status_and_name(alice, bob, alices_job):
    # given: alices_job ("demo") is pending
    running = Job.objects.create(
        owner=alice.user, name="GPT sweep 1", requirements=alices_job.requirements, status=Job.Status.RUNNING
    )
    failed = Job.objects.create(
        owner=alice.user, name="gpt sweep 2", requirements=alices_job.requirements, status=Job.Status.FAILED
    )
    Job.objects.create(
        owner=bob.user, name="gpt", requirements=alices_job.requirements, status=Job.Status.RUNNING
    )

    # when
    by_name = alice.client.get("/api/jobs/?name=gpt").json()
    by_status = alice.client.get("/api/jobs/?status=running").json()
    both = alice.client.get("/api/jobs/?status=failed&name=SWEEP").json()
    paged = alice.client.get("/api/jobs/?name=sweep&limit=1").json()

    # then
    assert (by_name["count"], ids(by_name)) == (2, [str(failed.pk), str(running.pk)])
    assert (by_status["count"], ids(by_status)) == (1, [str(running.pk)])
    assert ids(both) == [str(failed.pk)]
    assert (paged["count"], ids(paged)) == (2, [str(failed.pk)])
    assert paged["next"] == "http://testserver/api/jobs/?limit=1&name=sweep&offset=1"


@pytest.mark.parametrize(
    ("query", "field"),
    [("status=done", "status"), ("name=" + "x" * 201, "name"), ("name=a%00b", "name")],
)
def test_a_bad_filter_is_a_400(alice, alices_job, query, field):
    response = alice.client.get(f"/api/jobs/?{query}")

    assert response.status_code == 400
    assert list(response.json()) == [field]
