"""A body that cannot be read at all — malformed TOML or JSON, TOML nested too deep — is answered, over real
HTTP, as ``docs/openapi.yaml`` documents for ``POST /api/jobs/diloco/``: ``400 {"detail": "..."}``; a readable
body with mistakes keeps its field errors (every one, by path)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from apps.jobs.models import Job

OPENAPI = Path(__file__).resolve().parents[3] / "docs" / "openapi.yaml"


def post(live_server, persona, body: bytes, content_type: str) -> httpx.Response:
    return httpx.post(
        f"{live_server.url}/api/jobs/diloco/",
        content=body,
        headers={"Authorization": f"Token {persona.token}", "Content-Type": content_type},
        timeout=30,
    )


def documented_400() -> dict:
    document = yaml.safe_load(OPENAPI.read_text())
    return document["paths"]["/api/jobs/diloco/"]["post"]["responses"]["400"]["content"]["application/json"][
        "schema"
    ]


def test_the_schema_documents_detail_for_a_body_that_cannot_be_parsed():
    schema = documented_400()

    assert schema["properties"] == {
        "detail": {"type": "string", "description": "Why the body could not be parsed."}
    }
    assert "malformed JSON or TOML" in schema["description"]


@pytest.mark.parametrize(
    ("body", "content_type", "starts"),
    [
        pytest.param(b"[scheduler.job\n", "application/toml", "TOML syntax error: ", id="toml"),
        pytest.param(
            b"a = " + b"[" * 200 + b"]" * 200, "application/toml", "TOML nested more", id="deep toml"
        ),
        pytest.param(b"\xff\xfe[", "application/toml", "TOML must be UTF-8", id="toml not utf-8"),
        pytest.param(b'{"model": ', "application/json", "JSON parse error - ", id="json"),
    ],
)
def test_a_body_that_cannot_be_parsed_is_a_400_with_detail(live_server, alice, body, content_type, starts):
    # when
    response = post(live_server, alice, body, content_type)

    # then
    assert response.status_code == 400
    assert response.headers["Content-Type"] == "application/json"
    answer = response.json()
    assert list(answer) == ["detail"]
    assert isinstance(answer["detail"], str) and answer["detail"].startswith(starts), answer
    assert Job.objects.count() == 0


def test_the_toml_syntax_error_names_its_line(live_server, alice):
    response = post(live_server, alice, b'[scheduler.job]\ntype = "diloco"\nmodel = \n', "application/toml")

    assert response.json() == {"detail": "TOML syntax error: Invalid value (at line 3, column 9)"}


def test_a_readable_toml_with_mistakes_keeps_its_field_errors(live_server, alice):
    # given: parses, but has no job table, and then a job with two mistakes
    no_job = post(live_server, alice, b'cert_pem = "x.pem"\n', "application/toml")
    two = b"[scheduler.job]\nbatch_size = 0\n[scheduler.job.rounds]\nupdate_rounds = 0\n"
    mistakes = post(live_server, alice, two, "application/toml")

    # then
    assert (no_job.status_code, no_job.json()) == (
        400,
        {"scheduler.job": ["Missing: no [scheduler.job] table."]},
    )
    assert mistakes.status_code == 400
    body = mistakes.json()
    assert "detail" not in body
    assert {"scheduler.job.batch_size", "scheduler.job.rounds.update_rounds", "scheduler.job.model"} <= set(
        body
    )


def test_hypha_submit_prints_the_detail_of_a_broken_toml(live_server, alice, tmp_path, capsys):
    # given
    from hypha_cli.__main__ import run
    from hypha_cli.exceptions import ExitCode

    broken = tmp_path / "job.toml"
    broken.write_text('[scheduler.job]\ntype = "diloco"\nmodel = \n')

    # when
    code = run(
        ["submit", str(broken), "--server", live_server.url, "--token", alice.token],
        environ={"HOME": str(tmp_path)},
    )

    # then
    assert code != ExitCode.OK
    assert "TOML syntax error: Invalid value (at line 3, column 9)" in capsys.readouterr().err
    assert Job.objects.count() == 0
