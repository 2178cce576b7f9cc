"""Checkpoint upload benchmark: the bytes a parameter server uploads to the control plane per round, before
the round can be published (docs/training.md, "A parameter server lost").

The real parameter server (``parameter_server.service.run``, in this process) runs ``--rounds`` rounds of one
trainer's random pseudo-gradients for each encoding of ``--encodings``, with ``rounds.checkpoint_every`` =
``--every`` (K). A small aiohttp server stands in for the control plane's checkpoint endpoint and records every
``PUT /api/jobs/<job>/checkpoint/<round>/<file>`` body's size. Measured per round:

* **before** — what the full copy of every round uploaded: θ_r, m_r, u_r and round.json. Measured, not
  computed: the sizes of the server's own local checkpoint of each round, which keeps all of them (the same
  files the scheme before this one uploaded).
* **after** — what was uploaded: m_r, u_r and round.json between bases, and θ_r too at a base round (every K).

The last columns scale the per-round means to a ``--scale-mb`` MB (float32) model on a ``--uplink`` Mbit/s
uplink: the seconds of upload before each round can be published. Results: docs/benchmarks.md.

Usage::

    python bench/checkpoint_uploads.py                       # float32 and int8, K = 10, 10 rounds
    python bench/checkpoint_uploads.py --every 5 --rounds 10 --encodings float32,bfloat16,int8
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/checkpoint_uploads.py`
    sys.path.insert(0, str(REPO_ROOT))

JOB_ID = "5b0f1f0e-2f7c-4a43-9b8e-3a1c2d4e5f60"
TRAINER = "11111111-1111-4111-8111-111111111111"
SERVER = "99999999-9999-4999-8999-999999999999"
KEY = "checkpoint-benchmark-key"


class Backend:
    """The bridge's control plane: every report is answered Ok; the ``ready`` report's URL is kept."""

    def __init__(self) -> None:
        self.ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def status(self, *, job_id: str | None, progress: Any) -> dict[str, Any]:
        if isinstance(progress, dict) and "ready" in progress and not self.ready.done():
            self.ready.set_result(progress["ready"]["url"])
        return {"type": "Ok"}


def model_config(layers: int, width: int, vocab: int) -> dict[str, Any]:
    return {
        "model_type": "gpt2",
        "n_layer": layers,
        "n_embd": width,
        "n_head": 4,
        "vocab_size": vocab,
        "n_positions": 128,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }


async def one_encoding(encoding: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import aiohttp
    import torch
    from aiohttp import web

    from hypha_tensors import weights as weights_io
    from parameter_server.job import parse_job
    from parameter_server.service import Settings, run
    from worker_daemon.bridge import serve_bridge
    from worker_daemon.protocol import sign_transfer_token

    uploads: dict[int, dict[str, int]] = {}

    async def put_checkpoint(request: web.Request) -> web.Response:
        body = await request.read()
        uploads.setdefault(int(request.match_info["round"]), {})[request.match_info["filename"]] = len(body)
        return web.json_response({"name": request.match_info["filename"]}, status=201)

    async def put_model(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({}, status=201)

    app = web.Application(client_max_size=1 << 34)
    app.router.add_put("/api/jobs/{job}/checkpoint/{round}/{filename}", put_checkpoint)
    app.router.add_put("/api/jobs/{job}/model/{filename}", put_model)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    receiver = f"http://127.0.0.1:{runner.addresses[0][1]}"

    work = root / encoding
    work.mkdir()
    backend = Backend()
    bridge = await serve_bridge(
        socket_path=work / "bridge.sock", work_dir=work, backend=backend, job_id=JOB_ID
    )
    reference = {"type": "peers", "peers": [TRAINER], "strategy": {"type": "All"}, "resource": None}
    rounds_json: dict[str, Any] = {
        "update_rounds": args.rounds,
        "round_timeout": 600.0,
        "checkpoint_every": args.every,
    }
    if encoding != "float32":
        rounds_json["encoding"] = encoding
    job = parse_job(
        {
            "job_id": JOB_ID,
            "executor": {
                "class": "aggregate",
                "config": {
                    "updates": reference,
                    "results": reference,
                    "optimizer": {"learning-rate": 0.7, "momentum": 0.9},
                    "model": {
                        "task": "causal-lm",
                        "source": {
                            "type": "config",
                            "config": model_config(args.layers, args.width, args.vocab),
                        },
                        "seed": 0,
                    },
                    "rounds": rounds_json,
                },
            },
        }
    )
    expires = int(time.time() + 3600)

    def token(peer: str, role: str) -> str:
        return sign_transfer_token(KEY, {"job": JOB_ID, "peer": peer, "role": role, "exp": expires})

    settings = Settings(
        work_dir=work / "server",
        socket_path=work / "bridge.sock",
        host="127.0.0.1",
        port=0,
        public_url=None,
        transfer_key=KEY,
        transfer_token=token(SERVER, "parameter_server"),
        server_url=receiver,
        final_wait=1.0,
    )
    before: dict[int, int] = {}
    stop = asyncio.Event()
    service = asyncio.create_task(run(job, settings, stop))
    try:
        url = await asyncio.wait_for(backend.ready, 600)
        headers = {"Authorization": f"Bearer {token(TRAINER, 'trainer')}"}
        checkpoints = work / "server" / "checkpoints"
        before[0] = _round_bytes(checkpoints / "round-000000000")
        generator = torch.Generator().manual_seed(0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            async with session.get(
                f"{url}/jobs/{JOB_ID}/model/model.safetensors", headers=headers
            ) as response:
                model_path = work / "theta.safetensors"
                model_path.write_bytes(await response.read())
            theta = weights_io.load(model_path)
            floating = {name: tensor for name, tensor in theta.items() if tensor.dtype.is_floating_point}
            for number in range(1, args.rounds + 1):
                delta = {
                    name: torch.randn(t.shape, generator=generator) * 1e-3 for name, t in floating.items()
                }
                body_path = work / "update.safetensors"
                encoded, metadata = _wire(encoding, delta)
                weights_io.save(body_path, encoded, metadata=metadata)
                async with session.put(
                    f"{url}/jobs/{JOB_ID}/rounds/{number}/update",
                    data=body_path.read_bytes(),
                    headers={**headers, "X-Samples": "8"},
                ) as response:
                    assert response.status == 200, await response.text()
                async with session.get(
                    f"{url}/jobs/{JOB_ID}/rounds/{number}/result?wait=600", headers=headers
                ) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                before[number] = _round_bytes(checkpoints / f"round-{number:09d}")
        await asyncio.wait_for(service, 120)
    finally:
        stop.set()
        if not service.done():
            service.cancel()
        await bridge.close()
        await runner.cleanup()
    model_bytes = (work / "server" / "checkpoints").glob("round-*/weights.safetensors")
    theta_bytes = max(path.stat().st_size for path in model_bytes)
    return {
        "encoding": encoding,
        "theta": theta_bytes,
        "before": before,
        "after": {n: sum(f.values()) for n, f in uploads.items()},
        "files": uploads,
    }


def _wire(encoding: str, delta: dict) -> tuple[dict, dict[str, str]]:
    """``delta`` as a trainer sends it in ``encoding``: the wire tensors and the header metadata."""
    from hypha_tensors.encoding import encode
    from hypha_tensors.formats import Encoding

    chosen = Encoding(encoding)
    return encode(delta, chosen), chosen.metadata() if chosen.lossy else {}


def _round_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir() if path.is_file())


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The table: bytes per round before and after, and seconds at ``--uplink`` for a ``--scale-mb`` model."""
    lines = [
        f"K = {args.every}, rounds 1..{args.rounds} (round 0, the initial model, uploads θ both ways); "
        f"{args.scale_mb} MB model at {args.uplink} Mbit/s",
        "",
        "| encoding | θ (bytes) | before: θ+m+u per round | after: m+u between bases | after: base round "
        f"| after: mean over rounds 1..{args.rounds} | saved | before → after at {args.uplink} Mbit/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        rounds = range(1, args.rounds + 1)
        before = sum(result["before"][n] for n in rounds) / len(rounds)
        after = sum(result["after"][n] for n in rounds) / len(rounds)
        between = [result["after"][n] for n in rounds if "weights.safetensors" not in result["files"][n]]
        bases = [result["after"][n] for n in rounds if "weights.safetensors" in result["files"][n]]
        scale = args.scale_mb * 1e6 / result["theta"]

        def seconds(size: float, scale: float = scale) -> str:
            return f"{size * scale * 8 / (args.uplink * 1e6):.0f} s"

        lines.append(
            f"| {result['encoding']} | {result['theta']:,} | {before:,.0f} | "
            f"{(sum(between) / len(between)) if between else float('nan'):,.0f} | "
            f"{(sum(bases) / len(bases)) if bases else float('nan'):,.0f} | {after:,.0f} | "
            f"{1 - after / before:.0%} | {seconds(before)} → {seconds(after)} (between bases "
            f"{seconds(sum(between) / len(between)) if between else '-'}) |"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="hypha-checkpoint-bench-") as root:
        results = [await one_encoding(name, args, Path(root)) for name in args.encodings.split(",")]
    for result in results:
        per_round = {n: sorted(files) for n, files in sorted(result["files"].items())}
        print(f"{result['encoding']}: files uploaded per round: {per_round}")
    print(report(results, args))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--encodings", default="float32,int8")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--every", type=int, default=10, help="rounds.checkpoint_every (K)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--scale-mb", type=float, default=500.0, help="the model size the seconds are for")
    parser.add_argument("--uplink", type=float, default=50.0, help="Mbit/s")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
