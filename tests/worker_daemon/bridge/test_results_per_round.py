"""Round results through the whole receive path — a real parameter-server-like peer (``FakePeer``), the daemon's
:class:`RemoteBackend`, the real bridge server and the executor's :class:`BridgeClient` — when the executor
reads its events late (issue 13, finding 1): every event must point at its own round's bytes.

Before the fix every round was saved to the same file (``incoming/<ps peer>``), so an executor that read round
1's event after round 2 had arrived loaded round 2's update for round 1 (the event said 2 bytes, the file held
8), then round 2's again, and never round 1's.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from worker_daemon import protocol
from worker_daemon.bridge import serve_bridge
from worker_daemon.bridge.references import ParameterServerReference, PeersReference
from worker_daemon.bridge.remote import RemoteBackend
from worker_daemon.executors.bridge_client import BridgeClient

TASK = uuid.UUID(int=13)
JOB = "5b0f1f0e-2f7c-4a43-9b8e-3a1c2d4e5f60"
PS = "ps-peer"
TOKEN = "transfer-token"
TO_PS = {"type": "peers", "peers": [PS], "strategy": {"type": "All"}, "resource": None}


@pytest.fixture
async def remote(link, answerer, peer, short_dir) -> AsyncIterator[RemoteBackend]:
    backend = RemoteBackend(
        task_id=TASK,
        job_id=JOB,
        link=link,
        work_dir=short_dir,
        peers={PS: peer.url},
        transfer_token=TOKEN,
        request_timeout=2.0,
        connect_timeout=2.0,
        read_timeout=5.0,
        result_wait=0.2,
        retry_base=0.01,
        retry_cap=0.05,
    )
    yield backend
    await backend.close()


@contextlib.asynccontextmanager
async def bridged(remote: RemoteBackend, work_dir: Path) -> AsyncIterator[BridgeClient]:
    """The bridge on ``work_dir/bridge.sock`` with ``remote`` behind it, and an executor's client of it."""
    server = await serve_bridge(
        socket_path=work_dir / "bridge.sock", work_dir=work_dir, backend=remote, job_id=JOB
    )
    client = BridgeClient(work_dir / "bridge.sock", status_timeout=5.0)
    try:
        yield client
    finally:
        client.close()
        await server.close()


async def polled(peer, round_number: int, timeout: float = 5.0) -> None:
    """Wait until the bridge asks for ``round_number``'s result (so it has everything before it)."""
    deadline = asyncio.get_running_loop().time() + timeout
    wanted = f"/jobs/{JOB}/rounds/{round_number}/result"
    while not any(path.startswith(wanted) for path in peer.paths("GET")):
        assert asyncio.get_running_loop().time() < deadline, f"round {round_number} was never asked for"
        await asyncio.sleep(0.01)


async def learn_round_zero(remote: RemoteBackend, peer, work_dir: Path) -> None:
    """The executor's first call: the model, from a parameter server that has completed no round."""
    peer.model = {"config.json": b"{}"}
    peer.rounds_completed = 0
    (work_dir / "artifacts").mkdir(exist_ok=True)
    await remote.fetch(
        reference=ParameterServerReference(peer=PS, filenames=["config.json"]),
        artifacts_dir=work_dir / "artifacts",
    )


async def test_an_executor_that_reads_late_gets_each_rounds_own_bytes(remote, peer, short_dir) -> None:
    # given: an executor with its receive stream open, busy training while rounds 1 and 2 close
    await learn_round_zero(remote, peer, short_dir)
    async with bridged(remote, short_dir) as client:
        stream = await asyncio.to_thread(client.receive, TO_PS, "incoming")
        peer.add_result(1, b"u1")
        peer.add_result(2, b"update 2")
        await polled(peer, 3)

        # when: it reads round 1's event, then round 2's
        def read_two() -> list[tuple[str, int | None, bytes, int]]:
            events = []
            for _ in range(2):
                received = stream.next_file()
                data = (short_dir / received.path).read_bytes()
                events.append((received.path, received.size, data, received.round))
            return events

        events = await asyncio.to_thread(read_two)
        await asyncio.to_thread(stream.close)

    # then: each event names its own round's file, whose size is the event's
    (
        (first_path, first_size, first_data, first_round),
        (second_path, second_size, second_data, second_round),
    ) = events
    assert (first_size, first_data, first_round) == (2, b"u1", 1)
    assert (second_size, second_data, second_round) == (8, b"update 2", 2)
    assert first_path != second_path
    assert first_path.startswith("incoming/") and second_path.startswith("incoming/")


async def test_a_merged_rounds_file_is_deleted_and_an_unread_one_kept(
    remote, peer, answerer, short_dir
) -> None:
    # given: rounds 1 and 2 received while the executor trained round 1
    await learn_round_zero(remote, peer, short_dir)
    incoming = short_dir / "incoming"
    incoming.mkdir()
    stream = remote.receive(reference=PeersReference.model_validate(TO_PS), directory=incoming)
    peer.add_result(1, b"u1")
    peer.add_result(2, b"update 2")
    first = await asyncio.wait_for(anext(stream), 5)
    second = await asyncio.wait_for(anext(stream), 5)
    (short_dir / "u.safetensors").write_bytes(b"delta")
    await remote.send(reference=PeersReference.model_validate(TO_PS), path=short_dir / "u.safetensors")

    # when: the executor says it merged round 1
    await remote.status(job_id=JOB, progress="update-received")

    # then: round 1's file is gone, round 2's (not read yet) is still there
    assert not (incoming / first[0]).exists()
    assert (incoming / second[0]).read_bytes() == b"update 2"
    await stream.aclose()


async def test_a_pruned_result_is_said_in_the_task_log_and_the_next_round_follows(
    remote, peer, answerer, short_dir
) -> None:
    # given: the parameter server no longer keeps round 1 (410), and round 2 is there
    await learn_round_zero(remote, peer, short_dir)
    incoming = short_dir / "incoming"
    incoming.mkdir()
    peer.pruned = {1}
    peer.add_result(2, b"update 2")

    # when
    stream = remote.receive(reference=PeersReference.model_validate(TO_PS), directory=incoming)
    name, size, sender, extra = await asyncio.wait_for(anext(stream), 5)
    await stream.aclose()

    # then: round 2 comes as round 2 (the executor sees the gap), and the job's page says what happened
    assert (size, sender, extra) == (8, PS, {"round": 2})
    lines = [line for message in answerer.of_type(protocol.TaskLog) for line in message.lines]
    assert any("round 1" in line and "pruned" in line and "full global weights" in line for line in lines), (
        lines
    )
