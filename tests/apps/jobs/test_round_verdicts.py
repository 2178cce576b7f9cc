"""The parameter server's verdicts on each round's updates (issue 18): stored bounded from real round frames,
shown on the API, and a trainer rejected round after round loses its lease (the role is advertised again)."""

from __future__ import annotations

import pytest

from apps.jobs.models import TRAINER, Job, Round, Task
from apps.leases.models import Lease
from tests.apps.conftest import advert
from tests.apps.jobs.test_training import SPEC, create_running_job, ready, status, task_of
from worker_daemon import protocol

EIGHT_ROUNDS = {**SPEC, "rounds": {**SPEC["rounds"], "update_rounds": 8}}


@pytest.fixture
def running_job(job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings) -> Job:
    settings.HYPHA_OFFER_WINDOW = 60.0
    return create_running_job(EIGHT_ROUNDS, job_owner, online_rigs, django_capture_on_commit_callbacks)


def verdict(kind: str, reason: str = "", norm_ratio=1.0, cosine=0.9) -> dict:
    return {"verdict": kind, "reason": reason, "norm_ratio": norm_ratio, "cosine": cosine}


def report(number: int, verdicts) -> dict:
    return {"round": {"round": number, "participants": [], "verdicts": verdicts}}


@pytest.mark.django_db
def test_verdicts_are_stored_and_shown_on_the_api(running_job, online_rigs, client, job_owner):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    verdicts = {
        str(rig_a.pk): verdict("rejected", "its norm is 100x the round's median norm", 100.0, -1.0),
        str(rig_b.pk): verdict("accepted", "", 1.0, None),
    }

    assert status(rig_c, task_of(running_job, rig_c), report(1, verdicts)) == {"type": "Ok"}

    assert Round.objects.get(job=running_job, number=1).verdicts == verdicts
    client.force_login(job_owner)
    body = client.get(f"/api/jobs/{running_job.pk}/").json()
    (shown,) = [round_ for round_ in body["rounds"] if round_["number"] == 1]
    assert shown["verdicts"] == verdicts


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("verdicts", "stored"),
    [
        ("rejected", {}),
        ([{"verdict": "rejected"}], {}),
        (None, {}),
        ({"p": "rejected"}, {}),
        ({"p": {"verdict": "evil"}}, {}),
        ({"p": {"verdict": ["rejected"]}}, {}),
        (
            {
                "p" * 100: {
                    "verdict": "rejected",
                    "reason": "r" * 10_000,
                    "norm_ratio": "1e999",
                    "cosine": True,
                }
            },
            {"p" * 64: {"verdict": "rejected", "reason": "r" * 500, "norm_ratio": None, "cosine": None}},
        ),
        (
            {"p": {"verdict": "down-weighted", "reason": 7, "norm_ratio": 10**400, "cosine": -0.25}},
            {"p": {"verdict": "down-weighted", "reason": "", "norm_ratio": None, "cosine": -0.25}},
        ),
    ],
)
def test_hostile_verdicts_are_stored_bounded(running_job, online_rigs, verdicts, stored):
    _rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)

    assert status(rig_c, task_of(running_job, rig_c), report(1, verdicts)) == {"type": "Ok"}

    assert Round.objects.get(job=running_job, number=1).verdicts == stored


@pytest.mark.django_db
def test_at_most_1024_peers_are_kept(running_job, online_rigs):
    _rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    many = {f"peer-{index}": verdict("accepted") for index in range(5000)}

    assert status(rig_c, task_of(running_job, rig_c), report(1, many)) == {"type": "Ok"}

    kept = Round.objects.get(job=running_job, number=1).verdicts
    assert sorted(kept) == sorted(f"peer-{index}" for index in range(1024))


@pytest.mark.django_db
def test_three_rejections_in_a_row_end_the_lease_and_the_role_is_advertised_again(
    running_job, online_rigs, sent, django_capture_on_commit_callbacks
):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    server = task_of(running_job, rig_c)
    cheat = task_of(running_job, rig_a)
    rejected = {str(rig_a.pk): verdict("rejected", "its norm is 100x the round's median norm", 100.0)}
    honest = {str(rig_b.pk): verdict("accepted")}

    # given: rejected in round 1, accepted in 2 (the count starts again), rejected in 3 and 4
    for number, verdicts in (
        (1, rejected),
        (2, {str(rig_a.pk): verdict("accepted")}),
        (3, rejected),
        (4, rejected),
    ):
        with django_capture_on_commit_callbacks(execute=True):
            assert status(rig_c, server, report(number, {**verdicts, **honest})) == {"type": "Ok"}
    # then: not yet (two in a row)
    assert Lease.objects.get(pk=cheat.lease_id).status == Lease.Status.ACTIVE

    # when: rejected in round 5 too
    sent.clear()
    with django_capture_on_commit_callbacks(execute=True):
        assert status(rig_c, server, report(5, {**rejected, **honest})) == {"type": "Ok"}

    # then: rig-a's lease ended with the reason, its daemon was told, the job trains on and advertises a trainer
    lease = Lease.objects.get(pk=cheat.lease_id)
    reason = (
        "rejected in 3 rounds in a row: round 3: its norm is 100x the round's median norm; "
        "round 4: its norm is 100x the round's median norm; round 5: its norm is 100x the round's median norm"
    )
    assert (lease.status, lease.status_reason) == (Lease.Status.RELEASED, reason[:300])
    assert [message.reason for _, message in sent if isinstance(message, protocol.LeaseEnded)] == [
        reason[:300]
    ]
    cheat.refresh_from_db()
    assert cheat.status == Task.Status.CANCELLED
    running_job.refresh_from_db()
    assert running_job.status == Job.Status.RUNNING
    assert running_job.status_reason.startswith(
        "RUNNING: the trainer lease on rig-a released while training: rejected in 3 rounds in a row: round 3:"
    )
    assert running_job.status_reason.endswith("; a replacement is advertised")
    wanted = advert(running_job, TRAINER)
    assert (wanted.status, wanted.wanted) == ("open", 1)
    # and the honest trainer keeps its lease
    assert Lease.objects.get(pk=task_of(running_job, rig_b).lease_id).status == Lease.Status.ACTIVE


@pytest.mark.django_db
def test_the_limit_is_a_setting(running_job, online_rigs, settings, django_capture_on_commit_callbacks):
    settings.HYPHA_MAX_REJECTIONS = 1
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    cheat = task_of(running_job, rig_a)

    with django_capture_on_commit_callbacks(execute=True):
        status(
            rig_c, task_of(running_job, rig_c), report(1, {str(rig_a.pk): verdict("rejected", "cosine -1")})
        )

    lease = Lease.objects.get(pk=cheat.lease_id)
    assert (lease.status, lease.status_reason) == (
        Lease.Status.RELEASED,
        "rejected in 1 rounds in a row: round 1: cosine -1",
    )


@pytest.mark.django_db
def test_the_jobs_max_rejections_overrides_the_setting(
    job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings
):
    # given: a job that allows 2 rejections in a row, on a control plane that allows 5
    settings.HYPHA_OFFER_WINDOW = 60.0
    settings.HYPHA_MAX_REJECTIONS = 5
    spec = {**EIGHT_ROUNDS, "rounds": {**EIGHT_ROUNDS["rounds"], "verification": {"max_rejections": 2}}}
    job = create_running_job(spec, job_owner, online_rigs, django_capture_on_commit_callbacks)
    rig_a, _rig_b, rig_c = online_rigs
    ready(job, rig_c)
    cheat = task_of(job, rig_a)
    rejected = {str(rig_a.pk): verdict("rejected", "cosine -1")}

    # when
    with django_capture_on_commit_callbacks(execute=True):
        status(rig_c, task_of(job, rig_c), report(1, rejected))
        assert Lease.objects.get(pk=cheat.lease_id).status == Lease.Status.ACTIVE
        status(rig_c, task_of(job, rig_c), report(2, rejected))

    # then
    lease = Lease.objects.get(pk=cheat.lease_id)
    assert (lease.status, lease.status_reason) == (
        Lease.Status.RELEASED,
        "rejected in 2 rounds in a row: round 1: cosine -1; round 2: cosine -1",
    )


@pytest.mark.django_db
def test_updates_refused_on_arrival_count_as_rejected(
    running_job, online_rigs, django_capture_on_commit_callbacks
):
    # given: the parameter server refused rig-a's update on arrival (its bounds on updates: a 422, so it has no
    # verdict) in round 1, and rejected it at the round's close in rounds 2 and 3
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    server = task_of(running_job, rig_c)
    cheat = task_of(running_job, rig_a)
    honest = {str(rig_b.pk): verdict("accepted")}
    refused = {
        "round": {
            "round": 1,
            "participants": [],
            "refused": {str(rig_a.pk): "update norm 812.3 is over 10x the last round's"},
            "verdicts": honest,
        }
    }
    rejected = {str(rig_a.pk): verdict("rejected", "cosine -0.98 to the others"), **honest}
    # when
    with django_capture_on_commit_callbacks(execute=True):
        status(rig_c, server, refused)
        status(rig_c, server, report(2, rejected))
        status(rig_c, server, report(3, rejected))
    # then: three in a row, the refusal among them
    lease = Lease.objects.get(pk=cheat.lease_id)
    assert lease.status == Lease.Status.RELEASED
    assert lease.status_reason.startswith(
        "rejected in 3 rounds in a row: round 1: refused: update norm 812.3 is over 10x the last round's; round 2:"
    ), lease.status_reason
