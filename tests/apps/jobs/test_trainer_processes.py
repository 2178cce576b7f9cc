"""``training.processes`` and ``training.process_timeout`` (docs/configuration.md, "Job specs: training knobs"):
checked at submission, carried into the trainers' job JSON only when set, and read by the trainer."""

from __future__ import annotations

import json

import pytest

from apps.jobs.exceptions import SpecError
from apps.jobs.spec import parse_json
from tests.apps.jobs.test_api_diloco import SPEC
from tests.apps.jobs.test_training_knobs import trainer_config
from worker_daemon.executors.job import parse_job


def spec_with(**changes: object) -> dict:
    spec = {key: value for key, value in SPEC.items() if key != "name"}
    spec["batch_size"] = 8
    spec.update(changes)
    return spec


def test_processes_and_their_timeout_reach_the_trainers_job_json_and_the_trainer_reads_them():
    spec = spec_with(training={"processes": 2, "process_timeout": 60})

    envelope_config = trainer_config({**spec, "name": "x"})

    assert envelope_config["training"]["processes"] == 2
    assert envelope_config["training"]["process_timeout"] == 60.0
    job = parse_job(
        json.dumps(
            {
                "job_id": "j",
                "executor": {"class": "train", "descriptor": {"name": "d"}, "config": envelope_config},
            }
        )
    )
    assert (job.config.training.processes, job.config.training.process_timeout) == (2, 60.0)


def test_a_job_that_does_not_set_them_keeps_its_json_as_it_was():
    assert "training" not in trainer_config({**spec_with(), "name": "x"})
    config = trainer_config({**spec_with(training={"max_grad_norm": 1.0}), "name": "x"})
    assert set(config["training"]) == {
        "max_grad_norm",
        "gradient_accumulation_steps",
        "mixed_precision",
        "gradient_checkpointing",
        "dataloader_workers",
    }


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"training": {"processes": 3}},
            "processes × gradient_accumulation_steps (3 × 1) must divide batch_size",
        ),
        (
            {"training": {"processes": 2, "gradient_accumulation_steps": 8}},
            "(2 × 8) must divide batch_size (8)",
        ),
        (
            {"training": {"processes": 2}, "rounds": {**SPEC["rounds"], "overlap": "eager"}},
            "cannot be combined with rounds.overlap",
        ),
        ({"training": {"processes": 65}}, "less than or equal to 64"),
        ({"training": {"process_timeout": 1}}, "greater than or equal to 10"),
    ],
)
def test_a_bad_value_is_refused_with_its_reason(changes: dict, message: str):
    with pytest.raises(SpecError) as refused:
        parse_json(spec_with(**changes))

    assert message in str(refused.value)
