"""``hypha discard JOB ROUND`` against a fake control plane: the request, its output and exit codes."""

from __future__ import annotations

import json

import pytest

from hypha_cli.exceptions import ExitCode
from tests.hypha_cli.conftest import JOB_ID, SERVER, closed_round, job, json_response

DISCARD = ("POST", f"/api/jobs/{JOB_ID}/rounds/3/discard/")


def test_discard_posts_to_the_round_and_says_what_happens_next(api, hypha, capsys):
    api.routes[DISCARD] = json_response(200, job("running", reason="RUNNING: round 3 discarded by its owner"))

    assert hypha("discard", JOB_ID, "3") == ExitCode.OK

    assert [(request.method, request.url.path, request.content) for request in api.requests] == [
        (*DISCARD, b"")
    ]
    assert capsys.readouterr().out == (
        f"job {JOB_ID}: round 3 will be discarded: the next round goes back to the weights and momentum of round 2\n"
    )


def test_discard_json_prints_the_job(api, hypha, capsys):
    answered = job("running", rounds=[closed_round(3, loss=2.5, eval_loss=None)])
    api.routes[DISCARD] = json_response(200, answered)

    assert hypha("discard", JOB_ID, "3", "--json") == ExitCode.OK
    assert json.loads(capsys.readouterr().out) == answered


def test_a_refused_discard_prints_the_servers_reason_and_exits_1(api, hypha, capsys):
    api.routes[DISCARD] = json_response(
        409, {"detail": "round 3 is not the job's last closed round (round 4 is)"}
    )

    assert hypha("discard", JOB_ID, "3") == ExitCode.REFUSED
    captured = capsys.readouterr()
    assert captured.err == "hypha: error: round 3 is not the job's last closed round (round 4 is)\n"
    assert captured.out == ""


def test_a_missing_job_or_round_exits_4_naming_both(api, hypha, capsys):
    # the fake server answers 404 for a path it does not know, as the API does for a missing job or round
    assert hypha("discard", JOB_ID, "3") == ExitCode.NOT_FOUND
    assert capsys.readouterr().err == (
        f"hypha: error: no job {JOB_ID} with a closed round 3 on {SERVER} (or it is not one of yours)\n"
    )


@pytest.mark.parametrize("number", ["0", "-1", "two", "1000000000"])
def test_a_round_that_cannot_be_discarded_is_a_usage_error_before_any_request(api, hypha, capsys, number):
    with pytest.raises(SystemExit) as exit_:
        hypha("discard", JOB_ID, number)
    assert exit_.value.code == ExitCode.USAGE
    assert api.requests == []
    assert "ROUND" in capsys.readouterr().err
