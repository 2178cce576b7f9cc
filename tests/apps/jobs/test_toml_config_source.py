"""A TOML job's model built from a transformers config (``[scheduler.job.model.config]`` or an inline
``config = {...}``), as the JSON spec's ``{"type": "config", "config": {...}}``; its mistakes named by TOML key.

No database: the module under test is pure pydantic.
"""

from __future__ import annotations

import pytest

from apps.jobs.spec import SpecError, parse_json, parse_toml

TINY = {"model_type": "gpt2", "vocab_size": 256, "n_positions": 128, "n_embd": 128, "n_layer": 2, "n_head": 4}

JOB = """
[scheduler.job.dataset]
dataset = "tiny-text"

[scheduler.job.rounds]
update_rounds = 3
inner_steps = 10

[scheduler.job.inner_optimizer]
learning-rate = 0.003

[scheduler.job.outer_optimizer]
learning-rate = 0.7
momentum = 0.9
"""

MODEL = """
[scheduler.job.model]
type = "causal-lm"
input_names = ["input_ids", "labels"]
"""


def as_json(source: dict) -> dict:
    return {
        "model": {"source": source, "type": "causal-lm", "input_names": ["input_ids", "labels"]},
        "dataset": {"name": "tiny-text"},
        "inner_optimizer": {"learning_rate": 0.003},
        "outer_optimizer": {"learning_rate": 0.7, "momentum": 0.9},
        "rounds": {"update_rounds": 3, "inner_steps": 10},
    }


def errors_of(text: str) -> list[dict[str, str]]:
    with pytest.raises(SpecError) as raised:
        parse_toml(text)
    return raised.value.errors


def test_an_inline_config_table_is_the_json_specs_config_source():
    # given
    text = MODEL + 'config = { model_type = "gpt2", vocab_size = 256, n_positions = 128, n_embd = 128, '
    text += "n_layer = 2, n_head = 4 }\n" + JOB

    # then
    assert parse_toml(text) == parse_json(as_json({"type": "config", "config": TINY}))


def test_a_config_subtable_with_nested_tables_and_arrays_is_kept_as_written():
    # given
    text = (
        MODEL
        + """
[scheduler.job.model.config]
model_type = "gpt2"
n_layer = 2
architectures = ["GPT2LMHeadModel"]

[scheduler.job.model.config.task_specific_params]
text-generation = { do_sample = true, max_length = 50 }
"""
        + JOB
    )
    config = {
        "model_type": "gpt2",
        "n_layer": 2,
        "architectures": ["GPT2LMHeadModel"],
        "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    }

    # then
    assert parse_toml(text) == parse_json(as_json({"type": "config", "config": config}))


def test_a_config_without_a_model_type_is_refused_at_its_toml_key():
    errors = errors_of(MODEL + "config = { n_layer = 2 }\n" + JOB)

    assert errors == [
        {
            "field": "scheduler.job.model.config",
            "message": "A transformers config needs a 'model_type' string, e.g. 'gpt2'.",
        }
    ]


def test_a_config_beside_a_repository_or_url_is_refused_with_every_other_mistake():
    # given: two sources at once, and a bad learning rate elsewhere
    text = MODEL + 'repository = "openai-community/gpt2"\nconfig = { model_type = "gpt2" }\n'
    text += JOB.replace("learning-rate = 0.003", "learning-rate = -1.0")

    # when
    errors = errors_of(text)

    # then
    assert {
        "field": "scheduler.job.model.config",
        "message": "Give one of repository, url, upload and config.",
    } in errors
    assert any(error["field"] == "scheduler.job.inner_optimizer.learning-rate" for error in errors)


def test_a_config_that_is_not_a_table_is_refused_at_its_key():
    errors = errors_of(MODEL + 'config = "gpt2"\n' + JOB)

    assert errors == [
        {"field": "scheduler.job.model.config", "message": "Input should be a valid dictionary"}
    ]


def test_a_toml_date_in_a_config_is_refused_at_its_key_json_has_none():
    errors = errors_of(MODEL + 'config = { model_type = "gpt2", made = { on = 2024-01-02 } }\n' + JOB)

    assert errors == [
        {
            "field": "scheduler.job.model.config.made.on",
            "message": "A TOML date or time has no JSON equivalent; write it as a string.",
        }
    ]


def test_a_preprocessor_cannot_be_a_config():
    text = MODEL + 'config = { model_type = "gpt2" }\n' + JOB
    text += '[scheduler.job.preprocessor]\ntype = "tokenizer"\ninput_names = ["text"]\nconfig = { a = 1 }\n'

    errors = errors_of(text)

    assert [error["field"] for error in errors] == ["scheduler.job.preprocessor.config"]
