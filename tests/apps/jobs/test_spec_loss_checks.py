"""The spec's held-out loss checks (``rounds.verification.validation_every``/``max_validation_rise``,
``rounds.discard_if_loss_rises``; docs/training.md, "Robust aggregation and verification"): what the
parameter server's job JSON carries (and reads), and the field errors, through a real POST to
/api/jobs/diloco/ — both checks need evaluation data."""

from __future__ import annotations

import pytest

from apps.datasets import services as dataset_services
from apps.jobs.models import Job
from apps.jobs.spec import parse_json, parse_toml, to_aggregate_job_json
from parameter_server.job import parse_job
from tests.apps.jobs.test_api_diloco import SPEC, URL
from tests.apps.jobs.test_spec import HYPHA_DEFAULT_TOML, _executor_jsons, lenet_json, peers

ROUNDS = {"update_rounds": 4, "inner_steps": 5}
EVALUATION = {"holdout": 1}


@pytest.fixture
def tiny_text(db):
    """The dataset SPEC trains on, as a data node registers it (4 slices)."""
    node, _ = dataset_services.create_data_node(name="node-1", url="http://127.0.0.1:9")
    dataset_services.register_dataset(node, "tiny-text", [(index, 100, "a" * 64) for index in range(4)])


def aggregate_config(**rounds) -> dict:
    """The parameter server's config, with the eval slices dispatch gives it (apps/jobs/training/dispatch.py)."""
    spec = parse_json(lenet_json(rounds={**ROUNDS, **rounds}, evaluation=EVALUATION))
    eval_slices = {
        "dataset": "mnist",
        "batch_size": 16,
        "slices": [{"index": 3, "size": 100, "sha256": "a" * 64, "urls": ["http://127.0.0.1:9/3"]}],
    }
    return to_aggregate_job_json(
        spec, job_id="j", updates_reference=peers("t"), results_reference=peers("t"), evaluation=eval_slices
    )["executor"]["config"]


def test_the_checks_reach_the_parameter_server_and_it_reads_them():
    config = aggregate_config(verification={"validation_every": 2}, discard_if_loss_rises=1.3)

    assert config["rounds"]["verification"] == {
        "enabled": None,
        "max_norm_ratio": 10.0,
        "min_cosine": -0.5,
        "validation_every": 2,
        "max_validation_rise": 1.5,
    }
    assert config["rounds"]["discard_if_loss_rises"] == 1.3
    assert "eval" in config
    rule = parse_job({"job_id": "j", "executor": {"class": "aggregate", "config": config}}).aggregation
    assert (rule.verification.validation_every, rule.verification.max_validation_rise) == (2, 1.5)
    assert rule.discard_if_loss_rises == 1.3


def test_without_the_checks_the_job_json_is_unchanged():
    config = aggregate_config(verification={"min_cosine": 0.0})
    assert config["rounds"]["verification"] == {"enabled": None, "max_norm_ratio": 10.0, "min_cosine": 0.0}
    assert "discard_if_loss_rises" not in config["rounds"]
    assert (
        "discard_if_loss_rises" not in parse_json(lenet_json(rounds=ROUNDS)).model_dump(mode="json")["rounds"]
    )


@pytest.mark.django_db(transaction=True)  # the allocation is queued on commit
def test_a_spec_with_the_checks_and_evaluation_data_is_accepted(alice, tiny_text):
    spec = {
        **SPEC,
        "rounds": {**SPEC["rounds"], "verification": {"validation_every": 5, "max_validation_rise": 2.0}},
        "evaluation": EVALUATION,
    }
    spec["rounds"]["discard_if_loss_rises"] = 1.5

    response = alice.client.post(URL, spec, format="json")

    assert response.status_code == 201, response.content
    stored = Job.objects.get(pk=response.json()["id"]).spec["rounds"]
    assert stored["discard_if_loss_rises"] == 1.5 and stored["verification"]["validation_every"] == 5


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("rounds", "evaluation", "field", "message"),
    [
        (
            {"verification": {"validation_every": 2}},
            None,
            "evaluation",
            "Evaluation data is needed for rounds.verification.validation_every (the held-out loss",
        ),
        (
            {"discard_if_loss_rises": 2.0},
            None,
            "evaluation",
            "Evaluation data is needed for rounds.discard_if_loss_rises (the held-out loss is measured",
        ),
        ({"discard_if_loss_rises": 1.0}, EVALUATION, "rounds.discard_if_loss_rises", "greater than 1"),
        (
            {"verification": {"validation_every": -1}},
            EVALUATION,
            "rounds.verification.validation_every",
            "greater than or equal to 0",
        ),
        (
            {"verification": {"validation_every": 1, "max_validation_rise": 0.5}},
            EVALUATION,
            "rounds.verification.max_validation_rise",
            "greater than 1",
        ),
    ],
)
def test_a_check_without_evaluation_data_or_out_of_range_is_a_400_at_its_field(
    alice, tiny_text, rounds, evaluation, field, message
):
    spec = {**SPEC, "rounds": {**SPEC["rounds"], **rounds}}
    if evaluation is not None:
        spec["evaluation"] = evaluation

    response = alice.client.post(URL, spec, format="json")

    assert response.status_code == 400
    body = response.json()
    assert list(body) == [field], body
    assert message in body[field][0]
    assert not Job.objects.exists()


def test_validation_every_0_is_off():
    spec = parse_json(lenet_json(rounds={**ROUNDS, "verification": {"validation_every": 0}}))
    assert "validation_every" not in _executor_jsons(spec)[1]["rounds"]["verification"]


def test_the_toml_takes_the_checks_in_its_rounds_table():
    text = HYPHA_DEFAULT_TOML.replace(
        "[scheduler.job.rounds]",
        "[scheduler.job.rounds]\ndiscard-if-loss-rises = 1.5\nverification = { validation_every = 2 }",
    ).replace(
        "[scheduler.job.inner_optimizer]",
        "[scheduler.job.evaluation]\nholdout = 1\n\n[scheduler.job.inner_optimizer]",
    )

    spec = parse_toml(text)

    assert spec.rounds.discard_if_loss_rises == 1.5
    assert spec.rounds.verification is not None and spec.rounds.verification.validation_every == 2
