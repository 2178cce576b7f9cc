"""A task's bridge reports the peers it cannot reach (``transfer_problem``) and clears them when they answer
again (``transfer_ok``), against real HTTP peers on 127.0.0.1 (one that stops listening) and the in-process
control plane of ``tests/worker_daemon/conftest.py``."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.worker_daemon.conftest import FakePeer
from worker_daemon import protocol
from worker_daemon.bridge.exceptions import ConnectorError
from worker_daemon.bridge.references import ParameterServerReference, PeersReference, SchedulerReference
from worker_daemon.bridge.remote import RemoteBackend

TASK = uuid.UUID(int=7)
JOB = "5b0f1f0e-2f7c-4a43-9b8e-3a1c2d4e5f60"
PS = "ps-peer"
TO_PS = PeersReference(peers=[PS], strategy={"type": "All"})
DATA = SchedulerReference(peer="control-plane", dataset="stdlib")


@pytest.fixture
async def backend(link, peer, tmp_path: Path):
    (tmp_path / "artifacts").mkdir()
    remote = RemoteBackend(
        task_id=TASK,
        job_id=JOB,
        link=link,
        work_dir=tmp_path,
        peers={PS: peer.url},
        transfer_token="transfer-token",
        connect_timeout=1.0,
        read_timeout=2.0,
        retry_base=0.01,
        retry_cap=0.05,
    )
    yield remote
    await remote.close()


def frames(answerer, kind) -> list:
    return [frame for frame in [*answerer.sent, *answerer.link.queued] if isinstance(frame, kind)]


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_an_unreachable_parameter_server_is_reported_after_the_quiet_retries_and_cleared_when_it_answers(
    backend, answerer, peer, tmp_path
):
    # given: nothing listens at the parameter server's address any more
    dead = peer.url
    await peer.stop()
    (tmp_path / "delta").write_bytes(b"pseudo-gradient")
    started = datetime.now(UTC)
    sending = asyncio.create_task(backend.send(reference=TO_PS, path=tmp_path / "delta"))

    # when: it keeps failing
    await wait_until(lambda: len(frames(answerer, protocol.TransferProblem)) >= 2)

    # then: the first report came with the 4th failure (3 are retried quietly), each names the cause
    first, second = frames(answerer, protocol.TransferProblem)[:2]
    assert (first.task_id, first.peer, first.role, first.url, first.operation, first.attempts) == (
        TASK,
        PS,
        "parameter_server",
        dead,
        "round 1 update",
        4,
    )
    assert "Cannot connect to host" in first.cause
    assert started <= first.since <= datetime.now(UTC)
    assert (second.attempts, second.since) == (5, first.since)
    assert frames(answerer, protocol.TransferOk) == []

    # when: the control plane names where the parameter server listens now
    replacement = FakePeer()
    await replacement.start()
    try:
        backend.update_peers({PS: replacement.url})
        await asyncio.wait_for(sending, 5)
    finally:
        await replacement.stop()

    # then: one transfer_ok clears it
    assert frames(answerer, protocol.TransferOk) == [protocol.TransferOk(task_id=TASK, peer=PS)]


async def test_a_passing_failure_is_not_reported(backend, answerer, peer, tmp_path):
    # given: the first update PUT gets a 503, the second goes through
    peer.update_statuses = [503]
    (tmp_path / "delta").write_bytes(b"pseudo-gradient")

    # when
    await backend.send(reference=TO_PS, path=tmp_path / "delta")

    # then
    assert frames(answerer, protocol.TransferProblem) == []
    assert frames(answerer, protocol.TransferOk) == []


async def test_a_parameter_server_gone_past_peer_wait_is_reported_as_the_cause_before_the_fetch_fails(
    backend, answerer, peer, tmp_path
):
    await peer.stop()
    backend.peer_wait = 0.05  # shorter than the quiet retries

    with pytest.raises(ConnectorError, match="model file config.json: Cannot connect to host"):
        await backend.fetch(
            reference=ParameterServerReference(peer=PS, filenames=["config.json"]),
            artifacts_dir=tmp_path / "artifacts",
        )

    [problem] = frames(answerer, protocol.TransferProblem)
    assert (problem.operation, problem.role) == ("model file config.json", "parameter_server")


async def test_a_data_node_that_does_not_answer_is_reported_and_cleared_once_a_slice_comes(
    backend, answerer, answer_slice, peer, tmp_path
):
    # given: the only node serving slice 2 answers 503 twice (restarting), then serves it
    peer.slices[("stdlib", 2)] = b"good"
    peer.slice_unavailable = 2
    answer = answer_slice(peer, "stdlib", 2)
    answer["urls"] = [url + "?token=download-secret" for url in answer["urls"]]
    answerer.slice_answers = [answer]
    host = peer.url.removeprefix("http://")

    # when
    files = await asyncio.wait_for(backend.fetch(reference=DATA, artifacts_dir=tmp_path / "artifacts"), 10)

    # then: each wait was reported (without the URL's token), and cleared once the slice came
    assert files == [("2", 4)]
    problems = frames(answerer, protocol.TransferProblem)
    assert [(p.peer, p.role, p.url, p.operation, p.attempts) for p in problems] == [
        (host, "data_node", f"{peer.url}/datasets/stdlib/slices/2", "slice download (stdlib)", 1),
        (host, "data_node", f"{peer.url}/datasets/stdlib/slices/2", "slice download (stdlib)", 2),
    ]
    assert problems[0].cause.startswith("answered 503")
    assert not any("download-secret" in protocol.encode(problem) for problem in problems)
    assert problems[1].since == problems[0].since
    assert frames(answerer, protocol.TransferOk) == [protocol.TransferOk(task_id=TASK, peer=host)]
