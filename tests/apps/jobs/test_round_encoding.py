"""The encoding a round's bytes travelled in (docs/training.md, "Encodings"): recorded from the parameter
server's round report, next to bytes_in and bytes_out, and shown in the API."""

from __future__ import annotations

import pytest

from apps.jobs.models import Job, Round
from tests.apps.jobs.test_training import SPEC, create_running_job, ready, status, task_of


@pytest.fixture
def running_job(job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings) -> Job:
    settings.HYPHA_OFFER_WINDOW = 60.0
    return create_running_job(SPEC, job_owner, online_rigs, django_capture_on_commit_callbacks)


@pytest.mark.django_db
def test_a_rounds_encoding_is_recorded_with_its_bytes_and_shown(running_job, online_rigs, client):
    # given
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    report = {
        "round": 1,
        "participants": [str(rig_a.pk)],
        "bytes_in": 1300,
        "bytes_out": 2600,
        "encoding": "int8",
    }

    # when
    assert status(rig_c, task_of(running_job, rig_c), {"round": report}) == {"type": "Ok"}

    # then
    round_ = Round.objects.get(job=running_job, number=1)
    assert (round_.encoding, round_.bytes_in, round_.bytes_out) == ("int8", 1300, 2600)
    client.force_login(running_job.owner)
    (shown,) = client.get(f"/api/jobs/{running_job.pk}/").json()["rounds"]
    assert (shown["encoding"], shown["bytes_in"], shown["bytes_out"]) == ("int8", 1300, 2600)


@pytest.mark.django_db
def test_an_encoding_that_is_none_of_ours_or_missing_is_recorded_as_unknown(running_job, online_rigs):
    _rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    server = task_of(running_job, rig_c)

    assert status(rig_c, server, {"round": {"round": 1, "encoding": "int4" * 10}}) == {"type": "Ok"}
    assert status(rig_c, server, {"round": {"round": 2}}) == {"type": "Done"}

    assert list(Round.objects.filter(job=running_job).values_list("encoding", flat=True)) == ["", ""]
