"""Status round-trip benchmark: how many per-step ``status`` → ``status_reply`` round trips the control plane
answers per second, and how fast, with 16 and 64 trainers reporting at once.

Every optimizer step of every trainer is one round trip: the executor's ``/status/send`` becomes a ``status``
frame on its daemon's websocket (``{"status": {"batch_size": 8, "loss": …}}``), and the control plane answers
``status_reply`` (``Continue``, or ``ScheduleUpdate`` when a round's steps are done) after updating the task's
row (apps/jobs/training/status.py ``handle_status``). This is the control plane's hottest path during training.

Starts a real control plane (``--mode auto``: services when DATABASE_URL and REDIS_URL are set, embedded
otherwise; see bench/harness.py), registers a real prepared dataset (the standard library's sources,
byte-level, through the data node's own registration call) and, per trainer count N, N + 1 real simulated
daemons (:class:`worker_daemon.connection.WorkerDaemon`, the allocation benchmark's 2-cpu/4-GB ``whole``
config) in this one asyncio process. It submits a DiLoCo job of N trainers + 1 parameter server with a huge
``inner_steps`` (no round ends during the run), and the market allocates it as usual.

No executor runs: each daemon's job manager is a :class:`BenchJobManager`, which accepts ``dispatch_job``
exactly as the real one does (lease held, executor configured), posts ``job_started``, and instead of a work
dir, a bridge and a process, hands the task to the benchmark and waits for its cancellation. The parameter
server's daemon reports ``{"ready": {"url": …}}`` (so the control plane dispatches the trainers), then each
trainer's daemon runs a closed loop through the daemon's own request path
(:meth:`worker_daemon.link.ControlLink.request`, what the bridge's ``/status/send`` uses): send a ``status``
with a fresh ``request_id``, wait for its ``status_reply``, record the latency, repeat.

``--path`` picks what a "round trip" is:

* ``bridge`` (default): what an executor sees. Each trainer calls its daemon's bridge backend
  (:class:`worker_daemon.bridge.remote.RemoteBackend`, what ``/status/send`` calls) and follows the sync
  protocol like a real trainer: step reports until its counter says stop (Hypha's counter logic), then
  ``"update"`` and ``"update-received"``, round after round (H = ``--inner-steps``, default 50). Step reports
  the control plane allowed the daemon to answer itself (``continue_for``) never leave the daemon; the table
  shows how many did reach the control plane.
* ``link``: every step report goes to the control plane (:meth:`worker_daemon.link.ControlLink.request`, no
  local answers, a round never ends): the control plane's raw capacity for step reports.

Per trainer count it reports, over ``--seconds`` after ``--warmup`` seconds: round trips per second in total
and per trainer, latency p50/p99/max, errors (``Error`` replies, timeouts), and where the time goes: the
control plane's own time per status (``hypha_status_message_seconds`` from ``/metrics``: arrival to reply
ready, including the wait for the web process's database thread) and the CPU use of each process (web,
Celery worker and beat, PostgreSQL, Redis, and this benchmark's own simulated daemons, which share the
machine's cores). ``--profile DIR`` records the web process with py-spy during each window (py-spy is not a
dependency: ``pip install py-spy`` into the venv).

``--rate R`` paces the trainers instead of the closed loop: each sends its next report ``trainers / R`` seconds
after the last one was sent (or at once when the answer came later), so the fleet offers R round trips per
second in total, as trainers with real steps do, and the latency is that of a control plane that is not driven
to saturation by construction.

``--web N --celery M`` (services mode; comma-separated lists run one control plane after the other and print
them side by side): N daphne processes, the daemons connected to them in turn (round robin, as a load balancer
would spread their websockets), and M Celery workers. Per run it also shows the CPU of each process, of the
PostgreSQL backends of the run's database and of the whole machine, and what the database did
(``bench/harness.py`` :class:`PostgresSampler`).

Goal: at least 1,000 round trips/s in total with p99 < 50 ms (issue 15: with two web processes).

Usage::

    python bench/status_load.py                         # 16 and 64 trainers, 20 s windows, mode auto
    python bench/status_load.py --trainers 16 --seconds 10 --profile /tmp/status-profiles
    python bench/status_load.py --mode services --trainers 64 --rate 1000 --web 1,2   # 1 vs 2 web processes
    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/hypha_ci REDIS_URL=redis://127.0.0.1:6379/15 \\
        SECRET_KEY=$(python -c 'import secrets; print(secrets.token_urlsafe(40))') python bench/status_load.py

Exits 1 if a trainer count could not be set up or a round trip failed. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import re
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/status_load.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from bench import harness  # noqa: E402
from bench.cluster import diloco_spec, prepare_stdlib_text  # noqa: E402
from bench.harness import CpuMeter, PostgresSampler, Scale  # noqa: E402
from data_node.server import ServedDataset, register  # noqa: E402
from data_node.slices import scan  # noqa: E402
from worker_daemon import protocol  # noqa: E402
from worker_daemon.bridge.exceptions import NetworkError  # noqa: E402
from worker_daemon.bridge.remote import RemoteBackend  # noqa: E402
from worker_daemon.config import WorkerConfig  # noqa: E402
from worker_daemon.connection import WorkerDaemon  # noqa: E402
from worker_daemon.jobs import JobManager, Task  # noqa: E402

#: The daemons' shape: each can hold exactly one role of the job (1 cpu, 1 GB each), as in bench/allocation.py.
DAEMON_CONFIG = {
    "resources": {"cpu": 2, "memory": 4, "storage": 10, "gpu": 0},
    "offer": {"price": 100, "floor": 50},
}
DATASET_NAME = "status-bench"
#: What a trainer reports after each optimizer step (the built-in executor sends these three keys).
PROGRESS = {"status": {"batch_size": 8, "loss": 3.2, "step_time": 0.05}}
#: What the parameter server reports once it listens (nothing connects to it: no executor runs).
READY = {"ready": {"url": "http://127.0.0.1:1/"}}
#: Seconds a status may wait for its reply before it counts as an error (the bridge's default is 30 s).
REQUEST_TIMEOUT = 10.0
#: Seconds from the submission to every trainer's task started.
SETUP_TIMEOUT = 120.0
GOAL_PER_SECOND = 1000.0
GOAL_P99 = 0.050


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python bench/status_load.py",
        description=__doc__.split("\n\n")[0],
        epilog="Prints the machine, the mode and markdown tables. See docs/benchmarks.md for results.",
    )
    parser.add_argument(
        "--trainers", default="16,64", help="trainer counts, comma-separated (default: 16,64; at most 256)"
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window per count (default: 20)")
    parser.add_argument(
        "--warmup", type=float, default=5.0, help="unmeasured seconds of load before it (default: 5)"
    )
    parser.add_argument(
        "--mode",
        choices=["auto", "embedded", "services"],
        default="auto",
        help="auto: services if DATABASE_URL and REDIS_URL are set, else embedded (default: auto)",
    )
    parser.add_argument(
        "--path",
        choices=["bridge", "link"],
        default="bridge",
        help="bridge: through the daemon's bridge backend, following the sync protocol (default); link: "
        "every step report to the control plane",
    )
    parser.add_argument(
        "--inner-steps",
        type=int,
        default=None,
        help="the spec's rounds.inner_steps (default: 50 with --path bridge; 1e9 with --path link, where a "
        "trainer told ScheduleUpdate keeps reporting in SCHEDULED state)",
    )
    parser.add_argument(
        "--lease-ttl", type=float, default=10.0, help="HYPHA_LEASE_TTL, seconds (default: 10, the default)"
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="round trips per second offered in total, paced over the trainers (default: none, a closed "
        "loop: each trainer's next report as soon as the last is answered)",
    )
    harness.add_scale_arguments(parser)
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="record the web process with py-spy during each window into DIR (raw collapsed stacks)",
    )
    parser.add_argument("--verbose", action="store_true", help="daemon and control-plane logs at INFO")
    parser.add_argument(
        "--keep", action="store_true", help="keep the run's directory (control-plane logs) and print its path"
    )
    arguments = parser.parse_args(argv)
    try:
        arguments.trainers = [int(count) for count in arguments.trainers.split(",") if count.strip()]
    except ValueError:
        parser.error(f"--trainers must be comma-separated integers, not {arguments.trainers!r}")
    if not arguments.trainers or not all(1 <= count <= 256 for count in arguments.trainers):
        parser.error("every trainer count must be between 1 and 256 (the spec's limit)")
    if arguments.seconds <= 0 or arguments.warmup < 0:
        parser.error("--seconds must be positive and --warmup not negative")
    if arguments.inner_steps is None:
        arguments.inner_steps = 50 if arguments.path == "bridge" else 1_000_000_000
    if not 1 <= arguments.inner_steps <= 2**31 - 1:
        parser.error("--inner-steps must be between 1 and 2**31 - 1")
    if arguments.profile is not None and py_spy() is None:
        parser.error("--profile needs py-spy (pip install py-spy into the venv)")
    if arguments.rate is not None and arguments.rate <= 0:
        parser.error("--rate must be positive")
    arguments.scales = harness.scale_configurations(parser, arguments)
    return arguments


def py_spy() -> str | None:
    """py-spy's path: the venv's, else the PATH's."""
    return shutil.which("py-spy", path=str(harness.BIN_DIR)) or shutil.which("py-spy")


# --- the simulated daemons ---------------------------------------------------------------------------------


class BenchJobManager(JobManager):
    """The daemon's real job manager, minus the process: a dispatch is checked and answered with
    ``job_started`` as usual, then the task is handed to ``on_started`` and "runs" until it is cancelled
    (``cancel_job``, its lease gone, the daemon shutting down), when it exits with ``job_exited``."""

    def __init__(self, *, on_started: Callable[[Task], None], **options) -> None:
        super().__init__(**options)
        self.on_started = on_started

    async def _launch(self, task: Task) -> None:
        # No work dir, bridge or process: _clean_up has nothing to remove.
        return None

    async def _supervise(self, task: Task) -> protocol.JobExited:
        self.on_started(task)
        await task.cancel_requested.wait()
        return protocol.JobExited(task_id=task.task_id, cancelled=True, reason=task.cancel_reason or "")


@dataclass
class SimulatedDaemon:
    name: str
    daemon: WorkerDaemon
    started: list[Task] = field(default_factory=list)
    run_task: asyncio.Task[int] | None = None

    @classmethod
    def create(cls, *, name: str, token: str, server_url: str, work_dir: Path) -> SimulatedDaemon:
        config = WorkerConfig.model_validate({**DAEMON_CONFIG, "work_dir": str(work_dir)})
        daemon = WorkerDaemon(config=config, server_url=server_url, token=token)
        simulated = cls(name=name, daemon=daemon)
        # The job manager reads the session's lease book, which the daemon makes: replace it before run().
        daemon.jobs = BenchJobManager(
            config=config,
            book=daemon.session.book,
            server_url=daemon.url,
            request_timeout=REQUEST_TIMEOUT,
            on_started=simulated.started.append,
        )
        return simulated

    def start(self) -> None:
        self.run_task = asyncio.create_task(self.daemon.run(), name=f"daemon-{self.name}")

    @property
    def welcomed(self) -> bool:
        return self.daemon.session.welcomed

    async def request(self, task_id: uuid.UUID, progress: dict) -> protocol.StatusReply:
        """One status round trip through the daemon's own request path (what a bridge's /status/send uses)."""
        message = protocol.StatusReport(request_id=uuid.uuid4(), task_id=task_id, progress=progress)
        reply = await self.daemon.jobs.link.request(message, timeout=REQUEST_TIMEOUT)
        assert isinstance(reply, protocol.StatusReply)
        return reply

    async def stop(self) -> int | None:
        self.daemon.request_shutdown(reason="benchmark finished")
        if self.run_task is None:
            return None
        try:
            return await asyncio.wait_for(self.run_task, 15.0)
        except TimeoutError:
            self.run_task.cancel()
            return None


async def wait_for(predicate: Callable[[], bool], *, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.perf_counter() + timeout
    while not predicate():
        if time.perf_counter() > deadline:
            return False
        await asyncio.sleep(interval)
    return True


# --- measuring ---------------------------------------------------------------------------------------------


@dataclass
class Samples:
    """Completed round trips: (completion time, latency in seconds, reply type, whether it reached the control
    plane), and the failures."""

    done: list[tuple[float, float, str, bool]] = field(default_factory=list)
    #: (time, what): timeouts and exceptions of the request itself.
    failures: list[tuple[float, str]] = field(default_factory=list)


class Pacer:
    """When a trainer sends its next report: at once (closed loop, ``interval`` None), or ``interval`` s after
    the previous send — at once if that moment has passed (no burst to catch up)."""

    def __init__(self, interval: float | None) -> None:
        self.interval = interval
        self.next_at = time.perf_counter()

    async def wait(self) -> None:
        if self.interval is None:
            return
        delay = self.next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        self.next_at = max(self.next_at, time.perf_counter() - self.interval) + self.interval


async def trainer_loop(
    daemon: SimulatedDaemon, task: Task, samples: Samples, stop: asyncio.Event, pacer: Pacer
) -> None:
    """``--path link``: a trainer that does nothing but report steps straight to the control plane, one at a
    time, the next as soon as it is answered (or when ``pacer`` says)."""
    while not stop.is_set():
        await pacer.wait()
        sent = time.perf_counter()
        try:
            reply = await daemon.request(task.task_id, PROGRESS)
        except TimeoutError:
            samples.failures.append((time.perf_counter(), "timeout"))
            continue
        except Exception as error:  # a broken loop would silently lower the rate: count it and stop
            samples.failures.append((time.perf_counter(), f"{type(error).__name__}: {error}"))
            return
        finished = time.perf_counter()
        samples.done.append((finished, finished - sent, str(reply.reply.get("type")), True))


async def bridge_trainer_loop(
    daemon: SimulatedDaemon, task: Task, samples: Samples, stop: asyncio.Event, work_dir: Path, pacer: Pacer
) -> None:
    """``--path bridge``: a trainer as its executor talks to the bridge — step reports through the daemon's
    bridge backend until Hypha's counter reaches 0, then ``"update"`` and ``"update-received"``."""
    backend = RemoteBackend(
        task_id=task.task_id,
        job_id=str(task.dispatch.job_id),
        link=daemon.daemon.jobs.link,
        work_dir=work_dir,
        request_timeout=REQUEST_TIMEOUT,
    )
    counter = -1
    try:
        while not stop.is_set():
            await pacer.wait()
            forwarded = backend.local_continues == 0
            sent = time.perf_counter()
            try:
                reply = await backend.status(job_id=None, progress=PROGRESS)
                finished = time.perf_counter()
                if reply.get("type") == "ScheduleUpdate":
                    counter = int(reply.get("counter", 0))
                else:
                    counter -= 1
                if counter == 0:
                    await backend.status(job_id=None, progress="update")
                    await backend.status(job_id=None, progress="update-received")
                    counter = -1
            except NetworkError:
                samples.failures.append((time.perf_counter(), "timeout"))
                continue
            except Exception as error:  # a broken loop would silently lower the rate: count it and stop
                samples.failures.append((time.perf_counter(), f"{type(error).__name__}: {error}"))
                return
            samples.done.append((finished, finished - sent, str(reply.get("type")), forwarded))
    finally:
        await backend.close()


_METRIC_LINE = re.compile(r'^hypha_status_message_seconds_(sum|count)\{kind="status"\} (\S+)$', re.MULTILINE)


async def status_seconds(api: httpx.AsyncClient, web_urls: list[str]) -> tuple[float, float] | None:
    """(sum of seconds, count) of ``hypha_status_message_seconds{kind="status"}``, summed over the web
    processes (each counts the reports it handled: hypha_site/metrics.py); None if one did not answer."""
    total, count = 0.0, 0.0
    for url in web_urls:
        values: dict[str, float] = {}
        with contextlib.suppress(httpx.HTTPError):
            response = await api.get(f"{url}/metrics")
            if response.status_code == 200:
                values = {kind: float(value) for kind, value in _METRIC_LINE.findall(response.text)}
        if "sum" not in values or "count" not in values:
            return None
        total += values["sum"]
        count += values["count"]
    return total, count


@dataclass
class Result:
    trainers: int
    scale: Scale = field(default_factory=Scale)
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    #: Step reports of the window that reached the control plane (the others were answered by the daemon).
    forwarded: int = 0
    replies: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    setup_seconds: float = 0.0
    #: Mean seconds the control plane spent per status (from /metrics), None if unavailable.
    server_mean: float | None = None
    cpu: dict[str, float] = field(default_factory=dict)
    #: Busy CPU of the whole machine over the window, % of one core.
    machine_cpu: float = 0.0
    #: What the database did over the window (services mode): PostgresSampler.summary().
    database: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    #: The job's status and reason after the window, when a status was answered Error.
    job_reason: str | None = None

    @property
    def errors(self) -> int:
        return sum(self.failures.values()) + self.replies.get("Error", 0)

    @property
    def per_second(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0


# --- one trainer count -------------------------------------------------------------------------------------


async def run_count(
    *, trainers: int, api: httpx.AsyncClient, plane: harness.ControlPlane, tokens: dict[str, str],
    arguments: argparse.Namespace, work_root: Path,
) -> Result:  # fmt: skip
    result = Result(trainers=trainers, scale=arguments.scale)
    # Each daemon connects to one web process, in turn (round robin, as a load balancer spreads websockets).
    daemons = [
        SimulatedDaemon.create(
            name=name, token=tokens[name], server_url=plane.url_for(index), work_dir=work_root / name
        )
        for index, name in enumerate(sorted(tokens)[: trainers + 1])
    ]
    samples = Samples()
    stop = asyncio.Event()
    loops: list[asyncio.Task[None]] = []
    job_id: str | None = None
    profiler: subprocess.Popen | None = None
    for daemon in daemons:
        (work_root / daemon.name).mkdir(parents=True, exist_ok=True)
        daemon.start()
    try:
        if not await wait_for(lambda: all(daemon.welcomed for daemon in daemons), timeout=60.0):
            raise RuntimeError(
                f"only {sum(d.welcomed for d in daemons)} of {len(daemons)} daemons were welcomed"
            )

        # --- the job: allocated by the market, the parameter server dispatched, then the trainers ----------
        submitted = time.perf_counter()
        # Through the bridge trainers go round after round; straight to the control plane one round never ends.
        spec = diloco_spec(
            dataset=DATASET_NAME,
            trainers=trainers,
            rounds=1_000_000 if arguments.path == "bridge" else 1,
            inner_steps=arguments.inner_steps,
        )
        spec["batch_size"] = PROGRESS["status"]["batch_size"]
        response = await api.post("/api/jobs/diloco/", json={"name": f"status-load-{trainers}", **spec})
        if response.status_code != 201:
            raise RuntimeError(f"submission refused ({response.status_code}): {response.text}")
        job_id = response.json()["id"]

        def started(role: str) -> list[tuple[SimulatedDaemon, Task]]:
            return [(d, task) for d in daemons for task in d.started if task.dispatch.role == role]

        async def job_reason() -> str:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                job = (await api.get(f"/api/jobs/{job_id}/")).json()
                return f"{job.get('status')}: {job.get('status_reason')}"
            return "?"

        if not await wait_for(lambda: bool(started("parameter_server")), timeout=SETUP_TIMEOUT):
            raise RuntimeError(f"the parameter server was not dispatched: {await job_reason()}")
        server_daemon, server_task = started("parameter_server")[0]
        ready = await server_daemon.request(server_task.task_id, READY)
        # Ok, with the path trainers take to it ("relay": nothing listens at READY's address).
        if ready.reply.get("type") != "Ok":
            raise RuntimeError(
                f"the parameter server's ready was answered {ready.reply}: {await job_reason()}"
            )
        if not await wait_for(lambda: len(started("trainer")) >= trainers, timeout=SETUP_TIMEOUT):
            raise RuntimeError(
                f"{len(started('trainer'))} of {trainers} trainers were dispatched: {await job_reason()}"
            )
        result.setup_seconds = time.perf_counter() - submitted

        # --- load: every trainer in a closed loop; measure a window after the warm-up -------------------------
        interval = None if arguments.rate is None else trainers / arguments.rate
        loops = [
            asyncio.create_task(
                bridge_trainer_loop(daemon, task, samples, stop, work_root / daemon.name, Pacer(interval))
                if arguments.path == "bridge"
                else trainer_loop(daemon, task, samples, stop, Pacer(interval)),
                name=f"trainer-{daemon.name}",
            )
            for daemon, task in started("trainer")
        ]
        await asyncio.sleep(arguments.warmup)
        web = next(child for child in plane.children if child.name in ("web", "server"))
        meter = CpuMeter(harness.process_groups(plane))
        database = PostgresSampler(plane.env["DATABASE_URL"]) if plane.mode == "services" else None
        if arguments.profile is not None:
            arguments.profile.mkdir(parents=True, exist_ok=True)
            output = arguments.profile / f"web-{plane.mode}-{trainers}.txt"
            profiler = subprocess.Popen(
                [py_spy() or "py-spy", "record", "--pid", str(web.popen.pid), "--duration", str(math.ceil(arguments.seconds)),
                 "--rate", "200", "--format", "raw", "--nonblocking", "--output", str(output)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        server_before = await status_seconds(api, plane.web_urls)
        meter.start()
        if database is not None:
            database.start()
        window_start = time.perf_counter()
        await asyncio.sleep(arguments.seconds)
        window_end = time.perf_counter()
        meter.stop()
        if database is not None:
            database.stop()
            result.database = database.summary()
        server_after = await status_seconds(api, plane.web_urls)
        result.cpu = meter.percent
        result.machine_cpu = meter.machine
        result.seconds = window_end - window_start
        if server_before and server_after and server_after[1] > server_before[1]:
            result.server_mean = (server_after[0] - server_before[0]) / (server_after[1] - server_before[1])
        for finished, latency, reply, forwarded in samples.done:
            if window_start <= finished <= window_end:
                result.latencies.append(latency)
                result.replies[reply] += 1
                result.forwarded += forwarded
        for at, what in samples.failures:
            if window_start <= at <= window_end:
                result.failures[what] += 1
        # Failures during the warm-up count too: a loop that died there would lower the rate unseen.
        for at, what in samples.failures:
            if at < window_start:
                result.failures[f"(warm-up) {what}"] += 1
        if result.errors:
            result.job_reason = await job_reason()
    except RuntimeError as error:
        result.error = str(error)
    finally:
        stop.set()
        if loops:
            await asyncio.wait(loops, timeout=REQUEST_TIMEOUT + 1.0)
            for loop in loops:
                loop.cancel()
        if profiler is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                profiler.wait(30.0)
            if profiler.poll() is None:
                profiler.kill()
                profiler.wait()
        if job_id is not None:
            with contextlib.suppress(httpx.HTTPError):
                await api.post(f"/api/jobs/{job_id}/cancel/")
        await asyncio.gather(*(daemon.stop() for daemon in daemons))
    return result


# --- the report --------------------------------------------------------------------------------------------


def percentile(values: list[float], fraction: float) -> float:
    """The ``fraction`` quantile by linear interpolation (``statistics.quantiles``' inclusive method)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    if len(ordered) == 1:
        return ordered[0]
    position = (len(ordered) - 1) * fraction
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def milliseconds(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 1000:.1f}"


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def results_table(results: list[Result], mode: str) -> str:
    header = [
        "trainers", "mode", "control plane", "window (s)", "round trips", "round trips/s", "per trainer/s",
        "p50 (ms)", "p99 (ms)", "max (ms)", "to the control plane/s", "errors", "goal",
    ]  # fmt: skip
    rows = []
    for result in results:
        scale = str(result.scale) if mode == "services" else "one process"
        if result.error is not None:
            rows.append([str(result.trainers), mode, scale, *["-"] * 8, "setup failed", "-"])
            continue
        latencies = result.latencies
        met = result.per_second >= GOAL_PER_SECOND and percentile(latencies, 0.99) < GOAL_P99
        rows.append(
            [
                str(result.trainers),
                mode,
                scale,
                f"{result.seconds:.1f}",
                str(len(latencies)),
                f"{result.per_second:.0f}",
                f"{result.per_second / result.trainers:.1f}",
                milliseconds(percentile(latencies, 0.5)),
                milliseconds(percentile(latencies, 0.99)),
                milliseconds(max(latencies, default=math.nan)),
                f"{result.forwarded / result.seconds:.0f}" if result.seconds else "-",
                str(result.errors),
                "met" if met and not result.errors else "missed",
            ]
        )
    return markdown(header, rows)


def costs_table(results: list[Result]) -> str:
    names = sorted({name for result in results for name in result.cpu}, key=_cpu_order)
    header = [
        "trainers",
        "control plane",
        "mean latency (ms)",
        "control plane per status (ms)",
        "web CPU per forwarded report (ms)",
        *(f"CPU {n} (%)" for n in names),
        "CPU machine (%)",
    ]
    rows = []
    for result in results:
        if result.error is not None or not result.latencies:
            continue
        # The processes that serve the websockets (embedded: the only one) answer every forwarded status.
        web_cpu = sum(
            percent for name, percent in result.cpu.items() if name == "server" or name.split("-")[0] == "web"
        )
        forwarded = result.forwarded
        rows.append(
            [
                str(result.trainers),
                str(result.scale),
                milliseconds(statistics.fmean(result.latencies)),
                milliseconds(result.server_mean),
                f"{web_cpu / 100 * result.seconds / forwarded * 1000:.1f}" if forwarded else "-",
                *(f"{result.cpu[name]:.0f}" if name in result.cpu else "-" for name in names),
                f"{result.machine_cpu:.0f}",
            ]
        )
    return markdown(header, rows)


def database_table(results: list[Result]) -> str:
    """What PostgreSQL did in each window (services mode)."""
    keys = [
        "transactions/s",
        "active (mean)",
        "active (max)",
        "waiting for a lock (mean)",
        "connections (mean)",
    ]
    rows = [
        [
            str(result.trainers),
            str(result.scale),
            *(f"{result.database[key]:.1f}" for key in keys),
            # Little's law: mean busy backends ÷ throughput = mean time per transaction in the server.
            f"{1000 * result.database['active (mean)'] / result.database['transactions/s']:.1f}"
            if result.database.get("transactions/s")
            else "-",
        ]
        for result in results
        if result.database
    ]
    return markdown(["trainers", "control plane", *keys, "ms in the server per transaction"], rows)


def _cpu_order(name: str) -> tuple[int, str]:
    order = ["server", "web", "worker", "beat"]
    base = name.split("-")[0]
    if base in order:
        return (order.index(base), name)
    if name.startswith("postgres"):
        return (len(order), name)
    if name.startswith("redis"):
        return (len(order) + 1, name)
    return (len(order) + 2, name)


# --- running it --------------------------------------------------------------------------------------------


async def run(arguments: argparse.Namespace, plane: harness.ControlPlane, root: Path) -> list[Result]:
    api_token = plane.manage("create_user_token", "bench", "--staff")
    node_token = plane.manage("create_data_node_token", "bench-data-node", "--url", "http://127.0.0.1:1")
    dataset_dir = prepare_stdlib_text(root / "datasets" / DATASET_NAME, max_bytes=200_000)
    # The data node's own registration call (nothing downloads slices here: no executor runs).
    await register(
        server=plane.base_url,
        token=node_token,
        dataset=ServedDataset(name=DATASET_NAME, slices=scan(dataset_dir)),
        public_url="http://127.0.0.1:1",
    )
    async with httpx.AsyncClient(
        base_url=plane.base_url, headers={"Authorization": f"Token {api_token}"}, timeout=30.0
    ) as api:
        tokens: dict[str, str] = {}
        for index in range(max(arguments.trainers) + 1):
            name = f"bench-{index:03d}"
            response = await api.post("/api/workers/", json={"name": name})
            response.raise_for_status()
            tokens[name] = response.json()["token"]
        results = []
        for trainers in arguments.trainers:
            print(f"… {trainers} trainers", file=sys.stderr, flush=True)
            result = await run_count(
                trainers=trainers, api=api, plane=plane, tokens=tokens, arguments=arguments,
                work_root=root / "daemons",
            )  # fmt: skip
            if result.error is not None:
                print(f"  {trainers} trainers: {result.error}", file=sys.stderr)
            results.append(result)
        return results


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    mode = harness.resolve_mode(arguments.mode)
    if mode != "services" and arguments.scales != [Scale()]:
        raise SystemExit("--web and --celery above 1 need services mode (DATABASE_URL and REDIS_URL)")
    harness.exit_on_sigterm()
    load_at_start = harness.load_average()
    logging.basicConfig(
        level=logging.INFO if arguments.verbose else logging.ERROR,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = {
        "HYPHA_LEASE_TTL": str(arguments.lease_ttl),
        "HYPHA_TICK_INTERVAL": "0.2",
        "HYPHA_OFFER_WINDOW": "1.0",
        "HYPHA_OFFER_TTL": "3.0",
        "HYPHA_READVERTISE_BASE": "0.5",
        "HYPHA_READVERTISE_MAX": "2.0",
        # status_seconds() scrapes /metrics without credentials
        "HYPHA_METRICS_PUBLIC": "1",
    }
    results: list[Result] = []
    details: dict[str, str] = {}
    for scale in arguments.scales:
        arguments.scale = scale
        if len(arguments.scales) > 1:
            print(f"… control plane: {scale}", file=sys.stderr, flush=True)
        with (
            harness.run_directory(
                "hypha-bench-status-", keep=arguments.keep, note=" (control-plane logs in control-plane/logs/)"
            ) as root,
            harness.control_plane(
                mode=mode, root=root / "control-plane", settings=settings, quiet=not arguments.verbose,
                web=scale.web, celery=scale.celery,
            ) as plane,
        ):  # fmt: skip
            results += asyncio.run(run(arguments, plane, root))
            details = plane.details

    harness.print_markdown_header(
        "Status round-trip benchmark",
        mode=mode,
        details=details,
        load_at_start=load_at_start,
        settings=settings,
        run=(
            f"{arguments.seconds:g} s window after {arguments.warmup:g} s warm-up, "
            f"inner_steps {arguments.inner_steps}, path {arguments.path}, "
            + (f"offered {arguments.rate:g} round trips/s in total" if arguments.rate else "closed loop")
        ),
    )
    pacing = (
        f"each trainer paced to {arguments.rate:g}/N reports per second"
        if arguments.rate
        else "each trainer one status at a time (closed loop)"
    )
    print(
        "- daemons: N trainers + 1 parameter server, real WorkerDaemon sessions (2 cpu, 4 GB, whole) in this "
        f"one asyncio process, connected to the web processes in turn; {pacing}"
    )
    setups = ", ".join(
        f"{r.trainers} ({r.scale}): {r.setup_seconds:.1f} s" for r in results if r.error is None
    )
    print(f"- submission to every trainer dispatched: {setups or '-'}\n")
    print(results_table(results, mode))
    print(
        "\nWhere the time goes (mean client latency; the control plane's own time per status, "
        "hypha_status_message_seconds summed over the web processes; the web processes' CPU time per report "
        "that reached them; CPU % of one core over the window, the machine's over all its cores):\n"
    )
    print(costs_table(results))
    if any(result.database for result in results):
        print("\nPostgreSQL (this run's database; sampled every 0.25 s):\n")
        print(database_table(results))
    for result in results:
        label = f"{result.trainers} trainers ({result.scale})"
        if result.failures:
            print(f"\n{label}, failures: {dict(result.failures)}")
        other = {kind: count for kind, count in result.replies.items() if kind not in ("Continue",)}
        if other:
            print(f"\n{label}, replies other than Continue: {other}")
        if result.job_reason:
            print(f"\n{label}, the job after the window: {result.job_reason}")
    failed = any(result.error is not None or result.errors or not result.latencies for result in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
