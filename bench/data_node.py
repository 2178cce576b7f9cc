"""Data node benchmark: slices served per second and MB/s to 4 concurrent clients, our data node vs nginx.

For each slice size (``--sizes``, default ``100k:400 4m:200``: 400 slices of 100 KiB, which measures the
request rate, and 200 slices of 4 MiB, which measures bandwidth) the benchmark prepares a byte-level text
dataset from the Python standard library's sources with ``hypha-data prepare-text`` (sequences of 128 tokens,
so every slice holds ``input_ids`` and ``labels`` of equal size and all slices of a dataset are the same
size), then starts two servers over the same files on loopback:

* **our data node** — ``python -m data_node`` as its CLI runs it. It serves slices only to requests carrying
  a slice token signed with the download key its control plane answers the registration with, so the
  benchmark answers ``POST /api/datasets/register/`` itself (a stdlib HTTP server on a loopback port, with a
  fixed key) and every request of both servers carries the slice's token (``?token=…``, signed once before
  the runs; nginx ignores it): the data node's numbers include verifying it. Ready when a slice answers 200
  (after it has hashed every slice and registered).
* **nginx** from Debian (``apt-get install -y nginx-light``), with a private configuration in the run's temp
  directory (``nginx -c CONF -p PREFIX -e ERROR_LOG``): ``daemon off``, ``master_process on``,
  ``worker_processes auto``, ``sendfile on``, no access log, and locations that map the same URLs
  (``/datasets/<name>/slices/<index>``, index without padding) onto the zero-padded slice files with ``alias``.
  A ``map`` adds the slice's ``X-Sha256`` header, so both servers send the same headers.

Before measuring, a sample of slices (first, last and a few between) is fetched from both servers and checked:
status 200, ``Content-Length``, the body's SHA-256 and ``X-Sha256``. Then, ``--rounds`` times, interleaved
(ours, nginx, ours, nginx, …, after one unmeasured warm-up run each), ``--clients`` client processes (default
4) each download slices round-robin for ``--seconds``, starting at evenly spaced slices. A client is
``http.client`` on one keep-alive connection reading each whole body with ``readinto`` into a preallocated
buffer (no per-slice allocation) and checking its length and status. Throughput is Σ over clients of slices
(or bytes) ÷ the client's own elapsed time; the tables show the median round, the per-round spread, and CPU
time as % of one core — the server's (all its processes, from ``/proc``) and the clients' (their process
time) — so a client that is the bottleneck shows up: on a 2-core machine clients and server share the cores.
The ratio column is ours ÷ nginx of the medians; the goal is ≥ 0.8×. With ``wrk`` installed (Debian package
``wrk``) the same rounds are repeated with ``wrk -c CLIENTS`` and a Lua script cycling the same paths, a C
client that costs far less CPU per request — for slices under 1 MiB only: wrk reads 8 KiB per ``read`` call,
so with MiB-sized bodies wrk itself is the bottleneck (4 MiB slices: both servers stuck at ≈ 600 MB/s under
wrk, while ``http.client`` got 1400–2000 MB/s out of nginx). ``--no-wrk`` skips it. MB = 10^6 bytes.

Usage::

    python bench/data_node.py                                  # 100 KiB × 400 and 4 MiB × 200, 3 rounds × 5 s
    python bench/data_node.py --sizes 16k:1000 1m:300 --rounds 5 --seconds 10
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
DOWNLOAD_KEY = "bench-download-key-" + "0" * 45  # what the benchmark's "control plane" gives the data node
NGINX_INSTALL_HELP = """nginx is not installed (looked for `nginx` on PATH and in /usr/sbin).
Install it from Debian and run the benchmark again:

    apt-get install -y nginx-light      # as root (or with sudo); or the package nginx

The benchmark starts its own nginx with a private configuration; the system service need not run."""


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
    parser.add_argument("--clients", type=int, default=4, help="concurrent client processes (default: 4)")
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
        token = tokens.sign(
            DOWNLOAD_KEY,
            dataset=self.name,
            index=index,
            job="bench",
            peer="bench",
            expires=int(time.time()) + 86400,
        )
        return f"{self.path(index)}?token={token}"

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
def data_node(dataset: Dataset, root: Path) -> Iterator[Server]:
    port = free_port()
    registrar = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Registrar)
    thread = threading.Thread(target=registrar.serve_forever, daemon=True)
    thread.start()
    argv = [
        sys.executable, "-m", "data_node", "--server", f"http://127.0.0.1:{registrar.server_address[1]}",
        "--token", "hd_benchmark", "--dataset", str(dataset.directory),
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING",
    ]  # fmt: skip
    try:
        with running(
            "data node", argv, log=root / f"data-node-{dataset.name}.log", port=port,
            ready_path=dataset.request_path(0),
        ) as server:  # fmt: skip
            yield server
    finally:
        registrar.shutdown()
        registrar.server_close()


def find_nginx() -> str | None:
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin:/sbin")


def nginx_config(dataset: Dataset, prefix: Path, port: int) -> str:
    """A private nginx configuration serving ``dataset`` at the data node's URLs, with its ``X-Sha256``."""
    # One location per index length: nginx cannot zero-pad a capture, so "/slices/7" → alias "00007…".
    locations = []
    for digits in range(1, 6):
        pattern = rf"\d{{{digits},}}" if digits == 5 else rf"\d{{{digits}}}"
        padding = "0" * (5 - digits)
        locations.append(
            f'        location ~ "^/datasets/{dataset.name}/slices/({pattern})$" {{\n'
            f"            alias {dataset.directory}/{padding}$1.safetensors;\n"
            f"            add_header X-Sha256 $slice_sha256;\n"
            f"        }}"
        )
    digests = "\n".join(
        f"        {dataset.path(index)} {digest};" for index, digest in enumerate(dataset.digests)
    )
    # Running as root (a container), workers would drop to www-data, which cannot read the private temp dir.
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""{user}daemon off;
master_process on;
worker_processes auto;
error_log {prefix}/error.log warn;
pid {prefix}/nginx.pid;
lock_file {prefix}/nginx.lock;
events {{
    worker_connections 1024;
}}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000;
    types {{ }}
    default_type application/octet-stream;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    map_hash_max_size {max(1024, 2 * dataset.count)};
    map_hash_bucket_size 128;
    map $uri $slice_sha256 {{
        default "";
{digests}
    }}
    server {{
        listen 127.0.0.1:{port};
{chr(10).join(locations)}
    }}
}}
"""


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
    finally:
        connection.close()


# Clients ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientResult:
    slices: int
    body_bytes: int
    elapsed: float
    cpu: float
    error: str | None


def http_client(
    results: multiprocessing.Queue, port: int, paths: list[str], size: int, first: int, start_at: float,
    seconds: float,
) -> None:  # fmt: skip
    """One client process: GET ``paths`` round-robin from ``first`` on one keep-alive connection."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends the clients
    buffer = memoryview(bytearray(size + 1))  # one byte spare: a longer body shows as a wrong length
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
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
            connection.request("GET", paths[index])
            response = connection.getresponse()
            received = 0
            while count := response.readinto(buffer[received:]):
                received += count
            if response.status != 200 or received != size:
                raise BenchmarkFailed(f"{paths[index]}: status {response.status}, {received} bytes of {size}")
            slices += 1
            body_bytes += received
            index = (index + 1) % len(paths)
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


def python_run(server: Server, dataset: Dataset, *, clients: int, seconds: float) -> Run:
    paths = [dataset.request_path(index) for index in range(dataset.count)]
    results: multiprocessing.Queue = multiprocessing.Queue()
    start_at = time.monotonic() + 0.5  # time for every client to fork and connect
    processes = [
        multiprocessing.Process(
            target=http_client,
            args=(
                results,
                server.port,
                paths,
                dataset.slice_size,
                client * dataset.count // clients,
                start_at,
                seconds,
            ),
            daemon=True,
        )  # fmt: skip
        for client in range(clients)
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


def print_table(rows: list[Row]) -> dict[tuple[str, str], float]:
    """The markdown table; returns ours ÷ nginx slices/s per (size, client)."""
    ratios: dict[tuple[str, str], float] = {}
    print(
        "| slice size | client | server | slices/s | MB/s | slices/s per round | server CPU | client CPU "
        "| ours/nginx |"
    )
    print("|---|---|---|---:|---:|---|---:|---:|---:|")
    for row in rows:
        ratio = ""
        if row.server == "data node":
            nginx_row = next(
                other
                for other in rows
                if (other.size, other.client, other.server) == (row.size, row.client, "nginx")
            )
            ratios[(row.size, row.client)] = row.median("slices_per_second") / nginx_row.median(
                "slices_per_second"
            )
            ratio = f"**{ratios[(row.size, row.client)]:.2f}×**"
        per_round = " / ".join(f"{run.slices_per_second:.0f}" for run in row.runs)
        print(
            f"| {row.size} | {row.client} | {row.server} | {row.median('slices_per_second'):.0f} "
            f"| {row.median('mb_per_second'):.0f} | {per_round} | {row.median('server_cpu'):.0%} "
            f"| {row.median('client_cpu'):.0%} | {ratio} |"
        )
    return ratios


def benchmark_size(
    arguments: argparse.Namespace, root: Path, spec: SizeSpec, nginx_binary: str, wrk_binary: str | None
) -> list[Row]:
    """Prepare one dataset, serve it from both servers and measure them: a row per (client, server)."""
    print(f"Preparing {spec.slices} slices of {spec.samples_per_slice} × {SEQ_LEN} tokens ({spec.label})…")
    dataset = prepare_dataset(root, spec)
    size = size_text(dataset)
    print(f"  {dataset.name}: {dataset.count} slices of {dataset.slice_size:,} bytes", flush=True)
    rows: list[Row] = []
    try:
        with data_node(dataset, root) as ours, nginx(nginx_binary, dataset, root) as theirs:
            servers = [ours, theirs]
            for server in servers:
                check_answers(server, dataset)
            common = {"rounds": arguments.rounds, "warmup": arguments.warmup, "size": size}

            def with_http_client(server: Server, seconds: float) -> Run:
                return python_run(server, dataset, clients=arguments.clients, seconds=seconds)

            rows += measure(
                with_http_client, servers, seconds=arguments.seconds,
                client=f"{arguments.clients} × http.client", **common,
            )  # fmt: skip
            if wrk_binary and dataset.slice_size < WRK_MAX_SLICE:
                script = root / f"wrk-{dataset.name}.lua"

                def with_wrk(server: Server, seconds: float) -> Run:
                    return wrk_run(
                        wrk_binary, script, server, dataset, clients=arguments.clients, seconds=seconds
                    )

                rows += measure(
                    with_wrk,
                    servers,
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
        f"\nMedians of {arguments.rounds} interleaved rounds of {arguments.seconds:g} s, {arguments.clients} "
        f"concurrent clients, loopback. CPU: % of one core (server: all its processes; client: all clients).\n"
    )
    ratios = print_table(rows)
    print()
    for (size, client), ratio in ratios.items():
        verdict = "met" if ratio >= GOAL_RATIO else "NOT met"
        print(f"- {size}, {client}: data node / nginx = {ratio:.2f}× (goal ≥ {GOAL_RATIO}×: {verdict})")
    return EXIT_OK


def nginx_version(binary: str) -> str:
    done = subprocess.run([binary, "-v"], capture_output=True, text=True)
    return (done.stderr or done.stdout).strip().removeprefix("nginx version: ")


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
