"""An executor written for Hypha's bridge, talking to ours unchanged.

The client below does what Hypha's Python executor does: httpx over the Unix socket with URL host
``hypha``, no timeouts, ``raise_for_status()`` on every call, every fetch/status reply parsed as JSON, and
``data:`` lines of the receive stream parsed with or without a space after the colon.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx

from worker_daemon.bridge import BridgeServer

from .conftest import RecordingBackend

JOB = {
    "job_id": "5b0f1f0e-2f7c-4a43-9b8e-3a1c2d4e5f60",
    "executor": {
        "class": "train",
        "descriptor": {"name": "diloco-transformer"},
        "config": {
            "model": {
                "task": "image-classification",
                "artifact": {
                    "type": "huggingface",
                    "repository": "hypha-space/lenet",
                    "revision": None,
                    "filenames": ["config.json", "model.safetensors"],
                    "token": None,
                },
                "input-names": ["pixel_values", "labels"],
            },
            "data": {"type": "scheduler", "peer": "12D3KooWSched", "dataset": "mnist"},
            "updates": {
                "type": "peers",
                "peers": ["12D3KooWPs"],
                "strategy": {"type": "All"},
                "resource": None,
            },
            "results": {
                "type": "peers",
                "peers": ["12D3KooWPs"],
                "strategy": {"type": "All"},
                "resource": None,
            },
            "optimizer": {"learning-rate": 0.001, "betas": None, "epsilon": None},
            "batch_size": 2,
        },
    },
}


def parse_data_line(line: str) -> Any | None:
    """What the executor does with one SSE line: JSON after ``data:`` (space optional), else ignore."""
    if not line.startswith("data:"):
        return None
    return json.loads(line[len("data:") :].lstrip())


class HyphaExecutorClient:
    def __init__(self, *, socket_path: str, work_dir: str) -> None:
        self.work_dir = work_dir
        self.http = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path), timeout=None)

    async def fetch(self, reference: dict) -> list[str]:
        response = await self.http.post("http://hypha/resources/fetch", json=reference)
        response.raise_for_status()
        return [os.path.join(self.work_dir, item["path"]) for item in response.json()]

    async def send(self, reference: dict, path: str) -> None:
        response = await self.http.post(
            "http://hypha/resources/send", json={"resource": reference, "path": path}
        )
        response.raise_for_status()

    async def status(self, progress: Any) -> dict:
        response = await self.http.post("http://hypha/status/send", json=progress)
        response.raise_for_status()
        return response.json()

    async def receive_one(self, reference: dict) -> dict:
        async with self.http.stream(
            "POST", "http://hypha/resources/receive", json={"resource": reference, "path": "incoming"}
        ) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                pointer = parse_data_line(line)
                if isinstance(pointer, list):
                    pointer = pointer[-1]
                if pointer is not None:
                    return pointer
        raise AssertionError("stream ended without an event")


async def test_a_round_of_the_hypha_executor(
    bridge: BridgeServer, backend: RecordingBackend, work_dir: Path
) -> None:
    # given
    job_json = json.dumps(JOB, separators=(",", ":"))  # what {JOB_JSON} expands to
    config = json.loads(job_json)["executor"]["config"]
    executor = HyphaExecutorClient(socket_path=str(bridge.socket_path), work_dir=str(work_dir))
    backend.status_replies += [{"type": "Continue"}, {"type": "ScheduleUpdate", "counter": 0}, {"type": "Ok"}]
    backend.status_replies += [{"type": "Ok"}, {"type": "Done"}]
    backend.release_send.set()
    try:
        # when: fetch the model and one slice
        model_files = await executor.fetch(config["model"]["artifact"])
        slice_files = await executor.fetch(config["data"])
        # the SSE subscription is held open on its own connection while other calls go on
        receiving = asyncio.create_task(executor.receive_one(config["results"]))
        replies = [await executor.status({"status": {"batch_size": 2, "round_time": 0.1}}) for _ in range(2)]
        (work_dir / "delta.safetensors").write_bytes(b"pseudo-gradient")
        replies.append(await executor.status("update"))
        await executor.send(config["updates"], "delta.safetensors")
        replies.append(await executor.status({"metrics": {"round": 0, "metrics": {"loss": 1.5}}}))
        await asyncio.sleep(0.1)
        await backend.incoming.put(("12D3KooWPs", b"merged", "12D3KooWPs"))
        pointer = await asyncio.wait_for(receiving, 3)
        replies.append(await executor.status("update-received"))
    finally:
        await executor.http.aclose()
    # then
    assert model_files == [f"{work_dir}/artifacts/config.json", f"{work_dir}/artifacts/model.safetensors"]
    assert slice_files == [f"{work_dir}/artifacts/17"]
    assert Path(slice_files[0]).read_bytes() == b"content of 17"
    assert replies == [
        {"type": "Continue"},
        {"type": "ScheduleUpdate", "counter": 0},
        {"type": "Ok"},
        {"type": "Ok"},
        {"type": "Done"},
    ]
    assert pointer == {"path": "incoming/12D3KooWPs", "size": 6, "from_peer": "12D3KooWPs"}
    assert Path(os.path.join(work_dir, pointer["path"])).read_bytes() == b"merged"
    await asyncio.wait_for(backend.send_finished.wait(), 2)
    # the receive subscription races the first statuses, so compare without its position
    assert sorted(name for name, _ in backend.calls) == ["fetch"] * 2 + ["receive", "send"] + ["status"] * 5
    assert [arguments["progress"] for name, arguments in backend.calls if name == "status"] == [
        {"status": {"batch_size": 2, "round_time": 0.1}},
        {"status": {"batch_size": 2, "round_time": 0.1}},
        "update",
        {"metrics": {"round": 0, "metrics": {"loss": 1.5}}},
        "update-received",
    ]


def test_data_lines_parse_with_or_without_a_space() -> None:
    assert parse_data_line('data: {"path":"a"}') == {"path": "a"}
    assert parse_data_line('data:{"path":"a"}') == {"path": "a"}
    assert parse_data_line(": keepalive") is None
