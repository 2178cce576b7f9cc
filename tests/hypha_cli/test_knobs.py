"""``hypha submit``'s training-knob options: set in a JSON spec, refused for a TOML one, a non-number refused
before any request (the server checks the ranges: tests/apps/jobs/test_training_knobs.py)."""

from __future__ import annotations

import json

import pytest

from hypha_cli.exceptions import ExitCode
from tests.hypha_cli.conftest import job, json_response


def test_submit_sets_every_knob_in_the_json_spec(api, hypha, tmp_path):
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"inner_optimizer": {"learning_rate": 0.001}, "batch_size": 8}))
    api.routes[("POST", "/api/jobs/diloco/")] = json_response(201, job("pending"))

    code = hypha(
        "submit",
        str(spec),
        "--weight-decay", "0.1",
        "--max-grad-norm", "1",
        "--gradient-accumulation-steps", "4",
        "--mixed-precision", "bf16",
        "--gradient-checkpointing",
        "--dataloader-workers", "2",
    )  # fmt: skip

    assert code == ExitCode.OK
    (request,) = api.requests
    assert json.loads(request.content) == {
        "inner_optimizer": {"learning_rate": 0.001, "weight_decay": 0.1},
        "batch_size": 8,
        "training": {
            "max_grad_norm": 1.0,
            "gradient_accumulation_steps": 4,
            "mixed_precision": "bf16",
            "gradient_checkpointing": True,
            "dataloader_workers": 2,
        },
    }


def test_submit_without_knob_options_leaves_the_spec_alone(api, hypha, tmp_path):
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"batch_size": 8}))
    api.routes[("POST", "/api/jobs/diloco/")] = json_response(201, job("pending"))

    assert hypha("submit", str(spec)) == ExitCode.OK
    (request,) = api.requests
    assert json.loads(request.content) == {"batch_size": 8}


def test_a_knob_option_with_a_toml_spec_is_a_usage_error(api, hypha, tmp_path, capsys):
    spec = tmp_path / "job.toml"
    spec.write_text("[scheduler.job]\nnum_trainers = 2\n")

    assert hypha("submit", str(spec), "--mixed-precision", "bf16") == ExitCode.USAGE
    assert "under [scheduler.job.training]" in capsys.readouterr().err
    assert api.requests == []


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--mixed-precision", "fp8", "invalid choice: 'fp8'"),
        ("--gradient-accumulation-steps", "two", "not a whole number"),
        ("--max-grad-norm", "nan", "not a finite number"),
    ],
)
def test_a_malformed_knob_option_is_refused_before_any_request(
    api, hypha, tmp_path, capsys, option, value, message
):
    with pytest.raises(SystemExit) as exit_:
        hypha("submit", str(tmp_path / "job.json"), option, value)
    assert exit_.value.code == ExitCode.USAGE
    assert message in capsys.readouterr().err
    assert api.requests == []


def test_the_servers_field_error_for_a_knob_is_shown(api, hypha, tmp_path, capsys):
    spec = tmp_path / "job.json"
    spec.write_text("{}")
    body = {"training.dataloader_workers": ["Input should be less than or equal to 32"]}
    api.routes[("POST", "/api/jobs/diloco/")] = json_response(400, body)

    assert hypha("submit", str(spec), "--dataloader-workers", "40") == ExitCode.REFUSED
    assert "training.dataloader_workers" in capsys.readouterr().err
