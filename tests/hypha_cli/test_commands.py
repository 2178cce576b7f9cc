"""The CLI's commands against a fake control plane (``httpx.MockTransport``): output and exit codes."""

from __future__ import annotations

import json
import zipfile
from io import BytesIO
from pathlib import Path

import httpx
import pytest

from hypha_cli.exceptions import ExitCode
from tests.hypha_cli.conftest import (
    JOB_ID,
    OTHER_JOB_ID,
    SERVER,
    TOKEN,
    closed_round,
    job,
    json_response,
)

# --- login -----------------------------------------------------------------------------------------------


def test_login_checks_the_token_and_saves_server_and_token_with_mode_0600(api, hypha, tmp_path, capsys):
    # given: a fresh machine
    config = tmp_path / "fresh" / "hypha" / "cli.json"
    api.routes[("GET", "/api/jobs/")] = json_response(
        200, {"count": 3, "next": None, "previous": None, "results": []}
    )

    # when
    code = hypha("login", "--server", f"{SERVER}/", "--token", TOKEN, env={"HYPHA_CONFIG": str(config)})

    # then
    assert code == ExitCode.OK
    assert json.loads(config.read_text()) == {"server": SERVER, "token": TOKEN}
    assert config.stat().st_mode & 0o777 == 0o600
    assert config.parent.stat().st_mode & 0o777 == 0o700
    assert [(r.method, str(r.url)) for r in api.requests] == [("GET", f"{SERVER}/api/jobs/?limit=1")]
    assert f"Logged in to {SERVER} (3 jobs visible); saved to {config}" in capsys.readouterr().out


def test_login_reads_the_token_from_stdin_without_a_terminal(api, hypha, tmp_path, monkeypatch):
    config = tmp_path / "cli.json"
    api.routes[("GET", "/api/jobs/")] = json_response(
        200, {"count": 0, "next": None, "previous": None, "results": []}
    )
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO(f"{TOKEN}\n"))

    assert hypha("login", "--server", SERVER, env={"HYPHA_CONFIG": str(config)}) == ExitCode.OK
    assert json.loads(config.read_text())["token"] == TOKEN


def test_login_with_a_bad_token_exits_3_and_saves_nothing(api, hypha, tmp_path, capsys):
    config = tmp_path / "cli.json"

    code = hypha("login", "--server", SERVER, "--token", "wrong", env={"HYPHA_CONFIG": str(config)})

    assert code == ExitCode.AUTHENTICATION == 3
    assert not config.exists()
    assert capsys.readouterr().err == (
        f"hypha: error: {SERVER} refused the API token (Invalid token.); run `hypha login --server {SERVER}`\n"
    )


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(404, text="<h1>Not Found</h1>", headers={"Content-Type": "text/html"}),
        httpx.Response(200, text="<html>a blog</html>", headers={"Content-Type": "text/html"}),
        httpx.Response(200, json={"hello": "world"}),
        httpx.Response(401, text="Unauthorized", headers={"Content-Type": "text/plain"}),
    ],
    ids=["404 page", "html", "other json", "plain 401"],
)
def test_login_to_something_that_is_not_a_hypha_server_exits_5(hypha, tmp_path, capsys, answer):
    from hypha_cli.__main__ import run

    config = tmp_path / "cli.json"
    transport = httpx.MockTransport(lambda request: answer)

    code = run(
        ["login", "--server", SERVER, "--token", TOKEN],
        environ={"HYPHA_CONFIG": str(config)},
        transport=transport,
    )

    assert code == ExitCode.WRONG_SERVER == 5
    assert not config.exists()
    assert "Hypha control plane" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (httpx.ConnectError("[Errno 111] Connection refused"), f"cannot connect to {SERVER}"),
        (httpx.ReadTimeout("timed out"), f"{SERVER} did not answer within 2s (ReadTimeout)"),
    ],
)
def test_an_unreachable_server_exits_5(environ, capsys, error, message):
    from hypha_cli.__main__ import run

    def refuse(request: httpx.Request) -> httpx.Response:
        raise error

    code = run(["--timeout", "2", "jobs"], environ=environ, transport=httpx.MockTransport(refuse))

    assert code == ExitCode.WRONG_SERVER
    assert message in capsys.readouterr().err


def test_a_server_url_without_a_scheme_is_a_usage_error(hypha, capsys):
    assert hypha("login", "--server", "hypha.test:8000", "--token", TOKEN) == ExitCode.USAGE == 64
    assert "--server must be an http(s)://host[:port] URL" in capsys.readouterr().err


def test_logout_removes_the_token_and_keeps_the_server(hypha, environ):
    assert hypha("logout") == ExitCode.OK
    assert json.loads(Path(environ["HYPHA_CONFIG"]).read_text()) == {"server": SERVER}
    assert hypha("jobs") == ExitCode.AUTHENTICATION


# --- submit ---------------------------------------------------------------------------------------------------


def test_submit_json_sends_the_spec_with_the_name_and_prints_the_job_id(api, hypha, tmp_path, capsys):
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"name": "old", "num_trainers": 2}))
    api.routes[("POST", "/api/jobs/diloco/")] = json_response(201, job("pending"))

    assert hypha("submit", str(spec), "--name", "tiny") == ExitCode.OK

    assert capsys.readouterr().out == f"{JOB_ID}\n"
    (request,) = api.requests
    assert request.headers["Content-Type"] == "application/json"
    assert json.loads(request.content) == {"name": "tiny", "num_trainers": 2}


def test_submit_prints_the_fleet_warnings_on_stderr_and_only_the_job_id_on_stdout(
    api, hypha, tmp_path, capsys
):
    # given: the server accepted the job but says the connected workers cannot serve it now
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"num_trainers": 6}))
    warning = "2 of the 6 trainers cannot be served now: 4 connected workers fit the trainer role"
    api.routes[("POST", "/api/jobs/diloco/")] = json_response(201, job("allocating", warnings=[warning]))

    # when
    assert hypha("submit", str(spec)) == ExitCode.OK

    # then
    captured = capsys.readouterr()
    assert captured.out == f"{JOB_ID}\n"
    assert captured.err == f"hypha: warning: {warning}\n"


def test_submit_toml_sends_toml_with_the_name_as_a_query_parameter(api, hypha, tmp_path):
    spec = tmp_path / "job.toml"
    spec.write_text("[scheduler.job]\nnum_trainers = 2\n")
    api.routes[("POST", "/api/jobs/diloco/")] = json_response(201, job("pending"))

    assert hypha("submit", str(spec), "--name", "from toml") == ExitCode.OK

    (request,) = api.requests
    assert request.headers["Content-Type"] == "application/toml"
    assert request.url.params["name"] == "from toml"
    assert request.content == spec.read_bytes()


def test_a_refused_submission_prints_each_field_error_on_a_line_with_its_path_and_exits_1(
    api, hypha, tmp_path, capsys
):
    spec = tmp_path / "job.json"
    spec.write_text("{}")
    api.routes[("POST", "/api/jobs/diloco/")] = json_response(
        400,
        {
            "rounds.update_rounds": ["Input should be greater than or equal to 1"],
            "trainer": {"price": {"max": ["Must be at least the bid (150)."]}},
            "non_field_errors": ["Something about the whole spec."],
        },
    )

    assert hypha("submit", str(spec)) == ExitCode.REFUSED == 1

    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "hypha: error: the server refused the request (HTTP 400):\n"
        "  rounds.update_rounds: Input should be greater than or equal to 1\n"
        "  trainer.price.max: Must be at least the bid (150).\n"
        "  Something about the whole spec.\n"
    )


def test_a_refused_submission_with_json_prints_the_apis_error_body(api, hypha, tmp_path, capsys):
    spec = tmp_path / "job.json"
    spec.write_text("{}")
    body = {"dataset.name": ["Unknown dataset 'nope'."]}
    api.routes[("POST", "/api/jobs/diloco/")] = json_response(400, body)

    assert hypha("submit", str(spec), "--json") == ExitCode.REFUSED
    assert json.loads(capsys.readouterr().out) == body


def test_submit_with_an_encoding_sets_it_in_the_json_specs_rounds(api, hypha, tmp_path):
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"rounds": {"update_rounds": 3}, "num_trainers": 2}))
    api.routes[("POST", "/api/jobs/diloco/")] = json_response(201, job("pending"))

    assert hypha("submit", str(spec), "--encoding", "int8", "--encoding-block-size", "64") == ExitCode.OK

    (request,) = api.requests
    assert json.loads(request.content) == {
        "rounds": {"update_rounds": 3, "encoding": "int8", "encoding_block_size": 64},
        "num_trainers": 2,
    }


def test_an_encoding_flag_with_a_toml_spec_or_an_unknown_encoding_is_a_usage_error(
    api, hypha, tmp_path, capsys
):
    spec = tmp_path / "job.toml"
    spec.write_text("[scheduler.job]\nnum_trainers = 2\n")

    assert hypha("submit", str(spec), "--encoding", "float16") == ExitCode.USAGE
    assert "under [scheduler.job.rounds]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        hypha("submit", str(tmp_path / "job.json"), "--encoding", "int4")
    assert exit_.value.code == ExitCode.USAGE
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    assert api.requests == []


def test_submit_with_eager_overlap_sets_it_in_the_json_specs_rounds(api, hypha, tmp_path):
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"rounds": {"update_rounds": 3}, "num_trainers": 2}))
    api.routes[("POST", "/api/jobs/diloco/")] = json_response(201, job("pending"))

    assert hypha("submit", str(spec), "--overlap", "eager", "--encoding", "int8") == ExitCode.OK

    (request,) = api.requests
    assert json.loads(request.content) == {
        "rounds": {"update_rounds": 3, "encoding": "int8", "overlap": "eager"},
        "num_trainers": 2,
    }


def test_an_overlap_flag_with_a_toml_spec_or_an_unknown_mode_is_a_usage_error(api, hypha, tmp_path, capsys):
    spec = tmp_path / "job.toml"
    spec.write_text("[scheduler.job]\nnum_trainers = 2\n")

    assert hypha("submit", str(spec), "--overlap", "eager") == ExitCode.USAGE
    assert 'write overlap = "eager" under [scheduler.job.rounds]' in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        hypha("submit", str(tmp_path / "job.json"), "--overlap", "lazy")
    assert exit_.value.code == ExitCode.USAGE
    assert "invalid choice: 'lazy'" in capsys.readouterr().err
    assert api.requests == []


def test_submit_with_streaming_overlap_sets_its_fragments_and_mix_in_the_json_specs_rounds(
    api, hypha, tmp_path
):
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"rounds": {"update_rounds": 3}, "num_trainers": 2}))
    api.routes[("POST", "/api/jobs/diloco/")] = json_response(201, job("pending"))

    assert hypha("submit", str(spec), "--overlap", "streaming", "--fragments", "8", "--mix", "0.25") == (
        ExitCode.OK
    )
    assert hypha("submit", str(spec), "--overlap", "streaming") == ExitCode.OK

    with_options, with_defaults = api.requests
    assert json.loads(with_options.content) == {
        "rounds": {"update_rounds": 3, "overlap": "streaming", "fragments": 8, "mix": 0.25},
        "num_trainers": 2,
    }
    assert json.loads(with_defaults.content) == {
        "rounds": {"update_rounds": 3, "overlap": "streaming"},
        "num_trainers": 2,
    }


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--fragments", "1"), "argument --fragments: must be from 2 to 64: '1'"),
        (("--fragments", "65"), "argument --fragments: must be from 2 to 64: '65'"),
        (("--fragments", "four"), "argument --fragments: not a whole number: 'four'"),
        (("--mix", "1"), "argument --mix: must be at least 0 and less than 1: '1'"),
        (("--mix", "-0.1"), "argument --mix: must be at least 0 and less than 1: '-0.1'"),
        (("--mix", "nan"), "argument --mix: must be at least 0 and less than 1: 'nan'"),
        (("--mix", "half"), "argument --mix: not a number: 'half'"),
    ],
)
def test_fragments_or_a_mix_out_of_range_is_a_usage_error(api, hypha, tmp_path, capsys, flags, message):
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"rounds": {"overlap": "streaming"}}))

    with pytest.raises(SystemExit) as exit_:
        hypha("submit", str(spec), *flags)

    assert exit_.value.code == ExitCode.USAGE
    assert message in capsys.readouterr().err
    assert api.requests == []


def test_fragments_or_mix_with_a_toml_spec_is_a_usage_error_that_says_where_they_go(
    api, hypha, tmp_path, capsys
):
    spec = tmp_path / "job.toml"
    spec.write_text("[scheduler.job]\nnum_trainers = 2\n")

    assert hypha("submit", str(spec), "--fragments", "8") == ExitCode.USAGE
    assert (
        'in a TOML spec write fragments = N and mix = A (with overlap = "streaming") under '
        "[scheduler.job.rounds]" in capsys.readouterr().err
    )
    assert hypha("submit", str(spec), "--mix", "0.5") == ExitCode.USAGE
    assert "--fragments and --mix set a JSON spec's rounds" in capsys.readouterr().err
    assert api.requests == []


def test_an_option_of_rounds_needs_rounds_to_be_an_object(api, hypha, tmp_path, capsys):
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"rounds": [3]}))

    assert hypha("submit", str(spec), "--overlap", "none") == ExitCode.REFUSED
    assert (
        "rounds must be a JSON object for --encoding, --encoding-block-size, --overlap, --fragments or --mix"
        in capsys.readouterr().err
    )
    assert api.requests == []


def test_submitting_invalid_json_is_refused_before_any_request(api, hypha, tmp_path, capsys):
    spec = tmp_path / "job.json"
    spec.write_text("{oops")

    assert hypha("submit", str(spec)) == ExitCode.REFUSED
    assert api.requests == []
    assert f"{spec} is not valid JSON" in capsys.readouterr().err


def test_submitting_a_missing_file_is_a_usage_error(api, hypha, tmp_path, capsys):
    assert hypha("submit", str(tmp_path / "nope.json")) == ExitCode.USAGE
    assert api.requests == []
    assert "No such file or directory" in capsys.readouterr().err


# --- jobs / show --------------------------------------------------------------------------------------------


def test_jobs_shows_a_table_with_rounds_and_last_loss_from_each_started_jobs_detail(api, hypha, capsys):
    running = job("running", rounds=[closed_round(1, loss=5.25, eval_loss=5.5)])
    pending = {**job("pending"), "id": OTHER_JOB_ID, "name": "queued"}
    listed = [
        {k: v for k, v in j.items() if k not in ("rounds", "tasks", "data", "model_files", "events")}
        for j in (running, pending)
    ]
    api.routes[("GET", "/api/jobs/")] = json_response(
        200, {"count": 2, "next": None, "previous": None, "results": listed}
    )
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = json_response(200, running)

    assert hypha("jobs") == ExitCode.OK

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "NAME", "STATUS", "ROUNDS", "LAST", "LOSS", "CREATED"]
    assert lines[1].split()[:5] == [JOB_ID, "tiny", "running", "1/2", "5.2500"]
    assert lines[2].split()[:5] == [OTHER_JOB_ID, "queued", "pending", "0/2", "-"]
    # the pending job's detail was not fetched: it cannot have rounds
    assert [r.url.path for r in api.requests] == ["/api/jobs/", f"/api/jobs/{JOB_ID}/"]


def test_jobs_json_prints_the_apis_job_objects(api, hypha, capsys):
    listed = [job("pending")]
    api.routes[("GET", "/api/jobs/")] = json_response(
        200, {"count": 1, "next": None, "previous": None, "results": listed}
    )

    assert hypha("jobs", "--json") == ExitCode.OK
    assert json.loads(capsys.readouterr().out) == listed


def test_jobs_follows_pages_up_to_the_limit(api, hypha, capsys):
    def page(request: httpx.Request) -> httpx.Response:
        offset, limit = int(request.url.params["offset"]), int(request.url.params["limit"])
        results = [
            {**job("pending"), "name": f"job-{index}"} for index in range(offset, min(offset + limit, 250))
        ]
        return json_response(
            200, {"count": 250, "next": "x" if offset + limit < 250 else None, "results": results}
        )

    api.routes[("GET", "/api/jobs/")] = page

    assert hypha("jobs", "--json", "--limit", "150") == ExitCode.OK
    names = [entry["name"] for entry in json.loads(capsys.readouterr().out)]
    assert names == [f"job-{index}" for index in range(150)]
    assert [dict(r.url.params) for r in api.requests] == [
        {"limit": "100", "offset": "0"},
        {"limit": "50", "offset": "100"},
    ]


def test_show_gives_each_lease_its_price_with_the_unit(api, hypha, capsys):
    leases = [{"id": "x", "role": "trainer", "worker": "rig-a", "status": "active", "price": 125.0}]
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = json_response(200, job(leases=leases))

    assert hypha("show", JOB_ID) == ExitCode.OK
    assert "lease: trainer on rig-a (active, 125 credits/h)" in capsys.readouterr().out


def test_show_of_a_missing_job_exits_4(hypha, capsys):
    assert hypha("show", OTHER_JOB_ID) == ExitCode.NOT_FOUND == 4
    assert (
        capsys.readouterr().err
        == f"hypha: error: no job {OTHER_JOB_ID} on {SERVER} (or it is not one of yours)\n"
    )


def test_a_job_id_that_is_not_a_uuid_is_a_usage_error_not_a_request(api, hypha, capsys):
    with pytest.raises(SystemExit) as exit_:
        hypha("show", "not-a-job")
    assert exit_.value.code == ExitCode.USAGE
    assert api.requests == []
    assert "not a job id: 'not-a-job'" in capsys.readouterr().err


def test_a_server_error_exits_6(api, hypha, capsys):
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = httpx.Response(
        500, text="boom", headers={"Content-Type": "text/html"}
    )

    assert hypha("show", JOB_ID) == ExitCode.SERVER_ERROR == 6
    assert f"{SERVER} failed: HTTP 500" in capsys.readouterr().err


# --- watch ------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_waiting(monkeypatch):
    monkeypatch.setattr("hypha_cli.watch.MIN_INTERVAL", 0.0)
    monkeypatch.setattr("hypha_cli.watch.MAX_INTERVAL", 0.0)


@pytest.mark.parametrize(
    ("final", "code"),
    [("completed", ExitCode.OK), ("failed", ExitCode.REFUSED), ("cancelled", ExitCode.CANCELLED)],
)
def test_watch_follows_the_job_until_it_ends_and_exits_with_its_outcome(
    api, hypha, capsys, no_waiting, final, code
):
    round_1 = closed_round(1, loss=5.0, eval_loss=5.1)
    round_2 = closed_round(2, loss=4.5, eval_loss=4.6)
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = [
        json_response(200, job("allocating", reason="ALLOCATING: waiting for offers")),
        json_response(200, job("running", reason="RUNNING: 2 trainers")),
        json_response(200, job("running", reason="RUNNING: 2 trainers", rounds=[round_1])),
        json_response(200, job(final, reason=f"{final.upper()}: the end", rounds=[round_1, round_2])),
    ]

    assert hypha("watch", JOB_ID) == code

    lines = capsys.readouterr().out.splitlines()
    assert lines[:5] == [
        "allocating: ALLOCATING: waiting for offers",
        "running: RUNNING: 2 trainers",
        "round 1/2: loss 5.0000 · eval 5.1000 · 2 trainers · 3.5s",
        f"{final}: {final.upper()}: the end",
        "round 2/2: loss 4.5000 · eval 4.6000 · 2 trainers · 3.5s",
    ]
    expected_tail = f"job {JOB_ID} {final} · rounds 2/2 · loss 5.0000 → 4.5000 · eval 4.6000"
    if final != "completed":
        expected_tail += f" · {final.upper()}: the end"
    assert lines[5:] == [expected_tail]


def test_watch_json_prints_only_the_final_job(api, hypha, capsys, no_waiting):
    final = job("completed", rounds=[closed_round(1, loss=5.0, eval_loss=None)])
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = [
        json_response(200, job("running")),
        json_response(200, final),
    ]

    assert hypha("watch", JOB_ID, "--json") == ExitCode.OK
    assert json.loads(capsys.readouterr().out) == final


def test_watch_retries_a_failing_server_and_then_carries_on(api, hypha, capsys, no_waiting):
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = [
        json_response(200, job("running")),
        httpx.Response(502, text="bad gateway", headers={"Content-Type": "text/html"}),
        json_response(200, job("completed")),
    ]

    assert hypha("watch", JOB_ID) == ExitCode.OK
    assert "HTTP 502" in capsys.readouterr().out


def test_watch_gives_up_on_a_server_that_stays_down_after_its_patience(api, hypha, capsys, no_waiting):
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = [
        json_response(200, job("running")),
        httpx.Response(503, text="down", headers={"Content-Type": "text/html"}),
    ]

    assert hypha("watch", JOB_ID, "--patience", "0.01") == ExitCode.SERVER_ERROR


def test_watch_of_a_missing_job_exits_4_at_once(api, hypha, capsys):
    assert hypha("watch", OTHER_JOB_ID) == ExitCode.NOT_FOUND
    assert len(api.requests) == 1


def test_follow_backs_off_while_nothing_changes_and_speeds_up_on_change():
    from hypha_cli import watch

    answers = iter(
        [job("running")] * 4
        + [job("running", rounds=[closed_round(1, loss=1.0, eval_loss=None)]), job("completed")]
    )
    slept: list[float] = []

    final = watch.follow(lambda: next(answers), reporter=watch.QuietReporter(), sleep=slept.append)

    assert final["status"] == "completed"
    assert slept == [0.5, 0.75, 1.125, 1.6875, 0.5]


# --- cancel -----------------------------------------------------------------------------------------------


def test_cancel_prints_the_new_status(api, hypha, capsys):
    api.routes[("POST", f"/api/jobs/{JOB_ID}/cancel/")] = json_response(
        200, job("cancelled", reason="CANCELLED: cancelled by its owner")
    )

    assert hypha("cancel", JOB_ID) == ExitCode.OK
    assert capsys.readouterr().out == f"job {JOB_ID} cancelled: CANCELLED: cancelled by its owner\n"


def test_cancelling_an_ended_job_is_refused_with_exit_1(api, hypha, capsys):
    api.routes[("POST", f"/api/jobs/{JOB_ID}/cancel/")] = json_response(409, {"detail": "job is completed"})

    assert hypha("cancel", JOB_ID) == ExitCode.REFUSED
    assert capsys.readouterr().err == "hypha: error: job is completed\n"


# --- download ---------------------------------------------------------------------------------------------


def _model_zip() -> bytes:
    buffer = BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        bundle.writestr("config.json", '{"model_type": "gpt2"}')
        bundle.writestr("model.safetensors", b"weights")
    return buffer.getvalue()


def test_download_saves_the_zip_under_the_servers_file_name_and_extracts_it(api, hypha, tmp_path, capsys):
    api.routes[("GET", f"/api/jobs/{JOB_ID}/model")] = httpx.Response(
        200,
        content=_model_zip(),
        headers={
            "Content-Type": "application/zip",
            "Content-Disposition": f'attachment; filename="model-{JOB_ID}.zip"',
        },
    )
    out = tmp_path / "out"

    assert hypha("download", JOB_ID, "-o", str(out), "--extract") == ExitCode.OK

    archive = out / f"model-{JOB_ID}.zip"
    assert capsys.readouterr().out == f"{archive}\n{out / f'model-{JOB_ID}'}\n"
    assert archive.read_bytes() == _model_zip()
    assert (out / f"model-{JOB_ID}" / "model.safetensors").read_bytes() == b"weights"
    assert sorted(path.name for path in out.iterdir()) == [f"model-{JOB_ID}", f"model-{JOB_ID}.zip"]


def test_download_ignores_a_path_in_the_servers_file_name(api, hypha, tmp_path):
    api.routes[("GET", f"/api/jobs/{JOB_ID}/model")] = httpx.Response(
        200, content=b"zip", headers={"Content-Disposition": 'attachment; filename="../../evil.zip"'}
    )

    assert hypha("download", JOB_ID, "-o", str(tmp_path / "out")) == ExitCode.OK
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["evil.zip"]


def test_downloading_before_the_model_exists_is_refused_and_leaves_no_file(api, hypha, tmp_path, capsys):
    api.routes[("GET", f"/api/jobs/{JOB_ID}/model")] = json_response(
        409, {"detail": f"job {JOB_ID} has no model yet (it is running)"}
    )

    assert hypha("download", JOB_ID, "-o", str(tmp_path / "out")) == ExitCode.REFUSED
    assert capsys.readouterr().err == f"hypha: error: job {JOB_ID} has no model yet (it is running)\n"
    assert not (tmp_path / "out").exists()


def test_downloading_a_missing_jobs_model_exits_4(api, hypha, tmp_path):
    api.routes[("GET", f"/api/jobs/{JOB_ID}/model")] = json_response(404, {"detail": "No such job."})

    assert hypha("download", JOB_ID, "-o", str(tmp_path)) == ExitCode.NOT_FOUND


# --- workers --------------------------------------------------------------------------------------------------


WORKER = {
    "id": "5e0c7c51-8d8e-4a77-9f2b-2bb9d3b1c0aa",
    "view": "full",
    "name": "bobs-gpu",
    "owner": "bob",
    "resources": {"cpu": 8.0, "memory": 32.0, "storage": 100.0, "gpu": 24.0},
    "executors": [{"class": "train", "name": "diloco-transformer"}],
    "price_floor": 50.0,
    "strategy": "",
    "benchmark_score": 123.45,
    "benchmark": {"device": "cpu", "model": "tiny-gpt-2x128", "batch_size": 8},
    "status": "online",
    "last_seen_at": None,
    "connected_at": None,
    "token_hint": "abcd",
    "revoked": False,
    "token_revoked_at": None,
    "created_at": "2025-01-02T03:04:05Z",
    "leases": [{"id": "x", "job": JOB_ID, "role": "trainer", "status": "active", "price": 90.0}],
}


def test_workers_shows_a_table(api, hypha, capsys):
    api.routes[("GET", "/api/workers/")] = json_response(
        200, {"count": 1, "next": None, "previous": None, "results": [WORKER]}
    )

    assert hypha("workers") == ExitCode.OK

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "NAME",
        "STATUS",
        "CPU",
        "MEM",
        "GB",
        "GPU",
        "GB",
        "EXECUTORS",
        "FLOOR",
        "CR/H",
        "BENCH/S",
        "LEASES",
        "LAST",
        "SEEN",
    ]
    assert lines[1].split() == [
        "bobs-gpu",
        "online",
        "8",
        "32",
        "24",
        "train/diloco-transformer",
        "50",
        "123.5",
        "trainer",
        "(active,",
        "90",
        "credits/h)",
        "-",
    ]


def test_workers_shows_a_dash_for_a_worker_not_benchmarked_yet(api, hypha, capsys):
    unmeasured = {**WORKER, "benchmark_score": None, "benchmark": {}}
    api.routes[("GET", "/api/workers/")] = json_response(
        200, {"count": 1, "next": None, "previous": None, "results": [unmeasured]}
    )

    assert hypha("workers") == ExitCode.OK

    assert capsys.readouterr().out.splitlines()[1].split()[6:8] == ["50", "-"]


def test_workers_json_prints_the_apis_worker_objects(api, hypha, capsys):
    api.routes[("GET", "/api/workers/")] = json_response(
        200, {"count": 1, "next": None, "previous": None, "results": [WORKER]}
    )

    assert hypha("workers", "--json") == ExitCode.OK
    assert json.loads(capsys.readouterr().out) == [WORKER]


# --- the command line itself -----------------------------------------------------------------------------


def test_usage_errors_exit_64_not_2_which_means_cancelled(hypha, capsys):
    with pytest.raises(SystemExit) as exit_:
        hypha("jobs", "--limit", "0")
    assert exit_.value.code == ExitCode.USAGE == 64
    with pytest.raises(SystemExit) as exit_:
        hypha()
    assert exit_.value.code == ExitCode.USAGE
    assert "a command is required" in capsys.readouterr().err


def test_connection_flags_work_before_and_after_the_command(api, hypha, capsys):
    api.routes[("GET", "/api/workers/")] = json_response(
        200, {"count": 0, "next": None, "previous": None, "results": []}
    )
    other = "http://elsewhere.test"

    assert hypha("--server", other, "workers", "--token", TOKEN, env={}) == ExitCode.OK
    assert hypha("workers", "--server", other, "--token", TOKEN, env={}) == ExitCode.OK
    assert [str(r.url) for r in api.requests] == [f"{other}/api/workers/?limit=100&offset=0"] * 2


def test_help_is_fast_and_imports_neither_httpx_nor_rich():
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from hypha_cli.__main__ import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    code = e.code\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('httpx', 'rich', 'django', 'apps'))\n"
        "print(code, heavy, file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=True
    )
    assert result.stderr.strip() == "0 []"
    assert "exit codes:" in result.stdout


def test_a_rounds_line_names_a_lossy_encoding_only():
    from hypha_cli.output import round_line

    plain = closed_round(2, loss=4.5, eval_loss=None)
    assert round_line({**plain, "encoding": "int8"}, 3) == (
        "round 2/3: loss 4.5000 · 2 trainers · 3.5s · int8"
    )
    assert (
        round_line({**plain, "encoding": "float32"}, 3)
        == round_line(plain, 3)
        == ("round 2/3: loss 4.5000 · 2 trainers · 3.5s")
    )


def test_jobs_filters_by_status_and_name_on_every_page(api, hypha, capsys):
    # given: the API filters (GET /api/jobs/?status=…&name=…); here one page of one job, then none
    api.routes[("GET", "/api/jobs/")] = [
        json_response(200, {"count": 1, "next": None, "results": [{**job("failed"), "name": "gpt sweep"}]}),
        json_response(200, {"count": 0, "next": None, "results": []}),
    ]

    # when
    found = hypha("jobs", "--json", "--status", "failed", "--name", "sweep")
    listed = json.loads(capsys.readouterr().out)
    nothing = hypha("jobs", "--name", "gamma")

    # then
    assert (found, [entry["name"] for entry in listed]) == (ExitCode.OK, ["gpt sweep"])
    assert (nothing, capsys.readouterr().out) == (ExitCode.OK, "No job matches the filter.\n")
    assert [dict(r.url.params) for r in api.requests] == [
        {"limit": "20", "offset": "0", "status": "failed", "name": "sweep"},
        {"limit": "20", "offset": "0", "name": "gamma"},
    ]
    with pytest.raises(SystemExit) as exit_:  # an unknown status is a usage error
        hypha("jobs", "--status", "done")
    assert exit_.value.code == ExitCode.USAGE
