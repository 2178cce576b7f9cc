"""``[[executors]] env`` (ours): string variables a worker TOML adds to a task's environment, validated when the
config is loaded (the names the daemon sets for the bridge are refused), seen by a real executor process."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path

import pytest

from worker_daemon import jobs as jobs_module
from worker_daemon import protocol
from worker_daemon.config import RESERVED_ENVIRONMENT, load_config
from worker_daemon.exceptions import ConfigError
from worker_daemon.jobs import JobManager
from worker_daemon.leases import LeaseBook

JOB = uuid.UUID(int=42)
LEASE = uuid.UUID(int=7)
SEEN = (
    "HF_HOME",
    "MY_FLAG",
    "EMPTY",
    "DAEMON_ONLY",
    "SOCKET_PATH",
    "WORK_DIR",
    "HYPHA_SLOWDOWN",
    "HYPHA_TOKEN",
)

EXECUTOR = f"""
import json, os, sys
with open(sys.argv[1], "w") as file:
    json.dump({{key: os.environ.get(key) for key in {SEEN!r}}}, file)
"""


def write_config(directory: Path, executors: str) -> Path:
    path = directory / "worker.toml"
    path.write_text(
        f'work_dir = "{directory / "w"}"\n'
        "[resources]\ncpu = 2\nmemory = 4\nstorage = 10\ngpu = 0\n"
        "[offer]\nprice = 1.0\nfloor = 1.0\n" + executors
    )
    return path


def process_executor(script: Path, record: Path, env: str) -> str:
    return (
        '[[executors]]\nclass = "train"\nname = "env-executor"\nruntime = "process"\n'
        f'cmd = "{sys.executable}"\nargs = ["{script}", "{record}"]\n{env}\n'
    )


@pytest.fixture
def book() -> LeaseBook:
    lease_book = LeaseBook(capacity=protocol.Resources(cpu=2, memory=4, storage=10))
    lease_book.activate(
        lease_id=LEASE, job_id=JOB, role="trainer", resources=protocol.Resources(cpu=1), price=1.0, ttl=60.0
    )
    return lease_book


def dispatch(name: str, executor_class: str = "train") -> protocol.DispatchJob:
    return protocol.DispatchJob(
        task_id=uuid.uuid4(),
        lease_id=LEASE,
        job_id=JOB,
        role="trainer",
        spec={"job_id": str(JOB), "executor": {"class": executor_class, "descriptor": {"name": name}}},
        peers={},
        transfer_token="token",
    )


async def test_the_executor_process_gets_its_env_over_the_daemons_but_not_over_what_the_daemon_sets(
    short_dir, book, link, answerer, monkeypatch
):
    # given: a worker TOML whose executor sets three variables, one of which the daemon has too
    monkeypatch.setenv("MY_FLAG", "from-the-daemon")
    monkeypatch.setenv("DAEMON_ONLY", "inherited")
    monkeypatch.setenv("HYPHA_TOKEN", "worker-secret")
    script, record = short_dir / "executor.py", short_dir / "record.json"
    script.write_text(EXECUTOR)
    env = 'env = { HF_HOME = "/data/hf cache", MY_FLAG = "1", EMPTY = "" }'
    config = load_config(write_config(short_dir, process_executor(script, record, env)), environ={})
    manager = JobManager(config=config, book=book, server_url="wss://cp.example/", link=link)

    # when: a task of that executor runs
    try:
        task = manager.start(dispatch("env-executor"))
        exited = await asyncio.wait_for(task.runner, 20)
    finally:
        await manager.stop_all(timeout=5.0)

    # then: its variables, over the daemon's; the daemon's own for the bridge; never the worker's token
    seen = json.loads(record.read_text())
    assert exited.exit_code == 0, exited.log_tail
    assert seen["HF_HOME"] == "/data/hf cache"
    assert seen["MY_FLAG"] == "1"
    assert seen["EMPTY"] == ""
    assert seen["DAEMON_ONLY"] == "inherited"
    assert seen["SOCKET_PATH"].endswith("/bridge.sock")
    assert seen["WORK_DIR"] == str(Path(seen["SOCKET_PATH"]).parent)
    assert seen["HYPHA_SLOWDOWN"] == "1.0"
    assert seen["HYPHA_TOKEN"] is None


@pytest.mark.parametrize("name", RESERVED_ENVIRONMENT)
def test_a_reserved_name_is_a_config_error_naming_it(tmp_path, name):
    path = write_config(
        tmp_path, process_executor(tmp_path / "x.py", tmp_path / "r", f'env = {{ {name} = "x" }}')
    )

    with pytest.raises(ConfigError) as raised:
        load_config(path, environ={})

    message = str(raised.value)
    assert f"executors[0].env: {name} is reserved: the daemon sets it for the bridge and the task" in message
    assert "reserved: SOCKET_PATH, WORK_DIR, JOB_JSON, HYPHA_SLOWDOWN, HYPHA_SERVER_URL" in message


@pytest.mark.parametrize(
    ("env", "complaint"),
    [
        (
            "env = { OMP_NUM_THREADS = 4 }",
            'OMP_NUM_THREADS must be a string (quote it: OMP_NUM_THREADS = "4")',
        ),
        ("env = { FLAG = true }", "FLAG must be a string"),
        ('env = { "1ABC" = "x" }', "'1ABC' is not an environment variable name"),
        ('env = { "A=B" = "x" }', "'A=B' is not an environment variable name"),
        ('env = { "" = "x" }', "'' is not an environment variable name"),
        ('env = { A = "x\\u0000y" }', "A must hold no NUL character"),
        ('env = "HF_HOME=/data"', "must be a table of strings"),
        ('env = { A = { B = "c" } }', "A must be a string"),
    ],
)
def test_a_bad_env_table_is_a_config_error(tmp_path, env, complaint):
    path = write_config(tmp_path, process_executor(tmp_path / "x.py", tmp_path / "r", env))

    with pytest.raises(ConfigError) as raised:
        load_config(path, environ={})

    assert "executors[0].env" in str(raised.value)
    assert complaint in str(raised.value)


def test_built_in_runtimes_get_the_env_too(short_dir, book, monkeypatch):
    # given: the built-in trainer and parameter server, each with an env table
    executors = (
        '[[executors]]\nclass = "train"\nname = "diloco-transformer"\nruntime = "trainer"\n'
        'env = { PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:True" }\n'
        '[[executors]]\nclass = "aggregate"\nname = "parameter-server"\nruntime = "parameter-server"\n'
        'env = { HF_HUB_OFFLINE = "1" }\n'
    )
    config = load_config(write_config(short_dir, executors), environ={})
    manager = JobManager(config=config, book=book, server_url="wss://cp.example/")
    work_dir = short_dir / "hypha-x"
    work_dir.mkdir()
    for (executor_class, name), variable, value in (
        (("train", "diloco-transformer"), "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        (("aggregate", "parameter-server"), "HF_HUB_OFFLINE", "1"),
    ):
        task = jobs_module.Task(
            dispatch=dispatch(name, executor_class),
            executor=config.find_executor(executor_class, name),
            work_dir=work_dir,
            socket_path=short_dir / "s",
        )

        # when
        _, environment = manager._command(task)

        # then
        assert environment[variable] == value
        assert environment["WORK_DIR"] == str(work_dir)


@pytest.mark.parametrize(("env", "asks_for_a_spare"), [("", True), ('env = { HF_HUB_OFFLINE = "1" }', False)])
async def test_a_task_of_an_executor_with_env_never_becomes_a_warm_spare(
    short_dir, book, link, answerer, monkeypatch, env, asks_for_a_spare
):
    # given: a built-in trainer runtime (here running a module that exits at once), warm start off so that no
    # real spare is started; the manager's spares record whether a task asked for one
    monkeypatch.setattr(jobs_module, "TRAINER_MODULE", "this")
    executors = f'[[executors]]\nclass = "train"\nname = "diloco-transformer"\nruntime = "trainer"\n{env}\n'
    config = load_config(write_config(short_dir, "warm_start = false\n" + executors), environ={})
    manager = JobManager(config=config, book=book, server_url="wss://cp.example/", link=link)
    asked: list[dict] = []
    monkeypatch.setattr(manager.spares, "take", lambda environment: asked.append(dict(environment)))

    # when
    try:
        task = manager.start(dispatch("diloco-transformer"))
        exited = await asyncio.wait_for(task.runner, 20)
    finally:
        await manager.stop_all(timeout=5.0)

    # then: it ran cold either way here; with an env table it never asked for the spare
    assert exited.exit_code == 0, exited.log_tail
    assert bool(asked) is asks_for_a_spare
