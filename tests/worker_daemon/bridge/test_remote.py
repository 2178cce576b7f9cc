"""The daemon's bridge backend against a real HTTP peer (a fake data node and parameter server on 127.0.0.1)
and an in-process control plane answering its requests (the ``answerer`` fixture)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from pathlib import Path

import aiohttp
import pytest

from worker_daemon import protocol
from worker_daemon.bridge import serve_bridge
from worker_daemon.bridge.exceptions import ConnectorError, NetworkError
from worker_daemon.bridge.references import (
    ParameterServerReference,
    PeersReference,
    SchedulerReference,
    UriReference,
    parse_progress,
)
from worker_daemon.bridge.remote import PREFETCH_DIR, RemoteBackend

TASK = uuid.UUID(int=5)
JOB = "5b0f1f0e-2f7c-4a43-9b8e-3a1c2d4e5f60"
PS = "ps-peer"
TOKEN = "transfer-token"
DATA = SchedulerReference(peer="control-plane", dataset="stdlib")
TO_PS = PeersReference(peers=[PS], strategy={"type": "All"})


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "artifacts").mkdir()
    return tmp_path


@pytest.fixture
async def backend(link, peer, work):
    remote = RemoteBackend(
        task_id=TASK,
        job_id=JOB,
        link=link,
        work_dir=work,
        peers={PS: peer.url + "/"},
        transfer_token=TOKEN,
        request_timeout=2.0,
        connect_timeout=2.0,
        read_timeout=5.0,
        result_wait=0.2,
        retry_base=0.01,
    )
    yield remote
    await remote.close()


def acks(answerer) -> list[int]:
    """The slices acknowledged so far: sent, or posted and about to be."""
    posted = [*answerer.sent, *answerer.link.queued]
    return [message.index for message in posted if isinstance(message, protocol.SliceAck)]


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# --- status ------------------------------------------------------------------------------------------------------


async def test_status_is_sent_verbatim_and_the_reply_returned(backend, answerer):
    answerer.status_replies = [{"type": "ScheduleUpdate", "counter": 3}]
    progress = {"status": {"batch_size": 4, "loss": 2.5, "step_time": 0.1}}

    reply = await backend.status(job_id=JOB, progress=progress)

    assert reply == {"type": "ScheduleUpdate", "counter": 3}
    (report,) = answerer.of_type(protocol.StatusReport)
    assert (report.task_id, report.progress) == (TASK, progress)
    assert await backend.status(job_id=JOB, progress="update") == {"type": "Continue"}
    assert backend.samples == 4


async def test_granted_step_reports_are_answered_here_and_counted_into_the_next_forwarded_one(
    backend, answerer
):
    # given: the control plane allows two step reports to be answered by the daemon
    answerer.status_replies = [
        {"type": "Continue", "continue_for": 2},
        {"type": "ScheduleUpdate", "counter": 0},
    ]
    step = {"status": {"batch_size": 4, "loss": 2.5}}

    # when: four steps
    replies = [await backend.status(job_id=JOB, progress=step) for _ in range(4)]

    # then: the 2nd and 3rd never left the daemon; the 4th stands for three steps and twelve samples
    assert replies == [{"type": "Continue"}] * 3 + [{"type": "ScheduleUpdate", "counter": 0}]
    first, fourth = answerer.of_type(protocol.StatusReport)
    assert first.progress == step
    assert fourth.progress == {
        "status": {
            "batch_size": 4,
            "loss": 2.5,
            "covered_steps": 3,
            "covered_samples": 12,
            # the two steps answered here, for the job's per-step charts (apps.jobs.metrics)
            "covered_points": [
                {"steps": 1, "seconds": 0.0, "samples": 4, "age": pytest.approx(0.0, abs=5.0),
                 "loss": 2.5, "loss_min": 2.5, "loss_max": 2.5},
            ] * 2,
        }
    }  # fmt: skip
    assert backend.samples == 16  # the update's X-Samples counts every step
    assert backend.local_continues == 0


async def test_a_grant_applies_to_step_reports_only(backend, answerer):
    answerer.status_replies = [{"type": "Continue", "continue_for": 5}]
    await backend.status(job_id=JOB, progress={"status": {"batch_size": 1}})
    assert await backend.status(job_id=JOB, progress="update") == {"type": "Continue"}  # forwarded
    assert backend.local_continues == 0
    assert len(answerer.of_type(protocol.StatusReport)) == 2


async def test_status_without_a_reply_is_a_network_error(backend, answerer):
    answerer.silent = True
    backend.request_timeout = 0.1

    with pytest.raises(NetworkError, match="did not answer the status within 0.1 s"):
        await backend.status(job_id=JOB, progress={"status": {"batch_size": 1}})
    assert backend.link.queued == []


async def test_a_request_waits_for_a_connection(backend, link):
    # given no connection yet
    status = asyncio.create_task(backend.status(job_id=JOB, progress="update"))
    await asyncio.sleep(0.05)
    assert [message.type for message in link.queued] == ["status"]

    # when the daemon connects
    sent = []

    async def send(message):
        sent.append(message)
        reply = protocol.StatusReply(request_id=message.request_id, reply={"type": "Ok"})
        asyncio.get_running_loop().call_soon(link.resolve, reply)

    link.connected(send)

    # then the request goes out and is answered
    assert await asyncio.wait_for(status, 2) == {"type": "Ok"}
    assert [message.progress for message in sent] == ["update"]
    link.disconnected()


def test_progress_extensions_of_our_parameter_server_are_accepted():
    assert parse_progress({"ready": {"url": "http://h:1", "round": 0}}).ready == {
        "url": "http://h:1",
        "round": 0,
    }
    assert parse_progress({"round": {"round": 1, "participants": ["a"]}}).round["round"] == 1
    with pytest.raises(ValueError):
        parse_progress({"ready": "now"})


# --- data slices -------------------------------------------------------------------------------------------------


async def test_slices_are_verified_acked_on_hand_out_and_prefetched(
    backend, answerer, answer_slice, peer, work
):
    # given five slices the control plane hands out in order
    for index in range(5):
        peer.slices[("stdlib", index)] = f"slice {index} ".encode() * (index + 1)
    answerer.slice_answers = [answer_slice(peer, "stdlib", index) for index in range(5)]

    # when the executor fetches the first slice
    files = await backend.fetch(reference=DATA, artifacts_dir=work / "artifacts")

    # then it is in artifacts/0, acked, and two more are claimed and downloaded but not acked
    assert files == [("0", len(peer.slices[("stdlib", 0)]))]
    assert (work / "artifacts" / "0").read_bytes() == peer.slices[("stdlib", 0)]
    assert acks(answerer) == [0]
    await wait_until(lambda: sorted(p.name for p in (work / PREFETCH_DIR).iterdir()) == ["1", "2"])
    assert len(answerer.of_type(protocol.FetchSlice)) == 3
    assert acks(answerer) == [0]

    # when it fetches the next one: served from the cache, acked now, and the prefetch tops up
    files = await backend.fetch(reference=DATA, artifacts_dir=work / "artifacts")
    assert files == [("1", len(peer.slices[("stdlib", 1)]))]
    assert (work / "artifacts" / "1").read_bytes() == peer.slices[("stdlib", 1)]
    assert acks(answerer) == [0, 1]
    assert peer.paths("GET").count("/datasets/stdlib/slices/1") == 1
    await wait_until(lambda: sorted(p.name for p in (work / PREFETCH_DIR).iterdir()) == ["2", "3"])

    # when the task ends, the prefetched slices are never acked
    await backend.close()
    await asyncio.sleep(0.05)
    assert acks(answerer) == [0, 1]


async def test_a_slice_with_the_wrong_digest_is_refused(backend, answerer, answer_slice, peer, work):
    peer.slices[("stdlib", 7)] = b"tampered bytes"
    answerer.slice_answers = [answer_slice(peer, "stdlib", 7, sha256=hashlib.sha256(b"original").hexdigest())]

    with pytest.raises(ConnectorError, match="slice 7 of 'stdlib' could not be downloaded: .*SHA-256"):
        await backend.fetch(reference=DATA, artifacts_dir=work / "artifacts")

    assert list((work / "artifacts").iterdir()) == []
    assert list((work / PREFETCH_DIR).iterdir()) == []
    assert acks(answerer) == []


async def test_a_slice_comes_from_the_next_url_when_one_fails(backend, answerer, answer_slice, peer, work):
    peer.slices[("stdlib", 2)] = b"good"
    answer = answer_slice(peer, "stdlib", 2)
    answer["urls"] = [f"{peer.url}/datasets/stdlib/slices/99", *answer["urls"]]
    answerer.slice_answers = [{"retry_in": 0.01}, answer]

    files = await backend.fetch(reference=DATA, artifacts_dir=work / "artifacts")

    assert files == [("2", 4)]
    assert len(answerer.of_type(protocol.FetchSlice)) >= 2  # asked again after "none yet"
    assert peer.paths("GET")[:2] == ["/datasets/stdlib/slices/99", "/datasets/stdlib/slices/2"]
    assert acks(answerer) == [2]


def task_log_lines(answerer) -> list[str]:
    frames = [*answerer.sent, *answerer.link.queued]
    return [line for frame in frames if isinstance(frame, protocol.TaskLog) for line in frame.lines]


async def test_while_no_data_node_answers_the_download_waits_and_says_so(
    backend, answerer, answer_slice, peer, work
):
    # given: the only node serving slice 2 answers 503 twice (restarting), then serves it
    peer.slices[("stdlib", 2)] = b"good"
    peer.slice_unavailable = 2
    answerer.slice_answers = [answer_slice(peer, "stdlib", 2)]
    backend.retry_base, backend.retry_cap = 0.01, 0.05

    # when
    files = await asyncio.wait_for(backend.fetch(reference=DATA, artifacts_dir=work / "artifacts"), 10)

    # then: it waited, saying so on the job's page (the task's log), and got the slice
    assert files == [("2", 4)]
    lines = task_log_lines(answerer)
    assert (
        len(lines) == 2 and lines[0].startswith("waiting for data: slice 2 of stdlib (") and "503" in lines[0]
    )


async def test_a_data_node_down_for_longer_than_data_wait_fails_the_fetch(
    backend, answerer, answer_slice, peer, work
):
    peer.slices[("stdlib", 2)] = b"good"
    peer.slice_unavailable = 10**6
    answerer.slice_answers = [answer_slice(peer, "stdlib", 2)]
    backend.retry_base, backend.retry_cap, backend.data_wait = 0.01, 0.05, 0.3

    with pytest.raises(ConnectorError, match="slice 2 of 'stdlib' could not be downloaded: .*503"):
        await asyncio.wait_for(backend.fetch(reference=DATA, artifacts_dir=work / "artifacts"), 10)
    assert task_log_lines(answerer)


async def test_an_exhausted_dataset_is_a_connector_error(backend, answerer, work):
    answerer.slice_answers = [{"error": "dataset stdlib has no slice left"}]
    with pytest.raises(ConnectorError, match="no slice left"):
        await backend.fetch(reference=DATA, artifacts_dir=work / "artifacts")


# --- the model, other fetches -----------------------------------------------------------------------------------


async def test_model_fetch_from_the_parameter_server_learns_the_round(backend, peer, work):
    peer.model = {"config.json": b"{}", "model.safetensors": b"weights"}
    peer.rounds_completed = 2
    reference = ParameterServerReference(peer=PS, filenames=["config.json", "model.safetensors"])

    files = await backend.fetch(reference=reference, artifacts_dir=work / "artifacts")

    assert files == [("config.json", 2), ("model.safetensors", 7)]
    assert (work / "artifacts" / "model.safetensors").read_bytes() == b"weights"
    assert peer.paths("GET") == [f"/jobs/{JOB}/model/config.json", f"/jobs/{JOB}/model/model.safetensors"]
    assert all(headers["Authorization"] == f"Bearer {TOKEN}" for _, _, headers, _ in peer.requests)
    assert (backend.rounds_completed, backend.next_send_round) == (2, 3)


async def test_a_fetch_waits_for_the_peers_address(backend, peer, work):
    # given: the trainer was dispatched before its parameter server listened
    peer.model = {"config.json": b"{}"}
    backend.peers.clear()
    fetch = asyncio.create_task(
        backend.fetch(
            reference=ParameterServerReference(peer=PS, filenames=["config.json"]),
            artifacts_dir=work / "artifacts",
        )
    )
    await asyncio.sleep(0.1)
    assert not fetch.done() and peer.requests == []

    # when: the repeated dispatch brings the address
    backend.update_peers({PS: peer.url + "/"})

    # then
    assert await asyncio.wait_for(fetch, 5) == [("config.json", 2)]


async def test_model_fetch_failures(backend, peer, work):
    backend.peer_wait = 0.1
    with pytest.raises(NetworkError, match="address of peer 'elsewhere' was not given within 0.1 s"):
        await backend.fetch(
            reference=ParameterServerReference(peer="elsewhere", filenames=["a"]),
            artifacts_dir=work / "artifacts",
        )
    with pytest.raises(ConnectorError, match="answered 404: not_found: no such file"):
        await backend.fetch(
            reference=ParameterServerReference(peer=PS, filenames=["missing"]),
            artifacts_dir=work / "artifacts",
        )
    assert len(peer.requests) == 1  # a 4xx is not retried


async def test_uri_fetch_names_the_file_by_its_last_segment(backend, peer, work):
    peer.model = {"weights.bin": b"w"}
    files = await backend.fetch(
        reference=UriReference(value=f"{peer.url}/jobs/{JOB}/model/weights.bin?x=1"),
        artifacts_dir=work / "artifacts",
    )
    assert files == [("weights.bin", 1)]
    assert "Authorization" not in peer.requests[0][2]


# --- updates and results -------------------------------------------------------------------------------------------


async def test_update_goes_to_the_next_round_with_the_samples_and_is_retried_on_5xx(
    backend, answerer, peer, work
):
    peer.model = {"model.safetensors": b"weights"}
    peer.rounds_completed = 2
    await backend.fetch(
        reference=ParameterServerReference(peer=PS, filenames=["model.safetensors"]),
        artifacts_dir=work / "artifacts",
    )
    for batch_size in (4, 4, 2):
        await backend.status(job_id=JOB, progress={"status": {"batch_size": batch_size}})
    (work / "delta.safetensors").write_bytes(b"pseudo-gradient")
    peer.update_statuses = [503]

    await backend.send(reference=TO_PS, path=work / "delta.safetensors")

    puts = [(path, headers, body) for method, path, headers, body in peer.requests if method == "PUT"]
    assert [(path, headers["X-Samples"], body) for path, headers, body in puts] == [
        (f"/jobs/{JOB}/rounds/3/update", "10", b"pseudo-gradient"),
        (f"/jobs/{JOB}/rounds/3/update", "10", b"pseudo-gradient"),
    ]
    assert puts[0][1]["Authorization"] == f"Bearer {TOKEN}"
    assert (backend.samples, backend.next_send_round) == (0, 4)


async def test_a_refused_update_is_logged_and_not_retried(backend, peer, work, caplog):
    (work / "delta").write_bytes(b"x")
    peer.update_statuses = [422]

    with caplog.at_level(logging.WARNING, logger="worker_daemon.bridge.remote"):
        await backend.send(reference=TO_PS, path=work / "delta")

    assert peer.paths("PUT") == [f"/jobs/{JOB}/rounds/1/update"]
    assert "refused the round 1 update (HTTP 422): refused: status 422 for this test" in caplog.text


async def test_an_update_waits_for_a_lost_parameter_server_and_goes_to_its_replacement(
    backend, answerer, peer, work
):
    # given: the parameter server is gone (nothing listens at its address any more)
    from tests.worker_daemon.conftest import FakePeer

    dead = peer.url
    await peer.stop()
    (work / "delta").write_bytes(b"pseudo-gradient")
    sending = asyncio.create_task(backend.send(reference=TO_PS, path=work / "delta"))

    # when: after a few failed attempts the control plane names the new parameter server's address
    def logs() -> list[protocol.TaskLog]:
        return [m for m in [*answerer.sent, *answerer.link.queued] if isinstance(m, protocol.TaskLog)]

    await wait_until(lambda: len(logs()) >= 1)
    replacement = FakePeer()
    await replacement.start()
    try:
        backend.update_peers({PS: replacement.url})
        await asyncio.wait_for(sending, 5)

        # then: the update went there, and the wait was said on the job's page
        assert replacement.paths("PUT") == [f"/jobs/{JOB}/rounds/1/update"]
        (log, *_) = logs()
        assert log.lines[0].startswith(f"waiting for the parameter server: round 1 update from {dead} failed")
    finally:
        await replacement.stop()


async def test_an_update_sent_to_a_server_that_was_lost_is_sent_again_to_the_one_that_resumed(
    backend, peer, work
):
    from tests.worker_daemon.conftest import FakePeer

    # given: round 1's update reached the parameter server, which was lost before it closed the round
    (work / "delta").write_bytes(b"round one")
    await backend.send(reference=TO_PS, path=work / "delta")
    (work / "delta").write_bytes(b"overwritten by the executor")
    incoming = work / "incoming"
    incoming.mkdir()
    replacement = FakePeer()
    await replacement.start()
    try:
        # when: a new server resumes elsewhere, and the trainer waits for round 1's result
        backend.update_peers({PS: replacement.url})
        replacement.add_result(1, b"u1")
        stream = backend.receive(reference=TO_PS, directory=incoming)
        assert await asyncio.wait_for(anext(stream), 5) == (f"{PS}.round-1", 2, PS, {"round": 1})
        await stream.aclose()

        # then: the new server got the update as it was sent, before the result was asked for
        assert [(method, path) for method, path, _, _ in replacement.requests][:2] == [
            ("PUT", f"/jobs/{JOB}/rounds/1/update"),
            ("GET", f"/jobs/{JOB}/rounds/1/result?wait=0.2"),
        ]
        assert replacement.requests[0][3] == b"round one"
        assert list((work / ".sent").iterdir()) == []  # the kept copy is gone once the result arrived
        assert peer.paths("PUT") == [f"/jobs/{JOB}/rounds/1/update"]  # sent once to the lost one
    finally:
        await replacement.stop()


async def test_an_update_answered_by_the_lost_server_after_a_new_address_came_is_sent_again_to_the_new_one(
    backend, peer, work
):
    """The parameter server's daemon was killed; the server, told to stop, still answered the update that was
    in flight, after the control plane had named its replacement. The replacement never saw it: without
    sending it again, the round waits for ever (tests/e2e/test_faults.py hit this in CI)."""
    from tests.worker_daemon.conftest import FakePeer

    # given: round 1's update is in flight at the old server, which holds its answer
    (work / "delta").write_bytes(b"round one")
    peer.hold_updates = asyncio.Event()
    sending = asyncio.create_task(backend.send(reference=TO_PS, path=work / "delta"))
    await wait_until(lambda: peer.paths("PUT") == [f"/jobs/{JOB}/rounds/1/update"])
    replacement = FakePeer()
    await replacement.start()
    incoming = work / "incoming"
    incoming.mkdir()
    try:
        # when: the replacement's address comes, then the old server answers 200
        backend.update_peers({PS: replacement.url})
        peer.hold_updates.set()
        await asyncio.wait_for(sending, 5)
        replacement.add_result(1, b"u1")
        stream = backend.receive(reference=TO_PS, directory=incoming)
        assert await asyncio.wait_for(anext(stream), 5) == (f"{PS}.round-1", 2, PS, {"round": 1})
        await stream.aclose()

        # then: the replacement got the update before the result was asked for
        assert [(method, path) for method, path, _, _ in replacement.requests][:2] == [
            ("PUT", f"/jobs/{JOB}/rounds/1/update"),
            ("GET", f"/jobs/{JOB}/rounds/1/result?wait=0.2"),
        ]
        assert replacement.requests[0][3] == b"round one"
    finally:
        await replacement.stop()


async def test_an_update_is_sent_again_when_the_address_is_given_again_even_unchanged(backend, peer, work):
    # given: round 1's update went out, and no result came yet
    (work / "delta").write_bytes(b"round one")
    await backend.send(reference=TO_PS, path=work / "delta")
    incoming = work / "incoming"
    incoming.mkdir()

    # when: the control plane gives the same address again (the server's daemon restarted on its fixed port)
    backend.update_peers({PS: peer.url})
    peer.add_result(1, b"u1")
    stream = backend.receive(reference=TO_PS, directory=incoming)
    assert await asyncio.wait_for(anext(stream), 5) == (f"{PS}.round-1", 2, PS, {"round": 1})

    # then: the update went again before the result was asked for, once
    assert [path for method, path, _, _ in peer.requests] == [
        f"/jobs/{JOB}/rounds/1/update",
        f"/jobs/{JOB}/rounds/1/update",
        f"/jobs/{JOB}/rounds/1/result?wait=0.2",
    ]

    # and a 409 from a server that already has it changes nothing (round 2: sent, told again, refused, fine)
    await backend.send(reference=TO_PS, path=work / "delta")
    backend.update_peers({PS: peer.url})
    peer.update_statuses = [409]
    peer.add_result(2, b"u2")
    assert await asyncio.wait_for(anext(stream), 5) == (f"{PS}.round-2", 2, PS, {"round": 2})
    await stream.aclose()
    assert peer.paths("PUT")[-2:] == [f"/jobs/{JOB}/rounds/2/update"] * 2


async def test_results_are_long_polled_round_by_round(backend, peer, work):
    # given the model said one round was completed
    peer.model = {"m": b"w"}
    peer.rounds_completed = 1
    await backend.fetch(
        reference=ParameterServerReference(peer=PS, filenames=["m"]), artifacts_dir=work / "artifacts"
    )
    incoming = work / "incoming"
    incoming.mkdir()
    stream = backend.receive(reference=TO_PS, directory=incoming)

    # when round 2's result appears only after a few long polls
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.5)
    assert not first.done()
    peer.add_result(2, b"update two")

    # then it is saved under the parameter server's peer id and its round, and round 3 is asked for next
    assert await asyncio.wait_for(first, 5) == (f"{PS}.round-2", 10, PS, {"round": 2})
    assert (incoming / f"{PS}.round-2").read_bytes() == b"update two"
    peer.add_result(3, b"update three")
    assert await asyncio.wait_for(anext(stream), 5) == (f"{PS}.round-3", 12, PS, {"round": 3})
    assert (incoming / f"{PS}.round-3").read_bytes() == b"update three"
    polled = [path for path in peer.paths("GET") if "/result" in path]
    assert polled[0] == f"/jobs/{JOB}/rounds/2/result?wait=0.2"
    assert polled.count(f"/jobs/{JOB}/rounds/2/result?wait=0.2") >= 2
    assert polled[-1] == f"/jobs/{JOB}/rounds/3/result?wait=0.2"
    await stream.aclose()


# --- through the bridge ------------------------------------------------------------------------------------------


async def test_the_bridge_accepts_parameter_server_references(backend, peer, short_dir):
    peer.model = {"config.json": b"{}"}
    bridge = await serve_bridge(
        socket_path=short_dir / "bridge.sock", work_dir=short_dir, backend=backend, job_id=JOB
    )
    try:
        connector = aiohttp.UnixConnector(path=str(bridge.socket_path))
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=5)
        ) as client:
            reference = {"type": "parameter-server", "peer": PS, "filenames": ["config.json"]}
            async with client.post("http://hypha/resources/fetch", json=reference) as response:
                assert (response.status, await response.json()) == (
                    200,
                    [{"path": "artifacts/config.json", "size": 2}],
                )
            async with client.post(
                "http://hypha/resources/fetch", json=reference | {"filenames": []}
            ) as response:
                assert response.status == 400
                assert (await response.json())["detail"] == "parameter-server filenames must not be empty"
    finally:
        await bridge.close()


# --- slice download tokens --------------------------------------------------------------------------------------


@pytest.fixture
async def data_node(tmp_path: Path):
    """A real data node (``data_node.server``) serving dataset "stdlib" (slices 0 and 1) with download key
    ``"k" * 64``; yields its base URL."""
    from aiohttp.test_utils import TestServer

    from data_node.server import ServedDataset, build_app
    from data_node.slices import scan

    directory = tmp_path / "stdlib"
    directory.mkdir()
    (directory / "00000.safetensors").write_bytes(b"slice zero")
    (directory / "00001.safetensors").write_bytes(b"slice one!")
    app = build_app(ServedDataset(name="stdlib", slices=scan(directory)), download_key="k" * 64)
    server = TestServer(app)
    await server.start_server(access_log=None)  # as hypha-data-node runs it: URLs hold tokens
    yield str(server.make_url("")).rstrip("/")
    await server.close()


def tokened_answer(base: str, index: int, data: bytes, *, expires_in: float = 600) -> dict:
    import time

    from data_node import tokens

    token = tokens.sign(
        "k" * 64, dataset="stdlib", index=index, job=JOB, peer="rig-a", expires=int(time.time() + expires_in)
    )
    return {
        "index": index,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "urls": [f"{base}/datasets/stdlib/slices/{index}?token={token}"],
    }


async def test_a_slice_url_with_its_token_downloads_from_a_real_data_node(backend, answerer, data_node, work):
    answerer.slice_answers = [tokened_answer(data_node, 1, b"slice one!")]

    files = await backend.fetch(reference=DATA, artifacts_dir=work / "artifacts")

    assert files == [("1", 10)]
    assert (work / "artifacts" / "1").read_bytes() == b"slice one!"
    assert acks(answerer) == [1]


async def test_a_refused_token_fails_the_fetch_at_once_and_is_never_logged(
    backend, answerer, data_node, work, caplog
):
    # given: an expired token (a 401 is no data node being down: waiting would not help)
    answer = tokened_answer(data_node, 0, b"slice zero", expires_in=-5)
    token = answer["urls"][0].partition("token=")[2]
    answerer.slice_answers = [answer]
    caplog.set_level(logging.DEBUG)

    # when
    with pytest.raises(ConnectorError) as refused:
        await asyncio.wait_for(backend.fetch(reference=DATA, artifacts_dir=work / "artifacts"), 10)

    # then: the reason is the node's, and the token is in no message, log record or task log line
    assert "answered 401: unauthorized: the slice token expired" in str(refused.value)
    assert token not in str(refused.value)
    assert token not in caplog.text
    assert all(token not in line for line in task_log_lines(answerer))
    assert acks(answerer) == []


# --- lost authorisation --------------------------------------------------------------------------------------


@pytest.fixture
async def watched(link, peer, work):
    """A backend whose lost authorisation is recorded in ``lost`` (its daemon would fail the task)."""
    lost: list[str] = []
    remote = RemoteBackend(
        task_id=TASK,
        job_id=JOB,
        link=link,
        work_dir=work,
        peers={PS: peer.url},
        transfer_token=TOKEN,
        result_wait=0.05,
        retry_base=0.01,
        retry_cap=0.05,
        auth_grace=0.5,
        on_authorisation_lost=lost.append,
    )
    remote.lost = lost
    (work / "incoming").mkdir()
    yield remote
    await remote.close()


async def test_a_token_refused_past_the_grace_fails_the_task_with_the_reason(watched, peer, work):
    # given: the parameter server refuses the task's token, and no fresh one comes
    peer.tokens = {"a-token-this-task-never-gets"}
    peer.rounds_completed = 0
    peer.model["config.json"] = b"{}"
    await watched.fetch(
        reference=ParameterServerReference(peer=PS, filenames=["config.json"]),
        artifacts_dir=work / "artifacts",
    )

    # when: the trainer waits for round 1's result
    async def everything() -> list:
        return [item async for item in watched.receive(reference=TO_PS, directory=work / "incoming")]

    received = await asyncio.wait_for(everything(), 10)

    # then: the stream ends instead of polling for ever, and the daemon is told why, once
    assert received == []
    (reason,) = watched.lost
    assert reason.startswith("the parameter server refused this task's transfer token for ")
    assert "unauthorized: transfer token expired" in reason
    assert len([path for path in peer.paths("GET") if "/result" in path]) >= 2


async def test_a_fresh_token_within_the_grace_keeps_the_task(watched, peer, work):
    # given: the token is refused at first
    peer.tokens = {"fresh-token"}
    peer.model["config.json"] = b"{}"
    await watched.fetch(
        reference=ParameterServerReference(peer=PS, filenames=["config.json"]),
        artifacts_dir=work / "artifacts",
    )
    peer.add_result(1, b"u1")
    stream = watched.receive(reference=TO_PS, directory=work / "incoming")
    first = asyncio.ensure_future(anext(stream))
    await wait_until(lambda: any("/result" in path for path in peer.paths("GET")))

    # when: a fresh token arrives (with the lease's renewal) before the grace has passed
    watched.transfer_token = "fresh-token"

    # then: round 1's result comes, and the task was never failed
    assert await asyncio.wait_for(first, 5) == (f"{PS}.round-1", 2, PS, {"round": 1})
    await stream.aclose()
    assert watched.lost == []
