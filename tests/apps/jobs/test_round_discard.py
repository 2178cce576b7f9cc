"""An owner's discard of a round (issue 18, "Discard a round"; apps/jobs/training/discard.py): who may ask,
when it is refused, and how the request reaches the parameter server (its next ``Expect`` reply) and comes
back (the next round's report)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from apps.jobs import services as job_services
from apps.jobs.models import Job, Round
from tests.apps.jobs.test_training import SPEC, create_running_job, ready, status, task_of

pytestmark = pytest.mark.django_db

OWNER_REASON = (
    "the owner discarded round 1: the weights and momentum of round 0 are restored and round 2's updates are "
    "dropped"
)


def spec(**rounds) -> dict:
    return {**SPEC, "rounds": {**SPEC["rounds"], "update_rounds": 3, **rounds}}


@pytest.fixture
def make_job(job_owner, online_rigs, data_node, django_capture_on_commit_callbacks, settings):
    """A RUNNING job on ``spec(**rounds)`` whose parameter server (rig-c) listens."""
    settings.HYPHA_OFFER_WINDOW = 60.0

    def make(**rounds) -> Job:
        job = create_running_job(spec(**rounds), job_owner, online_rigs, django_capture_on_commit_callbacks)
        ready(job, online_rigs[2])
        job.refresh_from_db()
        assert job.status == Job.Status.RUNNING, job.status_reason
        return job

    return make


def client(user) -> Client:
    browser = Client()
    browser.force_login(user)
    return browser


def report(job: Job, rig_c, number: int, **body) -> dict:
    return status(rig_c, task_of(job, rig_c), {"round": {"round": number, "participants": [], **body}})


def discard(browser: Client, job: Job, number: int):
    return browser.post(f"/api/jobs/{job.pk}/rounds/{number}/discard/")


def test_the_owner_discards_the_last_closed_round_and_the_parameter_server_hears_it(
    make_job, job_owner, online_rigs
):
    # given: round 1 closed
    rig_c = online_rigs[2]
    job = make_job()
    report(job, rig_c, 1)
    server = task_of(job, rig_c)
    assert "discard" not in status(rig_c, server, {"waiting": {"round": 2}})

    # when: the owner discards it
    response = discard(client(job_owner), job, 1)

    # then: recorded, said on the job, and in every Expect reply of round 2 (not of another round)
    assert response.status_code == 200, response.content
    shown = {round_["number"]: round_ for round_ in response.json()["rounds"]}
    assert shown[1]["discard_requested_at"] is not None and shown[1]["discarded"] is False
    assert response.json()["status_reason"] == (
        "RUNNING: round 1 discarded by its owner: round 2 goes back to the weights and momentum of round 0"
    )
    reply = status(rig_c, server, {"waiting": {"round": 2}})
    assert (reply["type"], reply["discard"]) == ("Expect", 1)
    assert "discard" not in status(rig_c, server, {"waiting": {"round": 3}})
    again = discard(client(job_owner), job, 1)
    assert (again.status_code, again.json()) == (409, {"detail": "round 1's discard was requested already"})

    # when: round 2 reports the owner's discard
    report(job, rig_c, 2, discarded=OWNER_REASON)

    # then: stored on round 2, said as gone back (not "weights kept"); nothing more to hear; round 1 is past
    round_2 = Round.objects.get(job=job, number=2)
    assert (round_2.discarded, round_2.discard_reason) == (True, OWNER_REASON)
    job.refresh_from_db()
    assert job.status_reason == f"RUNNING: round 2 of 3 discarded ({OWNER_REASON}) (0 trainers)"
    assert "discard" not in status(rig_c, server, {"waiting": {"round": 3}})
    late = discard(client(job_owner), job, 1)
    assert (late.status_code, late.json()) == (
        409,
        {"detail": "round 1 is not the job's last closed round (round 2 is)"},
    )
    # round 2 was discarded (by the owner's request): it cannot be discarded again
    assert discard(client(job_owner), job, 2).json() == {
        "detail": f"round 2 is discarded already: {OWNER_REASON}"
    }


def test_only_the_owner_or_staff_may_discard_and_only_a_closed_round(make_job, online_rigs):
    rig_c = online_rigs[2]
    job = make_job()
    report(job, rig_c, 1)
    User = get_user_model()
    eve = User.objects.create_user(username="eve", password=None)
    root = User.objects.create_user(username="root", password=None, is_staff=True)

    assert discard(Client(), job, 1).status_code in (401, 403)
    assert discard(client(eve), job, 1).status_code == 404  # another user's job is not shown at all
    assert Round.objects.get(job=job, number=1).discard_requested_at is None
    missing = discard(client(root), job, 2)  # round 2 is not closed
    assert (missing.status_code, missing.json()) == (404, {"detail": f"job {job.pk} has no closed round 2"})
    assert discard(client(root), job, 1_000_000_000).status_code == 404  # not even a round number

    by_staff = discard(client(root), job, 1)
    assert by_staff.status_code == 200
    assert by_staff.json()["status_reason"].startswith("RUNNING: round 1 discarded by root: ")


def test_the_last_round_and_a_job_that_is_not_running_are_refused(make_job, online_rigs, job_owner):
    rig_c = online_rigs[2]
    job = make_job()
    report(job, rig_c, 1)
    report(job, rig_c, 2)
    report(job, rig_c, 3)
    last = discard(client(job_owner), job, 3)
    assert (last.status_code, last.json()) == (
        409,
        {"detail": "round 3 is the job's last round: no round follows to go back"},
    )

    job_services.cancel_job(job)
    cancelled = discard(client(job_owner), job, 3)
    assert (cancelled.status_code, cancelled.json()) == (409, {"detail": "the job is cancelled, not running"})


@pytest.mark.parametrize(
    ("rounds", "why"),
    [
        ({"overlap": "eager"}, "rounds.overlap is eager: "),
        ({"overlap": "streaming", "fragments": 2}, "rounds.overlap is streaming: "),
        ({"encoding": "float16"}, "rounds.encoding is float16: "),
    ],
)
def test_jobs_whose_rounds_cannot_go_back_exactly_are_refused(make_job, online_rigs, job_owner, rounds, why):
    job = make_job(**rounds)
    report(job, online_rigs[2], 1)
    response = discard(client(job_owner), job, 1)
    assert response.status_code == 409 and response.json()["detail"].startswith(why)
    assert Round.objects.get(job=job, number=1).discard_requested_at is None
