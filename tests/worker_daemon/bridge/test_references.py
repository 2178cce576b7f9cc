from __future__ import annotations

import pytest
from pydantic import ValidationError

from worker_daemon.bridge.references import (
    HuggingFaceReference,
    MetricsProgress,
    PeersReference,
    ReceiveRequest,
    SchedulerReference,
    StatusProgress,
    UnitProgress,
    UriReference,
    parse_progress,
    reference_adapter,
)

EXAMPLES = [
    {
        "type": "huggingface",
        "repository": "hypha-space/lenet",
        "revision": None,
        "filenames": ["config.json", "model.safetensors"],
        "token": None,
    },
    {"type": "scheduler", "peer": "12D3KooWSched", "dataset": "mnist"},
    {"type": "peers", "peers": ["12D3KooWPs"], "strategy": {"type": "All"}, "resource": None},
    {"type": "uri", "value": "https://example.org/files/weights.bin"},
    {
        "type": "peers",
        "peers": [],
        "strategy": {"type": "Random"},
        "resource": {"dataset": "mnist", "index": 3},
    },
]


@pytest.mark.parametrize("example", EXAMPLES)
def test_references_round_trip_to_the_same_json(example: dict) -> None:
    reference = reference_adapter.validate_python(example)
    assert reference_adapter.dump_python(reference, mode="json") == example


def test_the_tag_selects_the_model_and_unknown_fields_are_ignored() -> None:
    assert type(reference_adapter.validate_python(EXAMPLES[0] | {"extra": 1})) is HuggingFaceReference
    assert type(reference_adapter.validate_python(EXAMPLES[1])) is SchedulerReference
    assert type(reference_adapter.validate_python(EXAMPLES[2])) is PeersReference
    assert type(reference_adapter.validate_python(EXAMPLES[3])) is UriReference


def test_optional_fields_may_be_missing() -> None:
    reference = reference_adapter.validate_python(
        {"type": "huggingface", "repository": "r", "filenames": ["a"]}
    )
    assert (reference.revision, reference.token) == (None, None)


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "Uri", "value": "https://x"},  # tags are lowercase
        {
            "type": "peers",
            "peers": [],
            "strategy": "All",
            "resource": None,
        },  # strategy is tagged, not a string
        {"type": "peers", "peers": [], "strategy": {"type": "all"}},
        {"type": "scheduler", "peer": "p"},
        {
            "type": "peers",
            "peers": [],
            "strategy": {"type": "All"},
            "resource": {"dataset": "d", "index": -1},
        },
    ],
)
def test_malformed_references_are_rejected(bad: dict) -> None:
    with pytest.raises(ValidationError):
        reference_adapter.validate_python(bad)


def test_receive_needs_strategy_all_and_defaults_to_incoming() -> None:
    peers = {"type": "peers", "peers": [], "strategy": {"type": "All"}, "resource": None}
    assert ReceiveRequest.model_validate({"resource": peers}).path == "incoming"
    with pytest.raises(ValidationError):
        ReceiveRequest.model_validate({"resource": peers | {"strategy": {"type": "One"}}})


def test_progress_forms() -> None:
    assert parse_progress({"status": {"batch_size": 2, "round_time": 1.5}}) == StatusProgress.model_validate(
        {"status": {"batch_size": 2, "round_time": 1.5}}
    )
    assert isinstance(parse_progress({"metrics": {"round": 1, "metrics": {"loss": 0.5}}}), MetricsProgress)
    assert parse_progress("update") == UnitProgress.model_validate("update")
    assert parse_progress("update-received").kind == "update-received"
    assert parse_progress({"updated": None}).kind == "updated"


@pytest.mark.parametrize(
    "bad", ["Update", "done", {"update": 1}, {"status": {}}, {"metrics": {"round": 1}}, 3, None, []]
)
def test_malformed_progress_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_progress(bad)
