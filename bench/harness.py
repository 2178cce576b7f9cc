"""Start a real control plane for a benchmark, in the mode the environment selects, and always stop it.

``DATABASE_URL`` and ``REDIS_URL`` set → *services*: ``hypha-server web``, ``worker`` and ``beat`` as separate
processes, on a throw-away PostgreSQL database ``hypha_bench_<random>`` (dropped at the end) and an empty
Redis database number claimed for the run (flushed at the end), so a benchmark never shares a Celery queue
with a test run. Otherwise → *embedded*: one ``hypha-server`` process with a private ``HYPHA_DATA_DIR``.

Children run in their own process groups with their output in log files; :func:`control_plane` stops them
(SIGTERM, then SIGKILL after 5 s) however the benchmark ends, and prints the log tails if it failed.

(The end-to-end tests have their own copy of this in ``tests/e2e/conftest.py``: tests do not import
benchmarks, and benchmarks do not import tests.)
"""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN_DIR = Path(sys.executable).parent
STOP_GRACE = 5.0
STARTUP_DEADLINE = 90.0


def _stop_with_parent() -> None:
    """Run in each child between fork and exec: the kernel SIGKILLs it if the process that started it dies.

    Children lead their own sessions, so nothing else would reach them when the parent is killed outright
    (SIGKILL, an OOM kill, a CI job cancelled): without this they outlive it, holding ports and databases.
    Linux only; elsewhere a no-op.
    """
    if sys.platform != "linux":
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the prctl: nobody would send the signal
        os._exit(1)


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
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_stop_with_parent,
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _with_path(url: str, path: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=path))


#: The same key as tests/e2e/conftest.py's, so a benchmark and an e2e run never claim the same database.
CLAIM_KEY = "hypha:claimed-by-a-run"


def _owner() -> str:
    """Who holds a throw-away database or a claimed Redis database: this host and process."""
    return f"{socket.gethostname()} {os.getpid()}"


def _abandoned(owner: str | None) -> bool:
    """True if ``owner`` (see :func:`_owner`) is a process of this host that no longer runs: a run killed
    outright cannot clean up after itself, so the next one does."""
    host, _, pid = (owner or "").partition(" ")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@contextlib.contextmanager
def throwaway_database(database_url: str) -> Iterator[tuple[str, str]]:
    """A fresh PostgreSQL database next to ``database_url``'s; yields (its URL, the server version).

    Its comment names its owner; benchmark databases of owners that died are dropped first.
    """
    import psycopg
    from psycopg import sql

    name = f"hypha_bench_{secrets.token_hex(4)}"
    maintenance = _with_path(database_url, "/postgres")
    with psycopg.connect(maintenance, autocommit=True, connect_timeout=5) as connection:
        leftovers = connection.execute(
            "SELECT datname, shobj_description(oid, 'pg_database') FROM pg_database "
            "WHERE datname LIKE 'hypha\\_bench\\_%'"
        ).fetchall()
        for leftover, owner in leftovers:
            if _abandoned(owner):
                connection.execute(f'DROP DATABASE IF EXISTS "{leftover}" WITH (FORCE)')
        connection.execute(f'CREATE DATABASE "{name}"')
        connection.execute(
            sql.SQL("COMMENT ON DATABASE {} IS {}").format(sql.Identifier(name), sql.Literal(_owner()))
        )
        version = connection.execute("SHOW server_version").fetchone()[0]
    try:
        yield _with_path(database_url, f"/{name}"), version
    finally:
        with psycopg.connect(maintenance, autocommit=True, connect_timeout=5) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def claimed_redis_database(redis_url: str) -> Iterator[tuple[str, str]]:
    """An empty Redis database number (not ``redis_url``'s own, not 0), claimed with a key set NX whose value
    names the owner (a dead owner's claim is flushed and taken over), flushed at the end; yields (its URL,
    the server version). Falls back to flushing ``redis_url``'s own database when every other is in use."""
    import redis

    configured = int(urlsplit(redis_url).path.strip("/") or 0)
    admin = redis.Redis.from_url(redis_url, socket_connect_timeout=5)
    version = str(admin.info("server").get("redis_version", "?"))
    count = int(admin.config_get("databases").get("databases", 16))
    chosen = configured
    for number in [n for n in range(count - 1, 0, -1) if n != configured]:
        client = redis.Redis.from_url(_with_path(redis_url, f"/{number}"), socket_connect_timeout=5)
        try:
            claim = client.get(CLAIM_KEY)
            if claim is not None and _abandoned(claim.decode(errors="replace")):
                client.flushdb()
            if client.dbsize() == 0 and client.set(CLAIM_KEY, _owner(), nx=True):
                if client.dbsize() == 1:
                    chosen = number
                    break
                client.delete(CLAIM_KEY)  # someone else started using it meanwhile
        finally:
            client.close()
    else:
        admin.flushdb()
    admin.close()
    url = _with_path(redis_url, f"/{chosen}")
    try:
        yield url, version
    finally:
        client = redis.Redis.from_url(url, socket_connect_timeout=5)
        with contextlib.suppress(redis.RedisError):
            client.flushdb()
        client.close()


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
    *, mode: str, root: Path, settings: dict[str, str], quiet: bool = True
) -> Iterator[ControlPlane]:
    """A running control plane in ``mode`` with the ``HYPHA_*`` ``settings``; stopped and cleaned up on exit."""
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
    port = free_port()
    plane = ControlPlane(mode=mode, base_url=f"http://127.0.0.1:{port}", env=env, log_dir=root / "logs")
    server = str(BIN_DIR / "hypha-server")
    failed = True
    with contextlib.ExitStack() as stack:
        if mode == "services":
            database_url, postgres_version = stack.enter_context(
                throwaway_database(os.environ["DATABASE_URL"])
            )
            redis_url, redis_version = stack.enter_context(claimed_redis_database(os.environ["REDIS_URL"]))
            env.update(DATABASE_URL=database_url, REDIS_URL=redis_url)
            env.setdefault("SECRET_KEY", f"bench-{secrets.token_urlsafe(40)}")
            plane.details = {"PostgreSQL": postgres_version, "Redis": redis_version}
        stack.callback(plane.stop)  # before the database is dropped: an ExitStack unwinds in reverse
        try:
            common = [server, "--log-level", log_level]
            if mode == "services":
                plane.start("web", [*common, "web", "--host", "127.0.0.1", "--port", str(port)])
                plane.wait_healthy()
                plane.start("worker", [*common, "worker"])
                plane.start("beat", [*common, "beat"])
            else:
                plane.start("server", [*common, "--host", "127.0.0.1", "--port", str(port)])
                plane.wait_healthy()
            yield plane
            failed = False
        finally:
            if failed:
                for child in plane.children:
                    print(f"--- {child.name} log (tail) ---\n{child.tail()}", file=sys.stderr)


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
