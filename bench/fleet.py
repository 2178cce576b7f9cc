"""Fleet benchmark: a fleet of daemons holds leases and renews them for minutes while jobs come and go.

Starts a real control plane in services mode (``hypha-server web`` + Celery ``worker`` + ``beat`` on
PostgreSQL and Redis, from DATABASE_URL and REDIS_URL; see bench/harness.py) and ``--daemons`` simulated
daemons in this one asyncio process (bench/simulated.py: the real :class:`WorkerDaemon`, 2 cpu, 4 GB,
strategy ``whole``, each on its own websocket). They answer everything a real daemon answers: offers on
adverts, ``lease_renewed`` to every ``renew_lease`` for a lease they hold, releases at shutdown, and a
``dispatch_job`` with ``job_started`` (status_load.py's job manager, which runs no process; the default jobs
this benchmark submits have no training spec, so none is expected).

The run:

1. **fill** — ``--jobs`` default jobs (2 trainers + 1 parameter server: 3 leases each; by default enough for
   90 % of the fleet) are submitted and allocated, one after the other;
2. **window** — for ``--duration`` seconds a driver cancels the oldest job and submits a new one every
   ``1 / --churn`` seconds through the REST API, so allocation, lease creation and release go on under the
   renewal load;
3. **drain** — every job is cancelled, the daemons stop; then the lease tables are read from PostgreSQL.

Measured (renewal figures over the window):

* **renewals/s** committed by the control plane (``renewed`` lease events), against the rate the fleet needs:
  leases held ÷ (TTL × (1 − HYPHA_RENEW_AT_REMAINING)) on the control plane's schedule, and leases held ÷ TTL
  at the very least (one renewal per TTL);
* **renewal latency**, p50/p95/p99/max: the protocol acknowledges a renewal by committing it (no frame goes
  back), so the round trip is from the daemon's ``lease_renewed`` send to the commit (the ``renewed`` lease
  event's time; the daemons and the control plane share this machine's clock). And the whole cycle, from the
  moment the lease became due (HYPHA_RENEW_AT_REMAINING of its TTL left) to the ``renew_lease`` arrival at
  the daemon (the lease clock's tick, Celery, the channel layer) and to the commit; with the **time left** on
  each lease when its renewal committed: how close the control plane came to expiring it;
* leases created, activated, released, and **wrongful expiries**: ACTIVE leases that ended ``expired``
  (every daemon is alive and answers every request, so each one is wrongful), with their last renewal times;
  also what the daemons saw go wrong (leases dropped locally for want of a renewal request, ``renew_refused``,
  error frames, reconnects) and the REST driver's latencies and errors.

Goal: 0 wrongful expiries (and 0 leases lost the other way: dropped by a daemon that no ``renew_lease`` reached
within the TTL, then released by its late ``renew_refused``) — issue 15: at 1,000 daemons, one of them flooding.

Hostile load: ``--flooders N`` (default 1) workers flood the first web process during the window
(``bench/flooder.py``, a process each: ``lease_renewed`` frames of leases they do not hold, as fast as the socket
takes them, reconnecting at once whenever the gateway closes them), as in ``tests/e2e/test_flood.py``.

Scale-out: ``--web N --celery M`` run the control plane with N daphne processes (the daemons connect to them in
turn, as a load balancer spreads websockets) and M Celery workers; comma-separated lists run one control plane
after the other, and the report puts them side by side, with the CPU of every process, of the run's PostgreSQL
backends and of the whole machine, and what the database did (``bench/harness.py``).

Usage::

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/bench_fleet REDIS_URL=redis://127.0.0.1:6379/15 \\
        SECRET_KEY=$(python -c 'import secrets; print(secrets.token_urlsafe(40))') \\
        python bench/fleet.py                            # 200 daemons, 5 minutes, TTL 10 s
    python bench/fleet.py --quick                        # 30 daemons, 30 s, for development
    python bench/fleet.py --daemons 200 --duration 180 --ttl 3
    python bench/fleet.py --daemons 1000 --duration 120 --web 1,2 --celery 1,2   # 1 vs 2 of each, one flooder

Exits 1 if any lease expired wrongfully, 2 if the fleet did not hold half of its leases (nothing measured). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import logging
import resource
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/fleet.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from bench import harness  # noqa: E402
from bench.fleet_report import DRAIN_TIMEOUT, RENEW_AT_REMAINING, SUMMARY_HEADER, report, summary_row  # noqa: E402
from bench.flooder import start_flooders, stop_flooders  # noqa: E402
from bench.harness import CeleryQueueSampler, CpuMeter, PostgresSampler, Scale, process_tree  # noqa: E402
from bench.simulated import SimulatedDaemon, markdown, wait_for  # noqa: E402
from bench.status_load import BenchJobManager  # noqa: E402
from worker_daemon import protocol  # noqa: E402

#: The default job (POST /api/jobs/ with only num_trainers): 2 trainers + 1 parameter server, 1 cpu, 1 GB each.
JOB = {"num_trainers": 2}
LEASES_PER_JOB = 3
#: Seconds to wait for one job's leases while the fleet fills up, and for the whole fill.
JOB_FILL_TIMEOUT = 20.0
FILL_TIMEOUT = 240.0
#: The whole fill may take at least this long per job (300 jobs at 1,000 daemons: 300 s).
FILL_SECONDS_PER_JOB = 1.0
WELCOME_TIMEOUT = 120.0
SAMPLE_INTERVAL = 0.5


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python bench/fleet.py",
        description=__doc__.split("\n\n")[0],
        epilog="Needs DATABASE_URL, REDIS_URL (and SECRET_KEY). Prints markdown tables; see docs/benchmarks.md.",
    )
    parser.add_argument("--daemons", type=int, help="simulated daemons (default: 200; --quick: 30)")
    parser.add_argument(
        "--duration", type=float, help="seconds of the measured window (default: 300; --quick: 30)"
    )
    parser.add_argument("--ttl", type=float, default=10.0, help="HYPHA_LEASE_TTL, seconds (default: 10)")
    parser.add_argument(
        "--tick",
        type=float,
        default=0.5,
        help="HYPHA_TICK_INTERVAL of the lease and market clocks (default: 0.5)",
    )
    parser.add_argument(
        "--jobs", type=int, help="jobs held at once (default: enough for 90 %% of the daemons, 3 leases each)"
    )
    parser.add_argument(
        "--churn",
        type=float,
        default=0.5,
        help="jobs cancelled and submitted per second during the window (default: 0.5)",
    )
    parser.add_argument(
        "--connect-rate",
        type=float,
        default=20.0,
        help="daemons started per second at the beginning; 0 = all at once (default: 20)",
    )
    parser.add_argument(
        "--offer-window",
        type=float,
        default=1.0,
        help="HYPHA_OFFER_WINDOW, seconds an advert takes offers (default: 1, the control plane's default); "
        "HYPHA_OFFER_TTL is 3 s or twice the window, whichever is longer",
    )
    parser.add_argument(
        "--flooders",
        type=int,
        default=1,
        help="hostile workers flooding the first web process during the window (bench/flooder.py; default: 1)",
    )
    harness.add_scale_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="a short run for development: 30 daemons, 30 s")
    parser.add_argument("--verbose", action="store_true", help="daemon and control-plane logs at INFO")
    parser.add_argument(
        "--keep", action="store_true", help="keep the run's directory (control-plane logs) and print its path"
    )
    arguments = parser.parse_args(argv)
    if arguments.daemons is None:
        arguments.daemons = 30 if arguments.quick else 200
    if arguments.duration is None:
        arguments.duration = 30.0 if arguments.quick else 300.0
    if arguments.jobs is None:
        arguments.jobs = max(1, int(arguments.daemons * 0.9) // LEASES_PER_JOB)
    if arguments.daemons < LEASES_PER_JOB:
        parser.error(f"--daemons must be at least {LEASES_PER_JOB} (one job's leases)")
    if arguments.jobs * LEASES_PER_JOB > arguments.daemons:
        parser.error(f"--jobs × {LEASES_PER_JOB} leases must fit in --daemons (one lease per daemon)")
    if arguments.churn <= 0 or arguments.duration <= 0:
        parser.error("--churn and --duration must be positive")
    if arguments.flooders < 0:
        parser.error("--flooders must not be negative")
    arguments.scales = harness.scale_configurations(parser, arguments)
    return arguments


# --- what the daemons hear and say -------------------------------------------------------------------------


@dataclass
class LeaseTrace:
    """One lease as its daemon saw it; times are ``time.time()`` (the control plane's clock too)."""

    worker: str
    granted_at: float | None = None
    #: Arrivals of ``renew_lease``, and sends of ``lease_renewed``.
    requests: list[float] = field(default_factory=list)
    confirmations: list[float] = field(default_factory=list)
    #: (status, arrival, reason) of its ``lease_ended``.
    ended: tuple[str, float, str] | None = None
    #: When the daemon's book dropped it because no renewal request came in time.
    dropped_at: float | None = None


@dataclass
class Recorder:
    """Everything the simulated daemons received and sent that this benchmark reports."""

    leases: dict[uuid.UUID, LeaseTrace] = field(default_factory=dict)
    welcomes: Counter[str] = field(default_factory=Counter)
    #: ``hello`` frames sent, by daemon: one per connection, so more than one is a reconnect.
    hellos: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)
    refusals: list[tuple[uuid.UUID, str]] = field(default_factory=list)
    declines: Counter[str] = field(default_factory=Counter)
    received_types: Counter[str] = field(default_factory=Counter)
    sent_types: Counter[str] = field(default_factory=Counter)

    def listener(self, worker: str) -> DaemonListener:
        return DaemonListener(self, worker)

    def trace(self, lease_id: uuid.UUID, worker: str) -> LeaseTrace:
        trace = self.leases.get(lease_id)
        if trace is None:
            trace = self.leases[lease_id] = LeaseTrace(worker=worker)
        return trace


@dataclass
class DaemonListener:
    """One daemon's :class:`bench.simulated.Listener`: stamps each message and files it in the recorder."""

    recorder: Recorder
    worker: str

    def received(self, message: protocol.ServerMessage) -> None:
        now = time.time()
        recorder = self.recorder
        recorder.received_types[message.type] += 1
        match message:
            case protocol.RenewLease():
                recorder.trace(message.lease_id, self.worker).requests.append(now)
            case protocol.LeaseGranted():
                recorder.trace(message.lease_id, self.worker).granted_at = now
            case protocol.LeaseEnded():
                trace = recorder.trace(message.lease_id, self.worker)
                trace.ended = (str(message.status), now, message.reason)
            case protocol.Welcome():
                recorder.welcomes[self.worker] += 1
            case protocol.OfferDeclined():
                recorder.declines[message.reason[:100]] += 1
            case protocol.Error():
                recorder.errors[message.code.value] += 1
                if len(recorder.error_samples) < 10:
                    recorder.error_samples.append(f"{self.worker}: {message.code.value}: {message.message}")

    def sent(self, message: protocol.DaemonMessage) -> None:
        now = time.time()
        recorder = self.recorder
        recorder.sent_types[message.type] += 1
        match message:
            case protocol.LeaseRenewed():
                recorder.trace(message.lease_id, self.worker).confirmations.append(now)
            case protocol.RenewRefused():
                recorder.refusals.append((message.lease_id, message.reason))

    def dropped(self, lease_id: uuid.UUID) -> None:
        self.recorder.trace(lease_id, self.worker).dropped_at = time.time()


def simulated_daemon(*, name: str, token: str, server_url: str, work_dir: Path, recorder: Recorder):
    listener = recorder.listener(name)
    daemon = SimulatedDaemon(
        name=name,
        token=token,
        server_url=server_url,
        work_dir=work_dir,
        recorder=listener,
        jobs=lambda config, book, url: BenchJobManager(
            config=config, book=book, server_url=url, on_started=lambda task: None
        ),
    )
    # A lease the book drops is one whose renewal request never came in time (its local expiry passed).
    book = daemon.daemon.session.book
    prune = book.prune

    def recording_prune(*args, **kwargs):
        reservations, leases = prune(*args, **kwargs)
        for lease in leases:
            listener.dropped(lease.lease_id)
        return reservations, leases

    book.prune = recording_prune
    session = daemon.daemon.session
    hello = session.hello

    def recording_hello():
        listener.recorder.hellos[name] += 1
        return hello()

    session.hello = recording_hello
    return daemon


# --- the driver --------------------------------------------------------------------------------------------


@dataclass
class Driver:
    """Submits and cancels default jobs through the REST API, and times each call."""

    api: httpx.AsyncClient
    live: collections.deque[str] = field(default_factory=collections.deque)
    submitted: int = 0
    cancelled: int = 0
    submit_seconds: list[float] = field(default_factory=list)
    cancel_seconds: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)

    async def submit(self, name: str) -> None:
        started = time.perf_counter()
        try:
            response = await self.api.post("/api/jobs/", json={"name": name, **JOB})
        except httpx.HTTPError as error:
            self.failures[f"POST /api/jobs/: {type(error).__name__}"] += 1
            return
        self.submit_seconds.append(time.perf_counter() - started)
        if response.status_code != 201:
            self.failures[f"POST /api/jobs/: HTTP {response.status_code}"] += 1
            return
        self.submitted += 1
        self.live.append(response.json()["id"])

    async def cancel_oldest(self) -> None:
        if not self.live:
            return
        job_id = self.live.popleft()
        started = time.perf_counter()
        try:
            response = await self.api.post(f"/api/jobs/{job_id}/cancel/")
        except httpx.HTTPError as error:
            self.failures[f"POST /api/jobs/{{id}}/cancel/: {type(error).__name__}"] += 1
            return
        self.cancel_seconds.append(time.perf_counter() - started)
        if response.status_code >= 300:
            self.failures[f"POST /api/jobs/{{id}}/cancel/: HTTP {response.status_code}"] += 1
            return
        self.cancelled += 1

    async def churn(self, *, rate: float, until: float) -> None:
        """Every ``1 / rate`` s until ``until`` (monotonic): cancel the oldest job, submit a new one."""
        interval = 1.0 / rate
        next_at = time.monotonic()
        index = 0
        while True:
            next_at += interval
            delay = next_at - time.monotonic()
            if next_at >= until:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            await self.cancel_oldest()
            await self.submit(f"fleet-churn-{index}")
            index += 1


@dataclass
class Sampler:
    """Leases the fleet holds, and how late this process's event loop wakes up (its daemons answer late
    by as much), every :data:`SAMPLE_INTERVAL` seconds."""

    daemons: list[SimulatedDaemon]
    held: list[int] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)

    async def run(self, until: float) -> None:
        while time.monotonic() < until:
            before = time.monotonic()
            await asyncio.sleep(SAMPLE_INTERVAL)
            self.lag.append(max(0.0, time.monotonic() - before - SAMPLE_INTERVAL))
            self.held.append(sum(len(daemon.daemon.session.book.leases) for daemon in self.daemons))


# --- what the control plane recorded -----------------------------------------------------------------------


@dataclass
class LeaseRow:
    id: uuid.UUID
    worker: str
    job_id: uuid.UUID
    role: str
    status: str
    reason: str
    created_at: float
    activated_at: float | None
    ended_at: float | None
    expires_at: float
    renewals: int
    #: (kind, at, expires_at) of its activated, renewed and extended (the lease clock resumed) events, in order.
    events: list[tuple[str, float, float]] = field(default_factory=list)


def _epoch(value: datetime.datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def read_leases(database_url: str) -> dict[uuid.UUID, LeaseRow]:
    import psycopg

    rows: dict[uuid.UUID, LeaseRow] = {}
    with psycopg.connect(database_url, connect_timeout=10) as connection:
        for record in connection.execute(
            "SELECT l.id, w.name, l.job_id, l.role, l.status, l.status_reason, l.created_at, l.activated_at,"
            " l.ended_at, l.expires_at, l.renewals"
            " FROM leases_lease l JOIN workers_worker w ON w.id = l.worker_id"
        ):
            rows[record[0]] = LeaseRow(
                id=record[0], worker=record[1], job_id=record[2], role=record[3], status=record[4],
                reason=record[5], created_at=record[6].timestamp(), activated_at=_epoch(record[7]),
                ended_at=_epoch(record[8]), expires_at=record[9].timestamp(), renewals=record[10],
            )  # fmt: skip
        for lease_id, kind, at, expires_at in connection.execute(
            "SELECT lease_id, kind, at, expires_at FROM leases_leaseevent"
            " WHERE kind IN ('activated', 'renewed', 'extended') ORDER BY lease_id, at, id"
        ):
            rows[lease_id].events.append((kind, at.timestamp(), expires_at.timestamp()))
    return rows


def control_plane_problems(plane: harness.ControlPlane) -> Counter[str]:
    """ERROR and WARNING lines and tracebacks in the control plane's logs, by their message (times cut)."""
    problems: Counter[str] = Counter()
    for child in plane.children:
        with contextlib.suppress(OSError):
            for line in child.log.read_text(errors="replace").splitlines():
                if "Traceback" in line or " ERROR " in line or " WARNING " in line or "CRITICAL" in line:
                    # Drop the timestamp and ids so that repeats of one message count together.
                    text = line.split(" ", 2)[-1] if line[:2].isdigit() else line
                    problems[f"{child.name}: {text[:160]}"] += 1
    return problems


# --- one run -----------------------------------------------------------------------------------------------


@dataclass
class Run:
    daemons: int
    scale: Scale = field(default_factory=Scale)
    window_start: float = 0.0
    window_end: float = 0.0
    fill_seconds: float = 0.0
    leases: dict[uuid.UUID, LeaseRow] = field(default_factory=dict)
    recorder: Recorder = field(default_factory=Recorder)
    driver: Driver | None = None
    sampler: Sampler | None = None
    cpu: dict[str, float] = field(default_factory=dict)
    bench_cpu_percent: float = 0.0
    #: Busy CPU of the whole machine in the window, % of one core.
    machine_cpu: float = 0.0
    #: What PostgreSQL did in the window (PostgresSampler.summary()).
    database: dict[str, float] = field(default_factory=dict)
    #: Each flooder's report (bench/flooder.py); they flood the first web process.
    flood: list[dict] = field(default_factory=list)
    #: The web process (index into plane.web_urls) each daemon connected to, by worker name.
    web_of: dict[str, int] = field(default_factory=dict)
    problems: Counter[str] = field(default_factory=Counter)
    not_welcomed: int = 0
    not_freed: int = 0


async def fleet_run(
    arguments: argparse.Namespace, plane: harness.ControlPlane, work_root: Path, scale: Scale
) -> Run:
    run = Run(daemons=arguments.daemons, scale=scale)
    api_token = plane.manage("create_user_token", "bench", "--staff")
    async with httpx.AsyncClient(
        base_url=plane.base_url, headers={"Authorization": f"Token {api_token}"}, timeout=30.0
    ) as api:
        tokens: dict[str, str] = {}
        for index in range(arguments.daemons):
            name = f"fleet-{index:03d}"
            response = await api.post("/api/workers/", json={"name": name})
            response.raise_for_status()
            tokens[name] = response.json()["token"]
        flooder_tokens = []
        for index in range(arguments.flooders):
            response = await api.post("/api/workers/", json={"name": f"fleet-flooder-{index + 1}"})
            response.raise_for_status()
            flooder_tokens.append(response.json()["token"])
        daemons = []
        # Each daemon connects to one web process, in turn (round robin, as a load balancer spreads websockets).
        for index, (name, token) in enumerate(tokens.items()):
            run.web_of[name] = index % len(plane.web_urls)
            (work_root / name).mkdir(parents=True, exist_ok=True)
            daemons.append(
                simulated_daemon(
                    name=name, token=token, server_url=plane.url_for(index), work_dir=work_root / name,
                    recorder=run.recorder,
                )
            )  # fmt: skip
        # Connected at --connect-rate, as a fleet that comes up over a while; 0 = all at once, as after a
        # control-plane restart (the daemons' own backoff jitter spreads their reconnects, though).
        for daemon in daemons:
            daemon.start()
            if arguments.connect_rate > 0:
                await asyncio.sleep(1.0 / arguments.connect_rate)
        driver = run.driver = Driver(api=api)
        try:
            print(f"… {len(daemons)} daemons connecting", file=sys.stderr, flush=True)
            if not await wait_for(
                lambda: all(d.welcomed for d in daemons), timeout=WELCOME_TIMEOUT, interval=0.1
            ):
                run.not_welcomed = sum(not daemon.welcomed for daemon in daemons)
                raise RuntimeError(f"{run.not_welcomed} of {len(daemons)} daemons were not welcomed")

            # --- fill ------------------------------------------------------------------------------------
            print(f"… filling: {arguments.jobs} jobs", file=sys.stderr, flush=True)
            started = time.monotonic()
            wanted = arguments.jobs * LEASES_PER_JOB

            def held_now() -> int:
                return sum(daemon.holds_lease for daemon in daemons)

            # One job at a time: with every daemon free, every advert gets an offer from each of them, and
            # many adverts open at once would only make the offers queue behind one another.
            for index in range(arguments.jobs):
                before = held_now()
                await driver.submit(f"fleet-fill-{index}")
                await wait_for(
                    lambda before=before: held_now() >= before + LEASES_PER_JOB,
                    timeout=JOB_FILL_TIMEOUT,
                    interval=0.05,
                )
                if time.monotonic() - started > max(FILL_TIMEOUT, FILL_SECONDS_PER_JOB * arguments.jobs):
                    break
            await wait_for(lambda: held_now() >= wanted, timeout=JOB_FILL_TIMEOUT, interval=0.1)
            run.fill_seconds = time.monotonic() - started
            held = sum(daemon.holds_lease for daemon in daemons)
            if held < wanted:
                print(
                    f"  warning: {held} of {wanted} leases held after {run.fill_seconds:.0f}s",
                    file=sys.stderr,
                )

            # --- window (skipped when the fleet did not fill: there would be nothing to measure) -----
            if held >= wanted / 2:
                print(
                    f"… window: {arguments.duration:g}s, churn {arguments.churn:g} jobs/s",
                    file=sys.stderr,
                    flush=True,
                )
                flooders = start_flooders(plane, flooder_tokens, plane.log_dir)
                groups = harness.process_groups(plane)
                # The load generator's own share is measured below (rusage); the flooders are the hostile load.
                del groups["benchmark (load generator)"]
                if flooders:
                    groups["flooders"] = lambda: [p for f in flooders for p in process_tree(f.pid)]
                meter = CpuMeter(groups)
                database = PostgresSampler(plane.env["DATABASE_URL"])
                queue = CeleryQueueSampler(plane.env["REDIS_URL"])
                run.sampler = Sampler(daemons=daemons)
                until = time.monotonic() + arguments.duration
                meter.start()
                database.start()
                queue.start()
                cpu_before = resource.getrusage(resource.RUSAGE_SELF)
                run.window_start = time.time()
                try:
                    await asyncio.gather(
                        driver.churn(rate=arguments.churn, until=until), run.sampler.run(until)
                    )
                finally:
                    run.window_end = time.time()
                    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
                    meter.stop()
                    database.stop()
                    queue.stop()
                    run.flood = stop_flooders(flooders)
                run.cpu = meter.percent
                run.machine_cpu = meter.machine
                run.database = {**database.summary(), **queue.summary()}
                used = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
                run.bench_cpu_percent = 100.0 * used / (run.window_end - run.window_start)

            # --- drain -------------------------------------------------------------------------------------
            print("… draining", file=sys.stderr, flush=True)
            while driver.live:
                await driver.cancel_oldest()
            if not await wait_for(lambda: all(d.free for d in daemons), timeout=DRAIN_TIMEOUT, interval=0.1):
                run.not_freed = sum(not daemon.free for daemon in daemons)
        finally:
            await asyncio.gather(*(daemon.stop() for daemon in daemons))
    run.leases = read_leases(plane.env["DATABASE_URL"])
    run.problems = control_plane_problems(plane)
    return run


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    harness.exit_on_sigterm()
    harness.print_start()
    mode = harness.resolve_mode("services")
    load_at_start = harness.load_average()
    logging.basicConfig(
        level=logging.INFO if arguments.verbose else logging.ERROR,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = {
        "HYPHA_LEASE_TTL": f"{arguments.ttl:g}",
        "HYPHA_RENEW_AT_REMAINING": f"{RENEW_AT_REMAINING:g}",
        "HYPHA_TICK_INTERVAL": f"{arguments.tick:g}",
        "HYPHA_OFFER_WINDOW": f"{arguments.offer_window:g}",
        "HYPHA_OFFER_TTL": f"{max(3.0, 2 * arguments.offer_window):g}",
        "HYPHA_READVERTISE_MAX": "5",
    }
    runs: list[Run] = []
    details: dict[str, str] = {}
    for scale in arguments.scales:
        print(f"… control plane: {scale}", file=sys.stderr, flush=True)
        with (
            harness.run_directory(
                "hypha-fleet-", keep=arguments.keep, note=" (control-plane logs in control-plane/logs/)"
            ) as root,
            harness.control_plane(
                mode=mode, root=root / "control-plane", settings=settings, quiet=not arguments.verbose,
                web=scale.web, celery=scale.celery,
            ) as plane,
        ):  # fmt: skip
            runs.append(asyncio.run(fleet_run(arguments, plane, root / "daemons", scale)))
            details = plane.details

    harness.print_markdown_header(
        "Fleet benchmark",
        mode=mode,
        details=details,
        load_at_start=load_at_start,
        settings=settings,
        run=(
            f"{arguments.daemons} daemons, {arguments.jobs} jobs held, churn {arguments.churn:g} jobs/s, "
            f"window {arguments.duration:g}s, {arguments.flooders} flooder(s) on the first web process"
        ),
    )
    print(
        "- daemons: real WorkerDaemon sessions (2 cpu, 4 GB, strategy whole) in this one asyncio process, "
        "connected to the web processes in turn\n"
    )
    print("## Side by side\n")
    print(markdown(SUMMARY_HEADER, [summary_row(run, arguments) for run in runs]))
    status = 0
    for run in runs:
        print(f"\n# {run.scale} (fill took {run.fill_seconds:.0f}s)\n")
        met = report(run, arguments)
        held = run.sampler.held if run.sampler else []
        if met and (not held or sum(held) / len(held) < 0.5 * arguments.jobs * LEASES_PER_JOB):
            print(
                f"\nGoal (0 wrongful expiries), {run.scale}: NOT MEASURED — the fleet held under half of its "
                f"{arguments.jobs * LEASES_PER_JOB} leases in the window (see the offers declined above)"
            )
            status = max(status, 2)
            continue
        print(f"\nGoal (0 wrongful expiries), {run.scale}: {'met' if met else 'MISSED'}")
        if not met:
            status = 1 if status != 2 else status
    return status


if __name__ == "__main__":
    sys.exit(main())
