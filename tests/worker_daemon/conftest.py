"""Fixtures for the worker daemon's tests: a config, message builders, a scripted control plane, and for tasks
a fake data node / parameter server (:class:`FakePeer`) and an in-process control plane behind a link
(:class:`Answerer`).

None of these tests touch Django or a database; the fake control plane is a plain websockets server on
127.0.0.1 that records what the daemon sends and lets a test send frames and close codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from worker_daemon import protocol, telemetry
from worker_daemon.config import WorkerConfig
from worker_daemon.connection import WorkerDaemon
from worker_daemon.link import ControlLink

TIMEOUT = 5.0

# A worker with room for one 24 GB trainer: the numbers every test asserts against.
CAPACITY = {"cpu": 8.0, "memory": 32.0, "storage": 100.0, "gpu": 24.0}
TRAIN = {"class": "train", "name": "diloco-transformer"}
CAPACITY_RESOURCES = protocol.Resources(**CAPACITY)


class FakeClock:
    """A monotonic clock the test moves by hand (``clock.now += 5``)."""

    def __init__(self, now: float = 500.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def worker_config(tmp_path: Path) -> WorkerConfig:
    """Whole strategy, price 120, floor 100, the default executors."""
    return WorkerConfig.model_validate(
        {"work_dir": str(tmp_path), "resources": CAPACITY, "offer": {"price": 120.0, "floor": 100.0}}
    )


@pytest.fixture
def flexible_config(tmp_path: Path) -> WorkerConfig:
    return WorkerConfig.model_validate(
        {
            "work_dir": str(tmp_path),
            "resources": CAPACITY,
            "offer": {"price": 120.0, "floor": 100.0, "strategy": "flexible"},
        }
    )


class Make:
    """Builders for protocol messages and a polling helper, handed to tests as the ``make`` fixture (test
    modules cannot import conftest reliably across pytest's import modes)."""

    @staticmethod
    def advertisement(
        *,
        bid: float = 150.0,
        attempt: int = 0,
        resources: dict[str, float] | None = None,
        executors: list[dict[str, str]] | None = None,
        role: str = "trainer",
        advertisement_id: uuid.UUID | None = None,
        job_id: uuid.UUID | None = None,
    ) -> protocol.Advertisement:
        """An advert for one trainer; by default 1 cpu + 10 GB VRAM at bid 150."""
        return protocol.Advertisement(
            advertisement_id=advertisement_id or uuid.uuid4(),
            attempt=attempt,
            job_id=job_id or uuid.uuid4(),
            role=role,
            resources=protocol.Resources(
                **(resources if resources is not None else {"cpu": 1.0, "gpu": 10.0})
            ),
            executors=[
                protocol.ExecutorDescriptor(**e) for e in (executors if executors is not None else [TRAIN])
            ],
            bid=bid,
            wanted=1,
        )

    @staticmethod
    def welcome(
        *,
        leases: list[protocol.LeaseInfo] | None = None,
        advertisements: list[protocol.Advertisement] | None = None,
        offer_ttl: float = 2.0,
        lease_ttl: float = 2.0,
    ) -> protocol.Welcome:
        return protocol.Welcome(
            worker_id=uuid.UUID(int=1),
            worker_name="gpu-01",
            lease_ttl=lease_ttl,
            offer_ttl=offer_ttl,
            leases=leases or [],
            advertisements=advertisements or [],
        )

    @staticmethod
    def grant(
        advertisement: protocol.Advertisement,
        lease_id: uuid.UUID,
        *,
        resources: protocol.Resources = CAPACITY_RESOURCES,
        expires_in: float = 10.0,
    ) -> protocol.LeaseGranted:
        """The control plane's grant of ``advertisement`` at price 150."""
        return protocol.LeaseGranted(
            lease_id=lease_id,
            advertisement_id=advertisement.advertisement_id,
            job_id=advertisement.job_id,
            role=advertisement.role,
            resources=resources,
            price=150.0,
            expires_in=expires_in,
        )

    @staticmethod
    def lease_info(
        lease_id: uuid.UUID,
        *,
        resources: protocol.Resources = CAPACITY_RESOURCES,
        expires_in: float = 10.0,
        status: str = "active",
    ) -> protocol.LeaseInfo:
        """A lease as ``welcome`` lists it (job 99, role trainer)."""
        return protocol.LeaseInfo(
            lease_id=lease_id,
            job_id=uuid.UUID(int=99),
            role="trainer",
            status=status,
            resources=resources,
            expires_in=expires_in,
        )

    @staticmethod
    def frame(message: protocol._Message) -> dict[str, Any]:
        """A message as the JSON object on the wire."""
        return json.loads(protocol.encode(message))

    @staticmethod
    async def wait_until(predicate: Callable[[], bool], *, timeout: float = TIMEOUT) -> None:
        """Poll ``predicate`` every 10 ms until it holds; fail after ``timeout`` seconds."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError("condition not reached in time")
            await asyncio.sleep(0.01)


@pytest.fixture
def make() -> type[Make]:
    return Make


class FakeConnection:
    """One daemon connection as the control plane sees it."""

    def __init__(self, websocket: ServerConnection) -> None:
        self.websocket = websocket
        self.received: asyncio.Queue[protocol.DaemonMessage] = asyncio.Queue()
        self.closed = asyncio.Event()

    @property
    def headers(self) -> Any:
        return self.websocket.request.headers

    async def pump(self) -> None:
        try:
            async for frame in self.websocket:
                await self.received.put(protocol.parse_daemon_message(frame))
        except ConnectionClosed:
            pass
        finally:
            self.closed.set()

    async def expect(self, message_type: type[Any], *, timeout: float = TIMEOUT) -> Any:
        """The next frame the daemon sends, which must be of ``message_type``. ``task_log`` frames (a task's
        output, sent on a timer and just before its ``job_exited``) are passed over unless asked for."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            message = await asyncio.wait_for(self.received.get(), max(remaining, 0.001))
            if message_type is protocol.TaskLog or not isinstance(message, protocol.TaskLog):
                break
        assert isinstance(message, message_type), f"expected {message_type.__name__}, got {message!r}"
        return message

    async def expect_silence(self, *, seconds: float = 0.3) -> None:
        """Assert the daemon sends nothing for ``seconds``."""
        with contextlib.suppress(TimeoutError):
            message = await asyncio.wait_for(self.received.get(), seconds)
            raise AssertionError(f"expected no frame, got {message!r}")

    async def send(self, message: protocol._Message) -> None:
        await self.websocket.send(protocol.encode(message))

    async def send_raw(self, text: str) -> None:
        await self.websocket.send(text)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        await self.websocket.close(code, reason)


class FakeControlPlane:
    """A websockets server on 127.0.0.1 that hands each daemon connection to the test.

    ``reject_status`` makes it refuse handshakes with that HTTP status instead.
    """

    def __init__(self) -> None:
        self.connections: asyncio.Queue[FakeConnection] = asyncio.Queue()
        self.reject_status: int | None = None
        self.handshakes = 0
        self._server: Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = next(iter(self._server.sockets)).getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> None:
        self._server = await serve(self._handle, "127.0.0.1", 0, process_request=self._process_request)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), TIMEOUT)

    async def next_connection(self, *, timeout: float = TIMEOUT) -> FakeConnection:
        return await asyncio.wait_for(self.connections.get(), timeout)

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        self.handshakes += 1
        assert request.path == "/ws/worker/"
        if self.reject_status is not None:
            return connection.respond(self.reject_status, "refused\n")
        return None

    async def _handle(self, websocket: ServerConnection) -> None:
        connection = FakeConnection(websocket)
        await self.connections.put(connection)
        await connection.pump()


@pytest.fixture
async def control_plane() -> AsyncIterator[FakeControlPlane]:
    server = FakeControlPlane()
    await server.start()
    yield server
    await server.stop()


class DaemonRunner:
    """Starts :class:`WorkerDaemon` instances in the test's loop and always stops them afterwards."""

    def __init__(self) -> None:
        self.started: list[tuple[WorkerDaemon, asyncio.Task[int]]] = []

    def start(
        self, *, config: WorkerConfig, server_url: str, **options: Any
    ) -> tuple[WorkerDaemon, asyncio.Task[int]]:
        settings: dict[str, Any] = {
            "token": "secret-token",
            "batch_window": 0.01,
            "prune_interval": 0.02,
            "backoff_base": 0.01,
            "backoff_cap": 0.05,
            "open_timeout": 3.0,
            "shutdown_timeout": 1.0,
        }
        settings.update(options)
        daemon = WorkerDaemon(config=config, server_url=server_url, **settings)
        task = asyncio.create_task(daemon.run())
        self.started.append((daemon, task))
        return daemon, task

    async def stop_all(self) -> None:
        for daemon, task in self.started:
            daemon.request_shutdown(reason="test finished")
            try:
                await asyncio.wait_for(task, TIMEOUT)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()


@pytest.fixture
async def daemons() -> AsyncIterator[DaemonRunner]:
    runner = DaemonRunner()
    yield runner
    await runner.stop_all()


# --- tasks: short work dirs, a fake data node / parameter server, a control plane answering the link --------


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A fresh directory under /tmp with a short path (a Unix socket path must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="hj-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class FakePeer:
    """An aiohttp server on 127.0.0.1 playing a data node and a job's parameter server (docs/training.md).

    ``slices[(dataset, index)]`` and ``model[filename]`` are served; ``results[r]`` is served for round r
    once set (a long-poll waits up to ``wait`` for it, then answers 204); ``update_statuses`` lists the
    statuses to answer successive update PUTs with (200 once empty). With ``tokens`` set, a result request
    whose bearer token is not among them is answered 401, as the parameter server answers an expired token.
    ``requests`` records ``(method, path, headers, body)``.
    """

    def __init__(self) -> None:
        self.slices: dict[tuple[str, int], bytes] = {}
        #: Slice requests answered 503 before slices are served (a data node that is restarting).
        self.slice_unavailable = 0
        self.model: dict[str, bytes] = {}
        self.rounds_completed = 0
        self.results: dict[int, bytes] = {}
        #: Rounds whose result is answered 410 (the parameter server pruned it).
        self.pruned: set[int] = set()
        self.result_added = asyncio.Event()
        self.update_statuses: list[int] = []
        #: When set to an event, an update PUT is recorded at once but answered only once the event is set
        #: (an update still in flight when the control plane gives a new address).
        self.hold_updates: asyncio.Event | None = None
        self.tokens: set[str] | None = None
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    def paths(self, method: str) -> list[str]:
        return [path for recorded, path, _, _ in self.requests if recorded == method]

    def add_result(self, round_number: int, data: bytes) -> None:
        self.results[round_number] = data
        self.result_added.set()

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 24)
        app.router.add_get("/datasets/{dataset}/slices/{index}", self._slice)
        app.router.add_get("/jobs/{job}/model/{filename}", self._model)
        app.router.add_put("/jobs/{job}/rounds/{round}/update", self._update)
        app.router.add_get("/jobs/{job}/rounds/{round}/result", self._result)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _record(self, request: web.Request) -> None:
        body = await request.read()
        self.requests.append((request.method, request.path_qs, dict(request.headers), body))

    async def _slice(self, request: web.Request) -> web.Response:
        await self._record(request)
        key = (request.match_info["dataset"], int(request.match_info["index"]))
        if self.slice_unavailable > 0:
            self.slice_unavailable -= 1
            return web.Response(status=503, text="restarting")
        if key not in self.slices:
            return web.Response(status=404)
        return web.Response(body=self.slices[key])

    async def _model(self, request: web.Request) -> web.Response:
        await self._record(request)
        data = self.model.get(request.match_info["filename"])
        if data is None:
            return web.json_response({"error": "not_found", "detail": "no such file"}, status=404)
        return web.Response(body=data, headers={"X-Round": str(self.rounds_completed)})

    async def _update(self, request: web.Request) -> web.Response:
        await self._record(request)
        if self.hold_updates is not None:
            await self.hold_updates.wait()
        status = self.update_statuses.pop(0) if self.update_statuses else 200
        if status == 200:
            return web.json_response({"round": int(request.match_info["round"]), "accepted": True})
        return web.json_response(
            {"error": "refused", "detail": f"status {status} for this test"}, status=status
        )

    async def _result(self, request: web.Request) -> web.Response:
        await self._record(request)
        if self.tokens is not None and request.headers.get("Authorization") not in {
            f"Bearer {token}" for token in self.tokens
        }:
            return web.json_response(
                {"error": "unauthorized", "detail": "transfer token expired"}, status=401
            )
        round_number = int(request.match_info["round"])
        if round_number in self.pruned:
            return web.json_response({"error": "round_pruned", "detail": "no longer kept"}, status=410)
        deadline = asyncio.get_running_loop().time() + float(request.query.get("wait", "0"))
        while round_number not in self.results:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return web.Response(status=204)
            self.result_added.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.result_added.wait(), remaining)
        return web.Response(body=self.results[round_number], headers={"X-Included": "true"})


@pytest.fixture
async def peer() -> AsyncIterator[FakePeer]:
    server = FakePeer()
    await server.start()
    yield server
    await server.stop()


class Answerer:
    """The control plane's side of a :class:`ControlLink`, in process: records every frame sent and answers
    ``status`` with ``status_reply`` (``{"type": "Continue"}`` unless ``status_replies`` has entries; an entry
    may carry the frame's ``continue_for`` under that key) and
    ``fetch_slice`` with the next of ``slice_answers`` (keyword arguments of ``SliceAssigned``); with
    ``silent`` it answers nothing."""

    def __init__(self, link: ControlLink) -> None:
        self.link = link
        self.sent: list[protocol.DaemonMessage] = []
        self.status_replies: list[dict[str, Any]] = []
        self.slice_answers: list[dict[str, Any]] = []
        self.silent = False

    def of_type(self, message_type: type[Any]) -> list[Any]:
        return [message for message in self.sent if isinstance(message, message_type)]

    async def send(self, message: protocol.DaemonMessage) -> None:
        self.sent.append(message)
        if self.silent:
            return
        loop = asyncio.get_running_loop()
        if isinstance(message, protocol.StatusReport):
            reply = dict(self.status_replies.pop(0) if self.status_replies else {"type": "Continue"})
            grant = reply.pop("continue_for", 0)
            loop.call_soon(
                self.link.resolve,
                protocol.StatusReply(request_id=message.request_id, reply=reply, continue_for=grant),
            )
        elif isinstance(message, protocol.FetchSlice):
            answer = self.slice_answers.pop(0) if self.slice_answers else {"retry_in": 0.05}
            loop.call_soon(
                self.link.resolve,
                protocol.SliceAssigned(request_id=message.request_id, dataset=message.dataset, **answer),
            )


@pytest.fixture
def link() -> ControlLink:
    return ControlLink()


@pytest.fixture
async def answerer(link: ControlLink) -> AsyncIterator[Answerer]:
    """An :class:`Answerer` already connected to ``link``."""
    answering = Answerer(link)
    link.connected(answering.send)
    yield answering
    link.disconnected()


def slice_answer(peer: FakePeer, dataset: str, index: int, *, sha256: str | None = None) -> dict[str, Any]:
    """What the control plane answers for ``peer``'s slice ``index`` (correct size and digest by default)."""
    data = peer.slices[(dataset, index)]
    return {
        "index": index,
        "size": len(data),
        "sha256": sha256 if sha256 is not None else hashlib.sha256(data).hexdigest(),
        "urls": [f"{peer.url}/datasets/{dataset}/slices/{index}"],
    }


@pytest.fixture
def answer_slice() -> Callable[..., dict[str, Any]]:
    return slice_answer


@pytest.fixture
def memory_spans(monkeypatch):
    """Tracing on for this test only: a private provider whose finished spans ``memory_spans()`` returns."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    monkeypatch.setattr(telemetry, "_tracer_provider", provider)
    yield memory.get_finished_spans
    provider.shutdown()
