"""Run as a process of its own (tests/parameter_server/test_update_memory.py): a real parameter-server HTTP API
in this process receives two update bodies at once over loopback; prints one JSON line with the model's bytes
and this process's RSS before and at its peak (``VmHWM``, reset first through ``/proc/self/clear_refs``)."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import tempfile
from pathlib import Path

import aiohttp
import torch

from hypha_tensors import weights as weights_io
from parameter_server import memory
from parameter_server.rounds import RoundCoordinator
from parameter_server.server import GlobalModelFiles, ParameterServerApp, start_http, stop_http
from tests.parameter_server.conftest import ALICE, BOB, CAROL, JOB_ID, auth

TENSORS = 16
ELEMENTS = 1 << 20  # 4 MiB of float32 each: the model is 64 MiB


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def settle() -> None:
    gc.collect()
    memory.release()


async def main(directory: Path) -> dict[str, int]:
    memory.configure_allocator()  # as ``python -m parameter_server`` does

    def weights() -> dict[str, torch.Tensor]:
        return {f"layer{index:02d}.weight": torch.zeros(ELEMENTS) for index in range(TENSORS)}

    files_dir = directory / "model"
    files_dir.mkdir()
    weights_path = directory / "global.safetensors"
    weights_io.save(weights_path, weights())
    bodies = []
    for index in range(2):
        generator = torch.Generator().manual_seed(index)
        update = {name: torch.randn(ELEMENTS, generator=generator) * 1e-3 for name in weights()}
        bodies.append(directory / f"update-{index}.safetensors")
        weights_io.save(bodies[-1], update)
        del update
    coordinator = RoundCoordinator(
        expected=[ALICE, BOB, CAROL],  # the round stays open: receiving alone is measured
        weights=weights(),
        momentum=None,
        rounds_completed=0,
        update_rounds=1,
        round_timeout=600.0,
        weighted=True,
        learning_rate=0.7,
        momentum_factor=0.9,
    )
    app = ParameterServerApp(
        job_id=JOB_ID,
        transfer_key="job-key-for-tests",
        coordinator=coordinator,
        files=GlobalModelFiles(files_dir=files_dir, weights_path=weights_path, rounds_completed=0),
        signature=weights_io.signature(weights()),
        incoming_dir=directory / "incoming",
    )
    runner, port = await start_http(app.make_app(), host="127.0.0.1", port=0)
    url = f"http://127.0.0.1:{port}/jobs/{JOB_ID}/rounds/1/update"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

            async def send(peer: str, body: Path) -> int:
                with body.open("rb") as file:
                    headers = {**auth(peer), "X-Samples": "1", "Content-Length": str(body.stat().st_size)}
                    async with session.put(url, data=file, headers=headers) as response:
                        await response.read()
                        return response.status

            settle()
            before = status("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here on
            statuses = await asyncio.gather(send(ALICE, bodies[0]), send(BOB, bodies[1]))
            peak = status("VmHWM")
    finally:
        await stop_http(runner)
        await coordinator.aclose()
    if statuses != [200, 200]:
        raise SystemExit(f"updates answered {statuses}")
    return {"model_bytes": TENSORS * ELEMENTS * 4, "before": before, "peak": peak}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as temporary:
        print(json.dumps(asyncio.run(main(Path(temporary)))))
