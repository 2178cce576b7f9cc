"""The bridge of an inference task (``InferenceBackend``): slices claimed without ``slice_ack`` and ``[]`` once
the control plane says ``done``; results PUT to a local aiohttp server standing for the control plane's
``/api/jobs/{job}/results/{index}/``, in order, retried on 5xx, not on 4xx."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from worker_daemon import protocol
from worker_daemon.bridge import serve_bridge
from worker_daemon.bridge.references import PeersReference, SchedulerReference
from worker_daemon.bridge.remote.results import InferenceBackend
from worker_daemon.config import WorkerConfig
from worker_daemon.jobs import INFERENCE_MODULE, JobManager, Task
from worker_daemon.leases import LeaseBook

TASK = uuid.UUID(int=19)
JOB = "6c1e2f3a-4b5c-4d6e-8f70-1a2b3c4d5e6f"
TOKEN = "transfer-token-of-the-task"
CONTROL_PLANE = "control-plane"
DATASET = "prompts"
UPLOADED = b"PK an uploaded model archive"


class ResultsEndpoint:
    """``PUT /api/jobs/{job}/results/{index}/`` answered with the next of ``statuses`` (201 once empty); every
    request recorded as ``(index, headers, body)``."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.requests: list[tuple[int, dict[str, str], bytes]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _put(self, request: web.Request) -> web.Response:
        body = await request.read()
        index = int(request.match_info["index"])
        self.requests.append((index, dict(request.headers), body))
        assert request.match_info["job"] == JOB
        status = self.statuses.pop(0) if self.statuses else 201
        if status == 201:
            return web.json_response(
                {"index": index, "sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}, status=201
            )
        return web.json_response({"error": "refused", "detail": f"status {status}"}, status=status)

    async def _upload(self, request: web.Request) -> web.Response:
        self.requests.append((-1, dict(request.headers), b""))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"detail": "no"}, status=401)
        return web.Response(body=UPLOADED, content_type="application/octet-stream")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_put("/api/jobs/{job}/results/{index}/", self._put)
        app.router.add_get("/api/uploads/3/content/", self._upload)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def control_plane() -> AsyncIterator[ResultsEndpoint]:
    server = ResultsEndpoint()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "results").mkdir()
    return tmp_path


@pytest.fixture
async def backend(link, control_plane, work) -> AsyncIterator[InferenceBackend]:
    remote = InferenceBackend(
        task_id=TASK,
        job_id=JOB,
        link=link,
        work_dir=work,
        server_url=control_plane.url + "/",
        transfer_token=TOKEN,
        request_timeout=2.0,
        connect_timeout=2.0,
        read_timeout=5.0,
        retry_base=0.01,
        retry_cap=0.05,
        drain_timeout=5.0,
    )
    yield remote
    await remote.close()


def to_control_plane(index: int) -> PeersReference:
    return PeersReference.model_validate(
        {
            "type": "peers",
            "peers": [CONTROL_PLANE],
            "strategy": {"type": "One"},
            "resource": {"dataset": DATASET, "index": index},
        }
    )


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def task_lines(answerer) -> list[str]:
    posted = [*answerer.sent, *answerer.link.queued]
    return [line for message in posted if isinstance(message, protocol.TaskLog) for line in message.lines]


# --- results ---------------------------------------------------------------------------------------------------


async def test_a_result_is_put_with_its_token_digest_and_format(backend, answerer, control_plane, work):
    # given
    body = b'{"row": 0, "tokens": [1, 2]}\n{"row": 1, "tokens": [3]}\n'
    (work / "results" / "4.jsonl").write_bytes(body)

    # when
    await backend.send(reference=to_control_plane(4), path=work / "results" / "4.jsonl")
    await wait_until(lambda: backend.results_stored == [4])

    # then
    ((index, headers, received),) = control_plane.requests
    assert (index, received) == (4, body)
    assert headers["Authorization"] == f"Bearer {TOKEN}"
    assert headers["X-Content-SHA256"] == hashlib.sha256(body).hexdigest()
    assert headers["Content-Type"] == "application/octet-stream"
    assert headers["X-Result-Format"] == "jsonl"
    assert headers["Content-Length"] == str(len(body))


async def test_results_go_in_the_order_sent_with_the_current_token(backend, answerer, control_plane, work):
    for index in (7, 2, 5):
        (work / "results" / f"{index}.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    backend.transfer_token = "a-fresher-token"  # the daemon's refresh_token sets this on each renewal

    for index in (7, 2, 5):
        await backend.send(reference=to_control_plane(index), path=work / "results" / f"{index}.safetensors")
    await wait_until(lambda: len(backend.results_stored) == 3)

    assert [index for index, _, _ in control_plane.requests] == [7, 2, 5]
    assert {headers["X-Result-Format"] for _, headers, _ in control_plane.requests} == {"safetensors"}
    assert {headers["Authorization"] for _, headers, _ in control_plane.requests} == {
        "Bearer a-fresher-token"
    }


async def test_a_500_is_retried_until_the_result_is_stored(backend, answerer, control_plane, work):
    control_plane.statuses = [500, 503]
    (work / "results" / "1.jsonl").write_bytes(b'{"row": 0, "tokens": []}\n')

    await backend.send(reference=to_control_plane(1), path=work / "results" / "1.jsonl")
    await wait_until(lambda: backend.results_stored == [1])

    assert [index for index, _, _ in control_plane.requests] == [1, 1, 1]
    assert len({body for _, _, body in control_plane.requests}) == 1  # the same body each time
    assert backend.results_failed == []


async def test_a_409_is_not_retried_and_the_next_result_still_goes(backend, answerer, control_plane, work):
    control_plane.statuses = [409]
    for index in (3, 6):
        (work / "results" / f"{index}.jsonl").write_bytes(b'{"row": 0, "tokens": [9]}\n')

    await backend.send(reference=to_control_plane(3), path=work / "results" / "3.jsonl")
    await backend.send(reference=to_control_plane(6), path=work / "results" / "6.jsonl")
    await wait_until(lambda: backend.results_stored == [6])

    assert [index for index, _, _ in control_plane.requests] == [3, 6]  # 3 asked once
    assert backend.results_failed == [3]
    (line,) = [line for line in task_lines(answerer) if "slice 3" in line]
    assert "was not stored" in line and "409" in line


async def test_a_connection_error_is_retried(backend, answerer, control_plane, work):
    # given: the control plane is away for the first attempts
    url = control_plane.url
    await control_plane.stop()
    (work / "results" / "8.jsonl").write_bytes(b'{"row": 0, "tokens": [1]}\n')

    # when
    await backend.send(reference=to_control_plane(8), path=work / "results" / "8.jsonl")
    await asyncio.sleep(0.2)
    assert backend.results_stored == []
    app = web.Application()
    app.router.add_put("/api/jobs/{job}/results/{index}/", control_plane._put)
    runner = web.AppRunner(app)
    await runner.setup()
    host, port = url.removeprefix("http://").split(":")
    await web.TCPSite(runner, host, int(port)).start()
    try:
        # then
        await wait_until(lambda: backend.results_stored == [8])
    finally:
        await runner.cleanup()


async def test_close_waits_for_the_queued_results(backend, answerer, control_plane, work):
    control_plane.statuses = [500]
    (work / "results" / "0.jsonl").write_bytes(b'{"row": 0, "tokens": [1]}\n')

    await backend.send(reference=to_control_plane(0), path=work / "results" / "0.jsonl")
    await backend.close()

    assert backend.results_stored == [0]


# --- slices ----------------------------------------------------------------------------------------------------


@pytest.fixture
async def bridge_client(backend, work) -> AsyncIterator[aiohttp.ClientSession]:
    socket = work / "bridge.sock"
    server = await serve_bridge(socket_path=socket, work_dir=work, backend=backend, job_id=JOB)
    connector = aiohttp.UnixConnector(path=str(socket))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session
    await server.close()


def slice_acks(answerer) -> list[Any]:
    posted = [*answerer.sent, *answerer.link.queued]
    return [message for message in posted if isinstance(message, protocol.SliceAck)]


async def test_slices_are_claimed_without_an_ack_and_done_ends_them(
    backend, answerer, peer, answer_slice, bridge_client, work
):
    # given: two slices, a "none yet", then the job has none left for this task
    peer.slices[(DATASET, 4)] = b"slice four"
    peer.slices[(DATASET, 9)] = b"slice nine"
    answerer.slice_answers = [
        answer_slice(peer, DATASET, 4),
        {"retry_in": 0.01},
        answer_slice(peer, DATASET, 9),
        {"done": True},
    ]
    backend.data_wait = 2.0
    reference = {"type": "scheduler", "peer": CONTROL_PLANE, "dataset": DATASET}

    # when
    replies = []
    for _ in range(3):
        async with bridge_client.post("http://hypha/resources/fetch", json=reference) as response:
            assert response.status == 200
            replies.append(await response.json())

    # then
    assert replies == [
        [{"path": "artifacts/4", "size": 10}],
        [{"path": "artifacts/9", "size": 10}],
        [],
    ]
    assert (work / "artifacts" / "9").read_bytes() == b"slice nine"
    assert slice_acks(answerer) == []  # a slice is used once its result is stored, not when fetched
    assert len(answerer.of_type(protocol.FetchSlice)) == 4  # nothing claimed ahead


async def test_done_waits_for_this_tasks_results_on_their_way(
    backend, answerer, peer, answer_slice, control_plane, work
):
    # given: a slice whose result the control plane takes only at the second attempt
    peer.slices[(DATASET, 4)] = b"slice four"
    answerer.slice_answers = [answer_slice(peer, DATASET, 4), {"done": True}, {"done": True}]
    control_plane.statuses = [503]
    reference = SchedulerReference(peer=CONTROL_PLANE, dataset=DATASET)
    assert await backend.fetch(reference=reference, artifacts_dir=work / "artifacts") == [("4", 10)]
    (work / "results" / "4.jsonl").write_bytes(b'{"row": 0, "tokens": [1]}\n')
    await backend.send(reference=to_control_plane(4), path=work / "results" / "4.jsonl")

    # when: "done" (the slice is this task's own) while its result is on its way
    files = await backend.fetch(reference=reference, artifacts_dir=work / "artifacts")

    # then: [] only once the result is stored, after asking again
    assert files == []
    assert backend.results_stored == [4]
    assert len(answerer.of_type(protocol.FetchSlice)) == 3


async def test_a_send_without_a_slice_is_an_update_as_before(backend, work, monkeypatch):
    sent = []

    async def remote_send(self, *, reference, path):
        sent.append((reference, path))

    monkeypatch.setattr("worker_daemon.bridge.remote.backend.RemoteBackend.send", remote_send)
    reference = PeersReference.model_validate({"type": "peers", "peers": ["ps"], "strategy": {"type": "All"}})

    await backend.send(reference=reference, path=work / "update")

    assert sent == [(reference, work / "update")]


async def test_an_uploaded_model_is_fetched_from_the_control_plane_with_the_token(
    backend, control_plane, bridge_client, work
):
    reference = {"type": "uri", "value": "/api/uploads/3/content/"}

    async with bridge_client.post("http://hypha/resources/fetch", json=reference) as response:
        assert response.status == 200
        reply = await response.json()

    assert reply == [{"path": "artifacts/upload", "size": len(UPLOADED)}]
    assert (work / "artifacts" / "upload").read_bytes() == UPLOADED
    ((_, headers, _),) = control_plane.requests
    assert headers["Authorization"] == f"Bearer {TOKEN}"
    # a scheme-relative URL is no path on the control plane
    async with bridge_client.post(
        "http://hypha/resources/fetch", json={"type": "uri", "value": "//elsewhere.example/x"}
    ) as response:
        assert response.status == 400


# --- the daemon ------------------------------------------------------------------------------------------------


def test_the_inference_runtime_runs_the_built_in_executor(tmp_path):
    config = WorkerConfig.model_validate(
        {"work_dir": str(tmp_path / "w"), "resources": {"cpu": 8, "memory": 32, "storage": 100, "gpu": 0}}
    )
    executor = config.find_executor("inference", "batch-inference")
    assert executor is not None and executor.runtime == "inference"
    book = LeaseBook(capacity=protocol.Resources(cpu=8, memory=32, storage=100, gpu=0))
    manager = JobManager(config=config, book=book, server_url="ws://cp.example/ws/worker/")
    spec = {"job_id": JOB, "executor": {"class": "inference", "descriptor": {"name": "batch-inference"}}}
    dispatch = protocol.DispatchJob(
        task_id=TASK, lease_id=uuid.uuid4(), job_id=uuid.UUID(JOB), role="inference", spec=spec
    )
    task = Task(dispatch=dispatch, executor=executor, work_dir=tmp_path, socket_path=tmp_path / "s")

    argv, environment = manager._command(task)

    assert argv[1:] == ["-m", INFERENCE_MODULE, "--socket", str(tmp_path / "s"), "--work-dir", str(tmp_path)]
    assert json.loads(environment["JOB_JSON"]) == spec


async def test_a_daemon_runs_an_inference_task_to_its_end(
    tmp_path, link, answerer, peer, answer_slice, control_plane
):
    """The whole worker side: the job manager starts the built-in executor (runtime ``inference``) with an
    inference backend; it claims two slices, uploads both results to the control plane, ends at ``done``."""
    import torch
    from safetensors.torch import save

    # given: two slices of prompts, then the control plane says the job has none left for this task
    for index in (0, 1):
        prompts = torch.randint(1, 256, (3, 5), generator=torch.Generator().manual_seed(index))
        peer.slices[(DATASET, index)] = save({"input_ids": prompts})
    # (twice: a "done" that comes while this task's results are still uploading is asked again once they are in)
    answerer.slice_answers = [
        answer_slice(peer, DATASET, 0),
        answer_slice(peer, DATASET, 1),
        {"done": True},
        {"done": True},
    ]
    work_root = Path(tempfile.mkdtemp(prefix="hi-"))  # short: a Unix socket path has at most 107 bytes
    config = WorkerConfig.model_validate(
        {"work_dir": str(work_root), "resources": {"cpu": 8, "memory": 32, "storage": 100, "gpu": 0}}
    )
    book = LeaseBook(capacity=protocol.Resources(cpu=8, memory=32, storage=100, gpu=0))
    lease = uuid.uuid4()
    book.activate(
        lease_id=lease, job_id=uuid.UUID(JOB), role="inference", resources=protocol.Resources(cpu=1), price=1.0,
        ttl=60.0,
    )  # fmt: skip
    manager = JobManager(config=config, book=book, server_url=control_plane.url, link=link)
    spec = {
        "job_id": JOB,
        "executor": {
            "class": "inference",
            "descriptor": {"name": "batch-inference"},
            "config": {
                "model": {
                    "task": "causal-lm",
                    "artifact": {
                        "type": "config",
                        "config": {"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2,
                                   "vocab_size": 256, "n_positions": 32},
                    },
                },
                "data": {"type": "scheduler", "peer": CONTROL_PLANE, "dataset": DATASET},
                "results": {"type": "peers", "peers": [CONTROL_PLANE], "strategy": {"type": "One"},
                            "resource": None},
                "task": {"type": "generate", "max_new_tokens": 3, "temperature": 0.0, "seed": 0},
                "batch_size": 2,
                "input_names": ["input_ids"],
            },
        },
    }  # fmt: skip
    dispatch = protocol.DispatchJob(
        task_id=TASK, lease_id=lease, job_id=uuid.UUID(JOB), role="inference", spec=spec, transfer_token=TOKEN
    )

    # when
    try:
        task = manager.start(dispatch)
        assert task is not None
        await wait_until(lambda: task.backend is not None)
        assert isinstance(task.backend, InferenceBackend)
        exited = await asyncio.wait_for(task.runner, 60)
    finally:
        await manager.stop_all(timeout=5.0)
        shutil.rmtree(work_root, ignore_errors=True)

    # then: a clean exit, both results stored in order, no slice acknowledged on fetch
    assert (exited.exit_code, exited.reason) == (0, ""), exited.log_tail
    assert [index for index, _, _ in control_plane.requests] == [0, 1]
    for _, headers, body in control_plane.requests:
        assert headers["X-Result-Format"] == "jsonl"
        assert headers["Authorization"] == f"Bearer {TOKEN}"
        assert [json.loads(line)["row"] for line in body.decode().splitlines()] == [0, 1, 2]
    assert slice_acks(answerer) == []
