"""Start a real control plane for a benchmark, in the mode the environment selects, and always stop it.

``DATABASE_URL`` and ``REDIS_URL`` set → *services*: ``hypha-server web``, ``worker`` and ``beat`` as separate
processes, on a throw-away PostgreSQL database ``hypha_bench_<random>`` (dropped at the end) and an empty
Redis database number claimed for the run (flushed at the end), so a benchmark never shares a Celery queue
with a test run. Otherwise → *embedded*: one ``hypha-server`` process with a private ``HYPHA_DATA_DIR``.

Children run in their own process groups with their output in log files; :func:`control_plane` stops them
(SIGTERM, then SIGKILL after 5 s) however the benchmark ends, and prints the log tails if it failed.

The isolation helpers (children that die with their parent, a throw-away database, a claimed Redis database)
are the end-to-end tests' own, from ``tests/e2e/isolation.py``: one implementation for both.
"""

from __future__ import annotations

import contextlib
import os
import platform
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

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_DEADLINE
        while time.monotonic() < deadline:
            for child in self.children:
                if child.popen.poll() is not None:
                    raise RuntimeError(f"{child.name} exited with {child.popen.returncode}:\n{child.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/healthz", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{self.base_url}/healthz did not answer within {STARTUP_DEADLINE:g}s")


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
    *, mode: str, root: Path, settings: dict[str, str], quiet: bool = True, host: str = "127.0.0.1"
) -> Iterator[ControlPlane]:
    """A running control plane in ``mode`` with the ``HYPHA_*`` ``settings``, listening on ``host`` (a
    ``tests/e2e/wan.py`` Wan's ``host_address`` for peers in namespaces); stopped and cleaned up on exit."""
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
    port = free_port()
    plane = ControlPlane(mode=mode, base_url=f"http://{host}:{port}", env=env, log_dir=root / "logs")
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
                plane.start("web", [*common, "web", "--host", host, "--port", str(port)])
                plane.wait_healthy()
                plane.start("worker", [*common, "worker"])
                plane.start("beat", [*common, "beat"])
            else:
                plane.start("server", [*common, "--host", host, "--port", str(port)])
                plane.wait_healthy()
            yield plane
            failed = False
        finally:
            if failed:
                for child in plane.children:
                    print(f"--- {child.name} log (tail) ---\n{child.tail()}", file=sys.stderr)


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
