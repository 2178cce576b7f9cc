"""Allocation benchmark: how fast a job gets its leases, and how many renewals the control plane handles.

Starts a real control plane (``--mode auto``: services when DATABASE_URL and REDIS_URL are set, embedded
otherwise; see bench/harness.py) and, for each fleet size, that many simulated worker daemons in this one
asyncio process. The daemons are the real thing: :class:`worker_daemon.connection.WorkerDaemon` with a
2-cpu/4-GB ``whole`` config (the e2e test's), each on its own websocket; the benchmark only listens in on
the messages their sessions handle.

Per fleet size it measures

* **allocation latency**: ``--jobs`` jobs of 2 trainers + 1 parameter server, one at a time; from the moment
  ``POST /api/jobs/`` returns to the arrival of the third ``lease_granted`` at the daemons (the control plane
  sends it after committing the lease ACTIVE, so all three granted = allocated). Each job is cancelled once
  allocated, and the next one starts when every daemon is free again.
* **renewal throughput**: with every daemon holding a lease (``ceil(daemons / 3)`` jobs, the last one maybe
  partly allocated) and a short lease TTL, ``renew_lease → lease_renewed`` round trips per second over
  ``--renewal-seconds``: sent by the daemons, and confirmed by the control plane (the growth of the leases'
  ``renewals`` counters). The rate is bounded by demand (each lease is due about every third of a TTL), so
  the telling column is "leases expired" (while the fleet filled up or in the window): any expiry means the
  control plane fell behind its renewals.

A second table splits the median allocation into its steps: the POST round trip, the first advert's
arrival at a daemon, the last trainer grant and the parameter server's grant, and the offers per job. A third
shows the CPU of each process and of the whole machine, and what the run's PostgreSQL database did, over the
allocation phase (``bench/harness.py``).

``--web N --celery M`` (services mode): N daphne processes, the daemons connected to them in turn (round robin,
as a load balancer spreads websockets), and M Celery workers; comma-separated lists run one control plane after
the other, side by side in the tables. Goal (issue 15): allocation p50 < 500 ms at 256 daemons.

Usage::

    python bench/allocation.py                          # 8, 16 and 32 daemons, 20 jobs each, mode auto
    python bench/allocation.py --sizes 16 --jobs 50
    python bench/allocation.py --mode services --sizes 256 --lease-ttl 10 --web 1,2 --celery 1,2
    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/hypha_bench REDIS_URL=redis://127.0.0.1:6379/15 \\
        SECRET_KEY=$(python -c 'import secrets; print(secrets.token_urlsafe(40))') python bench/allocation.py

Results and how to read them: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import statistics
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import harness
import httpx
from simulated import SimulatedDaemon, markdown, milliseconds, percentile, wait_for

from worker_daemon import protocol

JOB = {"num_trainers": 2}
LEASES_PER_JOB = 3
#: Seconds to wait for one job's three grants before counting it as not allocated.
ALLOCATION_TIMEOUT = 15.0
#: Seconds to wait for every daemon to be free after a cancellation.
FREE_TIMEOUT = 10.0


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python bench/allocation.py",
        description=__doc__.split("\n\n")[0],
        epilog="Prints the machine, the mode and a markdown table. See docs/benchmarks.md for results.",
    )
    parser.add_argument(
        "--sizes",
        default="8,16,32",
        help="fleet sizes (simulated daemons), comma-separated (default: 8,16,32)",
    )
    parser.add_argument("--jobs", type=int, default=20, help="measured jobs per fleet size (default: 20)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured jobs first, per size (default: 2)")
    parser.add_argument(
        "--mode",
        choices=["auto", "embedded", "services"],
        default="auto",
        help="auto: services if DATABASE_URL and REDIS_URL are set, else embedded (default: auto)",
    )
    parser.add_argument(
        "--lease-ttl", type=float, default=1.0, help="HYPHA_LEASE_TTL, seconds (default: 1.0, the minimum)"
    )
    parser.add_argument(
        "--tick",
        type=float,
        default=0.2,
        help="HYPHA_TICK_INTERVAL of the lease and market clocks (default: 0.2)",
    )
    parser.add_argument(
        "--renewal-seconds", type=float, default=10.0, help="length of the renewal window (default: 10)"
    )
    harness.add_scale_arguments(parser)
    parser.add_argument("--verbose", action="store_true", help="daemon and control-plane logs at INFO")
    parser.add_argument(
        "--keep", action="store_true", help="keep the run's directory (control-plane logs) and print its path"
    )
    arguments = parser.parse_args(argv)
    try:
        arguments.sizes = [int(size) for size in arguments.sizes.split(",") if size.strip()]
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, not {arguments.sizes!r}")
    if not arguments.sizes or min(arguments.sizes) < LEASES_PER_JOB:
        parser.error(f"every fleet size must be at least {LEASES_PER_JOB} (one job's leases)")
    if arguments.jobs < 1:
        parser.error("--jobs must be at least 1")
    arguments.scales = harness.scale_configurations(parser, arguments)
    return arguments


# --- listening in on the daemons ------------------------------------------------------------------------


@dataclass
class Recorder:
    """What the simulated daemons received and sent, with ``time.perf_counter()`` arrival times."""

    #: Per job: (arrival time, role) of each ``lease_granted``.
    grants: dict[uuid.UUID, list[tuple[float, str]]] = field(default_factory=lambda: defaultdict(list))
    #: Per job: the arrival of its first advertisement at any daemon.
    first_advert: dict[uuid.UUID, float] = field(default_factory=dict)
    #: Per job: offers the daemons made on its advertisements.
    offers: dict[uuid.UUID, int] = field(default_factory=lambda: defaultdict(int))
    advert_jobs: dict[uuid.UUID, uuid.UUID] = field(default_factory=dict)
    renewed: int = 0
    expired: int = 0
    _waiters: dict[uuid.UUID, tuple[asyncio.Future, int]] = field(default_factory=dict)

    def received(self, message: protocol.ServerMessage) -> None:
        now = time.perf_counter()
        if isinstance(message, protocol.LeaseGranted):
            self._granted(message.job_id, message.role, now)
        elif isinstance(message, protocol.Advertisement):
            self.advert_jobs[message.advertisement_id] = message.job_id
            self.first_advert.setdefault(message.job_id, now)
        elif isinstance(message, protocol.LeaseEnded) and message.status == "expired":
            self.expired += 1

    def sent(self, message: protocol.DaemonMessage) -> None:
        if isinstance(message, protocol.LeaseRenewed):
            self.renewed += 1
        elif isinstance(message, protocol.Offer):
            job_id = self.advert_jobs.get(message.advertisement_id)
            if job_id is not None:
                self.offers[job_id] += 1

    def _granted(self, job_id: uuid.UUID, role: str, at: float) -> None:
        grants = self.grants[job_id]
        grants.append((at, role))
        waiter = self._waiters.get(job_id)
        if waiter is not None and len(grants) >= waiter[1] and not waiter[0].done():
            waiter[0].set_result(None)

    async def allocated(self, job_id: uuid.UUID, *, count: int, timeout: float) -> float | None:
        """The arrival time of the job's ``count``-th grant, or None if it did not come within ``timeout``."""
        if len(self.grants[job_id]) < count:
            future = asyncio.get_running_loop().create_future()
            self._waiters[job_id] = (future, count)
            try:
                await asyncio.wait_for(future, timeout)
            except TimeoutError:
                return None
            finally:
                self._waiters.pop(job_id, None)
        return sorted(at for at, _ in self.grants[job_id])[count - 1]

    def phases(self, job_id: uuid.UUID, since: float) -> tuple[float, float, float] | None:
        """Seconds from ``since`` to the first advert's arrival, the last trainer grant, the parameter
        server's grant."""
        trainers = [at for at, role in self.grants[job_id] if role == "trainer"]
        servers = [at for at, role in self.grants[job_id] if role == "parameter_server"]
        if job_id not in self.first_advert or not trainers or not servers:
            return None
        return self.first_advert[job_id] - since, max(trainers) - since, max(servers) - since


# --- one fleet size ----------------------------------------------------------------------------------------


@dataclass
class SizeResult:
    daemons: int
    scale: harness.Scale = field(default_factory=harness.Scale)
    latencies: list[float] = field(default_factory=list)
    #: Per allocated job: seconds to the first advert, the last trainer grant, the parameter server's grant.
    phases: list[tuple[float, float, float] | None] = field(default_factory=list)
    offers: list[int] = field(default_factory=list)
    submit: list[float] = field(default_factory=list)
    unallocated: int = 0
    renewals_sent: int = 0
    renewals_confirmed: int = 0
    renewal_seconds: float = 0.0
    leases_held: int = 0
    expired: int = 0
    #: CPU per process over the allocation phase (% of one core), the machine's, and the database's work.
    cpu: dict[str, float] = field(default_factory=dict)
    machine_cpu: float = 0.0
    database: dict[str, float] = field(default_factory=dict)


async def run_size(
    *, size: int, api: httpx.AsyncClient, plane: harness.ControlPlane, tokens: dict[str, str],
    arguments: argparse.Namespace, work_root: Path,
) -> SizeResult:  # fmt: skip
    recorder = Recorder()
    names = sorted(tokens)[:size]
    # Each daemon connects to one web process, in turn (round robin, as a load balancer spreads websockets).
    daemons = [
        SimulatedDaemon(
            name=name,
            token=tokens[name],
            server_url=plane.url_for(index),
            work_dir=work_root / name,
            recorder=recorder,
        )
        for index, name in enumerate(names)
    ]
    for daemon in daemons:
        (work_root / daemon.name).mkdir(parents=True, exist_ok=True)
        daemon.start()
    result = SizeResult(daemons=size, scale=arguments.scale)
    try:
        if not await wait_for(lambda: all(daemon.welcomed for daemon in daemons), timeout=30.0):
            raise RuntimeError(f"only {sum(d.welcomed for d in daemons)} of {size} daemons were welcomed")

        # --- allocation latency: one job at a time, cancelled once allocated --------------------------
        meter = harness.CpuMeter(harness.process_groups(plane))
        database = harness.PostgresSampler(plane.env["DATABASE_URL"]) if plane.mode == "services" else None
        queue = harness.CeleryQueueSampler(plane.env["REDIS_URL"]) if plane.mode == "services" else None
        for index in range(arguments.warmup + arguments.jobs):
            measured = index >= arguments.warmup
            if index == arguments.warmup:
                meter.start()
                if database is not None:
                    database.start()
                    queue.start()
            sent = time.perf_counter()
            response = await api.post("/api/jobs/", json={"name": f"bench-{size}-{index}", **JOB})
            returned = time.perf_counter()
            response.raise_for_status()
            job_id = uuid.UUID(response.json()["id"])
            third_grant = await recorder.allocated(job_id, count=LEASES_PER_JOB, timeout=ALLOCATION_TIMEOUT)
            if measured:
                result.submit.append(returned - sent)
                if third_grant is None:
                    result.unallocated += 1
                else:
                    result.latencies.append(third_grant - returned)
                    result.phases.append(recorder.phases(job_id, returned))
                    result.offers.append(recorder.offers[job_id])
            (await api.post(f"/api/jobs/{job_id}/cancel/")).raise_for_status()
            if not await wait_for(lambda: all(daemon.free for daemon in daemons), timeout=FREE_TIMEOUT):
                busy = [daemon.name for daemon in daemons if not daemon.free]
                print(f"  warning: {busy} still busy {FREE_TIMEOUT:g}s after a cancellation", file=sys.stderr)
        meter.stop()
        result.cpu, result.machine_cpu = meter.percent, meter.machine
        if database is not None:
            database.stop()
            queue.stop()
            result.database = {**database.summary(), **queue.summary()}

        # --- renewal throughput: every daemon holds a lease --------------------------------------------
        expired_before = recorder.expired
        jobs = []
        for index in range(math.ceil(size / LEASES_PER_JOB)):
            response = await api.post("/api/jobs/", json={"name": f"bench-renewals-{size}-{index}", **JOB})
            response.raise_for_status()
            jobs.append(response.json()["id"])
            wanted = min(LEASES_PER_JOB, size - index * LEASES_PER_JOB)
            granted = await recorder.allocated(uuid.UUID(jobs[-1]), count=wanted, timeout=ALLOCATION_TIMEOUT)
            if granted is None:
                break  # the market is stuck (see the warning below): more jobs would only wait as long
        await wait_for(lambda: all(daemon.holds_lease for daemon in daemons), timeout=ALLOCATION_TIMEOUT)
        result.leases_held = sum(daemon.holds_lease for daemon in daemons)
        if result.leases_held < size:
            print(f"  warning: only {result.leases_held} of {size} daemons hold a lease:", file=sys.stderr)
            for job_id in jobs:
                job = (await api.get(f"/api/jobs/{job_id}/")).json()
                print(f"    job {job_id}: {job.get('status_reason')}", file=sys.stderr)
        before = await renewal_counters(api, jobs)
        sent_before, started = recorder.renewed, time.perf_counter()
        await asyncio.sleep(arguments.renewal_seconds)
        after = await renewal_counters(api, jobs)
        result.renewal_seconds = time.perf_counter() - started
        result.renewals_sent = recorder.renewed - sent_before
        # Counted from the start of the phase: leases that expire while the fleet fills up count too.
        result.expired = recorder.expired - expired_before
        result.renewals_confirmed = sum(
            after[lease] - before[lease] for lease in before.keys() & after.keys()
        )
        for job_id in jobs:
            with contextlib.suppress(httpx.HTTPError):
                await api.post(f"/api/jobs/{job_id}/cancel/")
    finally:
        await asyncio.gather(*(daemon.stop() for daemon in daemons))
    return result


async def renewal_counters(api: httpx.AsyncClient, jobs: list[str]) -> dict[str, int]:
    """``renewals`` of every ACTIVE lease of ``jobs``, by lease id."""
    counters: dict[str, int] = {}
    for job_id in jobs:
        response = await api.get("/api/leases/", params={"job": job_id, "status": "active", "limit": 1000})
        response.raise_for_status()
        counters.update({lease["id"]: lease["renewals"] for lease in response.json()["results"]})
    return counters


# --- the report --------------------------------------------------------------------------------------------


def per_second(count: int, seconds: float) -> str:
    return f"{count / seconds:.1f}" if seconds else "-"


def results_table(results: list[SizeResult]) -> str:
    header = [
        "daemons", "control plane", "jobs", "allocation p50 (ms)", "p95 (ms)", "max (ms)", "not allocated",
        "leases held", "renewals/s sent", "renewals/s confirmed", "leases expired",
    ]  # fmt: skip
    rows = []
    for result in results:
        latencies = result.latencies or [math.nan]
        rows.append(
            [
                str(result.daemons),
                str(result.scale),
                str(len(result.latencies) + result.unallocated),
                milliseconds(percentile(latencies, 0.5)),
                milliseconds(percentile(latencies, 0.95)),
                milliseconds(max(latencies)),
                str(result.unallocated),
                f"{result.leases_held}/{result.daemons}",
                per_second(result.renewals_sent, result.renewal_seconds),
                per_second(result.renewals_confirmed, result.renewal_seconds),
                str(result.expired),
            ]
        )
    return markdown(header, rows)


def phases_table(results: list[SizeResult]) -> str:
    """Where the time goes: medians, in ms after POST /api/jobs/ returned."""
    header = [
        "daemons", "control plane", "POST round trip", "first advert arrives", "both trainers granted",
        "parameter server granted", "offers per job",
    ]  # fmt: skip
    rows = []
    for result in results:
        phases = [phase for phase in result.phases if phase is not None]
        if not phases:
            continue
        rows.append(
            [
                str(result.daemons),
                str(result.scale),
                milliseconds(statistics.median(result.submit)),
                *(milliseconds(statistics.median(phase[index] for phase in phases)) for index in range(3)),
                f"{statistics.mean(result.offers):.1f}",
            ]
        )
    return markdown(header, rows)


def costs_table(results: list[SizeResult]) -> str:
    """CPU per process (% of one core) and the machine's over the measured allocations; the database's work."""
    names = sorted({name for result in results for name in result.cpu}, key=_cpu_order)
    header = [
        "daemons", "control plane", *(f"CPU {name} (%)" for name in names), "CPU machine (%)",
        "PostgreSQL transactions/s", "active backends (mean)", "waiting for a lock (mean)", "Celery queue (mean)",
        "Celery queue (max)",
    ]  # fmt: skip
    rows = [
        [
            str(result.daemons),
            str(result.scale),
            *(f"{result.cpu[name]:.0f}" if name in result.cpu else "-" for name in names),
            f"{result.machine_cpu:.0f}",
            *(
                f"{result.database[key]:.1f}" if key in result.database else "-"
                for key in (
                    "transactions/s",
                    "active (mean)",
                    "waiting for a lock (mean)",
                    "Celery queue (mean)",
                    "Celery queue (max)",
                )
            ),
        ]  # fmt: skip
        for result in results
        if result.cpu
    ]
    return markdown(header, rows)


def _cpu_order(name: str) -> tuple[int, str]:
    order = ["server", "web", "worker", "beat", "postgres", "redis", "benchmark"]
    for index, prefix in enumerate(order):
        if name.startswith(prefix):
            return (index, name)
    return (len(order), name)


async def run(
    arguments: argparse.Namespace, plane: harness.ControlPlane, work_root: Path
) -> list[SizeResult]:
    api_token = plane.manage("create_user_token", "bench", "--staff")
    async with httpx.AsyncClient(
        base_url=plane.base_url, headers={"Authorization": f"Token {api_token}"}, timeout=30.0
    ) as api:
        tokens: dict[str, str] = {}
        for index in range(max(arguments.sizes)):
            name = f"bench-{index:03d}"
            response = await api.post("/api/workers/", json={"name": name})
            response.raise_for_status()
            tokens[name] = response.json()["token"]
        results = []
        for size in arguments.sizes:
            print(f"… {size} daemons", file=sys.stderr, flush=True)
            results.append(
                await run_size(
                    size=size, api=api, plane=plane, tokens=tokens, arguments=arguments, work_root=work_root
                )
            )
        return results


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    mode = harness.resolve_mode(arguments.mode)
    if mode != "services" and arguments.scales != [harness.Scale()]:
        raise SystemExit("--web and --celery above 1 need services mode (DATABASE_URL and REDIS_URL)")
    harness.exit_on_sigterm()
    load_at_start = harness.load_average()
    logging.basicConfig(
        level=logging.INFO if arguments.verbose else logging.ERROR,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = {
        "HYPHA_LEASE_TTL": str(arguments.lease_ttl),
        "HYPHA_TICK_INTERVAL": str(arguments.tick),
        "HYPHA_OFFER_WINDOW": "1.0",
        "HYPHA_OFFER_TTL": "3.0",
        "HYPHA_READVERTISE_BASE": "0.5",
        "HYPHA_READVERTISE_MAX": "2.0",
    }
    results: list[SizeResult] = []
    details: dict[str, str] = {}
    for scale in arguments.scales:
        arguments.scale = scale
        if len(arguments.scales) > 1:
            print(f"… control plane: {scale}", file=sys.stderr, flush=True)
        with (
            harness.run_directory(
                "hypha-bench-", keep=arguments.keep, note=" (control-plane logs in control-plane/logs/)"
            ) as root,
            harness.control_plane(
                mode=mode, root=root / "control-plane", settings=settings, quiet=not arguments.verbose,
                web=scale.web, celery=scale.celery,
            ) as plane,
        ):  # fmt: skip
            results += asyncio.run(run(arguments, plane, root / "daemons"))
            details = plane.details

    harness.print_markdown_header(
        "Allocation benchmark",
        mode=mode,
        details=details,
        load_at_start=load_at_start,
        settings=settings,
        run=(
            f"{arguments.jobs} measured jobs per size after {arguments.warmup} warm-up, "
            f"renewal window {arguments.renewal_seconds:g}s"
        ),
    )
    print(
        "- daemons: real WorkerDaemon sessions (2 cpu, 4 GB, strategy whole) in this one asyncio process, "
        "connected to the web processes in turn\n"
    )
    print(results_table(results))
    print("\nWhere the time goes (medians, ms after POST /api/jobs/ returned):\n")
    print(phases_table(results))
    print(
        "\nCPU over the measured allocations (% of one core; the machine's over all its cores) and what "
        "PostgreSQL did (this run's database):\n"
    )
    print(costs_table(results))
    return 0 if all(result.unallocated == 0 for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
