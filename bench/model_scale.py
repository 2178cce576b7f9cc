"""Model scale benchmark: the parameter server's peak memory and round phases for bigger models (issue 17).

Per size (a GPT-2-shaped model built from a config: about 10 M, 50 M and 124 M parameters, the last GPT-2
small's own shape) it starts the real parameter server as a subprocess — ``python -m parameter_server`` with an
aggregate job of ``--rounds`` rounds, its transfer key and token in the environment, reporting through a real
job bridge (``worker_daemon.bridge.serve_bridge``) whose backend answers ``Ok`` in place of the control plane —
and a small aiohttp server in this process standing in for the control plane's checkpoint and final-model
endpoints (it reads and drops every body: the server uploads its checkpoint of each round before publishing it,
as it does against the real control plane).

**The trainers are simulated**: ``--trainers`` HTTP clients, each with its own valid trainer transfer token,
download the model (``GET /jobs/<job>/model/model.safetensors``) and then, every round, all upload at once a real
safetensors pseudo-gradient with the model's names, shapes and dtypes (``PUT /jobs/<job>/rounds/<r>/update``,
``X-Samples`` 1000, the body streamed from a file) and fetch the round's result
(``GET /jobs/<job>/rounds/<r>/result?wait=…``, streamed to nothing). No training runs: on 2 shared cores a real
124 M-parameter trainer would take minutes a step; the server sees what it sees from real trainers.

Measured per round, on this machine's clock (the server's log lines carry its wall-clock time, ms):

* **receive** — the first upload's start → the last upload's answer (bodies in, checked, added).
* **aggregate** — the last upload's answer → the server's ``round N: the global weights' digest`` log line: the
  outer step (mean, Nesterov, θ + u), the local checkpoint, its upload to the stand-in control plane and the new
  global and result files.
* **publish** — that line → the last trainer's result download done.

**Peak RSS**: ``VmHWM`` of the server process (``/proc/<pid>/status``) after the last round, before it is
stopped; also its RSS when it said ready (the model built, nothing received). Goal (issue 17): peak RSS ≤
4 × the model's float32 size + 300 MB.

Usage::

    python bench/model_scale.py                              # 10M, 50M, 124M; 2 trainers, 3 rounds
    python bench/model_scale.py --sizes 10M,50M --trainers 4 --rounds 2

Results and how to read them: docs/benchmarks.md ("Model scale").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/model_scale.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

from bench.harness import load_average, machine_details  # noqa: E402
from bench.transfers import _tail, trainer_peer, write_pseudo_gradient  # noqa: E402
from tests.e2e.isolation import stop_with_parent  # noqa: E402

JOB_ID = "3f6b2d0e-7a41-4c55-9e3d-1b2a3c4d5e6f"
PARAMETER_SERVER_PEER = "99999999-9999-4999-8999-999999999999"
TRANSFER_KEY = "bench-model-scale-key"
WEIGHTS_FILENAME = "model.safetensors"
READY_DEADLINE = 900.0
ROUND_DEADLINE = 900.0
CHUNK = 1 << 20
MB = 1_000_000
#: The goal: peak RSS ≤ GOAL_FACTOR × the model's float32 bytes + GOAL_EXTRA bytes.
GOAL_FACTOR = 4
GOAL_EXTRA = 300 * MB

#: name → GPT-2 config (n_layer, n_embd, n_head, vocab_size, n_positions); 124M is GPT-2 small itself.
SIZES: dict[str, dict[str, int]] = {
    "10M": {"n_layer": 4, "n_embd": 384, "n_head": 6, "vocab_size": 8192, "n_positions": 512},
    "50M": {"n_layer": 8, "n_embd": 640, "n_head": 10, "vocab_size": 16384, "n_positions": 1024},
    "124M": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024},
}
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*round (\d+): the global weights' digest")


def transfer_token(peer: str, role: str) -> str:
    from worker_daemon.protocol import sign_transfer_token

    claims = {"job": JOB_ID, "peer": peer, "role": role, "exp": int(time.time() + 7200)}
    return sign_transfer_token(TRANSFER_KEY, claims)


def aggregate_job(config: dict[str, int], trainers: list[str], rounds: int) -> dict[str, Any]:
    reference = {"type": "peers", "peers": trainers, "strategy": {"type": "All"}, "resource": None}
    model_config = {"model_type": "gpt2", "bos_token_id": 0, "eos_token_id": 0, **config}
    return {
        "job_id": JOB_ID,
        "executor": {
            "class": "aggregate",
            "descriptor": {"name": "parameter-server"},
            "config": {
                "updates": reference,
                "results": reference,
                "optimizer": {"learning-rate": 0.7, "momentum": 0.9},
                "model": {
                    "task": "causal-lm",
                    "source": {"type": "config", "config": model_config},
                    "input-names": ["input_ids", "labels"],
                    "seed": 1234,
                },
                "rounds": {"update_rounds": rounds, "round_timeout": ROUND_DEADLINE, "weighted": True},
                "eval": None,
            },
        },
    }


def proc_status_bytes(pid: int, field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of a process, in bytes (0 when it is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


async def sample_rss(pid: int, samples: list[tuple[float, int]], interval: float = 0.05) -> None:
    """``VmRSS`` of ``pid`` every ``interval`` s, with wall-clock stamps: which phase the peak falls in."""
    while True:
        samples.append((time.time(), proc_status_bytes(pid, "VmRSS")))
        await asyncio.sleep(interval)


def parameter_count(model_path: Path) -> int:
    from hypha_tensors import weights as weights_io

    return sum(t.numel() for t in weights_io.load(model_path).values() if t.dtype.is_floating_point)


class Backend:
    """The bridge's control plane: answers Ok; keeps the ``ready`` URL and the round reports."""

    def __init__(self) -> None:
        self.ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.rounds: dict[int, dict[str, Any]] = {}

    async def status(self, *, job_id: str | None, progress: Any) -> dict[str, Any]:
        if isinstance(progress, dict):
            if "ready" in progress and not self.ready.done():
                self.ready.set_result(str(progress["ready"]["url"]))
            if isinstance(progress.get("round"), dict):
                self.rounds[int(progress["round"]["round"])] = progress["round"]
        return {"type": "Ok"}


@contextlib.asynccontextmanager
async def stand_in_control_plane():
    """Accepts the server's checkpoint and final-model uploads, reading each body in chunks and dropping it."""
    from aiohttp import web

    received = {"bytes": 0}

    async def drain(request: web.Request) -> web.Response:
        try:
            async for chunk in request.content.iter_chunked(CHUNK):
                received["bytes"] += len(chunk)
        except ConnectionResetError:  # the final model's upload, cut short when the server is stopped
            return web.Response(status=499)
        return web.json_response({"name": request.match_info["filename"]}, status=201)

    app = web.Application(client_max_size=1 << 36)
    app.router.add_put("/api/jobs/{job}/checkpoint/{round}/{filename}", drain)
    app.router.add_put("/api/jobs/{job}/model/{filename}", drain)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", received
    finally:
        await runner.cleanup()


async def measure_size(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import aiohttp

    from worker_daemon.bridge import serve_bridge

    trainers = [trainer_peer(index) for index in range(args.trainers)]
    work = root / name
    work.mkdir()
    job_path = work / "job.json"
    job_path.write_text(json.dumps(aggregate_job(SIZES[name], trainers, args.rounds)))
    backend = Backend()
    socket_dir = Path(tempfile.mkdtemp(prefix="bench-scale-"))  # AF_UNIX paths are short
    bridge = await serve_bridge(
        socket_path=socket_dir / "bridge.sock", work_dir=work, backend=backend, job_id=JOB_ID
    )
    log_path = work / "parameter-server.log"
    result: dict[str, Any] = {"size": name, "trainers": args.trainers, "rounds": []}
    async with stand_in_control_plane() as (control_plane_url, uploaded):
        environment = {
            **os.environ,
            "HYPHA_TRANSFER_KEY": TRANSFER_KEY,
            "HYPHA_TRANSFER_TOKEN": transfer_token(PARAMETER_SERVER_PEER, "parameter_server"),
            "HYPHA_SERVER_URL": control_plane_url,
            "PYTHONUNBUFFERED": "1",
        }
        started = time.monotonic()
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "parameter_server", "--socket", str(bridge.socket_path),
                 "--work-dir", str(work / "ps"), "--job", f"@{job_path}", "--host", "127.0.0.1",
                 "--port", "0", "--log-level", "INFO"],
                cwd=REPO_ROOT, env=environment, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=stop_with_parent,
            )  # fmt: skip
        try:
            url = await _wait_ready(backend, process, log_path)
            result["startup_s"] = time.monotonic() - started
            result["ready_rss"] = proc_status_bytes(process.pid, "VmRSS")
            samples: list[tuple[float, int]] = []
            sampler = asyncio.create_task(sample_rss(process.pid, samples))
            timeout = aiohttp.ClientTimeout(total=ROUND_DEADLINE)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                model_path = work / "client" / WEIGHTS_FILENAME
                model_path.parent.mkdir()
                headers = {"Authorization": f"Bearer {transfer_token(trainers[0], 'trainer')}"}
                async with session.get(
                    f"{url}/jobs/{JOB_ID}/model/{WEIGHTS_FILENAME}", headers=headers
                ) as got:
                    got.raise_for_status()
                    with model_path.open("wb") as handle:
                        async for chunk in got.content.iter_chunked(CHUNK):
                            handle.write(chunk)
                result["model_bytes"] = model_path.stat().st_size
                result["parameters"] = await asyncio.to_thread(parameter_count, model_path)
                update_path = work / "client" / "update.safetensors"
                result["update_bytes"] = await asyncio.to_thread(
                    write_pseudo_gradient, model_path, update_path
                )
                model_path.unlink()
                for number in range(1, args.rounds + 1):
                    result["rounds"].append(await one_round(session, url, trainers, number, update_path))
                    print(f"  {name}: round {number} done", file=sys.stderr, flush=True)
            result["peak_rss"] = proc_status_bytes(process.pid, "VmHWM")
            sampler.cancel()
            if process.poll() is not None:
                raise RuntimeError(f"the parameter server exited {process.returncode}:\n{_tail(log_path)}")
        except BaseException:
            print(f"--- parameter server log (tail) ---\n{_tail(log_path)}", file=sys.stderr)
            raise
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(process.wait, 20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await asyncio.to_thread(process.wait, 10)
            await bridge.close()
            shutil.rmtree(socket_dir, ignore_errors=True)
        result["checkpoint_bytes_uploaded"] = uploaded["bytes"]
    digests = _digest_times(log_path)
    for entry in result["rounds"]:
        stamp = digests.get(entry["round"])
        if stamp is None:
            entry["aggregate_s"] = entry["publish_s"] = None
            continue
        entry["aggregate_s"] = stamp - entry["last_upload_answered"]
        entry["publish_s"] = entry["last_result_done"] - stamp
        phases = {
            "receive": (entry["first_upload"], entry["last_upload_answered"]),
            "aggregate": (entry["last_upload_answered"], stamp),
            "publish": (stamp, entry["last_result_done"]),
        }
        for phase, (begin, end) in phases.items():
            inside = [rss for when, rss in samples if begin <= when <= end]
            entry[f"{phase}_max_rss"] = max(inside, default=None)
    result["reports"] = backend.rounds
    return result


async def _wait_ready(backend: Backend, process: subprocess.Popen, log_path: Path) -> str:
    deadline = time.monotonic() + READY_DEADLINE
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the parameter server exited {process.returncode}:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the parameter server was not ready within {READY_DEADLINE:g}s")
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(backend.ready), 0.5)


async def one_round(session, url: str, trainers: list[str], number: int, update_path: Path) -> dict[str, Any]:
    """Every trainer uploads its update at once, then fetches the round's result; wall-clock stamps."""

    async def upload(peer: str) -> float:
        headers = {
            "Authorization": f"Bearer {transfer_token(peer, 'trainer')}",
            "X-Samples": "1000",
            "Content-Type": "application/octet-stream",
            "Content-Length": str(update_path.stat().st_size),
        }
        with update_path.open("rb") as body:
            async with session.put(
                f"{url}/jobs/{JOB_ID}/rounds/{number}/update", data=body, headers=headers
            ) as response:
                if response.status != 200:
                    raise RuntimeError(f"{peer}'s update refused: {response.status} {await response.text()}")
                await response.read()
        return time.time()

    async def fetch_result(peer: str) -> float:
        headers = {"Authorization": f"Bearer {transfer_token(peer, 'trainer')}"}
        async with session.get(
            f"{url}/jobs/{JOB_ID}/rounds/{number}/result?wait={ROUND_DEADLINE:g}", headers=headers
        ) as response:
            if response.status != 200:
                raise RuntimeError(f"round {number}'s result for {peer}: {response.status}")
            async for _ in response.content.iter_chunked(CHUNK):
                pass
        return time.time()

    first = time.time()
    fetches = [asyncio.create_task(fetch_result(peer)) for peer in trainers]
    answered = await asyncio.gather(*(upload(peer) for peer in trainers))
    done = await asyncio.gather(*fetches)
    last_answer = max(answered)
    return {
        "round": number,
        "receive_s": last_answer - first,
        "first_upload": first,
        "last_upload_answered": last_answer,
        "last_result_done": max(done),
    }


def _digest_times(log_path: Path) -> dict[int, float]:
    found = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if match := LOG_TIME.match(line):
            stamp = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f")
            found[int(match[2])] = stamp.timestamp()  # logging's asctime is local time, as is this
    return found


def goal_bytes(model_bytes: int) -> int:
    return GOAL_FACTOR * model_bytes + GOAL_EXTRA


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def median(entries: list[dict[str, Any]], key: str) -> str:
        values = [entry[key] for entry in entries if entry.get(key) is not None]
        return f"{statistics.median(values):.2f}" if values else "-"

    lines = [
        f"Trainers: {args.trainers} simulated HTTP clients (real safetensors updates, no training); "
        f"{args.rounds} rounds; medians over the rounds after the first (all rounds if only one)",
        "",
        "| size | parameters | model (float32) | ready RSS | peak RSS (VmHWM) | goal (4 × model + 300 MB) | "
        "peak ÷ goal | peak ÷ model | (peak − ready) ÷ model | receive (s) | aggregate (s) | publish (s) | round 1: receive / "
        "aggregate / publish (s) | load (1/5/15) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        steady = result["rounds"][1:] or result["rounds"]
        first = result["rounds"][0]
        goal = goal_bytes(result["model_bytes"])

        def seconds(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"

        lines.append(
            f"| {result['size']} | {result['parameters'] / 1e6:.1f} M | {result['model_bytes'] / MB:.0f} MB | "
            f"{result['ready_rss'] / MB:.0f} MB | {result['peak_rss'] / MB:.0f} MB | {goal / MB:.0f} MB | "
            f"**{result['peak_rss'] / goal:.2f}** | {result['peak_rss'] / result['model_bytes']:.2f} | "
            f"{(result['peak_rss'] - result['ready_rss']) / result['model_bytes']:.2f} | "
            f"{median(steady, 'receive_s')} | {median(steady, 'aggregate_s')} | {median(steady, 'publish_s')} | "
            f"{seconds(first['receive_s'])} / {seconds(first['aggregate_s'])} / {seconds(first['publish_s'])} | "
            f"{result['load']} |"
        )
    lines += [
        "",
        "Highest sampled RSS (every 50 ms) per phase, over all rounds, ÷ the model's size:",
        "",
        "| size | ready | receive | aggregate | publish | VmHWM |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        model = result["model_bytes"]

        def phase(name: str, result: dict[str, Any] = result, model: int = model) -> str:
            values = [entry.get(f"{name}_max_rss") for entry in result["rounds"]]
            values = [value for value in values if value]
            return f"{max(values) / MB:.0f} MB ({max(values) / model:.1f}×)" if values else "-"

        lines.append(
            f"| {result['size']} | {result['ready_rss'] / MB:.0f} MB ({result['ready_rss'] / model:.1f}×) | "
            f"{phase('receive')} | {phase('aggregate')} | {phase('publish')} | "
            f"{result['peak_rss'] / MB:.0f} MB ({result['peak_rss'] / model:.1f}×) |"
        )
    return "\n".join(lines)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10M,50M,124M", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--trainers", type=int, default=2, help="simulated trainers (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per size (default 3)")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    arguments = parser.parse_args(argv)
    arguments.sizes = [size.strip() for size in arguments.sizes.split(",") if size.strip()]
    unknown = [size for size in arguments.sizes if size not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}: choose from {', '.join(SIZES)}")
    if arguments.trainers < 1 or arguments.rounds < 1:
        parser.error("--trainers and --rounds must be at least 1")
    return arguments


async def run(arguments: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    root = Path(tempfile.mkdtemp(prefix="bench-model-scale-"))
    try:
        for name in arguments.sizes:
            print(f"size {name}: starting the parameter server", file=sys.stderr, flush=True)
            try:
                result = await measure_size(name, arguments, root)
            except Exception as error:  # the other sizes still run; the report leaves this one out
                print(f"size {name} failed: {error}", file=sys.stderr, flush=True)
                continue
            result["load"] = load_average()
            results.append(result)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    print("Machine: " + ", ".join(f"{key} {value}" for key, value in machine_details().items()))
    print(f"Load average at start: {load_average()}")
    print(f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", flush=True)
    results = asyncio.run(run(arguments))
    print(report(results, arguments))
    print(f"Load average at end: {load_average()}")
    if arguments.json is not None:
        arguments.json.write_text(json.dumps(results, indent=2, default=str))
    missed = [r["size"] for r in results if r["peak_rss"] > goal_bytes(r["model_bytes"])]
    print("Goal (peak RSS ≤ 4 × model + 300 MB): " + (f"missed for {', '.join(missed)}" if missed else "met"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
