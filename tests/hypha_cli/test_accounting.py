"""The CLI's figures: a job's cost in `hypha show`, a worker's earnings and reliability in `hypha workers` (full view only)."""

from __future__ import annotations

from hypha_cli.exceptions import ExitCode
from tests.hypha_cli.conftest import JOB_ID, job, json_response
from tests.hypha_cli.test_commands import WORKER


def test_show_gives_the_jobs_cost_and_its_max_cost(api, hypha, capsys):
    body = job(cost="19.635417", spec={"rounds": {"update_rounds": 2, "inner_steps": 5}, "max_cost": 30.0})
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = json_response(200, body)

    assert hypha("show", JOB_ID) == ExitCode.OK
    assert "cost: 19.635417 credits (max_cost 30 credits)" in capsys.readouterr().out


def test_show_of_a_job_without_max_cost_gives_its_cost_alone(api, hypha, capsys):
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = json_response(200, job(cost="0.000000"))

    assert hypha("show", JOB_ID) == ExitCode.OK
    lines = capsys.readouterr().out.splitlines()
    assert "cost: 0 credits" in lines


def test_workers_gives_the_earnings_of_the_workers_in_full_view(api, hypha, capsys):
    public = {key: value for key, value in WORKER.items() if key not in ("owner", "token_hint")}
    listed = [
        {**WORKER, "earnings": "45.500000"},
        {**public, "id": "2e0c7c51-8d8e-4a77-9f2b-2bb9d3b1c0ab", "name": "others-gpu", "view": "public"},
    ]
    api.routes[("GET", "/api/workers/")] = json_response(
        200, {"count": 2, "next": None, "previous": None, "results": listed}
    )

    assert hypha("workers") == ExitCode.OK

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-2:] == ["EARNED", "CR"]
    assert lines[1].split()[0] == "bobs-gpu" and lines[1].split()[-1] == "45.5"
    assert lines[2].split()[0] == "others-gpu" and lines[2].split()[-1] == "-"


def test_workers_gives_the_reliability_of_the_workers_in_full_view(api, hypha, capsys):
    public = {key: value for key, value in WORKER.items() if key not in ("owner", "token_hint")}
    listed = [
        {**WORKER, "earnings": "45.500000", "reputation": {"reliability": 0.9, "leases_completed": 8}},
        {**public, "id": "2e0c7c51-8d8e-4a77-9f2b-2bb9d3b1c0ab", "name": "others-gpu", "view": "public"},
    ]
    api.routes[("GET", "/api/workers/")] = json_response(
        200, {"count": 2, "next": None, "previous": None, "results": listed}
    )

    assert hypha("workers") == ExitCode.OK

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-3:] == ["RELIABILITY", "EARNED", "CR"]
    assert lines[1].split()[-2:] == ["0.900", "45.5"]
    assert lines[2].split()[-2:] == ["-", "-"]
