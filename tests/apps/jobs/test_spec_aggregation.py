"""The spec's aggregation rule and verification (``rounds.aggregation``, ``clip_factor``, ``trim_fraction``,
``verification``; docs/training.md, "Robust aggregation and verification"): field errors, the TOML, and what
the parameter server's job JSON carries (nothing for the default, so that existing jobs' JSON is unchanged).
The parameter server parses what the spec writes (parameter_server.job).

No database: the modules under test are pure pydantic.
"""

from __future__ import annotations

import pytest

from apps.jobs.spec import parse_json, parse_toml
from parameter_server.aggregation import AggregationRule, Verification
from parameter_server.job import parse_job
from tests.apps.jobs.test_spec import HYPHA_DEFAULT_TOML, _executor_jsons, errors_of, lenet_json

ROUNDS = {"update_rounds": 2, "inner_steps": 5}


def aggregate_rounds(**rounds) -> dict:
    spec = parse_json(lenet_json(rounds={**ROUNDS, **rounds}))
    return _executor_jsons(spec)[1]["rounds"]


def test_a_mean_job_writes_no_aggregation_keys():
    assert aggregate_rounds() == aggregate_rounds(aggregation="mean")
    assert not {"aggregation", "clip_factor", "trim_fraction", "verification"} & set(aggregate_rounds())


def test_a_robust_rule_and_its_options_reach_the_parameter_server():
    rounds = aggregate_rounds(
        aggregation="clipped_mean", clip_factor=3.0, verification={"max_norm_ratio": 20.0, "min_cosine": -0.8}
    )

    assert rounds["aggregation"] == "clipped_mean" and rounds["clip_factor"] == 3.0
    assert rounds["verification"] == {"enabled": None, "max_norm_ratio": 20.0, "min_cosine": -0.8}
    # and the parameter server reads them as written
    spec = parse_json(
        lenet_json(
            rounds={
                **ROUNDS,
                "aggregation": "clipped_mean",
                "clip_factor": 3.0,
                "verification": {"min_cosine": 0},
            }
        )
    )
    _, aggregate = _executor_jsons(spec)
    job = parse_job({"job_id": "j", "executor": {"class": "aggregate", "config": aggregate}})
    assert job.aggregation == AggregationRule(
        "clipped_mean", clip_factor=3.0, verification=Verification(enabled=None, min_cosine=0.0)
    )
    # a verified mean is carried too
    assert aggregate_rounds(verification={"enabled": True})["verification"]["enabled"] is True


@pytest.mark.parametrize(
    ("rounds", "field", "message"),
    [
        ({"aggregation": "krum"}, "rounds.aggregation", "'mean', 'clipped_mean', 'trimmed_mean' or 'median'"),
        (
            {"aggregation": "median", "clip_factor": 2.0},
            "rounds.clip_factor",
            "clip_factor is an option of aggregation = 'clipped_mean' (this job's is median).",
        ),
        (
            {"trim_fraction": 0.1},
            "rounds.trim_fraction",
            "trim_fraction is an option of aggregation = 'trimmed_mean' (this job's is mean).",
        ),
        ({"aggregation": "trimmed_mean", "trim_fraction": 0.5}, "rounds.trim_fraction", "less than 0.5"),
        (
            {"aggregation": "clipped_mean", "clip_factor": 0.5},
            "rounds.clip_factor",
            "greater than or equal to 1",
        ),
        ({"verification": {"max_norm_ratio": 1}}, "rounds.verification.max_norm_ratio", "greater than 1"),
        (
            {"verification": {"min_cosine": -2.0}},
            "rounds.verification.min_cosine",
            "greater than or equal to -1",
        ),
        ({"verification": {"enable": True}}, "rounds.verification.enable", "Unknown key."),
    ],
)
def test_a_wrong_rule_or_option_is_reported_at_its_field(rounds, field, message):
    (error,) = errors_of(parse_json, lenet_json(rounds={**ROUNDS, **rounds}))

    assert error["field"] == field and message in error["message"]


def test_the_toml_takes_the_rule_in_its_rounds_table():
    text = HYPHA_DEFAULT_TOML.replace(
        "[scheduler.job.rounds]",
        '[scheduler.job.rounds]\naggregation = "trimmed_mean"\ntrim-fraction = 0.2\n'
        "verification = { min_cosine = -0.3 }",
    )

    spec = parse_toml(text)

    assert (spec.rounds.aggregation, spec.rounds.trim_fraction) == ("trimmed_mean", 0.2)
    assert spec.rounds.verification is not None and spec.rounds.verification.min_cosine == -0.3


def test_the_toml_takes_verification_as_a_table_and_max_rejections_stays_on_the_control_plane():
    text = HYPHA_DEFAULT_TOML.replace(
        "[scheduler.job.inner_optimizer]",
        "[scheduler.job.rounds.verification]\nenabled = true\nmax_rejections = 5\n\n[scheduler.job.inner_optimizer]",
    )

    spec = parse_toml(text)

    assert spec.rounds.verification is not None
    assert (spec.rounds.verification.enabled, spec.rounds.verification.max_rejections) == (True, 5)
    _, aggregate = _executor_jsons(spec)
    assert aggregate["rounds"]["verification"] == {
        "enabled": True,
        "max_norm_ratio": 10.0,
        "min_cosine": -0.5,
    }
    assert "aggregation" not in aggregate["rounds"]  # a verified mean


def test_the_stored_spec_keeps_the_rule_and_leaves_the_defaults_out():
    default = parse_json(lenet_json(rounds=ROUNDS))
    robust = parse_json(
        lenet_json(rounds={**ROUNDS, "aggregation": "median", "verification": {"max_rejections": 2}})
    )

    stored = robust.model_dump(mode="json")

    assert not {"aggregation", "clip_factor", "trim_fraction", "verification"} & set(
        default.model_dump(mode="json")["rounds"]
    )
    assert parse_json(stored) == robust
    assert parse_json(stored).rounds.verification.max_rejections == 2
