"""End-to-end harness: real control-plane and worker-daemon processes on loopback.

* :class:`ProcessGroup` starts children in their own process groups with stdout/stderr to files, and always
  stops them (SIGTERM to the group, SIGKILL after a grace period) — at fixture teardown, even when the test
  failed or was interrupted, and at interpreter exit as a last resort. When a test fails, the logs of every
  child still registered are attached to its report.
* :func:`free_port`, :func:`wait_for_healthz` and :func:`wait_until` are the small helpers the tests poll with.
* The ``control_plane`` fixture (module-scoped: starting one costs seconds) runs the control plane in the
  CURRENT mode of the environment, the same switch as the settings:

  - ``DATABASE_URL`` and ``REDIS_URL`` set → *services*: ``hypha-server web``, ``worker`` and ``beat`` as three
    processes, on a fresh throw-away PostgreSQL database ``hypha_e2e_<random>`` on the server of
    ``DATABASE_URL`` (dropped at teardown) and an empty Redis database number claimed for this run (flushed
    at teardown), so concurrent runs never share a Celery queue or a channel-layer group;
  - otherwise → *embedded*: one ``hypha-server`` process with a private ``HYPHA_DATA_DIR``.

  Short market timings (:data:`TIMINGS`) keep the tests quick; they never assert speed beyond deadlines.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.cluster import WORKER_TOML
from tests.e2e.isolation import claimed_redis_database, free_port, stop_with_parent, throwaway_database
from tests.e2e.wan import Peer
from tests.modes import only_in_mode, services_mode  # noqa: F401 (used by the e2e tests)

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN_DIR = Path(sys.executable).parent

#: Market timings of the control plane under test, in seconds (the settings read them from the environment).
LEASE_TTL = 3.0
TIMINGS = {
    "HYPHA_LEASE_TTL": str(LEASE_TTL),
    "HYPHA_OFFER_WINDOW": "0.5",
    "HYPHA_OFFER_TTL": "1.5",
    "HYPHA_TICK_INTERVAL": "0.2",
    "HYPHA_READVERTISE_BASE": "0.5",
    "HYPHA_READVERTISE_MAX": "2",
}

#: Seconds a child gets between SIGTERM and SIGKILL when the harness stops it.
STOP_GRACE = 5.0
#: Seconds for a control plane to answer /healthz (services mode migrates a fresh database first).
STARTUP_DEADLINE = 90.0
#: How much of each child's log a failure report shows.
LOG_TAIL_CHARS = 20_000


def small_training_job(tmp_path: Path, **spec: Any) -> tuple[Path, dict]:
    """A byte-level dataset of the standard library's sources and a DiLoCo spec on it for the small GPT-2 at
    batch 8 (``spec`` goes to ``bench.cluster.diloco_spec``): the training tests' job."""
    from bench.cluster import SMALL_GPT2, diloco_spec, prepare_stdlib_text

    dataset = prepare_stdlib_text(tmp_path / "stdlib", max_bytes=250_000, samples_per_slice=32)
    return dataset, diloco_spec(dataset="stdlib", batch_size=8, model=SMALL_GPT2, **spec)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e: end-to-end test with real control-plane and worker-daemon processes (slow)"
    )


# --- processes --------------------------------------------------------------------------------------


@dataclass
class Child:
    """A started process; ``stdout``/``stderr`` are the files its output goes to."""

    name: str
    argv: list[str]
    popen: subprocess.Popen
    stdout: Path
    stderr: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, signal_number: int) -> None:
        """Send ``signal_number`` to the child's process group (it is the group leader)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal_number)

    def wait(self, timeout: float) -> int:
        """The exit code; raises ``subprocess.TimeoutExpired`` if it is still running after ``timeout``."""
        return self.popen.wait(timeout)

    def logs(self, *, tail: int = LOG_TAIL_CHARS) -> str:
        parts = []
        for label, path in (("stdout", self.stdout), ("stderr", self.stderr)):
            try:
                text = path.read_text(errors="replace")
            except OSError as error:
                text = f"<cannot read {path}: {error}>"
            if len(text) > tail:
                text = f"<… {len(text) - tail} characters cut …>\n" + text[-tail:]
            parts.append(f"--- {label} ({path}) ---\n{text}")
        return "\n".join(parts)


#: Every group not yet stopped; failure reports and the atexit hook walk it.
_LIVE_GROUPS: list[ProcessGroup] = []


class ProcessGroup:
    """Starts children with their output in ``log_dir`` and stops them all in :meth:`stop_all`.

    Each child leads its own session (``start_new_session``), so stopping it reaches its children too
    (Celery's pool processes, daphne's workers) and a Ctrl-C in the terminal does not race the harness.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        log_dir.mkdir(parents=True, exist_ok=True)
        _LIVE_GROUPS.append(self)

    def start(self, name: str, argv: list[str], *, env: dict[str, str], cwd: Path = REPO_ROOT) -> Child:
        stdout = self.log_dir / f"{name}.stdout.log"
        stderr = self.log_dir / f"{name}.stderr.log"
        with stdout.open("ab") as out, stderr.open("ab") as err:
            popen = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=stop_with_parent,
            )
        child = Child(name=name, argv=argv, popen=popen, stdout=stdout, stderr=stderr)
        self.children.append(child)
        return child

    def stop(self, child: Child, *, grace: float = STOP_GRACE) -> int:
        """SIGTERM the child's group, SIGKILL it after ``grace`` seconds; return the exit code."""
        if child.poll() is None:
            child.signal(signal.SIGTERM)
            try:
                child.wait(grace)
            except subprocess.TimeoutExpired:
                child.signal(signal.SIGKILL)
                child.wait(grace)
        # Whatever the leader left behind in its group (a Celery pool process, say) goes too.
        child.signal(signal.SIGKILL)
        return child.popen.returncode

    def stop_all(self) -> None:
        """Stop every child, newest first, all of them in parallel. Safe to call more than once."""
        running = [child for child in reversed(self.children) if child.poll() is None]
        for child in running:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for child in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(max(0.0, deadline - time.monotonic()))
        for child in self.children:
            child.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(STOP_GRACE)
        with contextlib.suppress(ValueError):
            _LIVE_GROUPS.remove(self)

    def logs(self) -> str:
        return "\n\n".join(
            f"===== {child.name} (pid {child.pid}, exit {child.poll()}): {' '.join(child.argv)}\n{child.logs()}"
            for child in self.children
        )


@atexit.register
def _stop_leftovers() -> None:
    # Last resort when a fixture's teardown never ran (the interpreter is going down).
    for group in list(_LIVE_GROUPS):
        group.stop_all()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[Any]:
    report = yield
    if report.failed and report.when in ("setup", "call") and item.get_closest_marker("e2e"):
        for group in _LIVE_GROUPS:
            for child in group.children:
                report.sections.append(
                    (f"Captured process log {child.name} (exit {child.poll()})", child.logs())
                )
    return report


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[ProcessGroup]:
    """Children of one test; every one is stopped at teardown, pass or fail."""
    group = ProcessGroup(tmp_path / "logs")
    try:
        yield group
    finally:
        group.stop_all()


# --- small helpers ---------------------------------------------------------------------------------------


def wait_until(
    probe: Callable[[], Any], *, timeout: float, interval: float = 0.1, message: str = "condition"
) -> Any:
    """Call ``probe`` every ``interval`` s until it returns something truthy, and return that; fail after
    ``timeout`` s with the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message} not reached within {timeout:g}s (last value: {value!r})")
        time.sleep(interval)


def wait_for_healthz(base_url: str, *, children: list[Child], timeout: float = STARTUP_DEADLINE) -> None:
    """Poll ``GET /healthz`` until it answers 200; fail at once if one of ``children`` exits meanwhile."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        for child in children:
            if child.poll() is not None:
                raise AssertionError(
                    f"{child.name} exited with {child.poll()} while starting:\n{child.logs()}"
                )
        try:
            response = httpx.get(f"{base_url}/healthz", timeout=2.0)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as error:
            last = f"{type(error).__name__}: {error}"
        time.sleep(0.1)
    logs = "\n".join(child.logs() for child in children)
    raise AssertionError(f"{base_url}/healthz did not answer 200 within {timeout:g}s ({last}):\n{logs}")


# --- services: a throw-away PostgreSQL database and a claimed Redis database ------------------------


# --- the control plane ---------------------------------------------------------------------------------


@dataclass
class ControlPlane:
    """A running control plane: its URL, the environment its processes share, and an authenticated API."""

    mode: str
    base_url: str
    env: dict[str, str]
    group: ProcessGroup
    components: dict[str, Child] = field(default_factory=dict)
    api_token: str = ""
    lease_ttl: float = LEASE_TTL

    def manage(self, *arguments: str) -> str:
        """Run ``manage.py`` with the control plane's environment; return its stripped stdout."""
        return self.manage_many([list(arguments)])[0]

    def manage_many(self, commands: list[list[str]], *, timeout: float = 60.0) -> list[str]:
        """Run several ``manage.py`` commands at once (each costs a Django start-up); their stdouts in order."""
        started = [
            subprocess.Popen(
                [sys.executable, str(REPO_ROOT / "manage.py"), *arguments],
                cwd=REPO_ROOT,
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for arguments in commands
        ]
        outputs = []
        for arguments, popen in zip(commands, started, strict=True):
            try:
                stdout, stderr = popen.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                popen.kill()
                stdout, stderr = popen.communicate()
            if popen.returncode != 0:
                raise AssertionError(f"manage.py {' '.join(arguments)} exited {popen.returncode}:\n{stderr}")
            outputs.append(stdout.strip())
        return outputs

    def create_worker_tokens(self, names: list[str]) -> dict[str, str]:
        tokens = self.manage_many([["create_worker_token", name] for name in names])
        return dict(zip(names, tokens, strict=True))

    def api(self) -> httpx.Client:
        """An HTTP client for the REST API, authenticated as a staff user."""
        return httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Token {self.api_token}"}, timeout=10.0
        )


def child_environment(data_dir: Path, **overrides: str) -> dict[str, str]:
    """The environment of control-plane children: ours, without the mode switches, plus the test timings."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"DATABASE_URL", "REDIS_URL", "HYPHA_DATA_DIR", "DJANGO_SETTINGS_MODULE"}
    }
    env.update(TIMINGS)
    env.update(
        {
            "HYPHA_DATA_DIR": str(data_dir),
            "PYTHONUNBUFFERED": "1",
            "LOG_LEVEL": "INFO",
            "PATH": f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}",
        }
    )
    env.update(overrides)
    return env


@contextlib.contextmanager
def start_control_plane(root: Path, *, host: str = "127.0.0.1") -> Iterator[ControlPlane]:
    """Start the control plane in the current mode under ``root``, listening on ``host`` (a Wan's
    ``host_address`` for peers in namespaces, ``tests/e2e/wan.py``); stop it (and clean up) on exit."""
    group = ProcessGroup(root / "logs")
    port = free_port()
    base_url = f"http://{host}:{port}"
    server = str(BIN_DIR / "hypha-server")
    with contextlib.ExitStack() as stack:
        if services_mode():
            database_url = stack.enter_context(throwaway_database(os.environ["DATABASE_URL"]))
            redis_url = stack.enter_context(claimed_redis_database(os.environ["REDIS_URL"]))
        # Registered after the database and Redis claims, so the children stop before those are dropped
        # (an ExitStack unwinds in reverse order).
        stack.callback(group.stop_all)
        if services_mode():
            env = child_environment(root / "data", DATABASE_URL=database_url, REDIS_URL=redis_url)
            if host != "127.0.0.1":  # Django answers 400 to a Host it does not know
                env.setdefault("ALLOWED_HOSTS", f"localhost,127.0.0.1,[::1],{host}")
            if not env.get("SECRET_KEY") and not env.get("SECRET_KEY_FILE"):
                env["SECRET_KEY"] = f"e2e-{secrets.token_urlsafe(40)}"
            plane = ControlPlane(mode="services", base_url=base_url, env=env, group=group)
            plane.components["web"] = group.start(
                "web", [server, "web", "--host", host, "--port", str(port)], env=env
            )
            # The worker and beat only run tasks once jobs exist, which needs web's migrations first.
            wait_for_healthz(base_url, children=list(plane.components.values()))
            # WARNING: at INFO both log every tick (5 a second), which would bury what a failure needs.
            quiet = ["--log-level", "WARNING"]
            plane.components["worker"] = group.start("worker", [server, *quiet, "worker"], env=env)
            plane.components["beat"] = group.start("beat", [server, *quiet, "beat"], env=env)
        else:
            env = child_environment(root / "data")
            if host != "127.0.0.1":
                env.setdefault("ALLOWED_HOSTS", f"localhost,127.0.0.1,[::1],{host}")
            plane = ControlPlane(mode="embedded", base_url=base_url, env=env, group=group)
            plane.components["server"] = group.start(
                "server", [server, "--host", host, "--port", str(port)], env=env
            )
            wait_for_healthz(base_url, children=list(plane.components.values()))
        plane.api_token = plane.manage("create_user_token", "e2e-admin", "--staff")
        yield plane


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """The control plane in the current mode (see the module docstring), shared by the tests of a module."""
    root = tmp_path_factory.mktemp("control-plane")
    with start_control_plane(root) as plane:
        yield plane
    shutil.rmtree(root / "data", ignore_errors=True)


# --- worker daemons ------------------------------------------------------------------------------------


def start_daemon(
    group: ProcessGroup,
    plane: ControlPlane,
    *,
    name: str,
    token: str,
    root: Path,
    benchmark: bool = False,
    options: tuple[str, ...] = (),
    peer: Peer | None = None,
) -> Child:
    """Start ``hypha-worker-daemon`` as worker ``name`` with a 2-cpu/4-GB config under ``root``; without its
    start benchmark (seconds of CPU per daemon) unless ``benchmark``. With ``peer`` (``tests/e2e/wan.py``) it
    runs in the peer's namespace, its parameter server bound to the peer's address (``plane`` must listen
    on the Wan's ``host_address``)."""
    work_dir = root / name
    work_dir.mkdir(parents=True, exist_ok=True)
    config = root / f"{name}.toml"
    config.write_text(WORKER_TOML.format(work_dir=work_dir))
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("HYPHA_") and key not in {"DATABASE_URL", "REDIS_URL"}
    }
    env["PYTHONUNBUFFERED"] = "1"
    env["HYPHA_WORKER_TOKEN"] = token  # not --token: a command line is visible to every user in ps
    argv = [
        str(BIN_DIR / "hypha-worker-daemon"),
        "--server", plane.base_url,
        "--config", str(config),
        "--log-level", "INFO",
        *([] if benchmark else ["--no-benchmark"]),
        *options,
    ]  # fmt: skip
    if peer is not None:
        argv = peer.command([*argv, "--ps-host", peer.address])
    return group.start(f"daemon-{name}", argv, env=env)


# --- fixtures handing the helpers to tests (test modules cannot import a conftest reliably) -----------


@pytest.fixture
def daemon_factory(
    processes: ProcessGroup, control_plane: ControlPlane, tmp_path: Path
) -> Callable[..., Child]:
    """``daemon_factory(name=..., token=..., benchmark=False, options=())`` starts a daemon of this test
    (stopped at teardown)."""

    def start(*, name: str, token: str, benchmark: bool = False, options: tuple[str, ...] = ()) -> Child:
        return start_daemon(
            processes,
            control_plane,
            name=name,
            token=token,
            root=tmp_path / "daemons",
            benchmark=benchmark,
            options=options,
        )

    return start


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., Any]:
    """:func:`wait_until`: poll a probe until it returns something truthy, with a deadline."""
    return wait_until
