"""The parameter server's job JSON (parameter_server/job.py)."""

from __future__ import annotations

import json

import pytest

from parameter_server.exceptions import JobConfigError
from parameter_server.job import EvalSlice, parse_job
from tests.parameter_server.conftest import ALICE, BOB, JOB_ID, TINY_GPT2, aggregate_job


def test_a_full_job_parses():
    eval_config = {
        "dataset": "stdlib",
        "batch_size": 4,
        "slices": [
            {"index": 3, "size": 10, "sha256": "A" * 64, "urls": ["http://data/datasets/stdlib/slices/3"]}
        ],
    }

    job = parse_job(json.dumps(aggregate_job(peers=[ALICE, BOB], eval_config=eval_config)))

    assert job.job_id == JOB_ID
    assert job.expected_peers == (ALICE, BOB)
    assert (job.learning_rate, job.momentum) == (0.5, 0.5)
    assert (job.task, job.source.type, job.source.config) == ("causal-lm", "config", TINY_GPT2)
    assert (job.input_names, job.seed) == (("input_ids", "labels"), 1234)
    assert (job.update_rounds, job.round_timeout, job.weighted) == (2, 30.0, True)
    assert job.eval.batch_size == 4
    assert job.eval.slices == (
        EvalSlice(index=3, size=10, sha256="a" * 64, urls=("http://data/datasets/stdlib/slices/3",)),
    )


def test_defaults_of_the_optional_keys():
    document = aggregate_job(peers=[ALICE])
    del document["executor"]["config"]["rounds"]
    del document["executor"]["config"]["eval"]

    job = parse_job(document)

    assert (job.update_rounds, job.round_timeout, job.weighted, job.eval) == (1, 120.0, True, None)
    assert (job.max_samples_per_update, job.update_norm_ratio) == (None, 10.0)
    assert job.checkpoint_every == 10


def test_the_update_bounds_parse():
    document = aggregate_job(peers=[ALICE])
    document["executor"]["config"]["rounds"].update(max_samples_per_update=4096, update_norm_ratio=4)

    job = parse_job(document)

    assert (job.max_samples_per_update, job.update_norm_ratio) == (4096, 4.0)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("executor", "class"), "train", "executor.class"),
        (("executor", "config", "updates", "peers"), [], "at least one trainer"),
        (("executor", "config", "updates", "peers"), [ALICE, ALICE], "twice"),
        (("executor", "config", "optimizer", "learning-rate"), 0, "learning-rate"),
        (("executor", "config", "optimizer", "momentum"), 1.0, "momentum"),
        (("executor", "config", "model", "source", "type"), "ftp", "model.source.type"),
        (("executor", "config", "rounds", "update_rounds"), 0, "update_rounds"),
        (("executor", "config", "rounds", "round_timeout"), -1, "round_timeout"),
        (("executor", "config", "rounds", "weighted"), "yes", "weighted"),
        (("executor", "config", "rounds", "max_samples_per_update"), 0, "max_samples_per_update"),
        (("executor", "config", "rounds", "max_samples_per_update"), 1.5, "max_samples_per_update"),
        (("executor", "config", "rounds", "update_norm_ratio"), 1, "update_norm_ratio"),
        (("executor", "config", "rounds", "update_norm_ratio"), float("inf"), "update_norm_ratio"),
        (("executor", "config", "eval"), {"batch_size": 1, "slices": []}, "eval.slices"),
        (
            ("executor", "config", "rounds", "checkpoint_every"),
            0,
            "rounds.checkpoint_every must be an integer",
        ),
        (("executor", "config", "rounds", "checkpoint_every"), 1001, "checkpoint_every must be at most 1000"),
        (
            ("executor", "config", "checkpoint"),
            {
                "round": 3,
                "uri": "/c/",
                "files": {"result-x.safetensors": {}, "round.json": {}, "weights.safetensors": {}},
            },
            "unknown file 'result-x.safetensors'",
        ),
    ],
)
def test_bad_values_name_their_key(path, value, message):
    document = aggregate_job(peers=[ALICE, BOB])
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value

    with pytest.raises(JobConfigError, match=message):
        parse_job(document)


def test_the_checkpoint_copy_names_its_chain_and_the_rounds_between_bases():
    entry = {"size": 10, "sha256": "a" * 64}
    files = ("round.json", "weights.safetensors", "momentum.safetensors", "result-4.safetensors")
    document = aggregate_job(peers=[ALICE])
    document["executor"]["config"]["rounds"]["checkpoint_every"] = 3
    document["executor"]["config"]["checkpoint"] = {
        "round": 4,
        "uri": "/api/jobs/j/checkpoint/",
        "files": {name: entry for name in files},
    }

    job = parse_job(document)

    assert job.checkpoint_every == 3
    assert (job.resume.round_number, [file.name for file in job.resume.files]) == (4, list(files))


def test_not_json_is_a_job_error():
    with pytest.raises(JobConfigError, match="not JSON"):
        parse_job("{nope")
