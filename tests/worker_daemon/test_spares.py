"""Warm spares (worker_daemon.spares, worker_daemon.warm) with real processes: the job manager hands a task of a
built-in runtime to its spare, which then is the executor in every way the daemon can see — pid and process
group, output, exit code, SIGTERM — and the spare is replaced, retired and killed when it should be.

A real spare imports torch, transformers and accelerate: several seconds of CPU each, so these tests start as
few as they can. A spare whose imports must fail gets a ``torch`` on its ``PYTHONPATH`` that raises.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from worker_daemon import protocol, warm
from worker_daemon.config import WorkerConfig
from worker_daemon.jobs import JobManager, Task
from worker_daemon.leases import LeaseBook
from worker_daemon.link import ControlLink
from worker_daemon.spares import Spare, Spares

JOB = uuid.UUID(int=42)
LEASE = uuid.UUID(int=7)
PS_PEER = "0a4f7e4e-3a8f-4d55-9d0c-6a3d0c1b7e22"
#: A trainer stopped by SIGTERM tears down an interpreter holding torch: seconds on a loaded machine.
GRACE = 30.0
#: A spare's imports: 5-15 s on 2 shared cores.
WARM_TIMEOUT = 180.0


def config(work_dir: Path, *, warm_start: bool) -> WorkerConfig:
    return WorkerConfig.model_validate(
        {
            "work_dir": str(work_dir),
            "resources": {"cpu": 2, "memory": 4, "storage": 10, "gpu": 0},
            "kill_grace": GRACE,
            "warm_start": warm_start,
            "executors": [
                {"class": "train", "name": "diloco-transformer", "runtime": "trainer"},
                {"class": "aggregate", "name": "parameter-server", "runtime": "parameter-server"},
            ],
        }
    )


@pytest.fixture
def book() -> LeaseBook:
    lease_book = LeaseBook(capacity=protocol.Resources(cpu=2, memory=4, storage=10))
    lease_book.activate(
        lease_id=LEASE, job_id=JOB, role="trainer", resources=protocol.Resources(cpu=1), price=1.0, ttl=600.0
    )
    return lease_book


@pytest.fixture
def quiet_threads(monkeypatch) -> None:
    # One thread per process (as the cluster runs them): these tests share two cores with others.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")


@pytest.fixture
async def managers(book, link: ControlLink, answerer, short_dir) -> AsyncIterator:
    """Makes job managers (warm or cold) that are always stopped, and checks no spare outlives them."""
    made: list[JobManager] = []

    def make(*, warm_start: bool) -> JobManager:
        manager = JobManager(
            config=config(short_dir / f"w{len(made)}", warm_start=warm_start),
            book=book,
            server_url="http://cp.example",
            link=link,
        )
        made.append(manager)
        return manager

    yield make
    for manager in made:
        await manager.stop_all(timeout=GRACE + 10)


def train_spec(*, job_json_broken: bool = False) -> dict:
    """A trainer's envelope whose parameter server is PS_PEER (an address the test gives, or none)."""
    peers = {"type": "peers", "peers": [PS_PEER], "strategy": {"type": "All"}, "resource": None}
    config = {
        "model": {
            "task": "causal-lm",
            "artifact": {"type": "parameter-server", "peer": PS_PEER, "filenames": ["config.json"]},
            "input-names": ["input_ids", "labels"],
        },
        "data": {"type": "scheduler", "peer": "control-plane", "dataset": "tiny"},
        "updates": peers,
        "results": peers,
        "optimizer": {"learning-rate": 1e-3, "betas": None, "epsilon": None},
        "batch_size": 4,
    }
    executor = {"class": "train", "descriptor": {"name": "diloco-transformer"}, "config": config}
    if job_json_broken:
        executor = {"class": "train", "descriptor": {"name": "diloco-transformer"}}  # no config
    return {"job_id": str(JOB), "executor": executor}


def dispatch(spec: dict, *, peers: dict[str, str] | None = None) -> protocol.DispatchJob:
    return protocol.DispatchJob(
        task_id=uuid.uuid4(),
        lease_id=LEASE,
        job_id=JOB,
        role="trainer",
        spec=spec,
        peers=peers or {},
        transfer_token="token",
    )


async def until(predicate, *, timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout:g} s: {what}"
        await asyncio.sleep(0.05)


def gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (reaped, or a zombie nobody reaps)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def ready_spare(manager: JobManager) -> Spare | None:
    spare = manager.spares.spare
    return spare if spare is not None and spare.ready_after is not None else None


class BlackHole:
    """A TCP server that accepts connections and never answers: a parameter server the trainer waits on."""

    def __init__(self) -> None:
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def __aexit__(self, *exc_info: object) -> None:
        for writer in self.writers:
            writer.close()
        assert self.server is not None
        self.server.close()


async def stop_a_blocked_trainer(manager: JobManager) -> tuple[Task, protocol.JobExited]:
    """Dispatch a trainer that blocks on its parameter server (past its imports), then cancel it."""
    hole = BlackHole()
    async with hole as url:
        task = manager.start(dispatch(train_spec(), peers={PS_PEER: url}))
        assert task is not None
        await until(lambda: hole.connections > 0, timeout=WARM_TIMEOUT, what="the trainer reached its peer")
        # no spare warms up beside a running task (it would take the CPU of the task's start-up)
        assert manager.spares.spare is None
        assert manager.cancel(task.task_id, reason="cancelled by the user")
        exited = await asyncio.wait_for(task.runner, GRACE + 10)
    return task, exited


async def test_a_warm_spare_becomes_the_trainer_and_stops_on_sigterm_as_a_cold_one_does(
    managers, link, answerer, quiet_threads
):
    # given: a daemon's job manager whose warm spare has done its imports
    manager = managers(warm_start=True)
    manager.start_spares()
    await until(lambda: ready_spare(manager) is not None, timeout=WARM_TIMEOUT, what="the spare is ready")
    spare_pid = manager.spares.spare.process.pid

    # when: a trainer is dispatched, blocks on its parameter server and is cancelled
    task, exited = await stop_a_blocked_trainer(manager)

    # then: the spare was the trainer: same pid, its own process group, the trainer's own output
    assert task.warm is True and task.process.pid == spare_pid
    assert manager.spares.handed_out == 1
    lines = exited.log_tail.splitlines()
    assert any(
        "worker_daemon.executors.training: job" in line and "starting the trainer" in line for line in lines
    )
    # SIGTERM went to its group; the trainer turned it into exit code 143, as a cold one does
    assert (exited.exit_code, exited.signal, exited.cancelled, exited.reason) == (
        143,
        None,
        True,
        "cancelled by the user",
    )
    assert any(
        line.endswith("WARNING worker_daemon.executors.training: terminated by SIGTERM") for line in lines
    )

    # and: a cold trainer, stopped the same way, ends the same way
    cold = managers(warm_start=False)
    cold_task, cold_exited = await stop_a_blocked_trainer(cold)
    assert cold_task.warm is False and cold.spares.spare is None
    assert (cold_exited.exit_code, cold_exited.signal, cold_exited.cancelled, cold_exited.reason) == (
        exited.exit_code,
        exited.signal,
        exited.cancelled,
        exited.reason,
    )
    assert any(line.endswith("terminated by SIGTERM") for line in cold_exited.log_tail.splitlines())

    # and: the idle daemon has a new spare, which stopping the manager kills
    await until(lambda: manager.spares.spare is not None, timeout=10, what="a replacement spare")
    replacement = manager.spares.spare.process.pid
    assert replacement != spare_pid and gone(spare_pid)
    await manager.stop_all()
    assert gone(replacement) and manager.spares.spare is None


async def test_a_spare_that_dies_is_replaced_and_a_task_may_take_it_before_it_is_ready(
    managers, link, answerer, quiet_threads
):
    # given: a warm manager whose spare is killed from outside
    manager = managers(warm_start=True)
    manager.start_spares()
    await until(lambda: manager.spares.spare is not None, timeout=10, what="a spare")
    first = manager.spares.spare.process.pid
    os.kill(first, signal.SIGKILL)

    # when: it is replaced, and the replacement is frozen before it can finish its imports
    await until(
        lambda: manager.spares.spare is not None and manager.spares.spare.process.pid != first,
        timeout=10,
        what="a replacement spare",
    )
    second = manager.spares.spare.process.pid
    os.kill(second, signal.SIGSTOP)
    assert manager.spares.failures == 1 and manager.spares.spare.ready_after is None
    task = manager.start(dispatch(train_spec(job_json_broken=True)))
    await until(lambda: task.process is not None, timeout=10, what="the task's process")
    os.kill(second, signal.SIGCONT)
    exited = await asyncio.wait_for(task.runner, WARM_TIMEOUT)

    # then: the still-importing spare ran the task, which failed as a cold one does
    assert task.warm is True and task.process.pid == second and gone(first)
    cold = managers(warm_start=False)
    cold_task = cold.start(dispatch(train_spec(job_json_broken=True)))
    cold_exited = await asyncio.wait_for(cold_task.runner, 60)
    assert cold_task.warm is False
    assert (exited.exit_code, exited.signal, exited.reason) == (
        cold_exited.exit_code,
        cold_exited.signal,
        cold_exited.reason,
    )
    assert exited.exit_code == 4 and exited.reason.startswith("JobConfigError: ")

    # and: a spare still importing is killed when the manager stops
    await until(lambda: manager.spares.spare is not None, timeout=10, what="the next spare")
    third = manager.spares.spare.process.pid
    await manager.stop_all()
    assert gone(third)


@pytest.fixture
def broken_torch(tmp_path, monkeypatch) -> Path:
    """A ``torch`` first on the path that prints a line and fails to import."""
    package = tmp_path / "broken" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import sys\nprint('broken torch imported', file=sys.stderr)\nraise ImportError('broken torch for a test')\n"
    )
    path = [str(package.parent), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, path)))
    return package


async def test_a_spare_whose_imports_failed_is_retired_and_tasks_start_cold(
    managers, link, answerer, broken_torch, caplog
):
    # given: a spare that cannot import torch
    manager = managers(warm_start=True)
    manager.start_spares()
    await until(lambda: manager.spares.disabled is not None, timeout=60, what="the spare gives up")
    assert manager.spares.spare is None
    assert "import torch: ImportError: broken torch for a test" in manager.spares.disabled

    # when: a trainer is dispatched
    task = manager.start(dispatch(train_spec(job_json_broken=True)))
    exited = await asyncio.wait_for(task.runner, 60)

    # then: it ran cold, and no spare is started again
    assert task.warm is False and exited.exit_code == 4
    await asyncio.sleep(0.2)
    assert manager.spares.spare is None and manager.spares.handed_out == 0
    assert any("tasks start cold from now on" in record.getMessage() for record in caplog.records)


async def test_a_task_reaching_a_spare_whose_imports_failed_runs_cold_with_the_spares_output(
    broken_torch, short_dir
):
    # given: a spare (the bare protocol) that cannot import torch, handed its task at once
    read_end, write_end = os.pipe()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "worker_daemon.warm", "--ready-fd", str(write_end), "--runtime", "trainer"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        pass_fds=(write_end,),
        start_new_session=True,
    )
    os.close(write_end)
    environment = {**os.environ, "JOB_JSON": json.dumps(train_spec(job_json_broken=True))}
    argv = [sys.executable, "-m", "worker_daemon.executors.training", "--socket", "s", "--work-dir", "w"]
    task = json.dumps({"argv": argv, "env": environment, "cwd": str(short_dir)}) + "\n"

    # when
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(task.encode()), 60)
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    report = json.loads(os.read(read_end, 65536))
    os.close(read_end)

    # then: the spare said its imports failed, ran the task cold (exit 4: the job's error), and what its
    # imports printed comes first, once
    assert report["failed"] == "import torch: ImportError: broken torch for a test"
    assert process.returncode == 4
    assert stderr.decode().splitlines()[0] == "broken torch imported"
    assert stderr.decode().count("broken torch imported") == 1
    assert "ERROR worker_daemon.executors.training: JobConfigError: " in stdout.decode()


async def test_a_spare_started_in_another_environment_is_retired_not_handed_out(monkeypatch):
    # given: a spare (a stand-in process) started with the daemon's environment of then
    process = await asyncio.create_subprocess_exec("sleep", "60", start_new_session=True)
    spares = Spares(runtimes=["trainer"], environment=lambda: {"A": "1"})
    spares.spare = Spare(process=process, environment={"A": "1"})

    # when: the environment now differs
    taken = spares.take({"A": "2"})

    # then: no spare; the stand-in is killed
    assert taken is None and spares.spare is None
    assert await asyncio.wait_for(process.wait(), 5) == -signal.SIGKILL

    # and: one with the same environment is handed out
    same = await asyncio.create_subprocess_exec("sleep", "60", start_new_session=True)
    spares.spare = Spare(process=same, environment={"A": "1"})
    assert spares.take({"A": "1"}).process is same and spares.handed_out == 1
    same.kill()
    await same.wait()


def test_no_spare_without_a_built_in_runtime_or_with_warm_start_off(tmp_path, book):
    process_only = WorkerConfig.model_validate(
        {
            "work_dir": str(tmp_path),
            "executors": [{"class": "train", "name": "t", "runtime": "process", "cmd": "x"}],
        }
    )
    assert JobManager(config=process_only, book=book, server_url="http://cp").spares.runtimes == ()
    off = config(tmp_path, warm_start=False)
    assert JobManager(config=off, book=book, server_url="http://cp").spares.runtimes == ()
    on = config(tmp_path, warm_start=True)
    assert JobManager(config=on, book=book, server_url="http://cp").spares.runtimes == (
        "trainer",
        "parameter-server",
    )


@pytest.mark.parametrize(
    "line",
    [
        b"not json\n",
        b'{"argv": [], "env": {}, "cwd": "/"}\n',
        b'{"argv": ["x"], "env": {"A": 1}, "cwd": "/"}\n',
        b'{"argv": ["x"], "env": {}}\n',
    ],
)
def test_a_bad_task_line_is_refused(tmp_path, line):
    path = tmp_path / "line"
    path.write_bytes(line)
    with path.open("rb") as stream, pytest.raises(ValueError):
        warm.read_task(stream)


def test_a_task_line_and_the_end_of_file(tmp_path):
    path = tmp_path / "line"
    task = {"argv": [sys.executable, "-m", "parameter_server"], "env": {"A": "1"}, "cwd": "/"}
    path.write_text(json.dumps(task) + "\n")
    with path.open("rb") as stream:
        assert warm.read_task(stream) == task
        assert warm.read_task(stream) is None


async def test_a_daemon_keeps_a_spare_from_its_start(
    control_plane, daemons, worker_config, broken_torch, caplog
):
    # given / when: a daemon with warm start, no benchmark at start (its spare's imports fail: a quick one)
    caplog.set_level(logging.INFO, logger="worker_daemon")
    daemon, _ = daemons.start(config=worker_config, server_url=control_plane.url, warm_start=True)

    # then: it started a spare at once
    await until(lambda: daemon.jobs.spares.disabled is not None, timeout=60, what="the spare gave up")
    assert daemon.jobs.spares.active is True
    messages = [record.getMessage() for record in caplog.records]
    assert any(message.startswith("warm spare started (pid ") for message in messages)


async def test_a_daemon_benchmarking_at_start_starts_its_spare_after_the_benchmark(
    control_plane, daemons, worker_config, broken_torch, caplog
):
    # given / when: a daemon with warm start and a benchmark at start (which fails at once without torch)
    caplog.set_level(logging.INFO, logger="worker_daemon")
    daemon, _ = daemons.start(
        config=worker_config, server_url=control_plane.url, warm_start=True, benchmark_at_start=True
    )

    # then: the spare was started once the benchmark had ended: its imports would have slowed it
    await until(lambda: daemon.jobs.spares.disabled is not None, timeout=60, what="the spare gave up")
    messages = [record.getMessage() for record in caplog.records]
    benchmark_end = next(i for i, m in enumerate(messages) if m.startswith("worker benchmark failed"))
    spare_start = next(i for i, m in enumerate(messages) if m.startswith("warm spare started"))
    assert benchmark_end < spare_start


async def test_a_daemon_without_warm_start_starts_no_spare(control_plane, daemons, worker_config, make):
    daemon, _ = daemons.start(config=worker_config, server_url=control_plane.url)
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)
    await asyncio.sleep(0.2)
    assert daemon.jobs.spares.active is False and daemon.jobs.spares.spare is None


def test_the_spares_tiny_model_leaves_torchs_random_state_as_it_was():
    torch = pytest.importorskip("torch")
    before = torch.random.get_rng_state()

    warm.exercise()  # builds a model: its weights' initialisation draws from the generator

    assert torch.equal(torch.random.get_rng_state(), before)
