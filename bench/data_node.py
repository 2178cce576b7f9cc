"""Data node benchmark: slices served per second and MB/s, our data node vs nginx, with the clients trainers are.

For each slice size (``--sizes``, default ``100k:400 4m:200``: 400 slices of 100 KiB, which measures the
request rate, and 200 slices of 4 MiB, which measures bandwidth) the benchmark prepares a byte-level text
dataset from the Python standard library's sources with ``hypha-data prepare-text`` (sequences of 128 tokens,
so every slice holds ``input_ids`` and ``labels`` of equal size and all slices of a dataset are the same
size), then starts these servers over the same files on loopback:

* **our data node** — ``python -m data_node`` as its CLI runs it. It serves slices only to requests carrying
  a slice token signed with the download key its control plane answers the registration with, so the
  benchmark answers ``POST /api/datasets/register/`` itself (a stdlib HTTP server on a loopback port, with a
  fixed key) and every request of both servers carries the slice's token (``?token=…``, signed once before
  the runs; nginx ignores it): the data node's numbers include verifying it. Ready when a slice answers 200
  (after it has hashed every slice and registered).
* **the data node as it was** (``data node, streamed``), for slices under its inline limit (1 MiB) only: the
  same node with ``--inline-limit 0``, which answers every slice with aiohttp's ``FileResponse`` (two
  thread-pool hops per slice) as every slice was answered before small slices were read into the answer.
* **nginx** from Debian (``apt-get install -y nginx-light``), with a private configuration in the run's temp
  directory (``nginx -c CONF -p PREFIX -e ERROR_LOG``): ``daemon off``, ``master_process on``,
  ``worker_processes auto``, ``sendfile on``, no access log, and locations that map the same URLs
  (``/datasets/<name>/slices/<index>``, index without padding) onto the zero-padded slice files with ``alias``.
  A ``map`` adds the slice's ``X-Sha256`` header, so both servers send the same headers.

Before measuring, a sample of slices (first, last and a few between) is fetched from every server and checked:
status 200, ``Content-Length``, the body's SHA-256 and ``X-Sha256``; and a batch of the data node's is split
and checked the same way. Then, per client pattern, ``--rounds`` times, interleaved (ours, nginx, ours, nginx,
…, after one unmeasured warm-up run each), client processes download slices round-robin for ``--seconds``,
starting at evenly spaced slices. A client process is ``http.client`` on keep-alive connections reading each
whole body with ``readinto`` into a preallocated buffer (no per-slice allocation) and checking its status and
length (and a batch's frame lines). The patterns:

* ``4 × http.client``: ``--clients`` processes (default 4), one ``GET`` at a time each: an older bridge, or a
  downloader that fetches one slice after another.
* ``4 trainers, prefetch P`` (``--prefetch``, default 2, 3 and 9), slices under 1 MiB only: what
  ``--clients`` trainers' bridges send when the data node is what they wait for. A bridge keeps ``P`` slices
  prefetched and tops up once one is left, claiming ``K = P - 1`` slices and fetching them in one request (a
  ``GET`` when ``K`` is 1, else a batch ``POST``). With the bridge's default, prefetch 2, that is a ``GET``
  after every hand-out, and two in flight per trainer while it waits for data; with more places, one batch
  of ``P - 1`` in flight (the slice left is in the cache already). A trainer is as many client processes as
  it has requests in flight, each on its own connection (its bridge is asynchronous; one process
  interleaving two blocking connections cost nginx 20 %).
  nginx has no batches (a bridge falls back to ``GET`` there): it gets the same connections, one slice per
  request.

Throughput is Σ over clients of slices (or bytes) ÷ the client's own elapsed time; the tables show the median
round, the per-round spread, and CPU time as % of one core — the server's (all its processes, from ``/proc``)
and the clients' (their process time) — so a client that is the bottleneck shows up: on a 2-core machine
clients and server share the cores. The ratio column is ours ÷ nginx of the medians in the same pattern; the
goal is ≥ 0.8× with the trainers' pattern at the bridge's default prefetch. With ``wrk`` installed (Debian
package ``wrk``) the one-``GET``-at-a-time rounds are repeated with ``wrk -c CLIENTS`` and a Lua script
cycling the same paths, a C client that costs far less CPU per request — for slices under 1 MiB only: wrk
reads 8 KiB per ``read`` call, so with MiB-sized bodies wrk itself is the bottleneck (4 MiB slices: both
servers stuck at ≈ 600 MB/s under wrk, while ``http.client`` got 1400–2000 MB/s out of nginx). ``--no-wrk``
skips it. MB = 10^6 bytes.

Usage::

    python bench/data_node.py                                  # 100 KiB × 400 and 4 MiB × 200, 3 rounds × 5 s
    python bench/data_node.py --sizes 100k:400 --prefetch 2 4 8 16 --rounds 5
    python bench/data_node.py --no-wrk --keep                  # keep the temp dir (datasets, server logs)

Exit codes: 0 measured (whether or not the goal was met; the report says), 1 a server failed to start or
answered wrongly, 2 bad command line or nginx is not installed, 130 interrupted. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import http.server
import json
import multiprocessing
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Run as `python bench/data_node.py`, bench/ comes first on the path and this file would shadow the data_node
# package: put the repo root first instead.
sys.path[:] = [
    str(REPO_ROOT),
    *(entry for entry in sys.path if Path(entry or ".").resolve() != REPO_ROOT / "bench"),
]

from bench.harness import BIN_DIR, Child, load_average, print_start, run_directory  # noqa: E402
from bench.nginx_slices import NGINX_INSTALL_HELP, find_nginx, nginx_config, nginx_version  # noqa: E402
from data_node import tokens  # noqa: E402
from data_node.slices import sha256_of, slice_file_name  # noqa: E402
from tests.e2e.isolation import free_port, stop_with_parent  # noqa: E402

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

GOAL_RATIO = 0.8
SEQ_LEN = 128
BYTES_PER_SAMPLE = SEQ_LEN * 8 * 2  # input_ids and labels, int64 each
STARTUP_DEADLINE = 120.0  # the data node hashes every slice before it listens
STOP_GRACE = 5.0
REQUEST_TIMEOUT = 30.0
SAMPLE_CHECKS = 8
MB = 1_000_000
WRK_MAX_SLICE = 1 << 20  # see the module docstring: above this wrk, not the server, sets the pace
INLINE_LIMIT = 1 << 20  # the data node's default --inline-limit: larger slices are streamed and never batched
BATCH_CONTENT_TYPE = "application/x-hypha-slices"
DOWNLOAD_KEY = "bench-download-key-" + "0" * 45  # what the benchmark's "control plane" gives the data node


# Command line -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SizeSpec:
    label: str
    samples_per_slice: int
    slices: int


def size_spec(text: str) -> SizeSpec:
    """``100k:400`` → 400 slices of about 100 KiB (``k`` KiB, ``m`` MiB, or bytes), rounded to whole samples."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmM]?):(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not SIZE:COUNT, e.g. 100k:400 or 4m:200")
    number, unit, count = float(match.group(1)), match.group(2).lower(), int(match.group(3))
    target = number * {"": 1, "k": 1024, "m": 1024 * 1024}[unit]
    samples = max(1, round(target / BYTES_PER_SAMPLE))
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: COUNT must be at least 1")
    return SizeSpec(label=f"{match.group(1)}{unit}", samples_per_slice=samples, slices=count)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python bench/data_node.py",
        description=__doc__.split("\n\n")[0],
        epilog="Prints the machine and markdown tables; exit codes: 0 measured, 1 a server failed, "
        "2 bad command line or no nginx, 130 interrupted. See docs/benchmarks.md.",
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=size_spec,
        default=[size_spec("100k:400"), size_spec("4m:200")],
        metavar="SIZE:COUNT",
        help="datasets to serve: slice size (k = KiB, m = MiB) and slice count (default: 100k:400 4m:200)",
    )
    parser.add_argument(
        "--clients", type=int, default=4, help="concurrent clients, and trainers (default: 4)"
    )
    parser.add_argument(
        "--prefetch",
        nargs="+",
        type=int,
        default=[2, 3, 9],
        metavar="P",
        help="trainers' prefetch depths to measure, slices under 1 MiB (default: 2, the bridge's, 3 and 9)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per server (default: 3)")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one run (default: 5)")
    parser.add_argument(
        "--warmup", type=float, default=1.0, help="unmeasured run per server before the rounds (default: 1 s)"
    )
    parser.add_argument("--no-wrk", action="store_true", help="skip the wrk rounds even if wrk is installed")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory and print its path")
    arguments = parser.parse_args(argv)
    if arguments.clients < 1 or arguments.rounds < 1 or arguments.seconds <= 0:
        parser.error("--clients and --rounds must be at least 1, --seconds positive")
    if any(depth < 1 or depth > 128 for depth in arguments.prefetch):
        parser.error("--prefetch depths must be 1 to 128")
    return arguments


# Datasets -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    name: str
    directory: Path
    slice_size: int
    digests: list[str]

    def path(self, index: int) -> str:
        return f"/datasets/{self.name}/slices/{index}"

    def request_path(self, index: int) -> str:
        """:meth:`path` with the slice's download token, as the control plane hands slice URLs out."""
        return f"{self.path(index)}?token={self.token(index)}"

    def token(self, index: int) -> str:
        return tokens.sign(
            DOWNLOAD_KEY,
            dataset=self.name,
            index=index,
            job="bench",
            peer="bench",
            expires=int(time.time()) + 86400,
        )

    def batch(self, first: int, size: int) -> tuple[bytes, bytes]:
        """A batch request for ``size`` slices from ``first`` on (round-robin), each with its own token, as a
        bridge sends it; and the frame lines its answer must hold, in order, joined."""
        indices = [(first + offset) % self.count for offset in range(size)]
        body = json.dumps({"slices": [{"index": index, "token": self.token(index)} for index in indices]})
        lines = b"".join(f"{index} {self.slice_size} {self.digests[index]}\n".encode() for index in indices)
        return body.encode(), lines

    @property
    def batch_path(self) -> str:
        return f"/datasets/{self.name}/slices"

    @property
    def count(self) -> int:
        return len(self.digests)


def stdlib_text(size: int) -> Iterator[bytes]:
    """``size`` bytes of the standard library's ``*.py`` sources in sorted path order, repeated if need be."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    left = size
    while left > 0:
        for path in sources:
            with contextlib.suppress(OSError):
                data = path.read_bytes()[:left]
                left -= len(data)
                yield data
            if left <= 0:
                return


def prepare_dataset(root: Path, spec: SizeSpec) -> Dataset:
    """``spec.slices`` full slices (the input holds exactly that many sequences) via ``hypha-data prepare-text``."""
    name = f"bench-{spec.label}"
    source = root / f"{name}.txt"
    with source.open("wb") as file:
        for chunk in stdlib_text(spec.slices * spec.samples_per_slice * SEQ_LEN):
            file.write(chunk)
    directory = root / name
    done = subprocess.run(
        [
            str(BIN_DIR / "hypha-data"), "prepare-text", "--input", str(source), "--output", str(directory),
            "--seq-len", str(SEQ_LEN), "--samples-per-slice", str(spec.samples_per_slice),
        ],
        capture_output=True, text=True,
    )  # fmt: skip
    source.unlink()
    if done.returncode != 0:
        raise BenchmarkFailed(f"hypha-data prepare-text exited {done.returncode}:\n{done.stderr}")
    files = [directory / slice_file_name(index) for index in range(spec.slices)]
    sizes = {file.stat().st_size for file in files}
    if len(sizes) != 1:
        raise BenchmarkFailed(f"{directory}: expected {spec.slices} slices of one size, got sizes {sizes}")
    return Dataset(
        name=name, directory=directory, slice_size=sizes.pop(), digests=[sha256_of(file) for file in files]
    )


# Servers ------------------------------------------------------------------------------------------------------


class BenchmarkFailed(Exception):
    """A server did not start or answered wrongly: the numbers would mean nothing."""


@dataclass
class Server:
    name: str
    port: int
    child: Child
    #: Whether it answers batch requests (our data node); others get one GET per slice.
    batches: bool = False

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server's processes (the process and its children, e.g. nginx workers)."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in [self.child.popen.pid, *_children_of(self.child.popen.pid)]:
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / ticks


def _children_of(parent: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    children.append(int(entry.name))
    return children


@contextlib.contextmanager
def running(name: str, argv: list[str], *, log: Path, port: int, ready_path: str) -> Iterator[Server]:
    """``argv`` as a child in its own session; yielded once ``ready_path`` answers 200, always stopped."""
    with log.open("ab") as output:
        popen = subprocess.Popen(
            argv, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=stop_with_parent,
        )  # fmt: skip
    child = Child(name=name, popen=popen, log=log)
    try:
        deadline = time.monotonic() + STARTUP_DEADLINE
        while True:
            if popen.poll() is not None:
                raise BenchmarkFailed(f"{name} exited with {popen.returncode}:\n{child.tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
                try:
                    connection.request("GET", ready_path)
                    if connection.getresponse().status == 200:
                        break
                finally:
                    connection.close()
            if time.monotonic() > deadline:
                raise BenchmarkFailed(f"{name} did not answer within {STARTUP_DEADLINE:g} s:\n{child.tail()}")
            time.sleep(0.1)
        yield Server(name=name, port=port, child=child)
    finally:
        child.signal(signal.SIGTERM)
        try:
            popen.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            child.signal(signal.SIGKILL)
            popen.wait(STOP_GRACE)


class _Registrar(http.server.BaseHTTPRequestHandler):
    """The control plane's part the data node needs: its registration, answered with :data:`DOWNLOAD_KEY`."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"download_key": DOWNLOAD_KEY}).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
        pass


@contextlib.contextmanager
def data_node(dataset: Dataset, root: Path, *, streamed: bool = False) -> Iterator[Server]:
    """Our data node; ``streamed``: with ``--inline-limit 0``, every slice by ``FileResponse``, as before."""
    port = free_port()
    name = "data node, streamed" if streamed else "data node"
    registrar = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Registrar)
    thread = threading.Thread(target=registrar.serve_forever, daemon=True)
    thread.start()
    argv = [
        sys.executable, "-m", "data_node", "--server", f"http://127.0.0.1:{registrar.server_address[1]}",
        "--token", "hd_benchmark", "--dataset", str(dataset.directory),
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING",
        "--inline-limit", "0" if streamed else str(INLINE_LIMIT),
    ]  # fmt: skip
    try:
        with running(
            name, argv, log=root / f"{name.replace(', ', '-').replace(' ', '-')}-{dataset.name}.log", port=port,
            ready_path=dataset.request_path(0),
        ) as server:  # fmt: skip
            server.batches = not streamed
            yield server
    finally:
        registrar.shutdown()
        registrar.server_close()


def nginx(binary: str, dataset: Dataset, root: Path) -> contextlib.AbstractContextManager[Server]:
    prefix = root / f"nginx-{dataset.name}"
    prefix.mkdir()
    port = free_port()
    config = prefix / "nginx.conf"
    config.write_text(nginx_config(dataset, prefix, port))
    argv = [binary, "-c", str(config), "-p", str(prefix), "-e", str(prefix / "error.log")]
    return running("nginx", argv, log=prefix / "stdout.log", port=port, ready_path=dataset.path(0))


def check_answers(server: Server, dataset: Dataset) -> None:
    """Fetch a sample of slices: status 200, Content-Length, body digest and X-Sha256 must all be right."""
    step = max(1, dataset.count // (SAMPLE_CHECKS - 1))
    indices = sorted({*range(0, dataset.count, step), dataset.count - 1})
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT)
    try:
        for index in indices:
            connection.request("GET", dataset.request_path(index))
            response = connection.getresponse()
            body = response.read()
            problems = []
            if response.status != 200:
                problems.append(f"status {response.status}")
            if response.headers.get("Content-Length") != str(dataset.slice_size):
                problems.append(f"Content-Length {response.headers.get('Content-Length')}")
            if hashlib.sha256(body).hexdigest() != dataset.digests[index]:
                problems.append("body digest differs")
            if response.headers.get("X-Sha256") != dataset.digests[index]:
                problems.append(f"X-Sha256 {response.headers.get('X-Sha256')}")
            if problems:
                raise BenchmarkFailed(f"{server.name}: {dataset.path(index)}: {', '.join(problems)}")
        if server.batches and dataset.slice_size <= INLINE_LIMIT:
            check_batch(connection, server, dataset, indices[-2])
    finally:
        connection.close()


def check_batch(connection: http.client.HTTPConnection, server: Server, dataset: Dataset, first: int) -> None:
    """A batch of three slices from ``first`` on: split by its frame lines, every slice's bytes and digest."""
    body, _ = dataset.batch(first, 3)
    connection.request("POST", dataset.batch_path, body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = response.read()
    if response.status != 200 or response.headers.get("Content-Type") != BATCH_CONTENT_TYPE:
        raise BenchmarkFailed(f"{server.name}: a batch answered {response.status}: {answer[:300]!r}")
    position = 0
    for offset in range(3):
        index = (first + offset) % dataset.count
        end = answer.index(b"\n", position)
        line = answer[position:end].decode()
        data = answer[end + 1 : end + 1 + dataset.slice_size]
        if line != f"{index} {dataset.slice_size} {dataset.digests[index]}" or (
            hashlib.sha256(data).hexdigest() != dataset.digests[index]
        ):
            raise BenchmarkFailed(f"{server.name}: a batch's slice {index} is wrong (frame {line!r})")
        position = end + 1 + dataset.slice_size
    if position != len(answer):
        raise BenchmarkFailed(f"{server.name}: a batch's answer has {len(answer) - position} bytes too many")


# Clients ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientResult:
    slices: int
    body_bytes: int
    elapsed: float
    cpu: float
    error: str | None


@dataclass(frozen=True)
class Request:
    """One request a client sends: a slice's ``GET``, or a batch ``POST`` whose answer must hold ``frames``
    (offset, frame line) and be ``length`` bytes long."""

    method: str
    path: str
    body: bytes | None
    slices: int
    length: int
    frames: tuple[tuple[int, bytes], ...] = ()


@dataclass(frozen=True)
class Pattern:
    """How the clients ask: ``clients`` clients, each with ``connections`` requests in flight (a process and a
    keep-alive connection each), each request for ``batch`` slices (1: a ``GET``; more: a batch ``POST`` to a
    server that takes them, one-slice ``GET`` requests to one that does not)."""

    label: str
    clients: int
    connections: int
    batch: int


def trainer_pattern(clients: int, prefetch: int) -> Pattern:
    """What ``clients`` bridges with ``prefetch`` places send while they wait for the data node (module
    docstring): top-ups of P - 1 slices once one is left; single slices are each their own request."""
    batch = max(1, prefetch - 1)
    return Pattern(
        label=f"{clients} trainers, prefetch {prefetch}",
        clients=clients,
        connections=prefetch if batch == 1 else 1,
        batch=batch,
    )


def requests_for(dataset: Dataset, batch: int) -> list[Request]:
    """Per first slice index, the request for ``batch`` slices from there on."""
    if batch == 1:
        return [
            Request("GET", dataset.request_path(index), None, 1, dataset.slice_size)
            for index in range(dataset.count)
        ]
    made = []
    for first in range(dataset.count):
        body, _ = dataset.batch(first, batch)
        frames = []
        offset = 0
        for step in range(batch):
            index = (first + step) % dataset.count
            line = f"{index} {dataset.slice_size} {dataset.digests[index]}\n".encode()
            frames.append((offset, line))
            offset += len(line) + dataset.slice_size
        made.append(Request("POST", dataset.batch_path, body, batch, offset, tuple(frames)))
    return made


def http_client(
    results: multiprocessing.Queue, port: int, requests: list[Request], first: int, start_at: float,
    seconds: float,
) -> None:  # fmt: skip
    """One client process: ``requests`` round-robin from ``first`` on, one at a time on one keep-alive
    connection."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends the clients
    step = requests[0].slices
    # one byte spare: a longer body shows as a wrong length
    buffer = memoryview(bytearray(max(request.length for request in requests) + 1))
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    headers = {"Content-Type": "application/json"}
    slices = body_bytes = 0
    index = first
    error = None
    started, cpu_started = time.monotonic(), time.process_time()
    try:
        connection.connect()
        time.sleep(max(0.0, start_at - time.monotonic()))
        started, cpu_started = time.monotonic(), time.process_time()
        deadline = started + seconds
        while time.monotonic() < deadline:
            request = requests[index]
            connection.request(request.method, request.path, body=request.body, headers=headers)
            response = connection.getresponse()
            received = 0
            while count := response.readinto(buffer[received:]):
                received += count
            if response.status != 200 or received != request.length:
                raise BenchmarkFailed(
                    f"{request.method} {request.path.partition('?')[0]}: status {response.status}, "
                    f"{received} bytes of {request.length}: {bytes(buffer[: min(received, 300)])!r}"
                )
            for offset, line in request.frames:
                if buffer[offset : offset + len(line)] != line:
                    raise BenchmarkFailed(f"a batch's frame at {offset} is not {line!r}")
            slices += request.slices
            body_bytes += received - sum(len(line) for _, line in request.frames)
            index = (index + step) % len(requests)
    except Exception as exception:  # noqa: BLE001 — reported to the parent, which fails the run
        error = f"{type(exception).__name__}: {exception}"
    finally:
        connection.close()
    results.put(
        ClientResult(
            slices=slices,
            body_bytes=body_bytes,
            elapsed=time.monotonic() - started,
            cpu=time.process_time() - cpu_started,
            error=error,
        )  # fmt: skip
    )


@dataclass(frozen=True)
class Run:
    slices_per_second: float
    mb_per_second: float
    server_cpu: float  # fraction of one core
    client_cpu: float


def python_run(server: Server, dataset: Dataset, pattern: Pattern, *, seconds: float) -> Run:
    requests = requests_for(dataset, pattern.batch if server.batches else 1)
    results: multiprocessing.Queue = multiprocessing.Queue()
    start_at = time.monotonic() + 0.5  # time for every client to fork and connect
    # A trainer's requests in flight are concurrent (its bridge is asynchronous): one process each.
    count = pattern.clients * pattern.connections
    processes = [
        multiprocessing.Process(
            target=http_client,
            args=(results, server.port, requests, client * dataset.count // count, start_at, seconds),
            daemon=True,
        )
        for client in range(count)
    ]
    for process in processes:
        process.start()
    time.sleep(max(0.0, start_at - time.monotonic()))
    server_cpu = server.cpu_seconds()
    answers = [results.get(timeout=seconds + REQUEST_TIMEOUT + 10) for _ in processes]
    server_cpu = server.cpu_seconds() - server_cpu
    for process in processes:
        process.join()
    errors = [answer.error for answer in answers if answer.error]
    if errors:
        raise BenchmarkFailed(f"{server.name}: {errors[0]}")
    wall = max(answer.elapsed for answer in answers)
    return Run(
        slices_per_second=sum(answer.slices / answer.elapsed for answer in answers),
        mb_per_second=sum(answer.body_bytes / answer.elapsed for answer in answers) / MB,
        server_cpu=server_cpu / wall,
        client_cpu=sum(answer.cpu for answer in answers) / wall,
    )


WRK_SCRIPT = """-- written by bench/data_node.py: GET the paths round-robin, each thread from its own offset
local paths = {{ {paths} }}
local threads = 0
function setup(thread)
  thread:set("first", threads)
  threads = threads + 1
end
function init(args)
  index = math.floor(first * #paths / {threads})
end
function request()
  index = index % #paths + 1
  return wrk.format("GET", paths[index])
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("HYPHA-WRK %d %d %d\\n", summary.requests, summary.duration,
    e.connect + e.read + e.write + e.status + e.timeout))
end
"""


def wrk_run(
    binary: str, script: Path, server: Server, dataset: Dataset, *, clients: int, seconds: float
) -> Run:
    threads = min(clients, os.cpu_count() or 1)
    script.write_text(
        WRK_SCRIPT.format(
            paths=", ".join(f'"{dataset.request_path(index)}"' for index in range(dataset.count)),
            threads=threads,
        )
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_cpu = server.cpu_seconds()
    done = subprocess.run(
        [binary, "-t", str(threads), "-c", str(clients), "-d", f"{seconds:g}s", "--timeout", "30s",
         "-s", str(script), f"http://127.0.0.1:{server.port}"],
        capture_output=True, text=True, timeout=seconds + 60,
    )  # fmt: skip
    server_cpu = server.cpu_seconds() - server_cpu
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    match = re.search(r"^HYPHA-WRK (\d+) (\d+) (\d+)$", done.stdout, re.MULTILINE)
    if done.returncode != 0 or not match:
        raise BenchmarkFailed(
            f"wrk against {server.name} exited {done.returncode}:\n{done.stdout}{done.stderr}"
        )
    requests, microseconds, errors = (int(group) for group in match.groups())
    if errors:
        raise BenchmarkFailed(f"wrk against {server.name}: {errors} errors\n{done.stdout}")
    wall = microseconds / 1e6
    client_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Run(
        slices_per_second=requests / wall,
        mb_per_second=requests * dataset.slice_size / wall / MB,
        server_cpu=server_cpu / wall,
        client_cpu=client_cpu / wall,
    )


# Measuring and reporting --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    size: str
    client: str
    server: str
    runs: list[Run]

    def median(self, attribute: str) -> float:
        return statistics.median(getattr(run, attribute) for run in self.runs)


def measure(
    measure_one: Callable[[Server, float], Run], servers: list[Server], *, rounds: int, seconds: float,
    warmup: float, size: str, client: str,
) -> list[Row]:  # fmt: skip
    """Warm up each server, then ``rounds`` interleaved runs (ours, nginx, ours, nginx, …)."""
    if warmup > 0:
        for server in servers:
            measure_one(server, warmup)
    runs: dict[str, list[Run]] = {server.name: [] for server in servers}
    for round_ in range(rounds):
        for server in servers:
            run = measure_one(server, seconds)
            runs[server.name].append(run)
            print(
                f"  {size} {client} round {round_ + 1}/{rounds} {server.name}: "
                f"{run.slices_per_second:.0f} slices/s, {run.mb_per_second:.0f} MB/s, "
                f"server CPU {run.server_cpu:.0%}, client CPU {run.client_cpu:.0%}",
                flush=True,
            )
    return [Row(size=size, client=client, server=server.name, runs=runs[server.name]) for server in servers]


def size_text(dataset: Dataset) -> str:
    if dataset.slice_size >= 1024 * 1024:
        return f"{dataset.slice_size / 1024 / 1024:.1f} MiB"
    return f"{dataset.slice_size / 1024:.0f} KiB"


def print_table(rows: list[Row]) -> dict[tuple[str, str, str], float]:
    """The markdown table; returns ours ÷ nginx slices/s per (size, client, server) of each data node row."""
    ratios: dict[tuple[str, str, str], float] = {}
    print(
        "| slice size | client | server | slices/s | MB/s | slices/s per round | server CPU | client CPU "
        "| ours/nginx |"
    )
    print("|---|---|---|---:|---:|---|---:|---:|---:|")
    for row in rows:
        ratio = ""
        if row.server != "nginx":
            nginx_row = next(
                other
                for other in rows
                if (other.size, other.client, other.server) == (row.size, row.client, "nginx")
            )
            key = (row.size, row.client, row.server)
            ratios[key] = row.median("slices_per_second") / nginx_row.median("slices_per_second")
            ratio = f"**{ratios[key]:.2f}×**"
        per_round = " / ".join(f"{run.slices_per_second:.0f}" for run in row.runs)
        print(
            f"| {row.size} | {row.client} | {row.server} | {row.median('slices_per_second'):.0f} "
            f"| {row.median('mb_per_second'):.0f} | {per_round} | {row.median('server_cpu'):.0%} "
            f"| {row.median('client_cpu'):.0%} | {ratio} |"
        )
    return ratios


def patterns(arguments: argparse.Namespace, dataset: Dataset) -> list[Pattern]:
    """The client patterns for ``dataset``: one ``GET`` at a time, then (small slices) the trainers'."""
    made = [Pattern(f"{arguments.clients} × http.client", clients=arguments.clients, connections=1, batch=1)]
    if dataset.slice_size <= INLINE_LIMIT:
        made += [trainer_pattern(arguments.clients, depth) for depth in arguments.prefetch]
    return made


def benchmark_size(
    arguments: argparse.Namespace, root: Path, spec: SizeSpec, nginx_binary: str, wrk_binary: str | None
) -> list[Row]:
    """Prepare one dataset, serve it from every server and measure them: a row per (client, server)."""
    print(f"Preparing {spec.slices} slices of {spec.samples_per_slice} × {SEQ_LEN} tokens ({spec.label})…")
    dataset = prepare_dataset(root, spec)
    size = size_text(dataset)
    small = dataset.slice_size <= INLINE_LIMIT
    print(f"  {dataset.name}: {dataset.count} slices of {dataset.slice_size:,} bytes", flush=True)
    rows: list[Row] = []
    try:
        with contextlib.ExitStack() as stack:
            ours = stack.enter_context(data_node(dataset, root))
            # Slices over the inline limit are streamed either way: "as before" would measure the same code.
            before = [stack.enter_context(data_node(dataset, root, streamed=True))] if small else []
            theirs = stack.enter_context(nginx(nginx_binary, dataset, root))
            for server in [ours, *before, theirs]:
                check_answers(server, dataset)
            common = {"rounds": arguments.rounds, "warmup": arguments.warmup, "size": size}
            for number, pattern in enumerate(patterns(arguments, dataset)):

                def with_http_client(server: Server, seconds: float, pattern: Pattern = pattern) -> Run:
                    return python_run(server, dataset, pattern, seconds=seconds)

                # "As before" once, with the clients that fetch one slice at a time: a bridge batches only
                # from a node that takes batches, and the streamed node refuses them.
                servers = [ours, *(before if number == 0 else []), theirs]
                rows += measure(
                    with_http_client, servers, seconds=arguments.seconds, client=pattern.label, **common
                )
            if wrk_binary and dataset.slice_size < WRK_MAX_SLICE:
                script = root / f"wrk-{dataset.name}.lua"

                def with_wrk(server: Server, seconds: float) -> Run:
                    return wrk_run(
                        wrk_binary, script, server, dataset, clients=arguments.clients, seconds=seconds
                    )

                rows += measure(
                    with_wrk,
                    [ours, theirs],
                    seconds=arguments.seconds,
                    client=f"wrk -c {arguments.clients}",
                    **common,
                )
    finally:
        if not arguments.keep:  # a 4 MiB × 200 dataset is 840 MB: gone before the next one is written
            shutil.rmtree(dataset.directory, ignore_errors=True)
    return rows


def benchmark(arguments: argparse.Namespace, root: Path, nginx_binary: str, wrk_binary: str | None) -> int:
    rows: list[Row] = []
    for spec in arguments.sizes:
        rows += benchmark_size(arguments, root, spec, nginx_binary, wrk_binary)
    print(
        f"\nMedians of {arguments.rounds} interleaved rounds of {arguments.seconds:g} s, loopback. CPU: % of one "
        f"core (server: all its processes; client: all clients).\n"
    )
    ratios = print_table(rows)
    print()
    goal_client = trainer_pattern(arguments.clients, 2).label
    for (size, client, server), ratio in ratios.items():
        verdict = "met" if ratio >= GOAL_RATIO else "NOT met"
        goal = " — the goal's pattern" if client == goal_client and server == "data node" else ""
        print(f"- {size}, {client}: {server} / nginx = {ratio:.2f}× (≥ {GOAL_RATIO}×: {verdict}){goal}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    nginx_binary = find_nginx()
    if nginx_binary is None:
        print(NGINX_INSTALL_HELP, file=sys.stderr)
        return EXIT_USAGE
    wrk_binary = None if arguments.no_wrk else shutil.which("wrk")
    # SIGTERM unwinds like Ctrl-C, through the `finally`s that stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_INTERRUPTED))
    print_start()
    import aiohttp

    print(f"Servers: data node (aiohttp {aiohttp.__version__}), nginx {nginx_version(nginx_binary)}")
    print(f"wrk: {wrk_binary or 'not used (--no-wrk, or not installed: apt-get install -y wrk)'}")
    with run_directory("hypha-bench-data-node-", keep=arguments.keep) as root:
        try:
            code = benchmark(arguments, root, nginx_binary, wrk_binary)
            print(f"\nLoad average at end: {load_average()}")
            return code
        except BenchmarkFailed as error:
            print(f"benchmark failed: {error}", file=sys.stderr)
            return EXIT_FAILED
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
