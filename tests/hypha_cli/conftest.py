"""A fake control plane for the CLI's unit tests: an ``httpx.MockTransport`` answering like the REST API.

``api`` records every request and answers from ``routes``: ``(method, path) -> response or callable``. Tests
run the CLI in-process with ``hypha_cli.__main__.run(argv, environ=..., transport=api.transport)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

SERVER = "http://hypha.test"
TOKEN = "good-token"
JOB_ID = "8d6c3a59-9a5a-4d59-9e7e-0f5d7c3b1a10"
OTHER_JOB_ID = "1b1f4b8e-2c27-4d53-a3a0-6bd5a44f9e02"


def json_response(status: int, body: Any) -> httpx.Response:
    return httpx.Response(status, json=body)


def job(status: str = "running", *, rounds: list[dict] | None = None, reason: str = "", **extra: Any) -> dict:
    """A job detail as ``GET /api/jobs/<id>/`` sends it (the fields the CLI reads, and a few more)."""
    return {
        "id": JOB_ID,
        "name": "tiny",
        "owner": "alice",
        "status": status,
        "status_reason": reason,
        "num_trainers": 2,
        "spec": {"rounds": {"update_rounds": 2, "inner_steps": 5}},
        "leases": [],
        "created_at": "2025-01-02T03:04:05Z",
        "allocated_at": None,
        "ended_at": None,
        "tasks": [],
        "rounds": rounds or [],
        "data": {"epoch": 0, "available": 1, "assigned": 0, "used": 0, "total": 1},
        "model_files": {},
        "events": [],
        **extra,
    }


def closed_round(number: int, *, loss: float, eval_loss: float | None) -> dict:
    return {
        "number": number,
        "closed": True,
        "participants": ["w1", "w2"],
        "left_out": [],
        "refused": {},
        "samples": 160,
        "duration": 3.5,
        "bytes_in": 10,
        "bytes_out": 10,
        "mean_loss": loss,
        "eval_loss": eval_loss,
        "trainer_metrics": {},
        "created_at": "2025-01-02T03:04:05Z",
        "closed_at": "2025-01-02T03:04:09Z",
    }


Route = httpx.Response | Callable[[httpx.Request], httpx.Response] | list


@dataclass
class FakeApi:
    routes: dict[tuple[str, str], Route] = field(default_factory=dict)
    requests: list[httpx.Request] = field(default_factory=list)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.headers.get("Authorization") != f"Token {TOKEN}":
            return json_response(401, {"detail": "Invalid token."})
        route = self.routes.get((request.method, request.url.path))
        if route is None:
            return json_response(404, {"detail": "No Job matches the given query."})
        if isinstance(route, list):  # answers in turn; the last one repeats
            route = route.pop(0) if len(route) > 1 else route[0]
        return route(request) if callable(route) else route

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def bodies(self, method: str, path: str) -> list[Any]:
        return [json.loads(r.content) for r in self.requests if r.method == method and r.url.path == path]


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
def environ(tmp_path: Path) -> dict[str, str]:
    """An environment logged in to the fake server through a config file of its own."""
    config = tmp_path / "config" / "cli.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"server": SERVER, "token": TOKEN}))
    config.chmod(0o600)
    return {"HYPHA_CONFIG": str(config), "HOME": str(tmp_path)}


@pytest.fixture
def hypha(api: FakeApi, environ: dict[str, str]) -> Callable[..., int]:
    """``hypha("jobs", "--json")``: run the CLI in-process against ``api``; its exit code."""
    from hypha_cli.__main__ import run

    def invoke(*argv: str, env: dict[str, str] | None = None) -> int:
        return run(list(argv), environ=environ if env is None else env, transport=api.transport)

    return invoke
