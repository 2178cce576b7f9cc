"""The CLI's batch inference surfaces against the fake control plane: ``hypha submit`` sends an inference spec
(TOML or JSON) to ``POST /api/jobs/inference/``, ``hypha watch`` shows slices done/total with an ETA, and
``hypha results`` saves the results zip or one slice's file."""

from __future__ import annotations

import io
import json
import re
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from hypha_cli import inference
from hypha_cli.exceptions import ExitCode
from tests.hypha_cli.conftest import JOB_ID, job, json_response

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inference" / "embed-tiny-gpt2.toml"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

INFERENCE_TOML = """\
[scheduler.job]
type = "inference"
batch_size = 4

[scheduler.job.model]
upload = "tiny-gpt2.zip"

[scheduler.job.dataset]
dataset = "tiny-text"

[scheduler.job.task]
type = "embed"
"""

INFERENCE_JSON = {
    "name": "embed",
    "model": {"source": {"type": "upload", "file": "tiny-gpt2.zip"}},
    "dataset": {"name": "tiny-text"},
    "task": {"type": "generate", "max_new_tokens": 4},
    "workers": 2,
}


def inference_job(status: str = "running", *, done: int, total: int, **extra) -> dict:
    """An inference job's detail: ``kind`` and ``progress``, no rounds."""
    return job(
        status,
        kind="inference",
        progress={"slices_done": done, "slices_total": total},
        spec={"task": {"type": "embed"}},
        **extra,
    )


@pytest.fixture
def no_waiting(monkeypatch):
    monkeypatch.setattr("hypha_cli.watch.MIN_INTERVAL", 0.0)
    monkeypatch.setattr("hypha_cli.watch.MAX_INTERVAL", 0.0)


# --- submit -------------------------------------------------------------------------------------------------


def test_submit_sends_an_inference_toml_to_the_inference_endpoint_with_its_name(api, hypha, tmp_path, capsys):
    # given
    spec = tmp_path / "embed.toml"
    spec.write_text(INFERENCE_TOML)
    api.routes[("POST", "/api/jobs/inference/")] = json_response(
        201, inference_job("pending", done=0, total=8)
    )

    # when
    code = hypha("submit", str(spec), "--name", "embed")

    # then
    assert code == ExitCode.OK
    assert capsys.readouterr().out == f"{JOB_ID}\n"
    (request,) = api.requests
    assert request.url.path == "/api/jobs/inference/"
    assert request.url.params["name"] == "embed"
    assert request.headers["Content-Type"] == "application/toml"
    assert request.content == INFERENCE_TOML.encode()


def test_submit_sends_a_json_spec_with_a_task_to_the_inference_endpoint(api, hypha, tmp_path):
    spec = tmp_path / "generate.json"
    spec.write_text(json.dumps(INFERENCE_JSON))
    api.routes[("POST", "/api/jobs/inference/")] = json_response(
        201, inference_job("pending", done=0, total=8)
    )

    assert hypha("submit", str(spec), "--name", "renamed") == ExitCode.OK

    assert api.bodies("POST", "/api/jobs/inference/") == [{**INFERENCE_JSON, "name": "renamed"}]


def test_the_example_toml_goes_to_the_inference_endpoint(api, hypha):
    api.routes[("POST", "/api/jobs/inference/")] = json_response(
        201, inference_job("pending", done=0, total=8)
    )

    assert hypha("submit", str(EXAMPLE), "--name", "embed-tiny-gpt2") == ExitCode.OK
    assert [request.url.path for request in api.requests] == ["/api/jobs/inference/"]


def test_a_training_toml_still_goes_to_the_diloco_endpoint(api, hypha, tmp_path):
    spec = tmp_path / "train.toml"
    spec.write_text('[scheduler.job]\ntype = "diloco"\n[scheduler.job.dataset]\ndataset = "tiny-text"\n')
    api.routes[("POST", "/api/jobs/diloco/")] = json_response(201, job("pending"))

    assert hypha("submit", str(spec)) == ExitCode.OK
    assert [request.url.path for request in api.requests] == ["/api/jobs/diloco/"]


@pytest.mark.parametrize(
    ("suffix", "content", "option"),
    [
        (".toml", INFERENCE_TOML, ["--encoding", "int8"]),
        (".json", json.dumps(INFERENCE_JSON), ["--overlap", "eager"]),
        (".json", json.dumps(INFERENCE_JSON), ["--mix", "0.5"]),
    ],
)
def test_training_options_are_a_usage_error_for_an_inference_spec(
    api, hypha, tmp_path, capsys, suffix, content, option
):
    spec = tmp_path / f"job{suffix}"
    spec.write_text(content)

    assert hypha("submit", str(spec), *option) == ExitCode.USAGE
    assert api.requests == []
    assert f"{option[0]}: training options; {spec} is an inference job" in capsys.readouterr().err


def test_a_refused_inference_spec_prints_each_toml_path_and_exits_1(api, hypha, tmp_path, capsys):
    spec = tmp_path / "embed.toml"
    spec.write_text(INFERENCE_TOML)
    api.routes[("POST", "/api/jobs/inference/")] = json_response(
        400, {"scheduler.job.task.max_new_tokens": ["Input should be greater than or equal to 1"]}
    )

    assert hypha("submit", str(spec)) == ExitCode.REFUSED
    assert "  scheduler.job.task.max_new_tokens: Input should be greater than or equal to 1" in (
        capsys.readouterr().err
    )


# --- watch --------------------------------------------------------------------------------------------------


def test_watch_prints_slices_done_of_total_with_an_eta_then_where_the_results_are(
    api, hypha, no_waiting, capsys
):
    # given: a job allocated 60 s ago that has done 2 of 8 slices, then 6, then all
    allocated = (datetime.now(UTC) - timedelta(seconds=60)).isoformat()
    answers = [
        inference_job("running", done=0, total=8, allocated_at=allocated),
        inference_job("running", done=2, total=8, allocated_at=allocated),
        inference_job("running", done=2, total=8, allocated_at=allocated),
        inference_job("running", done=6, total=8, allocated_at=allocated),
        inference_job(
            "completed",
            done=8,
            total=8,
            allocated_at=allocated,
            created_at="2025-01-02T03:04:05Z",
            ended_at="2025-01-02T03:05:10Z",
        ),
    ]
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = [json_response(200, answer) for answer in answers]

    # when
    code = hypha("watch", JOB_ID)

    # then: a line per status and per change of the count, the ETA from the rate so far (2 in 60 s: 6 more
    # in about 180 s; 6 in 60 s: 2 more in about 20 s), none once ended
    assert code == ExitCode.OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "running"
    assert lines[1] == "slices 0/8"
    assert re.fullmatch(r"slices 2/8 · ETA 0:03:0\d", lines[2]), lines[2]
    assert re.fullmatch(r"slices 6/8 · ETA 0:00:2\d", lines[3]), lines[3]
    assert lines[4:6] == ["completed", "slices 8/8"]
    assert lines[6] == (
        f"job {JOB_ID} completed · slices 8/8 · took 0:01:05 · results: hypha results {JOB_ID}"
    )
    assert len(lines) == 7


def test_watch_on_a_terminal_draws_a_bar_of_slices_with_the_eta(api, hypha, no_waiting, monkeypatch):
    # given: a terminal of 80 columns
    monkeypatch.setenv("COLUMNS", "80")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    allocated = (datetime.now(UTC) - timedelta(seconds=40)).isoformat()
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = [
        json_response(
            200, inference_job("running", done=4, total=8, allocated_at=allocated, created_at=allocated)
        ),
        json_response(
            200,
            inference_job(
                "completed",
                done=8,
                total=8,
                created_at="2025-01-02T03:04:05Z",
                ended_at="2025-01-02T03:05:10Z",
            ),
        ),
    ]

    # when
    assert hypha("watch", JOB_ID) == ExitCode.OK

    # then: the bar's line has the count and the ETA and fits 80 columns (the summary line is printed plain)
    drawn = [line for line in re.split(r"[\r\n]", ANSI.sub("", screen.getvalue())) if line.strip()]
    bars = [line for line in drawn if "slices 4/8" in line and "ETA" in line]
    assert bars, drawn
    assert all(len(line) <= 80 for line in drawn if not line.startswith(f"job {JOB_ID}")), drawn
    assert re.search(r"ETA 0:00:[34]\d", bars[-1]), bars[-1]


def test_the_eta_prefers_the_servers_estimate_and_is_none_before_the_first_slice():
    now = datetime(2025, 1, 2, 3, 5, 5, tzinfo=UTC)
    running = inference_job("running", done=0, total=8, allocated_at="2025-01-02T03:04:05Z")
    assert inference.eta_seconds(running, now=now) is None
    running["progress"]["slices_done"] = 4
    assert inference.eta_seconds(running, now=now) == pytest.approx(60.0)
    running["progress"]["eta_seconds"] = 12.5
    assert inference.eta_seconds(running, now=now) == 12.5
    assert inference.eta_seconds(inference_job("completed", done=8, total=8), now=now) is None


def test_show_prints_an_inference_jobs_slices(api, hypha, capsys):
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = json_response(
        200, inference_job("running", done=3, total=8)
    )

    assert hypha("show", JOB_ID) == ExitCode.OK
    assert "slices 3/8" in capsys.readouterr().out


# --- results ------------------------------------------------------------------------------------------------


def results_zip() -> bytes:
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("0.jsonl", '{"row": 0, "tokens": [1, 2]}\n')
        archive.writestr("manifest.json", json.dumps({"job": JOB_ID, "slices_done": 1, "slices_total": 1}))
    return buffer.getvalue()


def test_results_saves_the_zip_under_the_servers_name_in_the_current_directory(
    api, hypha, tmp_path, monkeypatch, capsys
):
    # given
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    body = results_zip()
    api.routes[("GET", f"/api/jobs/{JOB_ID}/results/")] = httpx.Response(
        200,
        content=body,
        headers={
            "Content-Type": "application/zip",
            "Content-Disposition": f'attachment; filename="results-{JOB_ID}.zip"',
        },
    )

    # when
    assert hypha("results", JOB_ID) == ExitCode.OK

    # then
    assert capsys.readouterr().out == f"results-{JOB_ID}.zip\n"
    assert (here / f"results-{JOB_ID}.zip").read_bytes() == body
    assert [p.name for p in here.iterdir()] == [f"results-{JOB_ID}.zip"]  # no partial file left


def test_results_with_output_writes_that_file(api, hypha, tmp_path, capsys):
    body = results_zip()
    api.routes[("GET", f"/api/jobs/{JOB_ID}/results/")] = httpx.Response(
        200, content=body, headers={"Content-Type": "application/zip"}
    )
    target = tmp_path / "out" / "embeddings.zip"

    assert hypha("results", JOB_ID, "-o", str(target), "--json") == ExitCode.OK

    assert target.read_bytes() == body
    assert json.loads(capsys.readouterr().out) == {"path": str(target), "bytes": len(body), "slice": None}


def test_results_of_one_slice_saves_its_file_in_a_directory_under_its_name(api, hypha, tmp_path, capsys):
    api.routes[("GET", f"/api/jobs/{JOB_ID}/results/3/")] = httpx.Response(
        200,
        content=b'{"row": 0, "tokens": [5]}\n',
        headers={
            "Content-Type": "application/octet-stream",
            "Content-Disposition": 'attachment; filename="3.jsonl"',
        },
    )

    assert hypha("results", JOB_ID, "--slice", "3", "-o", str(tmp_path)) == ExitCode.OK

    assert (tmp_path / "3.jsonl").read_bytes() == b'{"row": 0, "tokens": [5]}\n'
    assert capsys.readouterr().out == f"{tmp_path / '3.jsonl'}\n"


def test_results_of_a_slice_without_one_exits_4_and_leaves_nothing(api, hypha, tmp_path, capsys):
    api.routes[("GET", f"/api/jobs/{JOB_ID}/results/5/")] = json_response(404, {"detail": "No such result."})

    target = tmp_path / "results"

    assert hypha("results", JOB_ID, "--slice", "5", "-o", f"{target}/") == ExitCode.NOT_FOUND

    assert f"job {JOB_ID} has no result for slice 5" in capsys.readouterr().err
    assert not target.exists() or list(target.iterdir()) == []


def test_results_of_a_training_job_is_refused_with_the_servers_reason(api, hypha, tmp_path, capsys):
    api.routes[("GET", f"/api/jobs/{JOB_ID}/results/")] = json_response(
        409, {"detail": f"job {JOB_ID} is not an inference job"}
    )

    assert hypha("results", JOB_ID, "-o", str(tmp_path)) == ExitCode.REFUSED
    assert "is not an inference job" in capsys.readouterr().err


@pytest.mark.parametrize("index", ["-1", "x", str(2**31)])
def test_a_bad_slice_number_is_a_usage_error(api, hypha, index):
    with pytest.raises(SystemExit) as exited:
        hypha("results", JOB_ID, "--slice", index)
    assert exited.value.code == ExitCode.USAGE
    assert api.requests == []
