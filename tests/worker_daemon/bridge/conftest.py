"""Fixtures for the bridge's tests: a recording backend that writes real files, and a running bridge.

``RecordingBackend`` stands for the daemon's future backend (control plane and parameter-server
transfers), which does not exist yet: it records every call and writes real files where a real one would.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from worker_daemon.bridge import BridgeServer, serve_bridge

JOB_ID = "5b0f1f0e-2f7c-4a43-9b8e-3a1c2d4e5f60"
KEEPALIVE = 0.2


class RecordingBackend:
    """Records calls; ``fail_with`` makes fetch/status raise; ``send`` waits for ``release_send``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail_with: BaseException | None = None
        self.status_replies: list[Any] = []
        self.status_delay = 0.0
        self.release_send = asyncio.Event()
        self.send_finished = asyncio.Event()
        self.send_error: BaseException | None = None
        self.incoming: asyncio.Queue[tuple[str, bytes, str] | None] = asyncio.Queue()
        self.receive_cancelled = asyncio.Event()

    async def fetch(self, *, reference: Any, artifacts_dir: Path) -> list[tuple[str, int]]:
        self.calls.append(("fetch", {"reference": reference, "artifacts_dir": artifacts_dir}))
        if self.fail_with is not None:
            raise self.fail_with
        if reference.type == "huggingface":
            names = list(reference.filenames)
        elif reference.type == "uri":
            names = [reference.value.rsplit("/", 1)[-1]]
        else:
            names = ["17"]
        written = []
        for name in names:
            path = artifacts_dir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            data = f"content of {name}".encode()
            path.write_bytes(data)
            written.append((name, len(data)))
        return written

    async def send(self, *, reference: Any, path: Path) -> None:
        self.calls.append(("send", {"reference": reference, "path": path}))
        await self.release_send.wait()
        if self.send_error is not None:
            raise self.send_error
        self.send_finished.set()

    async def receive(self, *, reference: Any, directory: Path) -> AsyncIterator[tuple[str, int, str]]:
        self.calls.append(("receive", {"reference": reference, "directory": directory}))
        try:
            while (item := await self.incoming.get()) is not None:
                name, data, peer = item
                (directory / name).write_bytes(data)
                yield name, len(data), peer
        except asyncio.CancelledError:
            self.receive_cancelled.set()
            raise

    async def status(self, *, job_id: str | None, progress: Any) -> Any:
        self.calls.append(("status", {"job_id": job_id, "progress": progress}))
        if self.status_delay:
            await asyncio.sleep(self.status_delay)
        if self.fail_with is not None:
            raise self.fail_with
        return self.status_replies.pop(0) if self.status_replies else {"type": "Continue"}


@pytest.fixture
def backend() -> RecordingBackend:
    return RecordingBackend()


@pytest.fixture
def work_dir(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


@pytest.fixture
def socket_path(work_dir: Path) -> Path:
    path = work_dir / "bridge.sock"
    if len(str(path)) < 100:
        return path
    # AF_UNIX paths are limited to ~108 bytes; long test names make tmp_path longer than that.
    return Path(tempfile.mkdtemp(prefix="hb-")) / "bridge.sock"


@pytest.fixture
async def bridge(socket_path: Path, work_dir: Path, backend: RecordingBackend) -> AsyncIterator[BridgeServer]:
    server = await serve_bridge(
        socket_path=socket_path,
        work_dir=work_dir,
        backend=backend,
        job_id=JOB_ID,
        keepalive_interval=KEEPALIVE,
        status_timeout=1.0,
    )
    yield server
    await server.close()


@pytest.fixture
async def client(bridge: BridgeServer) -> AsyncIterator[aiohttp.ClientSession]:
    """An aiohttp session over the bridge's socket; use URLs like ``http://hypha/status/send``."""
    connector = aiohttp.UnixConnector(path=str(bridge.socket_path))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=5)) as session:
        yield session
