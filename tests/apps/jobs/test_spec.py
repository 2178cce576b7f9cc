"""The DiLoCo job specification: parsing JSON and Hypha's TOML, every error at once, and the executor JSON.

No database: the module under test is pure pydantic.
"""

from __future__ import annotations

import json

import pytest

from apps.jobs.spec import (
    DiLoCoSpec,
    SpecError,
    parse_json,
    parse_toml,
    to_aggregate_job_json,
    to_requirements,
    to_train_job_json,
)
from worker_daemon.protocol import ExecutorDescriptor, Resources

SCHEDULER_PEER = "12D3KooWSchedulerPeerIdxxxxxxxxxxxxxxxxxxxxxxxxxx"
PS_PEER = "12D3KooWParamServerPeerIdxxxxxxxxxxxxxxxxxxxxxxx"
LENET_FILES = ["config.json", "model.safetensors", "configuration_lenet.py", "modeling_lenet.py"]

#: What ``hypha-scheduler init`` writes for the job (reference §7.2), under a scheduler's other keys.
HYPHA_DEFAULT_TOML = """
cert_pem = "scheduler-cert.pem"
status_bridge = "127.0.0.1:61000"

[scheduler]
listen_addresses = ["/ip4/127.0.0.1/tcp/0"]

[scheduler.job]
type = "diloco"

[scheduler.job.model]
repository = "hypha-space/lenet"
filenames = ["config.json", "model.safetensors", "configuration_lenet.py", "modeling_lenet.py"]
type = "image-classification"
input_names = ["pixel_values", "labels"]

[scheduler.job.preprocessor]
repository = "hypha-space/lenet"
filenames = ["preprocessor_config.json"]
type = "image"
input_names = ["images"]

[scheduler.job.dataset]
dataset = "mnist"

[scheduler.job.rounds]
update_rounds = 100
avg_samples_between_updates = 1200
max_batch_size = 600

[scheduler.job.inner_optimizer]
learning-rate = 0.001

[scheduler.job.outer_optimizer]
learning-rate = 0.7
momentum = 0.9

[scheduler.job.resources]
num_workers = 2

[scheduler.job.resources.worker]
gpu = 10.0
cpu = 1.0
storage = 0.0
memory = 1.0

[scheduler.job.resources.parameter_server]
gpu = 0.0
cpu = 1.0
storage = 0.0
memory = 1.0

[scheduler.job.resources.worker_price]
bid = 100.0
max = 100.0

[scheduler.job.resources.parameter_server_price]
bid = 100.0
max = 100.0
"""

#: The reference's "complete realistic train example" (§2.2), verbatim.
HYPHA_TRAIN_EXAMPLE = """
{
  "job_id": "5b0f1f0e-2f7c-4a43-9b8e-3a1c2d4e5f60",
  "executor": {
    "class": "train",
    "descriptor": {"name": "diloco-transformer"},
    "config": {
      "model": {
        "task": "image-classification",
        "artifact": {"type": "huggingface", "repository": "hypha-space/lenet", "revision": null,
                     "filenames": ["config.json", "model.safetensors", "configuration_lenet.py", "modeling_lenet.py"],
                     "token": null},
        "input-names": ["pixel_values", "labels"]
      },
      "data": {"type": "scheduler", "peer": "12D3KooWSchedulerPeerIdxxxxxxxxxxxxxxxxxxxxxxxxxx", "dataset": "mnist"},
      "updates": {"type": "peers", "peers": ["12D3KooWParamServerPeerIdxxxxxxxxxxxxxxxxxxxxxxx"], "strategy": {"type": "All"}, "resource": null},
      "results": {"type": "peers", "peers": ["12D3KooWParamServerPeerIdxxxxxxxxxxxxxxxxxxxxxxx"], "strategy": {"type": "All"}, "resource": null},
      "optimizer": {"learning-rate": 0.001, "betas": null, "epsilon": null},
      "batch_size": 2,
      "preprocessor": {
        "task": "image",
        "artifact": {"type": "huggingface", "repository": "hypha-space/lenet", "revision": null,
                     "filenames": ["preprocessor_config.json"], "token": null},
        "input-names": ["images"]
      }
    }
  }
}
"""


def lenet_json(**changes: object) -> dict:
    """The original's default job as a JSON spec; ``changes`` replace top-level entries."""
    spec = {
        "model": {
            "source": {"type": "huggingface", "repository": "hypha-space/lenet", "filenames": LENET_FILES},
            "type": "image-classification",
            "input_names": ["pixel_values", "labels"],
        },
        "preprocessor": {
            "source": {
                "type": "huggingface",
                "repository": "hypha-space/lenet",
                "filenames": ["preprocessor_config.json"],
            },
            "type": "image",
            "input_names": ["images"],
        },
        "dataset": {"name": "mnist"},
        "inner_optimizer": {"learning_rate": 0.001},
        "outer_optimizer": {"learning_rate": 0.7, "momentum": 0.9},
        "rounds": {"update_rounds": 100, "avg_samples_between_updates": 1200, "max_batch_size": 600},
        "num_trainers": 2,
        "trainer": {"resources": {"gpu": 10.0, "cpu": 1.0, "storage": 0.0, "memory": 1.0}},
        "parameter_server": {"resources": {"gpu": 0.0, "cpu": 1.0, "storage": 0.0, "memory": 1.0}},
    }
    spec.update(changes)
    return spec


def peers(*peer_ids: str) -> dict:
    return {"type": "peers", "peers": list(peer_ids), "strategy": {"type": "All"}, "resource": None}


def errors_of(call, *args) -> list[dict[str, str]]:
    with pytest.raises(SpecError) as raised:
        call(*args)
    return raised.value.errors


# --- Hypha's TOML -----------------------------------------------------------------------------------------


def test_the_originals_default_scheduler_toml_parses_to_its_values():
    # when
    spec = parse_toml(HYPHA_DEFAULT_TOML)

    # then
    assert spec == parse_json(lenet_json())
    assert spec.model.source.repository == "hypha-space/lenet"
    assert spec.model.source.revision == "main"
    assert spec.model.source.filenames == LENET_FILES
    assert spec.model.source.token is None
    assert spec.model.type == "image-classification"
    assert spec.model.input_names == ["pixel_values", "labels"]
    assert spec.preprocessor.type == "image"
    assert spec.preprocessor.source.filenames == ["preprocessor_config.json"]
    assert spec.preprocessor.input_names == ["images"]
    assert spec.dataset.name == "mnist"
    assert (spec.rounds.update_rounds, spec.rounds.avg_samples_between_updates) == (100, 1200)
    assert (spec.rounds.inner_steps, spec.rounds.max_batch_size) == (None, 600)
    assert (spec.inner_optimizer.learning_rate, spec.inner_optimizer.betas) == (0.001, None)
    assert (spec.inner_optimizer.epsilon, spec.inner_optimizer.schedule) == (None, None)
    assert (spec.outer_optimizer.learning_rate, spec.outer_optimizer.momentum) == (0.7, 0.9)
    assert spec.num_trainers == 2
    assert to_requirements(spec) == {
        "trainer": {
            "resources": {
                "cpu": 1.0,
                "memory": 1.0,
                "storage": 0.0,
                "gpu": 10.0,
                "devices": 0,
                "device_memory": 0.0,
            },
            "executor": {"class": "train", "name": "diloco-transformer"},
            "bid": 100.0,
            "max": 100.0,
        },
        "parameter_server": {
            "resources": {
                "cpu": 1.0,
                "memory": 1.0,
                "storage": 0.0,
                "gpu": 0.0,
                "devices": 0,
                "device_memory": 0.0,
            },
            "executor": {"class": "aggregate", "name": "parameter-server"},
            "bid": 100.0,
            "max": 100.0,
            "reachable": "prefer",
        },
    }


def test_requirements_are_what_job_requirement_reads():
    # given
    requirements = to_requirements(parse_toml(HYPHA_DEFAULT_TOML))

    # then: the shared protocol models accept every role as stored
    for entry in requirements.values():
        Resources.model_validate(entry["resources"])
        ExecutorDescriptor.model_validate(entry["executor"])
    assert Resources.model_validate(requirements["trainer"]["resources"]) == Resources(
        cpu=1, memory=1, gpu=10
    )


def test_a_bare_job_table_and_a_top_level_table_parse_alike():
    # given
    bare = HYPHA_DEFAULT_TOML.split("[scheduler.job]", 1)[1].replace("[scheduler.job.", "[job.")
    top_level = HYPHA_DEFAULT_TOML.split("[scheduler.job]", 1)[1].replace("[scheduler.job.", "[")

    # then
    assert parse_toml("[job]" + bare) == parse_toml(HYPHA_DEFAULT_TOML)
    assert parse_toml(top_level) == parse_toml(HYPHA_DEFAULT_TOML)


def test_the_docs_spellings_parse():
    # given: docs/scheduler.md and docs/training.md keys (reference §9 item 8)
    text = """
[scheduler.job]
dataset_name = "imagenet"

[scheduler.job.model]
repository = "l45k/Resnet50"
revision = "v2"
filenames = ["config.json", "model.safetensors"]
token = "hf_secret"
type = "image-classification"
input_names = ["pixel_values", "labels"]

[scheduler.job.inner_optimizer]
learning_rate = 0.001
betas = [0.9, 0.999]
epsilon = 1e-8
schedule = "cosine"
warmup_steps = 100
total_steps = 10000

[scheduler.job.outer_optimizer]
learning_rate = 0.7
momentum = 0.9

[scheduler.job.rounds]
update_rounds = 10
inner_steps = 500

[scheduler.job.resources]
num_workers = 4

[[scheduler.job.resources.worker]]
type = "GPU"
min = 10.0

[[scheduler.job.resources.worker]]
type = "CPU"
min = 2.0

[[scheduler.job.resources.worker]]
kind = "diloco-transformer"

[[scheduler.job.resources.parameter_server]]
type = "Memory"
min = 16.0

[scheduler.job.resources.worker_price]
bid = 110.0
max = 160.0
"""

    # when
    spec = parse_toml(text)

    # then
    assert spec.dataset.name == "imagenet"
    assert (spec.model.source.revision, spec.model.source.token) == ("v2", "hf_secret")
    assert spec.inner_optimizer.learning_rate == 0.001
    assert spec.inner_optimizer.betas == (0.9, 0.999)
    assert spec.inner_optimizer.epsilon == 1e-8
    assert spec.inner_optimizer.schedule.model_dump() == {
        "type": "cosine",
        "warmup_steps": 100,
        "training_steps": 10000,
    }
    assert spec.outer_optimizer.learning_rate == 0.7
    assert (spec.rounds.inner_steps, spec.rounds.avg_samples_between_updates) == (500, None)
    assert spec.num_trainers == 4
    assert spec.trainer.resources.model_dump() == {
        "cpu": 2.0,
        "memory": 1.0,
        "storage": 0.0,
        "gpu": 10.0,
        "devices": 0,
        "device_memory": 0.0,
    }
    assert spec.parameter_server.resources.model_dump() == {
        "cpu": 1.0,
        "memory": 16.0,
        "storage": 0.0,
        "gpu": 0.0,
        "devices": 0,
        "device_memory": 0.0,
    }
    assert spec.trainer.price.model_dump() == {"bid": 110.0, "max": 160.0}
    assert spec.parameter_server.price.model_dump() == {"bid": 100.0, "max": 100.0}


def test_toml_errors_name_the_keys_as_written():
    # given: five mistakes in the original's keys
    text = (
        HYPHA_DEFAULT_TOML.replace('type = "image-classification"', 'type = "vision-classification"')
        .replace("learning-rate = 0.001", "learning-rate = 0.0")
        .replace("max_batch_size = 600", "max_batch_size = 600\ninner_steps = 10")
        .replace(
            "[scheduler.job.resources.worker_price]\nbid = 100.0\nmax = 100.0",
            "[scheduler.job.resources.worker_price]\nbid = 100.0\nmax = 90.0",
        )
        .replace("num_workers = 2", "num_workers = 2\nnum_worker = 3")
    )

    # then
    assert errors_of(parse_toml, text) == [
        {"field": "scheduler.job.resources.num_worker", "message": "Unknown key."},
        {
            "field": "scheduler.job.model.type",
            "message": "'vision-classification' is not a model type: "
            "use 'image-classification' (AutoModelForImageClassification).",
        },
        {
            "field": "scheduler.job.inner_optimizer.learning-rate",
            "message": "Input should be greater than 0",
        },
        {
            "field": "scheduler.job.rounds",
            "message": "Give exactly one of inner_steps and avg_samples_between_updates (both given).",
        },
        {"field": "scheduler.job.resources.worker_price.max", "message": "Must be at least the bid (100)."},
    ]


def test_two_spellings_of_one_key_are_refused():
    text = HYPHA_DEFAULT_TOML.replace("learning-rate = 0.001", "learning-rate = 0.001\nlearning_rate = 0.002")

    assert errors_of(parse_toml, text) == [
        {
            "field": "scheduler.job.inner_optimizer.learning_rate",
            "message": "Duplicate of 'learning-rate'; give one.",
        }
    ]


def test_a_toml_syntax_error_is_one_error_with_its_line():
    text = '[scheduler.job]\ntype = "diloco"\nmodel = \n'

    assert errors_of(parse_toml, text) == [
        {"field": "", "message": "TOML syntax error: Invalid value (at line 3, column 9)"}
    ]


def test_a_toml_without_a_job_is_refused():
    assert errors_of(parse_toml, 'cert_pem = "x.pem"\n') == [
        {"field": "scheduler.job", "message": "Missing: no [scheduler.job] table."}
    ]


# --- JSON and validation ----------------------------------------------------------------------------------


def test_every_mistake_is_reported_at_once():
    # given: five mistakes
    data = lenet_json(
        dataset={"name": ""},
        inner_optimizer={"learning_rate": 0.001, "betas": [0.9, 1.5]},
        outer_optimizer={"learning_rate": 0.7, "momentum": 0.9, "nesterov": True},
        num_trainers=0,
    )
    data["model"]["source"]["filenames"] = []

    # then
    assert errors_of(parse_json, data) == [
        {
            "field": "model.source.filenames",
            "message": "List should have at least 1 item after validation, not 0",
        },
        {"field": "dataset.name", "message": "String should have at least 1 character"},
        {"field": "inner_optimizer.betas.1", "message": "Input should be less than 1"},
        {"field": "outer_optimizer.nesterov", "message": "Unknown key."},
        {"field": "num_trainers", "message": "Input should be greater than or equal to 1"},
    ]


def test_missing_sections_are_each_reported():
    assert errors_of(parse_json, {"batch_size": 0}) == [
        {"field": "model", "message": "Field required"},
        {"field": "dataset", "message": "Field required"},
        {"field": "inner_optimizer", "message": "Field required"},
        {"field": "outer_optimizer", "message": "Field required"},
        {"field": "rounds", "message": "Field required"},
        {"field": "batch_size", "message": "Input should be greater than or equal to 1"},
    ]


def test_max_below_bid_is_refused():
    data = lenet_json(parameter_server={"price": {"bid": 80.0, "max": 79.5}})

    assert errors_of(parse_json, data) == [
        {"field": "parameter_server.price.max", "message": "Must be at least the bid (80)."}
    ]


def test_prices_default_to_100():
    spec = parse_json(lenet_json())

    assert spec.trainer.price.model_dump() == {"bid": 100.0, "max": 100.0}
    assert spec.parameter_server.price.model_dump() == {"bid": 100.0, "max": 100.0}


@pytest.mark.parametrize(
    ("rounds", "given"),
    [
        ({"update_rounds": 5, "inner_steps": 50, "avg_samples_between_updates": 1200}, "both"),
        ({"update_rounds": 5}, "neither"),
    ],
)
def test_exactly_one_sync_rule(rounds: dict, given: str):
    assert errors_of(parse_json, lenet_json(rounds=rounds)) == [
        {
            "field": "rounds",
            "message": f"Give exactly one of inner_steps and avg_samples_between_updates ({given} given).",
        }
    ]


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("causal-lm", "causal-lm"),
        ("image-classification", "image-classification"),
        ("sequence-classification", "sequence-classification"),
        ("seq2-seq-lm", "seq-2-seq-lm"),
        ("speech-seq2-seq", "speech-seq-2-seq"),
        ("vison2-seq", "vision-2-seq"),
        ("seq-2-seq-lm", "seq-2-seq-lm"),
        ("Causal-LM", "causal-lm"),
    ],
)
def test_model_types_are_normalised_to_the_executors_spelling(written: str, expected: str):
    data = lenet_json()
    data["model"]["type"] = written

    assert parse_json(data).model.type == expected


@pytest.mark.parametrize(
    ("written", "message"),
    [
        (
            "vision-classification",
            "'vision-classification' is not a model type: "
            "use 'image-classification' (AutoModelForImageClassification).",
        ),
        (
            "torch",
            "'torch' is not a model type: use 'auto', or a task such as 'image-classification' or 'causal-lm'.",
        ),
    ],
)
def test_the_docs_model_types_are_refused_with_a_suggestion(written: str, message: str):
    data = lenet_json()
    data["model"]["type"] = written

    assert errors_of(parse_json, data) == [{"field": "model.type", "message": message}]


def test_an_unknown_model_type_lists_the_known_ones():
    data = lenet_json()
    data["model"]["type"] = "text-generation"

    [error] = errors_of(parse_json, data)
    assert error["field"] == "model.type"
    assert error["message"].startswith(
        "'text-generation' is not a model type; expected one of auto, pretraining,"
    )


def test_sources_other_than_huggingface():
    # given
    url = lenet_json(preprocessor=None)
    url["model"]["source"] = {"type": "url", "url": "https://example.org/model.safetensors"}
    scratch = lenet_json(preprocessor=None)
    scratch["model"]["source"] = {"type": "config", "config": {"model_type": "gpt2", "n_layer": 2}}
    bad = lenet_json()
    bad["model"]["source"] = {"type": "url", "url": "ftp://example.org/x"}
    bad["preprocessor"]["source"] = {"type": "config", "config": {}}

    # then
    assert parse_json(url).model.source.url == "https://example.org/model.safetensors"
    assert parse_json(scratch).model.source.config == {"model_type": "gpt2", "n_layer": 2}
    assert [error["field"] for error in errors_of(parse_json, bad)] == [
        "model.source.url",
        "preprocessor.source",
    ]


def test_a_schedule_needs_its_steps_in_order():
    data = lenet_json(
        inner_optimizer={"learning_rate": 0.001, "schedule": {"type": "wsd", "warmup_steps": 10}},
        outer_optimizer={"learning_rate": 0.7, "momentum": 1.5},
    )

    assert errors_of(parse_json, data) == [
        {"field": "inner_optimizer.schedule.decay_steps", "message": "Field required"},
        {"field": "outer_optimizer.momentum", "message": "Input should be less than or equal to 1"},
    ]


# --- the executor JSON ------------------------------------------------------------------------------------


def test_the_realistic_train_example_is_reproduced_exactly():
    # given
    spec = parse_toml(HYPHA_DEFAULT_TOML)
    expected = json.loads(HYPHA_TRAIN_EXAMPLE)

    # when
    job = to_train_job_json(
        spec,
        job_id="5b0f1f0e-2f7c-4a43-9b8e-3a1c2d4e5f60",
        data_reference={"type": "scheduler", "peer": SCHEDULER_PEER, "dataset": "mnist"},
        updates_reference=peers(PS_PEER),
        results_reference=peers(PS_PEER),
        batch_size=2,
    )

    # then: same values, and the same key order everywhere
    assert job == expected
    assert json.dumps(job) == json.dumps(expected)


def test_a_schedule_and_optimizer_options_are_written_in_the_executors_shape():
    # given
    data = lenet_json(
        preprocessor=None,
        inner_optimizer={
            "learning_rate": 0.0003,
            "betas": [0.9, 0.95],
            "epsilon": 1e-8,
            "schedule": {"type": "cosine", "warmup_steps": 100, "training_steps": 10000},
        },
    )
    data["model"]["source"]["revision"] = "v1"
    data["model"]["source"]["token"] = "hf_secret"

    # when
    config = to_train_job_json(
        parse_json(data),
        job_id="j",
        data_reference={"type": "scheduler", "peer": SCHEDULER_PEER, "dataset": "mnist"},
        updates_reference=peers(PS_PEER),
        results_reference=peers(PS_PEER),
    )["executor"]["config"]

    # then
    assert list(config) == ["model", "data", "updates", "results", "optimizer", "batch_size", "scheduler"]
    assert config["model"]["artifact"] == {
        "type": "huggingface",
        "repository": "hypha-space/lenet",
        "revision": "v1",
        "filenames": LENET_FILES,
        "token": "hf_secret",
    }
    assert config["optimizer"] == {"learning-rate": 0.0003, "betas": [0.9, 0.95], "epsilon": 1e-8}
    assert config["batch_size"] == 1
    assert json.dumps(config["scheduler"]) == json.dumps(
        {"type": "cosine-with-warmup", "warmup_steps": 100, "training_steps": 10000}
    )


def test_a_wsd_schedule_is_readable_by_both_executors():
    data = lenet_json(
        inner_optimizer={
            "learning_rate": 0.001,
            "schedule": {"type": "wsd", "warmup_steps": 5, "decay_steps": 50},
        }
    )

    job = to_train_job_json(
        parse_json(data), job_id="j", data_reference={}, updates_reference={}, results_reference={}
    )

    assert job["executor"]["config"]["scheduler"] == {
        "type": "wsd",
        "warmup_steps": 5,
        "decay_steps": 50,
        "decay_step": 50,
    }


def test_an_upload_needs_a_reference_from_the_caller():
    # given
    data = lenet_json(preprocessor=None)
    data["model"]["source"] = {"type": "upload", "file": "lenet.tar"}
    spec = parse_json(data)
    reference = {"type": "uri", "value": "https://control.example/files/lenet.tar"}

    # when
    job = to_train_job_json(
        spec,
        job_id="j",
        data_reference={},
        updates_reference={},
        results_reference={},
        model_reference=reference,
    )

    # then
    assert job["executor"]["config"]["model"]["artifact"] == reference
    with pytest.raises(ValueError, match="'upload' source needs a reference"):
        to_train_job_json(spec, job_id="j", data_reference={}, updates_reference={}, results_reference={})


def test_the_aggregate_envelope():
    # given
    spec = parse_toml(HYPHA_DEFAULT_TOML)
    trainers = ("12D3KooWTrainerOne", "12D3KooWTrainerTwo")

    # when
    job = to_aggregate_job_json(
        spec,
        job_id="5b0f1f0e-2f7c-4a43-9b8e-3a1c2d4e5f60",
        updates_reference=peers(*trainers),
        results_reference=peers(*trainers),
    )

    # then
    expected = {
        "job_id": "5b0f1f0e-2f7c-4a43-9b8e-3a1c2d4e5f60",
        "executor": {
            "class": "aggregate",
            "descriptor": {"name": "parameter-server"},
            "config": {
                "updates": {
                    "type": "peers",
                    "peers": ["12D3KooWTrainerOne", "12D3KooWTrainerTwo"],
                    "strategy": {"type": "All"},
                    "resource": None,
                },
                "results": {
                    "type": "peers",
                    "peers": ["12D3KooWTrainerOne", "12D3KooWTrainerTwo"],
                    "strategy": {"type": "All"},
                    "resource": None,
                },
                "optimizer": {"learning-rate": 0.7, "momentum": 0.9},
                # Our parameter server also builds and evaluates the model (docs/training.md).
                "model": {
                    "task": "image-classification",
                    "source": {
                        "type": "huggingface",
                        "repository": "hypha-space/lenet",
                        "revision": None,
                        "filenames": [
                            "config.json",
                            "model.safetensors",
                            "configuration_lenet.py",
                            "modeling_lenet.py",
                        ],
                        "token": None,
                    },
                    "input-names": ["pixel_values", "labels"],
                    "seed": 0,
                },
                "rounds": {"update_rounds": 100, "round_timeout": 120.0, "weighted": True},
                "eval": None,
            },
        },
    }
    assert json.dumps(job) == json.dumps(expected)


def test_a_spec_round_trips_through_json():
    spec = parse_toml(HYPHA_DEFAULT_TOML)

    assert parse_json(spec.model_dump(mode="json")) == spec
    assert isinstance(spec, DiLoCoSpec)


def test_numbers_are_not_coerced_from_booleans_or_strings():
    data = lenet_json(batch_size=True, outer_optimizer={"learning_rate": "0.7", "momentum": 0.9})

    assert errors_of(parse_json, data) == [
        {"field": "outer_optimizer.learning_rate", "message": "Input should be a valid number"},
        {"field": "batch_size", "message": "Input should be a valid integer"},
    ]


def test_the_docs_flat_schedule_reports_a_missing_step_beside_it():
    text = HYPHA_DEFAULT_TOML.replace(
        "learning-rate = 0.001", 'learning-rate = 0.001\nschedule = "wsd"\nwarmup_steps = 10'
    )

    assert errors_of(parse_toml, text) == [
        {"field": "scheduler.job.inner_optimizer.decay_steps", "message": "Field required"}
    ]


def test_the_toml_takes_our_evaluation_timeout_and_seed_keys():
    # given: Hypha's default job plus the keys only we read
    text = HYPHA_DEFAULT_TOML.replace(
        "[scheduler.job.rounds]",
        "[scheduler.job.evaluation]\nholdout = 2\nbatch_size = 8\n\n[scheduler.job.rounds]\nround_timeout = 30.0",
    ).replace("[scheduler.job]\n", "[scheduler.job]\nseed = 7\n", 1)

    # when
    spec = parse_toml(text)

    # then
    assert (spec.seed, spec.rounds.round_timeout) == (7, 30.0)
    assert (spec.evaluation.holdout, spec.evaluation.batch_size, spec.evaluation.slices) == (2, 8, None)
    with pytest.raises(SpecError) as refused:
        parse_toml(text.replace("holdout = 2", "holdout = 2\nslices = [1]"))
    assert [error["field"] for error in refused.value.errors] == ["scheduler.job.evaluation"]


# --- encodings (docs/training.md, "Encodings") ----------------------------------------------------------------


def _executor_jsons(spec: DiLoCoSpec) -> tuple[dict, dict]:
    train = to_train_job_json(
        spec,
        job_id="j",
        data_reference={"type": "scheduler", "peer": SCHEDULER_PEER, "dataset": "mnist"},
        updates_reference=peers(PS_PEER),
        results_reference=peers(PS_PEER),
    )["executor"]["config"]
    aggregate = to_aggregate_job_json(
        spec, job_id="j", updates_reference=peers("t"), results_reference=peers("t")
    )["executor"]["config"]
    return train, aggregate


def test_an_int8_job_tells_both_executors_its_encoding_and_block_size():
    rounds = {"update_rounds": 2, "inner_steps": 5, "encoding": "int8", "encoding_block_size": 64}

    train, aggregate = _executor_jsons(parse_json(lenet_json(rounds=rounds)))

    assert (train["encoding"], train["encoding_block_size"]) == ("int8", 64)
    assert (aggregate["rounds"]["encoding"], aggregate["rounds"]["encoding_block_size"]) == ("int8", 64)


def test_int8_without_a_block_size_gets_256_and_half_precision_has_none():
    int8 = parse_json(lenet_json(rounds={"update_rounds": 2, "inner_steps": 5, "encoding": "int8"}))
    half = parse_json(lenet_json(rounds={"update_rounds": 2, "inner_steps": 5, "encoding": "bfloat16"}))

    assert int8.rounds.encoding_block_size is None
    assert _executor_jsons(int8)[0]["encoding_block_size"] == 256
    train, aggregate = _executor_jsons(half)
    assert (train["encoding"], "encoding_block_size" in train) == ("bfloat16", False)
    assert aggregate["rounds"]["encoding"] == "bfloat16"


def test_checkpoint_every_reaches_the_parameter_server_only_when_not_its_default():
    default = parse_json(lenet_json())
    every_3 = parse_json(lenet_json(rounds={"update_rounds": 2, "inner_steps": 5, "checkpoint_every": 3}))

    assert default.rounds.checkpoint_every == 10
    assert "checkpoint_every" not in _executor_jsons(default)[1]["rounds"]
    train, aggregate = _executor_jsons(every_3)
    assert aggregate["rounds"]["checkpoint_every"] == 3 and "checkpoint_every" not in train
    for wrong, message in ((0, "greater than or equal to 1"), (1001, "less than or equal to 1000")):
        data = lenet_json(rounds={"update_rounds": 2, "inner_steps": 5, "checkpoint_every": wrong})
        (error,) = errors_of(parse_json, data)
        assert error["field"] == "rounds.checkpoint_every" and message in error["message"]


def test_a_float32_job_writes_no_encoding_so_its_json_stays_hyphas():
    spec = parse_json(lenet_json())

    train, aggregate = _executor_jsons(spec)

    assert spec.rounds.encoding == "float32"
    assert "encoding" not in train and "encoding" not in aggregate["rounds"]


@pytest.mark.parametrize(
    ("rounds", "field", "message"),
    [
        (
            {"encoding": "int4"},
            "rounds.encoding",
            "Input should be 'float32', 'float16', 'bfloat16' or 'int8'",
        ),
        (
            {"encoding": "float16", "encoding_block_size": 64},
            "rounds.encoding_block_size",
            "Only the int8 encoding has blocks (this job's is float16).",
        ),
        (
            {"encoding": "int8", "encoding_block_size": 8},
            "rounds.encoding_block_size",
            "greater than or equal to 16",
        ),
        ({"encoding": "int8", "encoding_block_size": "64"}, "rounds.encoding_block_size", "valid integer"),
    ],
)
def test_a_wrong_encoding_or_block_size_is_reported_at_its_field(rounds, field, message):
    data = lenet_json(rounds={"update_rounds": 2, "inner_steps": 5, **rounds})

    (error,) = errors_of(parse_json, data)

    assert error["field"] == field and message in error["message"]


def test_the_toml_takes_the_encoding_in_its_rounds_table_in_either_spelling():
    text = HYPHA_DEFAULT_TOML.replace(
        "[scheduler.job.rounds]", '[scheduler.job.rounds]\nencoding = "int8"\nencoding-block-size = 128'
    )

    spec = parse_toml(text)

    assert (spec.rounds.encoding, spec.rounds.encoding_block_size) == ("int8", 128)
    assert errors_of(parse_toml, text.replace('"int8"', '"float16"')) == [
        {
            "field": "scheduler.job.rounds.encoding-block-size",
            "message": "Only the int8 encoding has blocks (this job's is float16).",
        }
    ]


def test_the_toml_takes_checkpoint_every_in_its_rounds_table():
    text = HYPHA_DEFAULT_TOML.replace(
        "[scheduler.job.rounds]", "[scheduler.job.rounds]\ncheckpoint-every = 4"
    )

    assert parse_toml(text).rounds.checkpoint_every == 4
    (error,) = errors_of(parse_toml, text.replace("= 4", "= 0"))
    assert error["field"] == "scheduler.job.rounds.checkpoint-every"


def test_the_toml_takes_weighted_a_key_with_one_spelling():
    # ``weighted`` and ``encoding`` have no "_" to spell as "-": once read as a duplicate of themselves
    text = HYPHA_DEFAULT_TOML.replace("[scheduler.job.rounds]", "[scheduler.job.rounds]\nweighted = false")

    assert parse_toml(text).rounds.weighted is False


def test_a_lossy_encoding_counts_the_residual_in_the_memory_a_role_needs():
    from apps.jobs.spec_checks import size_problem

    config = {
        "model_type": "gpt2",
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 2,
        "vocab_size": 256,
        "n_positions": 64,
    }
    data = lenet_json(
        preprocessor=None,
        model={
            "source": {"type": "config", "config": config},
            "type": "causal-lm",
            "input_names": ["input_ids"],
        },
        trainer={"resources": {"memory": 0.001}},
        parameter_server={"resources": {"memory": 0.001}},
    )
    exact = size_problem(parse_json(data), max_parameters=10**9)
    data["rounds"] = {"update_rounds": 2, "inner_steps": 5, "encoding": "int8"}
    lossy = size_problem(parse_json(data), max_parameters=10**9)

    assert "5 float32 copies" in exact and "4 float32 copies" in exact
    assert "6 float32 copies" in lossy and "5 float32 copies of them) but parameter_server" in lossy
