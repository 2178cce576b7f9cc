"""Transfer benchmark: model download and update upload through our HTTP path against a raw loopback socket.

Per size (a GPT-2-shaped model built from a config, whose ``model.safetensors`` is about ``--sizes`` MB of
float32 tensors) it starts the real parameter server as a subprocess — ``python -m parameter_server`` with an
aggregate job, its transfer key and token in the environment, reporting ``ready`` through a real job bridge
(``worker_daemon.bridge.serve_bridge``) on a Unix socket, whose backend only answers ``Ok`` in place of the
control plane — and times, on loopback, with the worker daemon's own client
(``worker_daemon.bridge.remote.RemoteBackend``, one per trainer, each with its own transfer token):

* **download** — ``RemoteBackend.fetch(ParameterServerReference(filenames=["model.safetensors"]))``:
  ``GET /jobs/<job>/model/model.safetensors`` streamed into a file (1 MiB chunks, SHA-256, fsync, rename).
* **upload** — ``RemoteBackend.send(PeersReference(...))``: ``PUT /jobs/<job>/rounds/1/update`` of a
  safetensors pseudo-gradient with the model's names, shapes and dtypes (``X-Samples`` 1000). The time runs
  until the server's answer, so it includes what the server does before answering: the body into a
  temporary file, ``weights.load``, validation (names, shapes, dtypes, NaN/Inf) and ``StreamingMean.add``.
  Each upload comes from another expected trainer and is checked with ``GET /state`` (``send`` only logs a
  refusal); the job expects one trainer more than send, so the round never closes during the run.

Against **raw**: a Python process of this script on a loopback TCP socket, moving the same bytes from the same
files. Download: ``socket.sendfile`` of the model file to a receiver that writes 1 MiB ``recv_into`` chunks
to a file, fsyncs and renames it (as our client does). Upload: ``socket.sendfile`` of the update file to the
raw process, which writes it to a temporary file (no fsync, as the server) and answers one byte.

Repetitions are interleaved (ours and raw alternate which goes first) after one unmeasured warm-up of each;
medians are reported, MB = 10⁶ bytes. Goal: ours ÷ raw ≥ 0.5. The server's work after the body (load,
validate, add) is also timed once in this process, to tell it apart from the transfer.

Usage::

    python bench/transfers.py                     # 100 MB and 1 GB, 3 repetitions (about 2 minutes)
    python bench/transfers.py --sizes 100 --repeats 5

Results and how to read them: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/transfers.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

from bench.harness import load_average, machine_details  # noqa: E402
from tests.e2e.isolation import stop_with_parent  # noqa: E402

JOB_ID = "7c3e9a52-0b1d-4f6e-8a27-5d4c3b2a1f00"
PARAMETER_SERVER_PEER = "99999999-9999-4999-8999-999999999999"
TRANSFER_KEY = "bench-transfer-key"
CHUNK = 1 << 20
READY_DEADLINE = 600.0
SOCKET_TIMEOUT = 120.0
RATIO_GOAL = 0.5
WEIGHTS_FILENAME = "model.safetensors"

#: Approximate model.safetensors size in MB → GPT-2 config (float32: 4 bytes per parameter).
MODEL_CONFIGS: dict[int, dict[str, int]] = {
    100: {"n_layer": 4, "n_embd": 640, "vocab_size": 8192, "n_positions": 1024},  # 25.6 M parameters
    1000: {"n_layer": 12, "n_embd": 1280, "vocab_size": 8192, "n_positions": 1024},  # 248 M parameters
}

logger = logging.getLogger("bench.transfers")


def trainer_peer(index: int) -> str:
    return f"00000000-0000-4000-8000-{index:012d}"


def transfer_token(peer: str, role: str) -> str:
    from worker_daemon.protocol import sign_transfer_token

    claims = {"job": JOB_ID, "peer": peer, "role": role, "exp": int(time.time() + 3600)}
    return sign_transfer_token(TRANSFER_KEY, claims)


def aggregate_job(config: dict[str, int], trainers: list[str]) -> dict[str, Any]:
    reference = {"type": "peers", "peers": trainers, "strategy": {"type": "All"}, "resource": None}
    model_config = {"model_type": "gpt2", "n_head": 8, "bos_token_id": 0, "eos_token_id": 0, **config}
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
                # Many rounds and a long timeout: no round closes (and nothing is uploaded) during the run.
                "rounds": {"update_rounds": 1000, "round_timeout": 3600, "weighted": True},
                "eval": None,
            },
        },
    }


# --- the raw socket peer (a subprocess: `--raw-peer DIR`) ---------------------------------------------------------


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("connection closed early")
        data += chunk
    return bytes(data)


def _receive_into_file(connection: socket.socket, size: int, file: Any) -> None:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    remaining = size
    while remaining:
        received = connection.recv_into(view, min(CHUNK, remaining))
        if not received:
            raise ConnectionError(f"connection closed with {remaining} bytes to go")
        file.write(view[:received])
        remaining -= received


def raw_peer(directory: Path) -> int:
    """Serve raw uploads (``U`` + size + bytes → a temporary file, answer ``K``) and downloads (``D`` + path →
    size + ``sendfile``) one connection at a time, until killed. Prints the port first."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        connection, _ = listener.accept()
        with connection:
            connection.settimeout(SOCKET_TIMEOUT)
            operation = _receive_exactly(connection, 1)
            if operation == b"U":
                (size,) = struct.unpack(">Q", _receive_exactly(connection, 8))
                descriptor, name = tempfile.mkstemp(suffix=".partial", dir=directory)
                try:
                    with open(descriptor, "wb") as file:
                        _receive_into_file(connection, size, file)
                finally:
                    os.unlink(name)  # the server deletes its temporary file too, once parsed
                connection.sendall(b"K")
            elif operation == b"D":
                (length,) = struct.unpack(">H", _receive_exactly(connection, 2))
                path = _receive_exactly(connection, length).decode()
                with open(path, "rb") as file:
                    connection.sendall(struct.pack(">Q", os.fstat(file.fileno()).st_size))
                    connection.sendfile(file)


def raw_upload(port: int, path: Path) -> None:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT) as connection,
        path.open("rb") as file,
    ):
        connection.sendall(b"U" + struct.pack(">Q", os.fstat(file.fileno()).st_size))
        connection.sendfile(file)
        if _receive_exactly(connection, 1) != b"K":
            raise ConnectionError("the raw peer did not acknowledge the upload")


def raw_download(port: int, source: Path, target: Path) -> int:
    """Like the worker's download: into a file beside ``target``, fsynced, then renamed."""
    encoded = str(source).encode()
    partial = target.with_name(f".{target.name}.part")
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT) as connection:
        connection.sendall(b"D" + struct.pack(">H", len(encoded)) + encoded)
        (size,) = struct.unpack(">Q", _receive_exactly(connection, 8))
        with partial.open("wb") as file:
            _receive_into_file(connection, size, file)
            file.flush()
            os.fsync(file.fileno())
    os.replace(partial, target)
    return size


# --- the parameter server and its bridge ----------------------------------------------------------------------------


@dataclass
class ReadyBackend:
    """The bridge backend in place of the daemon's link to the control plane: records the parameter server's
    progress values (its ``ready`` URL) and answers ``Ok``. The parameter server does not fetch or send."""

    values: list[Any] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    url: str | None = None

    async def status(self, *, job_id: str | None, progress: Any) -> dict[str, Any]:
        self.values.append(progress)
        if isinstance(progress, dict) and isinstance(progress.get("ready"), dict):
            self.url = str(progress["ready"]["url"])
            self.ready.set()
        return {"type": "Ok"}

    async def fetch(self, **kwargs: Any) -> list[tuple[str, int]]:
        raise NotImplementedError("the parameter server fetches nothing through its bridge")

    async def send(self, **kwargs: Any) -> None:
        raise NotImplementedError("the parameter server sends nothing through its bridge")

    async def receive(self, **kwargs: Any):
        raise NotImplementedError("the parameter server receives nothing through its bridge")
        yield  # pragma: no cover


@contextlib.asynccontextmanager
async def parameter_server(root: Path, config: dict[str, int], trainers: list[str]):
    """A real ``python -m parameter_server`` for the job, ready; yields its URL. Always stopped on exit."""
    from worker_daemon.bridge import serve_bridge

    work_dir = root / "ps"
    work_dir.mkdir(parents=True)
    job_path = root / "job.json"
    job_path.write_text(json.dumps(aggregate_job(config, trainers)))
    backend = ReadyBackend()
    # A short socket path: AF_UNIX paths are limited to about 108 bytes.
    socket_dir = Path(tempfile.mkdtemp(prefix="bench-ps-"))
    bridge = await serve_bridge(
        socket_path=socket_dir / "bridge.sock", work_dir=work_dir, backend=backend, job_id=JOB_ID
    )
    log_path = root / "parameter-server.log"
    environment = {
        **os.environ,
        "HYPHA_TRANSFER_KEY": TRANSFER_KEY,
        "HYPHA_TRANSFER_TOKEN": transfer_token(PARAMETER_SERVER_PEER, "parameter_server"),
        # The final upload never happens (the job has 1000 rounds); nothing listens on the discard port.
        "HYPHA_SERVER_URL": "http://127.0.0.1:9",
        "PYTHONUNBUFFERED": "1",
    }
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "parameter_server", "--socket", str(bridge.socket_path),
             "--work-dir", str(work_dir), "--job", f"@{job_path}", "--host", "127.0.0.1", "--port", "0",
             "--log-level", "WARNING"],
            cwd=REPO_ROOT, env=environment, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=stop_with_parent,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + READY_DEADLINE
        while not backend.ready.is_set():
            if process.poll() is not None:
                raise RuntimeError(f"the parameter server exited {process.returncode}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the parameter server was not ready within {READY_DEADLINE:g}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(backend.ready.wait(), 0.2)
        assert backend.url is not None
        yield backend.url
        if process.poll() is not None:
            raise RuntimeError(f"the parameter server exited {process.returncode}:\n{_tail(log_path)}")
    except BaseException:
        print(f"--- parameter server log (tail) ---\n{_tail(log_path)}", file=sys.stderr)
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.to_thread(process.wait, 10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await asyncio.to_thread(process.wait, 10)
        await bridge.close()
        shutil.rmtree(socket_dir, ignore_errors=True)


def _tail(path: Path, characters: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-characters:]
    except OSError as error:
        return f"<cannot read {path}: {error}>"


# --- one size ----------------------------------------------------------------------------------------------------


def trainer_backend(url: str, peer: str, work_dir: Path):
    """The worker daemon's bridge backend for one trainer task (no control-plane link: fetching a model from
    the parameter server and sending an update do not use it)."""
    from worker_daemon.bridge.remote import RemoteBackend

    return RemoteBackend(
        task_id=uuid.uuid4(),
        job_id=JOB_ID,
        link=None,  # type: ignore[arg-type]
        work_dir=work_dir,
        peers={PARAMETER_SERVER_PEER: url},
        transfer_token=transfer_token(peer, "trainer"),
    )


def write_pseudo_gradient(model_path: Path, target: Path) -> int:
    """A valid update for ``model_path``: every floating-point tensor, same shape and dtype, small values."""
    import torch

    from hypha_tensors import weights as weights_io

    weights = weights_io.load(model_path)
    generator = torch.Generator().manual_seed(7)
    update = {
        name: (torch.randn(tensor.shape, generator=generator) * 1e-3).to(tensor.dtype)
        for name, tensor in weights.items()
        if tensor.dtype.is_floating_point
    }
    weights_io.save(target, update)
    return target.stat().st_size


def server_work_after_body(model_path: Path, update_path: Path) -> float:
    """Seconds the server spends on an update once its body is on disk: ``ParameterServerApp._parse_update``
    (load + validate) and ``StreamingMean.add`` (the first add of a round: it allocates the accumulator)."""
    from hypha_tensors import weights as weights_io
    from parameter_server.math import StreamingMean

    signature = {
        name: value
        for name, value in weights_io.signature(weights_io.load(model_path)).items()
        if value[1].is_floating_point
    }
    started = time.perf_counter()
    update = weights_io.load(update_path)
    weights_io.validate(update, reference=signature)
    StreamingMean().add(update, 1000.0)
    return time.perf_counter() - started


async def received_peers(url: str, peer: str) -> list[str]:
    import aiohttp

    headers = {"Authorization": f"Bearer {transfer_token(peer, 'trainer')}"}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.get(f"{url}/jobs/{JOB_ID}/state", headers=headers) as response,
    ):
        response.raise_for_status()
        return list((await response.json())["received"])


async def measure_size(size_mb: int, repeats: int, root: Path, raw_port: int) -> dict[str, Any]:
    from worker_daemon.bridge.references import ParameterServerReference, PeersReference, SelectionStrategy

    # One trainer per upload (the warm-up's too), plus one that never sends: the round stays open.
    trainers = [trainer_peer(index) for index in range(repeats + 2)]
    client_dir = root / "client"
    client_dir.mkdir(parents=True)
    model_reference = ParameterServerReference(peer=PARAMETER_SERVER_PEER, filenames=[WEIGHTS_FILENAME])
    update_reference = PeersReference(peers=[PARAMETER_SERVER_PEER], strategy=SelectionStrategy(type="All"))
    timings: dict[tuple[str, str], list[float]] = {
        (direction, path): [] for direction in ("download", "upload") for path in ("ours", "raw")
    }

    started = time.monotonic()
    async with parameter_server(root, MODEL_CONFIGS[size_mb], trainers) as url:
        startup = time.monotonic() - started
        print(f"  parameter server ready at {url} after {startup:.1f}s", file=sys.stderr, flush=True)
        model_path = client_dir / "reference" / WEIGHTS_FILENAME
        reference_backend = trainer_backend(url, trainers[0], client_dir)
        try:
            [(_, model_bytes)] = await reference_backend.fetch(
                reference=model_reference, artifacts_dir=model_path.parent
            )
        finally:
            await reference_backend.close()
        update_path = client_dir / "update.safetensors"
        update_bytes = await asyncio.to_thread(write_pseudo_gradient, model_path, update_path)
        server_work = statistics.median(
            [await asyncio.to_thread(server_work_after_body, model_path, update_path) for _ in range(3)]
        )

        async def ours_download(index: int) -> float:
            backend = trainer_backend(url, trainers[index], client_dir)
            artifacts = client_dir / f"download-{index}"
            try:
                begin = time.perf_counter()
                [(_, size)] = await backend.fetch(reference=model_reference, artifacts_dir=artifacts)
                elapsed = time.perf_counter() - begin
            finally:
                await backend.close()
            if size != model_bytes:
                raise RuntimeError(f"downloaded {size} bytes, expected {model_bytes}")
            shutil.rmtree(artifacts)
            return elapsed

        async def raw_download_timed(index: int) -> float:
            target = client_dir / f"raw-{index}.safetensors"
            begin = time.perf_counter()
            size = await asyncio.to_thread(raw_download, raw_port, model_path, target)
            elapsed = time.perf_counter() - begin
            if size != model_bytes:
                raise RuntimeError(f"raw download of {size} bytes, expected {model_bytes}")
            target.unlink()
            return elapsed

        async def ours_upload(index: int) -> float:
            peer = trainers[index]
            backend = trainer_backend(url, peer, client_dir)
            backend.samples = 1000  # what the executor's status reports would have summed: X-Samples
            try:
                begin = time.perf_counter()
                await backend.send(reference=update_reference, path=update_path)
                elapsed = time.perf_counter() - begin
            finally:
                await backend.close()
            if peer not in await received_peers(url, peer):
                raise RuntimeError(f"the parameter server did not accept {peer}'s update (see its log)")
            return elapsed

        async def raw_upload_timed(index: int) -> float:
            begin = time.perf_counter()
            await asyncio.to_thread(raw_upload, raw_port, update_path)
            return time.perf_counter() - begin

        runners = {
            ("download", "ours"): ours_download,
            ("download", "raw"): raw_download_timed,
            ("upload", "ours"): ours_upload,
            ("upload", "raw"): raw_upload_timed,
        }
        for index in range(repeats + 1):  # index 0: the warm-up, not measured
            for direction in ("download", "upload"):
                order = ("ours", "raw") if index % 2 == 0 else ("raw", "ours")
                for path in order:
                    elapsed = await runners[direction, path](index)
                    if index > 0:
                        timings[direction, path].append(elapsed)
            print(f"  repetition {index or 'warm-up'} done", file=sys.stderr, flush=True)
    return {
        "model_bytes": model_bytes,
        "update_bytes": update_bytes,
        "startup": startup,
        "server_work": server_work,
        "timings": timings,
    }


# --- report ------------------------------------------------------------------------------------------------------


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python bench/transfers.py",
        description=__doc__.split("\n\n")[0],
        epilog="Prints the machine and a markdown table; exits 1 if a transfer fails or an update is not "
        "accepted. See docs/benchmarks.md for results.",
    )
    parser.add_argument(
        "--sizes",
        default="100,1000",
        help=f"comma-separated model sizes in MB among {', '.join(map(str, MODEL_CONFIGS))} (default: both)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="measured repetitions per direction and path (default: 3)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directory (logs, files)")
    parser.add_argument("--raw-peer", metavar="DIR", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.raw_peer:
        return arguments
    try:
        arguments.size_list = [int(value) for value in arguments.sizes.split(",") if value.strip()]
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {arguments.sizes!r}")
    unknown = [size for size in arguments.size_list if size not in MODEL_CONFIGS]
    if unknown or not arguments.size_list:
        parser.error(f"--sizes must be among {', '.join(map(str, MODEL_CONFIGS))}")
    if arguments.repeats < 1:
        parser.error("--repeats must be >= 1")
    return arguments


def _mb_per_second(size: int, seconds: list[float]) -> float:
    return size / statistics.median(seconds) / 1e6


async def run(arguments: argparse.Namespace, root: Path) -> list[tuple[int, dict[str, Any]]]:
    raw_dir = root / "raw-peer"
    raw_dir.mkdir(parents=True)
    raw = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--raw-peer", str(raw_dir)],
        cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=stop_with_parent,
    )  # fmt: skip
    try:
        assert raw.stdout is not None
        raw_port = int(await asyncio.to_thread(raw.stdout.readline))
        results = []
        for size_mb in arguments.size_list:
            print(f"… {size_mb} MB", file=sys.stderr, flush=True)
            results.append(
                (size_mb, await measure_size(size_mb, arguments.repeats, root / f"{size_mb}mb", raw_port))
            )
        return results
    finally:
        raw.kill()
        raw.wait(10)


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    if arguments.raw_peer:
        return raw_peer(Path(arguments.raw_peer))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    print(f"# Transfer benchmark — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n")
    for key, value in machine_details().items():
        print(f"- {key}: {value}")
    print(f"- load average (1/5/15 min) at start: {load_average()}")
    print(
        f"- loopback; {arguments.repeats} interleaved repetitions per direction after a warm-up, medians; "
        "MB = 10⁶ bytes",
        flush=True,
    )
    root = Path(tempfile.mkdtemp(prefix="hypha-bench-transfers-"))
    try:
        results = asyncio.run(run(arguments, root))
    except (RuntimeError, OSError, ValueError) as error:
        print(f"\nfailed: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # the worker's client raises ConnectorError for a failed transfer
        print(f"\nfailed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    finally:
        if arguments.keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)

    print(f"- load average at the end: {load_average()}\n")
    print("| size | direction | ours MB/s | raw MB/s | ours ÷ raw | ≥ 0.5 | ours s | raw s |")
    print("|---|---|---:|---:|---:|:---:|---:|---:|")
    below_goal = 0
    for _, result in results:
        for direction, size in (("download", result["model_bytes"]), ("upload", result["update_bytes"])):
            ours = result["timings"][direction, "ours"]
            raw = result["timings"][direction, "raw"]
            ratio = _mb_per_second(size, ours) / _mb_per_second(size, raw)
            below_goal += ratio < RATIO_GOAL
            print(
                f"| {size / 1e6:,.0f} MB | {direction} | {_mb_per_second(size, ours):,.0f} "
                f"| {_mb_per_second(size, raw):,.0f} | {ratio:.2f} | {'yes' if ratio >= RATIO_GOAL else 'no'} "
                f"| {statistics.median(ours):.2f} | {statistics.median(raw):.2f} |"
            )
    print()
    for size_mb, result in results:
        upload = statistics.median(result["timings"]["upload", "ours"])
        print(
            f"- {size_mb} MB model: parameter server ready {result['startup']:.1f}s after start; of the upload's "
            f"{upload:.2f}s, {result['server_work']:.2f}s is the server's load + validate + add after the body "
            "(timed separately in this process, median of 3)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
