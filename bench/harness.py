"""Start a real control plane for a benchmark, in the mode the environment selects, and always stop it.

``DATABASE_URL`` and ``REDIS_URL`` set → *services*: ``hypha-server web``, ``worker`` and ``beat`` as separate
processes, on a throw-away PostgreSQL database ``hypha_bench_<random>`` (dropped at the end) and an empty
Redis database number claimed for the run (flushed at the end), so a benchmark never shares a Celery queue
with a test run. Otherwise → *embedded*: one ``hypha-server`` process with a private ``HYPHA_DATA_DIR``.

Scale-out (services only; docs/deploy.md "Scaling out"): ``web=N`` starts N daphne processes on N ports (the
first migrates, the others start with ``--no-migrate`` once it answers) and ``celery=M`` M Celery workers, all on
the one database, Redis and ``HYPHA_DATA_DIR``, with one beat. There is no load balancer: a client picks a
web process itself (:meth:`ControlPlane.url_for`, round robin), as nginx's ``upstream`` would.
:func:`add_scale_arguments` and :func:`scale_configurations` give benchmarks ``--web``/``--celery`` lists (one
run per configuration, side by side); :class:`PostgresSampler` and :func:`process_groups` say where the CPU and
the database's time went.

Children run in their own process groups with their output in log files; :func:`control_plane` stops them
(SIGTERM, then SIGKILL after 5 s) however the benchmark ends, and prints the log tails if it failed.

The isolation helpers (children that die with their parent, a throw-away database, a claimed Redis database)
are the end-to-end tests' own, from ``tests/e2e/isolation.py``: one implementation for both.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/allocation.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

from tests.e2e.isolation import (  # noqa: E402
    claimed_redis_database,
    free_port,
    stop_with_parent,
    throwaway_database,
)

BIN_DIR = Path(sys.executable).parent
STOP_GRACE = 5.0
STARTUP_DEADLINE = 90.0


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log: Path

    def signal(self, signal_number: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal_number)

    def tail(self, characters: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-characters:]
        except OSError as error:
            return f"<cannot read {self.log}: {error}>"


@dataclass
class ControlPlane:
    mode: str
    base_url: str
    env: dict[str, str]
    log_dir: Path
    children: list[Child] = field(default_factory=list)
    #: What the mode runs on, for the report (database and Redis server versions in services mode).
    details: dict[str, str] = field(default_factory=dict)
    #: The base URL of every web process, the first being ``base_url`` (more than one only in services mode).
    web_urls: list[str] = field(default_factory=list)

    def url_for(self, index: int) -> str:
        """The web process the ``index``-th client connects to: round robin over :attr:`web_urls` (what a
        load balancer in front of them would do for long-lived websockets)."""
        urls = self.web_urls or [self.base_url]
        return urls[index % len(urls)]

    def named(self, prefix: str) -> list[Child]:
        """The children called ``prefix`` or ``prefix-<letter>`` (``web``, ``web-b``, …), in start order."""
        return [
            child
            for child in self.children
            if child.name == prefix or re.fullmatch(rf"{re.escape(prefix)}-[a-z]", child.name)
        ]

    def start(self, name: str, argv: list[str]) -> Child:
        log = self.log_dir / f"{name}.log"
        with log.open("ab") as output:
            popen = subprocess.Popen(
                argv, cwd=REPO_ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=output,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=stop_with_parent,
            )  # fmt: skip
        child = Child(name=name, popen=popen, log=log)
        self.children.append(child)
        return child

    def stop(self) -> None:
        running = [child for child in reversed(self.children) if child.popen.poll() is None]
        for child in running:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for child in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(max(0.0, deadline - time.monotonic()))
        for child in self.children:
            child.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(STOP_GRACE)

    def manage(self, *arguments: str) -> str:
        """``manage.py`` with the control plane's environment; its stripped stdout."""
        done = subprocess.run(
            [sys.executable, str(REPO_ROOT / "manage.py"), *arguments],
            cwd=REPO_ROOT, env=self.env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(arguments)} exited {done.returncode}:\n{done.stderr}")
        return done.stdout.strip()

    def wait_healthy(self, url: str | None = None) -> None:
        """Wait until ``url`` (default: every web process) answers ``/healthz``; fail if a child exits."""
        for base_url in [url] if url is not None else self.web_urls or [self.base_url]:
            self._wait_healthy(base_url)

    def _wait_healthy(self, base_url: str) -> None:
        deadline = time.monotonic() + STARTUP_DEADLINE
        while time.monotonic() < deadline:
            for child in self.children:
                if child.popen.poll() is not None:
                    raise RuntimeError(f"{child.name} exited with {child.popen.returncode}:\n{child.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/healthz", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{base_url}/healthz did not answer within {STARTUP_DEADLINE:g}s")


def resolve_mode(requested: str) -> str:
    """``auto`` → services when both DATABASE_URL and REDIS_URL are set, embedded otherwise."""
    have_services = bool(os.environ.get("DATABASE_URL") and os.environ.get("REDIS_URL"))
    if requested == "auto":
        return "services" if have_services else "embedded"
    if requested == "services" and not have_services:
        raise SystemExit(
            "--mode services needs DATABASE_URL and REDIS_URL (and SECRET_KEY) in the environment"
        )
    return requested


@contextlib.contextmanager
def control_plane(
    *,
    mode: str,
    root: Path,
    settings: dict[str, str],
    quiet: bool = True,
    host: str = "127.0.0.1",
    web: int = 1,
    celery: int = 1,
) -> Iterator[ControlPlane]:
    """A running control plane in ``mode`` with the ``HYPHA_*`` ``settings``, listening on ``host`` (a
    ``tests/e2e/wan.py`` Wan's ``host_address`` for peers in namespaces); stopped and cleaned up on exit.

    In services mode: ``web`` daphne processes (children ``web``, ``web-b``, …, each on its own port:
    :attr:`ControlPlane.web_urls`) and ``celery`` Celery workers (``worker``, ``worker-b``, …), one beat."""
    if web < 1 or celery < 1:
        raise ValueError("a control plane needs at least one web process and one Celery worker")
    if mode != "services" and (web, celery) != (1, 1):
        raise ValueError("several web processes or Celery workers need services mode (PostgreSQL, Redis)")
    root.mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(exist_ok=True)
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"DATABASE_URL", "REDIS_URL", "HYPHA_DATA_DIR", "DJANGO_SETTINGS_MODULE"}
    }
    env.update(settings)
    log_level = "WARNING" if quiet else "INFO"
    env.update(
        {
            "HYPHA_DATA_DIR": str(root / "data"),
            "PYTHONUNBUFFERED": "1",
            "LOG_LEVEL": log_level,
            "PATH": f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}",
        }
    )
    if host != "127.0.0.1":  # Django answers 400 to a Host it does not know
        env.setdefault("ALLOWED_HOSTS", f"localhost,127.0.0.1,[::1],{host}")
    ports: list[int] = []
    while len(ports) < web:  # free_port() may hand out a port twice in a row: N distinct ones
        if (port := free_port()) not in ports:
            ports.append(port)
    web_urls = [f"http://{host}:{port}" for port in ports]
    plane = ControlPlane(mode=mode, base_url=web_urls[0], env=env, log_dir=root / "logs", web_urls=web_urls)
    server = str(BIN_DIR / "hypha-server")
    failed = True
    with contextlib.ExitStack() as stack:
        if mode == "services":
            database_url = stack.enter_context(
                throwaway_database(os.environ["DATABASE_URL"], prefix="hypha_bench")
            )
            redis_url = stack.enter_context(claimed_redis_database(os.environ["REDIS_URL"]))
            env.update(DATABASE_URL=database_url, REDIS_URL=redis_url)
            env.setdefault("SECRET_KEY", f"bench-{secrets.token_urlsafe(40)}")
            plane.details = {
                "PostgreSQL": _postgres_version(database_url),
                "Redis": _redis_version(redis_url),
            }
        stack.callback(plane.stop)  # before the database is dropped: an ExitStack unwinds in reverse
        try:
            common = [server, "--log-level", log_level]
            if mode == "services":
                # The first web process migrates the fresh database; the others wait for it, then skip it
                # (two concurrent migrations of one database would race on creating the same tables).
                for index, port in enumerate(ports):
                    web_argv = [*common, "web", "--host", host, "--port", str(port)]
                    plane.start(numbered("web", index), web_argv + (["--no-migrate"] if index else []))
                    if index == 0:
                        plane.wait_healthy(web_urls[0])
                plane.wait_healthy()
                for index in range(celery):
                    plane.start(numbered("worker", index), [*common, "worker"])
                # One beat, whatever the number of workers: each beat would send every clock's ticks again.
                plane.start("beat", [*common, "beat"])
            else:
                plane.start("server", [*common, "--host", host, "--port", str(ports[0])])
                plane.wait_healthy()
            yield plane
            failed = False
        finally:
            if failed:
                for child in plane.children:
                    print(f"--- {child.name} log (tail) ---\n{child.tail()}", file=sys.stderr)


def numbered(name: str, index: int) -> str:
    """``name`` for the first of a kind (index 0), ``name-b``, ``name-c``, … for the others (letters: the
    training cluster's daemons are ``worker-1``, ``worker-2``, … among the same children)."""
    return name if index == 0 else f"{name}-{chr(ord('a') + index)}"


def _postgres_version(database_url: str) -> str:
    import psycopg

    with psycopg.connect(database_url, connect_timeout=5) as connection:
        return str(connection.execute("SHOW server_version").fetchone()[0])


def _redis_version(redis_url: str) -> str:
    import redis

    return str(
        redis.Redis.from_url(redis_url, socket_connect_timeout=5).info("server").get("redis_version", "?")
    )


def machine_details() -> dict[str, str]:
    """CPU model, core count, OS and Python, for the report."""
    model = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = "?"
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = f"{int(line.split()[1]) / 1024 / 1024:.1f} GB"
                break
    return {
        "CPU": model,
        "cores": str(os.cpu_count()),
        "memory": memory,
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
    }


def load_average() -> str:
    """The 1/5/15-minute load averages: other work on the machine skews a benchmark, this says how much."""
    return " / ".join(f"{load:.2f}" for load in os.getloadavg())


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit``, so a benchmark that is killed still stops its cluster on the way out."""
    signal.signal(signal.SIGTERM, lambda signal_number, frame: sys.exit(128 + signal_number))


def print_start() -> None:
    """The lines every benchmark begins with: the machine, its load, the command."""
    print("Machine: " + ", ".join(f"{key} {value}" for key, value in machine_details().items()))
    print(f"Load average at start: {load_average()}")
    print(f"Command: {' '.join(sys.argv)}", flush=True)


@contextlib.contextmanager
def run_directory(prefix: str, *, keep: bool, note: str = "") -> Iterator[Path]:
    """A temporary directory for one run, removed at the end unless ``keep`` (then its path is printed, with
    ``note``)."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        if keep:
            print(f"kept {root}{note}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


MODE_DESCRIPTIONS = {
    "embedded": "embedded (one hypha-server process: SQLite, in-process tasks and channel layer)",
    "services": "services (hypha-server web + worker + beat: PostgreSQL, Redis)",
}


def print_markdown_header(
    title: str, *, mode: str, details: dict[str, str], load_at_start: str, settings: dict[str, str], run: str
) -> None:
    """The markdown head of a control-plane benchmark's report: title, machine, load, mode, the control
    plane's details and settings, and ``run`` (what was measured, in a few words)."""
    import datetime

    print(f"# {title} — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n")
    for key, value in machine_details().items():
        print(f"- {key}: {value}")
    print(f"- load average (1/5/15 min): {load_at_start} at start, {load_average()} at the end")
    print(f"- mode: {MODE_DESCRIPTIONS[mode]}")
    for key, value in details.items():
        print(f"- {key}: {value}")
    print("- settings: " + ", ".join(f"{key}={value}" for key, value in settings.items()) + f"; {run}")


# --- scale-out: --web N --celery M, side by side ----------------------------------------------------------


@dataclass(frozen=True)
class Scale:
    """One configuration of a services-mode control plane: ``web`` daphne processes, ``celery`` workers."""

    web: int = 1
    celery: int = 1

    def __str__(self) -> str:
        return f"{self.web} web, {self.celery} Celery"


def add_scale_arguments(parser, *, default: str = "1") -> None:
    """``--web`` and ``--celery``: comma-separated counts, one control plane per position (side by side)."""
    parser.add_argument(
        "--web",
        default=default,
        help="web (daphne) processes, comma-separated for runs side by side: --web 1,2 --celery 1 runs "
        "1 web + 1 Celery, then 2 web + 1 Celery (services mode; default: %(default)s)",
    )
    parser.add_argument(
        "--celery",
        default=default,
        help="Celery worker processes (each with 2 pool processes), comma-separated like --web; a single "
        "value applies to every run (default: %(default)s)",
    )


def scale_configurations(parser, arguments) -> list[Scale]:
    """The runs ``--web``/``--celery`` ask for: the i-th of each list (a single value applies to every run)."""
    try:
        webs = [int(value) for value in str(arguments.web).split(",") if value.strip()]
        celeries = [int(value) for value in str(arguments.celery).split(",") if value.strip()]
    except ValueError:
        parser.error(
            f"--web and --celery must be comma-separated integers, not {arguments.web!r}/{arguments.celery!r}"
        )
    if not webs or not celeries or min(webs + celeries) < 1 or max(webs + celeries) > 16:
        parser.error("--web and --celery take counts from 1 to 16")
    runs = max(len(webs), len(celeries))
    if {len(webs), len(celeries)} - {1, runs}:
        parser.error("--web and --celery must have as many values as each other, or one value")
    webs, celeries = webs * (runs // len(webs)), celeries * (runs // len(celeries))
    return [Scale(web=web, celery=celery) for web, celery in zip(webs, celeries, strict=True)]


# --- where the time goes: CPU per process, and the database ----------------------------------------------


def process_tree(pid: int) -> list:
    """``pid`` and its descendants (a Celery worker's pool processes) as psutil processes."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def processes_named(name: str):
    """A finder of every process of this machine whose name starts with ``name``."""
    import psutil

    def find() -> list:
        return [
            process
            for process in psutil.process_iter(["name"])
            if (process.info["name"] or "").startswith(name)
        ]

    return find


def database_backends(database_url: str):
    """A finder of the PostgreSQL server processes that serve ``database_url``'s database (not the other
    databases of a shared server), through ``pg_stat_activity``; the server must be on this machine."""
    import psutil

    name = database_url.rsplit("/", 1)[-1].split("?", 1)[0]
    connection = None

    def find() -> list:
        nonlocal connection
        import psycopg

        try:
            if connection is None or connection.closed:
                connection = psycopg.connect(database_url, autocommit=True, connect_timeout=5)
            rows = connection.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()", (name,)
            ).fetchall()
        except psycopg.Error:
            connection = None
            return []
        found = []
        for (pid,) in rows:
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(pid))
        return found

    return find


def process_groups(plane: ControlPlane) -> dict:
    """The process groups a report shows the CPU of: every control-plane child with its descendants, the
    PostgreSQL backends of its database and the Redis server (services mode), and this process (the load
    generator: simulated daemons, drivers)."""
    import psutil

    groups: dict = {child.name: (lambda pid=child.popen.pid: process_tree(pid)) for child in plane.children}
    if plane.mode == "services":
        groups["postgres (this database)"] = database_backends(plane.env["DATABASE_URL"])
        groups["redis (shared server)"] = processes_named("redis-server")
    groups["benchmark (load generator)"] = lambda: [psutil.Process()]
    return groups


class CpuMeter:
    """CPU seconds used by groups of processes between :meth:`start` and :meth:`stop`, as % of one core;
    and the whole machine's (``machine``: % of one core, so up to 100 × cores).

    A thread samples every ``interval`` s, so processes that come and go meanwhile count too (PostgreSQL
    backends live as long as a Django connection, 60 s): one born in the window counts from zero, one that
    ended counts up to its last sample."""

    def __init__(self, groups: dict, *, interval: float = 0.5) -> None:
        self.groups = groups
        self.interval = interval
        self.percent: dict[str, float] = {}
        #: Busy CPU of the whole machine, % of one core (every process, ours or not).
        self.machine = 0.0
        self._baseline: dict[str, dict[int, float]] = {}
        self._latest: dict[str, dict[int, float]] = {}
        self._started = 0.0
        self._started_at = 0.0
        self._machine_before = None
        self._stopping = None
        self._thread = None

    def _sample(self, *, first: bool) -> None:
        import psutil

        for name, finder in self.groups.items():
            baseline = self._baseline.setdefault(name, {})
            latest = self._latest.setdefault(name, {})
            for process in finder():
                with contextlib.suppress(psutil.Error):
                    times = process.cpu_times()
                    used = times.user + times.system
                    if process.pid not in baseline:
                        born_in_window = not first and process.create_time() >= self._started_at
                        baseline[process.pid] = 0.0 if born_in_window else used
                    latest[process.pid] = used

    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            self._sample(first=False)

    def start(self) -> None:
        import threading

        import psutil

        self._started = time.perf_counter()
        self._started_at = time.time()
        self._machine_before = psutil.cpu_times()
        self._sample(first=True)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        import psutil

        self._stopping.set()
        self._thread.join()
        self._sample(first=False)
        elapsed = time.perf_counter() - self._started
        self.percent = {
            name: 100.0
            * sum(max(0.0, used - self._baseline[name].get(pid, used)) for pid, used in latest.items())
            / elapsed
            for name, latest in self._latest.items()
        }
        self.machine = 100.0 * (_busy(psutil.cpu_times()) - _busy(self._machine_before)) / elapsed


def _busy(times) -> float:
    """CPU seconds the machine's cores spent running something (not idle, not waiting for I/O, not stolen by
    the hypervisor; guest time is part of user time on Linux)."""
    return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))


class PostgresSampler:
    """What one database did between :meth:`start` and :meth:`stop`: transactions committed per second, and
    every ``interval`` s the backends of ``pg_stat_activity`` — how many were running a statement, how many
    of those waited for a lock. By Little's law, mean active backends ÷ transactions per second is the mean
    time a transaction spends in the server."""

    def __init__(self, database_url: str, *, interval: float = 0.25) -> None:
        self.database_url = database_url
        self.name = database_url.rsplit("/", 1)[-1].split("?", 1)[0]
        self.interval = interval
        self.active: list[int] = []
        self.waiting: list[int] = []
        self.connections: list[int] = []
        self.transactions_per_second = 0.0
        self._before = 0
        self._started = 0.0
        self._stopping = None
        self._thread = None

    def _transactions(self, connection) -> int:
        row = connection.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", (self.name,)
        ).fetchone()
        return int(row[0]) if row else 0

    def _run(self) -> None:
        import psycopg

        with psycopg.connect(self.database_url, autocommit=True, connect_timeout=5) as connection:
            while not self._stopping.wait(self.interval):
                rows = connection.execute(
                    "SELECT state, wait_event_type FROM pg_stat_activity"
                    " WHERE datname = %s AND pid <> pg_backend_pid()",
                    (self.name,),
                ).fetchall()
                self.connections.append(len(rows))
                self.active.append(sum(state == "active" for state, _ in rows))
                self.waiting.append(sum(state == "active" and wait == "Lock" for state, wait in rows))

    def start(self) -> None:
        import threading

        import psycopg

        with psycopg.connect(self.database_url, autocommit=True, connect_timeout=5) as connection:
            # pg_stat_database is a snapshot per transaction: a fresh connection reads fresh numbers.
            self._before = self._transactions(connection)
        self._started = time.perf_counter()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="postgres-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        import psycopg

        self._stopping.set()
        self._thread.join()
        elapsed = time.perf_counter() - self._started
        with psycopg.connect(self.database_url, autocommit=True, connect_timeout=5) as connection:
            after = self._transactions(connection)
        self.transactions_per_second = max(0, after - self._before) / elapsed

    def summary(self) -> dict[str, float]:
        """Transactions/s, mean and max active backends, mean backends waiting for a lock, mean connections."""

        def mean(values: list[int]) -> float:
            return sum(values) / len(values) if values else 0.0

        return {
            "transactions/s": self.transactions_per_second,
            "active (mean)": mean(self.active),
            "active (max)": float(max(self.active, default=0)),
            "waiting for a lock (mean)": mean(self.waiting),
            "connections (mean)": mean(self.connections),
        }


class CeleryQueueSampler:
    """How many tasks wait in the Celery broker's queue (Redis list ``celery``), every ``interval`` s between
    :meth:`start` and :meth:`stop`: a queue that grows means the Celery workers fall behind (the lease and market
    clocks' ticks wait in it with everything else)."""

    def __init__(self, redis_url: str, *, interval: float = 0.25) -> None:
        self.redis_url = redis_url
        self.interval = interval
        self.lengths: list[int] = []
        self._stopping = None
        self._thread = None

    def _run(self) -> None:
        import redis

        client = redis.Redis.from_url(self.redis_url, socket_connect_timeout=5)
        try:
            while not self._stopping.wait(self.interval):
                with contextlib.suppress(redis.RedisError):
                    self.lengths.append(int(client.llen("celery")))
        finally:
            client.close()

    def start(self) -> None:
        import threading

        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="celery-queue-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        lengths = self.lengths or [0]
        return {
            "Celery queue (mean)": sum(lengths) / len(lengths),
            "Celery queue (max)": float(max(lengths)),
        }


def cpu_model() -> str:
    """``lscpu``'s model name (what docs/benchmarks.md quotes), else /proc/cpuinfo's."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        output = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in output.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    return machine_details()["CPU"]
