"""The train job JSON and the bridge client's edges (event parsing, errors carrying the reply body)."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest

from worker_daemon.executors.bridge_client import BridgeClient, ReceivedFile, parse_event_data
from worker_daemon.executors.exceptions import BridgeCallError, JobConfigError
from worker_daemon.executors.job import parse_job

from .conftest import ScriptedTrainerBackend, peers_reference, running_bridge, train_job


def with_config(**changes: object) -> str:
    job = copy.deepcopy(train_job())
    job["executor"]["config"].update(changes)
    return json.dumps(job)


def test_parse_job_keeps_references_verbatim() -> None:
    job = parse_job(json.dumps(train_job()))
    assert job.config.model.artifact == train_job()["executor"]["config"]["model"]["artifact"]
    assert job.config.updates == peers_reference()
    assert job.config.model.input_names == ["input_ids", "labels"]
    assert job.config.optimizer.learning_rate == 1e-3
    assert job.config.scheduler is None and job.config.preprocessor is None


@pytest.mark.parametrize("key", ["decay_steps", "decay_step"])
def test_wsd_accepts_both_spellings_of_decay_steps(key: str) -> None:
    job = parse_job(with_config(scheduler={"type": "wsd", "warmup_steps": 10, key: 20}))
    assert job.config.scheduler.decay_steps == 20


@pytest.mark.parametrize(
    ("job", "message"),
    [
        ("{", "not JSON"),
        (json.dumps({"executor": {"class": "aggregate"}}), "runs train jobs"),
        (with_config(batch_size=0), "executor.config.batch_size"),
        (with_config(scheduler={"type": "step"}), "executor.config.scheduler"),
    ],
)
def test_parse_job_refuses(job: str, message: str) -> None:
    with pytest.raises(JobConfigError, match=message):
        parse_job(job)


def test_parse_job_refuses_an_unknown_task() -> None:
    job = train_job()
    job["executor"]["config"]["model"]["task"] = "torch"
    with pytest.raises(JobConfigError, match="unknown model task 'torch'"):
        parse_job(json.dumps(job))


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ('{"path":"incoming/ps","size":3,"from_peer":"ps"}', ReceivedFile("incoming/ps", 3, "ps")),
        ('[{"path":"a","size":1},{"path":"incoming/b","size":2}]', ReceivedFile("incoming/b", 2, None)),
        ('{"parameters":{"path":"incoming/c"}}', ReceivedFile("incoming/c", None, None)),
        ("[]", None),
    ],
)
def test_event_payloads_hyphas_client_accepts(payload: str, expected: ReceivedFile | None) -> None:
    assert parse_event_data(payload) == expected


def test_an_event_without_a_path_is_an_error() -> None:
    with pytest.raises(BridgeCallError, match="names no file"):
        parse_event_data('{"size": 3}')


async def test_errors_carry_the_bridges_reply(short_dir: Path, tiny_model) -> None:
    backend = ScriptedTrainerBackend(model_dir=tiny_model.directory, updates=[])

    def calls() -> tuple[BridgeCallError, BridgeCallError]:
        with BridgeClient(short_dir / "bridge.sock") as client:
            with pytest.raises(BridgeCallError) as refused:
                client.fetch(peers_reference())  # a peers reference cannot be fetched
            with pytest.raises(BridgeCallError) as malformed:
                client.status({"status": {"batch_size": -1}})
            return refused.value, malformed.value

    async with running_bridge(short_dir, backend):
        refused, malformed = await asyncio.to_thread(calls)

    assert refused.status_code == 400
    assert "/resources/fetch: HTTP 400" in str(refused) and "unsupported strategy" in str(refused)
    assert malformed.status_code == 422
    assert backend.progress == []


def test_a_missing_socket_is_a_bridge_error(tmp_path: Path) -> None:
    with (
        BridgeClient(tmp_path / "absent.sock") as client,
        pytest.raises(BridgeCallError, match="/status/send"),
    ):
        client.status("update")
