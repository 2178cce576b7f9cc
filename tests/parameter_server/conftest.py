"""Fixtures of the parameter server's service tests: tokens, a real bridge with a recording backend, jobs.

``StatusBackend`` stands for the daemon's bridge backend (which forwards to the control plane): it records
every progress value the parameter server reports and answers from ``replies`` (``{"type": "Ok"}`` when empty).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from worker_daemon.bridge import BridgeServer, serve_bridge
from worker_daemon.protocol import sign_transfer_token

JOB_ID = "5b0f1f0e-2f7c-4a43-9b8e-3a1c2d4e5f60"
OTHER_JOB_ID = "00000000-0000-4000-8000-000000000000"
TRANSFER_KEY = "job-key-for-tests"
ALICE = "11111111-1111-4111-8111-111111111111"
BOB = "22222222-2222-4222-8222-222222222222"
CAROL = "33333333-3333-4333-8333-333333333333"
PS_PEER = "99999999-9999-4999-8999-999999999999"

TINY_GPT2 = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": 256,
    "n_positions": 64,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def token(
    peer: str, *, role: str = "trainer", job: str = JOB_ID, key: str = TRANSFER_KEY, ttl: float = 86_400
) -> str:
    # A day: tokens built when the tests are collected (parametrize) must outlive the whole test run.
    return sign_transfer_token(key, {"job": job, "peer": peer, "role": role, "exp": int(time.time() + ttl)})


def auth(peer: str, **kwargs: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {token(peer, **kwargs)}"}


def aggregate_job(
    *,
    peers: list[str],
    update_rounds: int = 2,
    round_timeout: float = 30.0,
    weighted: bool = True,
    learning_rate: float = 0.5,
    momentum: float = 0.5,
    source: dict[str, Any] | None = None,
    eval_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    reference = {"type": "peers", "peers": peers, "strategy": {"type": "All"}, "resource": None}
    return {
        "job_id": JOB_ID,
        "executor": {
            "class": "aggregate",
            "descriptor": {"name": "parameter-server"},
            "config": {
                "updates": reference,
                "results": reference,
                "optimizer": {"learning-rate": learning_rate, "momentum": momentum},
                "model": {
                    "task": "causal-lm",
                    "source": source or {"type": "config", "config": dict(TINY_GPT2)},
                    "input-names": ["input_ids", "labels"],
                    "seed": 1234,
                },
                "rounds": {
                    "update_rounds": update_rounds,
                    "round_timeout": round_timeout,
                    "weighted": weighted,
                },
                "eval": eval_config,
            },
        },
    }


class StatusBackend:
    """Records status values; answers from ``replies`` (a list, first in first out) or ``{"type": "Ok"}``, and
    a round's ``{"waiting": …}`` question from ``expect`` (``{"type": "Ok"}``, i.e. no answer, when None)."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.replies: list[dict[str, Any]] = []
        self.expect: dict[str, Any] | None = None
        self.arrived = asyncio.Event()

    async def status(self, *, job_id: str | None, progress: Any) -> dict[str, Any]:
        self.values.append(progress)
        self.arrived.set()
        if isinstance(progress, dict) and "waiting" in progress:
            return self.expect or {"type": "Ok"}
        return self.replies.pop(0) if self.replies else {"type": "Ok"}

    async def wait_for(self, key: str, count: int = 1, timeout: float = 20.0) -> list[Any]:
        """The values reported under ``key`` once there are ``count`` of them."""
        async with asyncio.timeout(timeout):
            while True:
                found = [value[key] for value in self.values if isinstance(value, dict) and key in value]
                if len(found) >= count:
                    return found
                self.arrived.clear()
                await self.arrived.wait()

    async def fetch(self, **kwargs: Any) -> list[tuple[str, int]]:
        raise NotImplementedError

    async def send(self, **kwargs: Any) -> None:
        raise NotImplementedError

    async def receive(self, **kwargs: Any) -> AsyncIterator[tuple[str, int, str]]:
        raise NotImplementedError
        yield  # pragma: no cover


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # AF_UNIX paths are limited to ~108 bytes; pytest's tmp_path for long test names is longer than that.
    path = Path(tempfile.mkdtemp(prefix="ps-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def status_backend() -> StatusBackend:
    return StatusBackend()


@pytest.fixture
async def bridge(short_tmp: Path, status_backend: StatusBackend) -> AsyncIterator[BridgeServer]:
    server = await serve_bridge(
        socket_path=short_tmp / "bridge.sock", work_dir=short_tmp, backend=status_backend, job_id=JOB_ID
    )
    yield server
    await server.close()


@dataclass
class Receiver:
    """The control plane's model and checkpoint endpoints and a data node's slice endpoint, on one local
    port. ``checkpoints`` keeps what was uploaded per round; ``saved`` is the last round completed by its
    ``round.json``; ``copy`` is what the control plane keeps of them (apps/jobs/training/checkpoints.py: the
    base round's weights, the results since as ``result-<n>.safetensors``, the last momentum and manifest),
    which ``GET …/checkpoint/<filename>`` serves."""

    url: str = ""
    uploads: dict[str, bytes] = field(default_factory=dict)
    authorizations: list[str] = field(default_factory=list)
    failures: int = 0
    slices: dict[int, bytes] = field(default_factory=dict)
    checkpoints: dict[int, dict[str, bytes]] = field(default_factory=dict)
    saved: int | None = None
    copy: dict[str, bytes] = field(default_factory=dict)

    async def put_model(self, request: web.Request) -> web.Response:
        self.authorizations.append(request.headers.get("Authorization", ""))
        if self.failures:
            self.failures -= 1
            return web.Response(status=503, text="try later")
        assert request.match_info["job"] == JOB_ID
        self.uploads[request.match_info["filename"]] = await request.read()
        return web.json_response({"stored": True})

    async def put_checkpoint(self, request: web.Request) -> web.Response:
        assert request.match_info["job"] == JOB_ID
        number, filename = int(request.match_info["round"]), request.match_info["filename"]
        self.checkpoints.setdefault(number, {})[filename] = await request.read()
        if filename == "round.json":
            self.saved = number
            uploaded = self.checkpoints[number]
            base = json.loads(uploaded["round.json"]).get("base_round", number)
            kept = {f"result-{n}.safetensors" for n in range(base + 1, number)} | {"weights.safetensors"}
            self.copy = {name: data for name, data in self.copy.items() if name in kept}
            for name, data in uploaded.items():
                self.copy[f"result-{number}.safetensors" if name == "result.safetensors" else name] = data
            if base < number:
                assert "weights.safetensors" not in uploaded and "weights.safetensors" in self.copy
        return web.json_response({"name": filename}, status=201)

    async def get_checkpoint(self, request: web.Request) -> web.Response:
        self.authorizations.append(request.headers.get("Authorization", ""))
        if request.match_info["filename"] not in self.copy:
            return web.json_response({"detail": "no such file"}, status=404)
        return web.Response(body=self.copy[request.match_info["filename"]])

    def resume_entry(self) -> dict:
        """The job JSON's ``checkpoint`` naming the saved round, as the control plane sends it."""
        files = self.copy
        return {
            "round": self.saved,
            "uri": f"/api/jobs/{JOB_ID}/checkpoint/",
            "files": {
                name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                for name, data in files.items()
            },
        }

    async def get_slice(self, request: web.Request) -> web.Response:
        return web.Response(body=self.slices[int(request.match_info["index"])])


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    state = Receiver()
    app = web.Application()
    app.router.add_put("/api/jobs/{job}/model/{filename}", state.put_model)
    app.router.add_put("/api/jobs/{job}/checkpoint/{round}/{filename}", state.put_checkpoint)
    app.router.add_get("/api/jobs/{job}/checkpoint/{filename}", state.get_checkpoint)
    app.router.add_get("/datasets/{dataset}/slices/{index}", state.get_slice)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield state
    await runner.cleanup()
