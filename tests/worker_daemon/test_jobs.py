"""The job manager with real child processes (a small Python executor that speaks to its bridge with httpx over
the Unix socket) and the control plane's side of the link played in process (the ``answerer`` fixture)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from worker_daemon import jobs as jobs_module
from worker_daemon import protocol
from worker_daemon.config import WorkerConfig
from worker_daemon.jobs import JobManager, Task, substitute
from worker_daemon.leases import LeaseBook
from worker_daemon.link import ControlLink

JOB = uuid.UUID(int=42)
LEASE = uuid.UUID(int=7)
GRACE = 0.3

# The executor: records what it was started with, then behaves as JOB_JSON's config.mode says.
EXECUTOR = r"""
import json, os, signal, stat, subprocess, sys, time
import httpx

socket_path, work_dir, job_json, literal = sys.argv[1:5]
config = json.loads(job_json)["executor"]["config"]
record = {
    "argv": sys.argv[1:],
    "env": {key: os.environ.get(key) for key in ("SOCKET_PATH", "WORK_DIR", "JOB_JSON", "HYPHA_TOKEN")},
    "cwd": os.getcwd(),
    "work_dir_mode": stat.S_IMODE(os.stat(work_dir).st_mode),
    "socket_mode": stat.S_IMODE(os.stat(socket_path).st_mode),
    "own_group": os.getpgid(0) == os.getpid(),
}
mode = config["mode"]
if mode == "train":
    client = httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), base_url="http://hypha", timeout=10)
    record["reply"] = client.post("/status/send", json={"status": {"batch_size": 4}}).json()
    files = client.post("/resources/fetch", json={"type": "scheduler", "peer": "cp", "dataset": "d"}).json()
    record["files"] = files
    record["slice"] = open(os.path.join(work_dir, files[0]["path"]), "rb").read().decode()
with open(config["record"], "w") as file:
    json.dump(record, file)
for number in range(60):
    print(f"line {number}", flush=True)
print("to stderr", file=sys.stderr, flush=True)
if mode == "train":
    sys.exit(3)
if mode == "exit":
    sys.exit(0)
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(f"grandchild {child.pid}", flush=True)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def script(short_dir: Path) -> Path:
    path = short_dir / "executor.py"
    path.write_text(EXECUTOR)
    return path


@pytest.fixture
def config(short_dir: Path, script: Path) -> WorkerConfig:
    return WorkerConfig.model_validate(
        {
            "work_dir": str(short_dir / "w"),
            "resources": {"cpu": 8, "memory": 32, "storage": 100, "gpu": 24},
            "kill_grace": GRACE,
            "parameter_server": {"host": "0.0.0.0", "port": 8470, "public_url": "http://gpu-01:8470"},
            "executors": [
                {
                    "class": "train",
                    "name": "test-executor",
                    "runtime": "process",
                    "cmd": sys.executable,
                    "args": [str(script), "{SOCKET_PATH}", "{WORK_DIR}", "{JOB_JSON}", "{OTHER}-{WORK_DIR}"],
                },
                {"class": "aggregate", "name": "parameter-server", "runtime": "parameter-server"},
            ],
        }
    )


@pytest.fixture
def book() -> LeaseBook:
    lease_book = LeaseBook(capacity=protocol.Resources(cpu=8, memory=32, storage=100, gpu=24))
    lease_book.activate(
        lease_id=LEASE, job_id=JOB, role="trainer", resources=protocol.Resources(gpu=10), price=1.0, ttl=60.0
    )
    return lease_book


@pytest.fixture
async def manager(config, book, link: ControlLink, answerer):
    jobs = JobManager(config=config, book=book, server_url="wss://cp.example/prefix", link=link)
    yield jobs
    await jobs.stop_all(timeout=5.0)


def dispatch(
    record: Path, *, mode: str = "train", lease_id: uuid.UUID = LEASE, job_id: uuid.UUID = JOB, **spec_changes
) -> protocol.DispatchJob:
    executor = {
        "class": "train",
        "descriptor": {"name": "test-executor"},
        "config": {"mode": mode, "record": str(record)},
    }
    return protocol.DispatchJob(
        task_id=uuid.uuid4(),
        lease_id=lease_id,
        job_id=job_id,
        role="trainer",
        spec={"job_id": str(job_id), "executor": executor | spec_changes},
        peers={},
        transfer_token="token",
    )


async def wait_for_line(task: Task, text: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not any(text in line for line in task.output):
        assert asyncio.get_running_loop().time() < deadline, f"no {text!r} in the output"
        await asyncio.sleep(0.01)


async def posted(link: ControlLink, answerer, message_type: type, timeout: float = 5.0) -> list:
    """The frames of ``message_type`` once all posted frames are sent."""
    assert await link.flush(timeout=timeout)
    return answerer.of_type(message_type)


def test_placeholders_are_substituted_once():
    values = {"SOCKET_PATH": "/w/bridge.sock", "WORK_DIR": "/w{JOB_JSON}", "JOB_JSON": '{"a":1}'}
    assert substitute("--dir={WORK_DIR} {SOCKET_PATH} {JOB_JSON} {UNKNOWN}", values) == (
        '--dir=/w{JOB_JSON} /w/bridge.sock {"a":1} {UNKNOWN}'
    )


async def test_a_task_runs_with_its_bridge_and_reports_its_exit(
    manager, link, answerer, answer_slice, peer, short_dir, monkeypatch
):
    # given a slice the control plane hands out, and a worker token in the daemon's environment
    monkeypatch.setenv("HYPHA_TOKEN", "worker-secret")
    peer.slices[("d", 4)] = b"slice four"
    answerer.slice_answers = [answer_slice(peer, "d", 4)]
    answerer.status_replies = [{"type": "ScheduleUpdate", "counter": 2}]
    record = short_dir / "record.json"
    message = dispatch(record)

    # when
    task = manager.start(message)
    exited = await asyncio.wait_for(task.runner, 20)

    # then the executor was started as configured, talked to its bridge, and its exit was reported
    started = json.loads(record.read_text())
    work_dir = started["env"]["WORK_DIR"]
    socket_path = f"{work_dir}/bridge.sock"
    job_json = json.dumps(message.spec, separators=(",", ":"))
    assert Path(work_dir).parent == short_dir / "w" and Path(work_dir).name.startswith("hypha-")
    assert started["argv"] == [socket_path, work_dir, job_json, "{OTHER}-" + work_dir]
    assert started["env"] == {
        "SOCKET_PATH": socket_path,
        "WORK_DIR": work_dir,
        "JOB_JSON": job_json,
        "HYPHA_TOKEN": None,
    }
    assert (started["work_dir_mode"], started["socket_mode"]) == (0o700, 0o600)
    assert started["cwd"] == os.getcwd()
    assert started["own_group"] is True
    assert started["reply"] == {"type": "ScheduleUpdate", "counter": 2}
    assert started["files"] == [{"path": "artifacts/4", "size": 10}]
    assert started["slice"] == "slice four"
    assert (exited.exit_code, exited.signal, exited.cancelled, exited.reason) == (
        3,
        None,
        False,
        "exited with code 3",
    )
    lines = exited.log_tail.splitlines()
    assert len(lines) == 50 and "to stderr" in lines and lines[0] == "line 11"
    assert not Path(work_dir).exists()
    assert manager.tasks == {}
    assert await posted(link, answerer, protocol.JobStarted) == [protocol.JobStarted(task_id=message.task_id)]
    assert await posted(link, answerer, protocol.JobExited) == [exited]
    (report,) = answerer.of_type(protocol.StatusReport)
    assert (report.task_id, report.progress) == (message.task_id, {"status": {"batch_size": 4}})
    assert [ack.index for ack in answerer.of_type(protocol.SliceAck)] == [4]


async def test_a_dispatch_a_cancel_and_the_task_lifetime_are_spans(
    manager, link, answerer, short_dir, memory_spans
):
    # given: tracing on; an executor that waits to be cancelled
    record = short_dir / "record.json"
    message = dispatch(record, mode="wait")

    # when
    manager.handle(message)
    task = manager.tasks[message.task_id]
    await wait_for_line(task, "ready")
    manager.handle(protocol.CancelJob(task_id=message.task_id, reason="test over"))
    exited = await asyncio.wait_for(task.runner, 20)

    # then: dispatch_job ends at once; the task's span lasts until its exit and holds its outcome
    spans = {span.name: span for span in memory_spans()}
    assert set(spans) == {"dispatch_job", "cancel_job", "task"}
    ids = {"hypha.job_id": str(JOB), "hypha.task_id": str(message.task_id), "hypha.role": "trainer"}
    assert dict(spans["dispatch_job"].attributes) == {
        **ids,
        "hypha.lease_id": str(LEASE),
        "hypha.started": True,
    }
    assert dict(spans["cancel_job"].attributes) == {
        "hypha.task_id": str(message.task_id),
        "hypha.found": True,
    }
    assert dict(spans["task"].attributes) == {
        **ids,
        "hypha.executor": "train/test-executor",
        "hypha.signal": exited.signal,
        "hypha.cancelled": True,
        "hypha.reason": "test over",
    }
    assert spans["task"].parent.span_id == spans["dispatch_job"].context.span_id


async def test_cancel_sends_sigterm_then_sigkill_to_the_whole_group(manager, link, answerer, short_dir):
    # given a task that ignores SIGTERM and has a child of its own
    message = dispatch(short_dir / "record.json", mode="ignore-term")
    task = manager.start(message)
    await wait_for_line(task, "ready")
    grandchild = int(next(line for line in task.output if line.startswith("grandchild")).split()[1])
    work_dir = task.work_dir

    # when
    began = time.monotonic()
    assert manager.cancel(message.task_id, reason="cancelled by the user")
    exited = await asyncio.wait_for(task.runner, 10)

    # then it was killed after the grace period, with its child, and cleaned up
    assert time.monotonic() - began >= GRACE
    assert (exited.exit_code, exited.signal, exited.cancelled, exited.reason) == (
        None,
        signal.SIGKILL,
        True,
        "cancelled by the user",
    )
    assert "ready" in exited.log_tail
    assert not work_dir.exists()
    assert await posted(link, answerer, protocol.JobExited) == [exited]
    # the kernel ends the grandchild soon after the group's SIGKILL (later on a busy machine)
    status = Path(f"/proc/{grandchild}/status")

    def gone() -> bool:
        try:
            return "State:\tZ" in status.read_text()
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 30.0
    while not gone():
        assert time.monotonic() < deadline, f"grandchild {grandchild} still alive after the group's SIGKILL"
        await asyncio.sleep(0.05)


async def test_a_dropped_lease_cancels_its_tasks(manager, book, link, answerer, short_dir):
    task = manager.start(dispatch(short_dir / "record.json", mode="sleep"))
    await wait_for_line(task, "ready")
    assert manager.cancel_orphans() == []

    book.drop(LEASE)
    assert manager.cancel_orphans() == [task.task_id]
    exited = await asyncio.wait_for(task.runner, 10)

    # a process that stops on SIGTERM is not killed
    assert (exited.exit_code, exited.signal, exited.cancelled) == (None, signal.SIGTERM, True)
    assert exited.reason == f"lease {LEASE} ended"


async def test_stop_all_stops_every_task_and_refuses_new_ones(manager, link, answerer, short_dir):
    tasks = [manager.start(dispatch(short_dir / f"record-{n}.json", mode="sleep")) for n in range(2)]
    for task in tasks:
        await wait_for_line(task, "ready")

    await manager.stop_all(reason="daemon shutting down")

    assert manager.tasks == {}
    exits = await posted(link, answerer, protocol.JobExited)
    assert sorted(exited.task_id for exited in exits) == sorted(task.task_id for task in tasks)
    assert {(exited.cancelled, exited.reason) for exited in exits} == {(True, "daemon shutting down")}
    late = dispatch(short_dir / "late.json")
    assert manager.start(late) is None
    assert (await posted(link, answerer, protocol.JobExited))[-1].reason == "daemon shutting down"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"lease_id": uuid.UUID(int=8)}, f"lease {uuid.UUID(int=8)} is not held (active) by this worker"),
        ({"job_id": uuid.UUID(int=43)}, f"lease {LEASE} belongs to job {JOB}, not {uuid.UUID(int=43)}"),
        ({"descriptor": {"name": "llm"}}, "no executor train/llm is configured on this worker"),
        ({"class": "infer"}, "no executor infer/test-executor is configured on this worker"),
        (
            {"descriptor": None},
            "the job spec names no executor (executor.class and executor.descriptor.name)",
        ),
    ],
)
async def test_a_dispatch_that_cannot_run_here_is_refused(
    manager, link, answerer, short_dir, changes, reason
):
    ids = {key: changes.pop(key) for key in ("lease_id", "job_id") if key in changes}
    message = dispatch(short_dir / "record.json", **ids, **changes)

    assert manager.start(message) is None

    assert await posted(link, answerer, protocol.JobExited) == [
        protocol.JobExited(task_id=message.task_id, reason=reason)
    ]
    assert manager.tasks == {}
    assert not (short_dir / "w").exists()


async def test_exits_are_queued_while_disconnected(config, book, short_dir):
    # given a link without a connection
    link = ControlLink()
    manager = JobManager(config=config, book=book, server_url="http://cp:8000", link=link)
    message = dispatch(short_dir / "record.json", mode="train")
    message = message.model_copy(update={"spec": {"job_id": str(JOB), "executor": {"class": "train"}}})

    # when a task is refused and nothing is connected
    manager.start(message)
    assert [frame.type for frame in link.queued] == ["job_exited"]

    # then it is sent, in order, once a connection is welcomed
    sent = []

    async def send(frame):
        sent.append(frame)

    link.connected(send)
    assert await link.flush(timeout=2)
    assert [frame.type for frame in sent] == ["job_exited"]
    link.disconnected()


async def test_a_request_lost_with_its_connection_is_asked_again(short_dir):
    link = ControlLink()
    sent: list[protocol.DaemonMessage] = []

    async def send(frame):
        sent.append(frame)

    link.connected(send)
    request = protocol.StatusReport(request_id=uuid.uuid4(), task_id=uuid.uuid4(), progress="update")
    waiting = asyncio.create_task(link.request(request, timeout=5))
    await asyncio.sleep(0.05)
    assert sent == [request]

    link.disconnected()  # the reply died with the connection
    assert link.queued == [request]
    link.connected(send)
    await asyncio.sleep(0.05)
    assert sent == [request, request]
    link.resolve(protocol.StatusReply(request_id=request.request_id, reply={"type": "Ok"}))
    assert (await waiting).reply == {"type": "Ok"}
    link.disconnected()


def test_the_parameter_server_command(config, book, short_dir):
    manager = JobManager(config=config, book=book, server_url="wss://cp.example/prefix/ws/worker/")
    message = protocol.DispatchJob(
        task_id=uuid.uuid4(),
        lease_id=LEASE,
        job_id=JOB,
        role="parameter_server",
        spec={
            "job_id": str(JOB),
            "executor": {"class": "aggregate", "descriptor": {"name": "parameter-server"}},
        },
        transfer_token="ps-token",
        transfer_key="job-key",
    )
    executor = config.find_executor("aggregate", "parameter-server")
    task = Task(
        dispatch=message, executor=executor, work_dir=short_dir / "hypha-x", socket_path=short_dir / "s"
    )
    task.work_dir.mkdir()

    argv, environment = manager._command(task)

    job_json = json.dumps(message.spec, separators=(",", ":"))
    assert argv == [
        sys.executable,
        "-m",
        "parameter_server",
        "--socket",
        str(short_dir / "s"),
        "--work-dir",
        str(short_dir / "hypha-x"),
        "--job-file",
        str(short_dir / "hypha-x" / ".job.json"),
        "--host",
        "0.0.0.0",
        "--port",
        "8470",
        "--public-url",
        "http://gpu-01:8470",
    ]
    variables = ("HYPHA_SERVER_URL", "HYPHA_TRANSFER_KEY", "HYPHA_TRANSFER_TOKEN")
    assert {key: environment.get(key) for key in variables} == {
        "HYPHA_SERVER_URL": "https://cp.example/prefix",
        "HYPHA_TRANSFER_KEY": "job-key",
        "HYPHA_TRANSFER_TOKEN": "ps-token",
    }
    assert environment["JOB_JSON"] == job_json
    # the job (slice URLs with their tokens) is in a file only this user reads, not on the command line
    job_file = task.work_dir / ".job.json"
    assert (job_file.read_text(), job_file.stat().st_mode & 0o777) == (job_json, 0o600)
    # the current token is in a file only this user reads, which a fresh token replaces
    token_file = Path(environment["HYPHA_TRANSFER_TOKEN_FILE"])
    assert (token_file, token_file.read_text()) == (task.work_dir / ".transfer-token", "ps-token")
    assert token_file.stat().st_mode & 0o777 == 0o600
    manager.tasks[task.task_id] = task
    manager.handle(protocol.TransferToken(task_id=task.task_id, transfer_token="fresh-token"))
    assert (token_file.read_text(), task.dispatch.transfer_token) == ("fresh-token", "fresh-token")
    assert manager.refresh_token(uuid.uuid4(), "for a task that does not run here") is False


async def test_a_task_that_cannot_start_is_reported_and_cleaned_up(
    config, book, link, answerer, short_dir, monkeypatch
):
    # given a work dir too deep for a Unix socket path, and a temp dir (the fallback for the socket) too
    deep = short_dir / ("d" * 100)
    deep_temp = short_dir / ("t" * 100)
    deep_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep_temp))
    manager = JobManager(
        config=config.model_copy(update={"work_dir": deep}), book=book, server_url="http://cp", link=link
    )
    message = dispatch(short_dir / "record.json")

    exited = await asyncio.wait_for(manager.start(message).runner, 5)

    assert exited.task_id == message.task_id and exited.exit_code is None
    assert exited.reason.startswith("could not start: socket path ") and "too long" in exited.reason
    assert list(deep.iterdir()) == [] and list(deep_temp.iterdir()) == []
    assert await posted(link, answerer, protocol.JobStarted) == []
    assert await posted(link, answerer, protocol.JobExited) == [exited]


def test_a_task_process_dies_with_its_daemon(tmp_path):
    # given: a stand-in daemon that starts a long-running child the way the job manager does, then waits
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "daemon.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from worker_daemon.jobs import die_with_parent\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
        "                         start_new_session=True, preexec_fn=die_with_parent)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    daemon = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child_pid = int(daemon.stdout.readline())

    # when: the daemon is killed outright
    daemon.send_signal(signal.SIGKILL)
    daemon.wait(5)

    # then: its task process gets SIGTERM from the kernel and is gone within a few seconds
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            break
        # a zombie (exited, waiting for init to reap it) counts as gone
        with open(f"/proc/{child_pid}/stat") as stat:
            if stat.read().split()[2] == "Z":
                break
        time.sleep(0.05)
    else:
        os.kill(child_pid, signal.SIGKILL)
        raise AssertionError("the task process outlived its daemon")


async def test_a_running_tasks_output_is_forwarded_every_few_seconds(
    manager, link, answerer, short_dir, monkeypatch
):
    # given: a task that prints its lines and then keeps running
    monkeypatch.setattr(jobs_module, "LOG_FORWARD_INTERVAL", 0.05)
    message = dispatch(short_dir / "record.json", mode="sleep")
    task = manager.start(message)
    await wait_for_line(task, "ready")

    # when: a forwarding interval passes while it runs
    deadline = asyncio.get_running_loop().time() + 5
    forwarded: list[str] = []
    while "ready" not in forwarded:
        assert asyncio.get_running_loop().time() < deadline, forwarded[-5:]
        await asyncio.sleep(0.05)
        forwarded = [line for frame in answerer.of_type(protocol.TaskLog) for line in frame.lines]

    # then: every line went out once, in order, tagged with the task, before it exited
    frames = answerer.of_type(protocol.TaskLog)
    assert {frame.task_id for frame in frames} == {message.task_id}
    assert [line for line in forwarded if line.startswith("line ")] == [f"line {n}" for n in range(60)]
    assert forwarded.count("ready") == 1 and "to stderr" in forwarded
    assert answerer.of_type(protocol.JobExited) == []
    manager.cancel(message.task_id, reason="done")
    await asyncio.wait_for(task.runner, 10)


async def test_a_repeated_dispatch_of_an_ended_task_gets_its_exit_again_not_a_second_run(
    manager, link, answerer, short_dir
):
    # given: a task that ran and exited
    message = dispatch(short_dir / "record.json", mode="exit")
    task = manager.start(message)
    exited = await asyncio.wait_for(task.runner, 20)
    assert exited.exit_code == 0

    # when: the control plane, which had not heard of the exit, dispatches it again after a reconnect
    (short_dir / "record.json").unlink()
    assert manager.start(message) is None

    # then: no second process ran (nothing recorded again), and the exit is reported again
    await asyncio.sleep(0.2)
    assert not (short_dir / "record.json").exists()
    assert await posted(link, answerer, protocol.JobExited) == [exited, exited]


async def test_a_repeated_dispatch_of_a_running_task_brings_its_peers_addresses(
    manager, link, answerer, short_dir
):
    # given: a trainer dispatched before its parameter server listened
    message = dispatch(short_dir / "record.json", mode="sleep")
    task = manager.start(message)
    await wait_for_line(task, "ready")
    assert task.backend is not None and task.backend.peers == {}

    # when: the control plane dispatches it again with the address
    again = message.model_copy(update={"peers": {"ps-peer": "http://10.0.0.3:7070/"}})
    assert manager.start(again) is None

    # then: the same process, now knowing where its peer is
    assert manager.tasks[message.task_id] is task
    assert task.backend.peers == {"ps-peer": "http://10.0.0.3:7070"}
    assert task.dispatch.peers == {"ps-peer": "http://10.0.0.3:7070/"}
    manager.cancel(message.task_id, reason="done")
    await asyncio.wait_for(task.runner, 10)


@pytest.mark.parametrize("slowdown", [1.0, 2.5])
def test_every_executor_gets_the_slowdown_factor(config, book, short_dir, monkeypatch, slowdown):
    # given: a daemon slowed on purpose, whose own environment says something else
    monkeypatch.setenv("HYPHA_SLOWDOWN", "9")
    slowed = config.model_copy(update={"slowdown": slowdown})
    manager = JobManager(config=slowed, book=book, server_url="wss://cp.example/prefix/ws/worker/")
    (short_dir / "hypha-x").mkdir()  # where a parameter server's job file is written
    for executor_class, name in (("train", "test-executor"), ("aggregate", "parameter-server")):
        message = protocol.DispatchJob(
            task_id=uuid.uuid4(), lease_id=LEASE, job_id=JOB, role="trainer", spec={"job_id": str(JOB)}
        )
        task = Task(
            dispatch=message,
            executor=slowed.find_executor(executor_class, name),
            work_dir=short_dir / "hypha-x",
            socket_path=short_dir / "s",
        )

        # when
        _, environment = manager._command(task)

        # then: the config's factor, never the inherited one
        assert environment["HYPHA_SLOWDOWN"] == repr(slowdown)
