"""A round whose eval loss the parameter server could not compute (NaN, no eval data) says why, on the round
and in the job's status, instead of a silent null (issue 13, finding 2)."""

from __future__ import annotations

import pytest

from apps.jobs.models import Job, Round
from tests.apps.jobs.test_training import SPEC, create_running_job, ready, status, task_of


@pytest.fixture
def running_job(job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings) -> Job:
    settings.HYPHA_OFFER_WINDOW = 60.0
    return create_running_job(SPEC, job_owner, online_rigs, django_capture_on_commit_callbacks)


@pytest.mark.django_db
def test_a_non_finite_eval_loss_is_recorded_and_shown(running_job, online_rigs, client):
    # given
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    why = "the global model's eval loss is nan (its outputs are not finite)"
    report = {"round": 1, "participants": [str(rig_a.pk)], "eval_loss": None, "eval_error": why}

    # when
    assert status(rig_c, task_of(running_job, rig_c), {"round": report}) == {"type": "Ok"}

    # then
    round_ = Round.objects.get(job=running_job, number=1)
    assert (round_.eval_loss, round_.eval_error) == (None, why)
    running_job.refresh_from_db()
    assert running_job.status_reason == f"RUNNING: round 1 of 2 applied (1 trainers, no eval loss: {why})"
    client.force_login(running_job.owner)
    (shown,) = client.get(f"/api/jobs/{running_job.pk}/").json()["rounds"]
    assert (shown["eval_loss"], shown["eval_error"]) == (None, why)


@pytest.mark.django_db
def test_an_eval_error_next_to_a_loss_or_of_the_wrong_type_is_not_recorded(running_job, online_rigs):
    _rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    server = task_of(running_job, rig_c)

    assert status(rig_c, server, {"round": {"round": 1, "eval_loss": 2.5, "eval_error": "x"}}) == {
        "type": "Ok"
    }
    assert status(rig_c, server, {"round": {"round": 2, "eval_error": ["x"]}}) == {"type": "Done"}

    assert [(r.eval_loss, r.eval_error) for r in Round.objects.filter(job=running_job)] == [
        (2.5, ""),
        (None, ""),
    ]
