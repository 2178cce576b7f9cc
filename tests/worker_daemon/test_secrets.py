"""Secrets stay out of process lists and logs: the worker token comes from the environment or a file, the
parameter server gets its job JSON (slice URLs with their tokens) by file, and DEBUG logs mask credentials."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import uuid
from pathlib import Path

import pytest

from tests.parameter_server.conftest import ALICE, aggregate_job
from tests.worker_daemon.test_cli import REPO, clean_env, processes  # noqa: F401 - a fixture
from worker_daemon import protocol
from worker_daemon.config import WorkerConfig
from worker_daemon.jobs import JobManager
from worker_daemon.leases import LeaseBook
from worker_daemon.link import ControlLink

WORKER_TOKEN = "hw_" + "W" * 43
SLICE_TOKEN = "eyJzbGljZSI6MX0.c2lnbmF0dXJlLW9mLXRoZS1zbGljZS10b2tlbg"


async def start_daemon(processes, server_url: str, tmp_path: Path, *options: str, **environ: str):  # noqa: F811
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "worker_daemon",
        "--server",
        server_url,
        "--work-dir",
        str(tmp_path),
        "--no-benchmark",
        *options,
        env=clean_env(**environ),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    processes.append(process)
    return process


async def stop(process) -> str:
    process.terminate()
    _, stderr = await asyncio.wait_for(process.communicate(), 20)
    return stderr.decode()


async def test_the_token_from_the_environment_connects_and_is_not_logged_at_debug(
    control_plane,
    processes,  # noqa: F811
    tmp_path,
    make,
):
    # given: the real daemon, its token in HYPHA_WORKER_TOKEN, logging everything
    process = await start_daemon(
        processes, control_plane.url, tmp_path, "--log-level", "DEBUG", HYPHA_WORKER_TOKEN=WORKER_TOKEN
    )

    # when
    connection = await control_plane.next_connection(timeout=30)
    await connection.expect(protocol.Hello, timeout=10)
    await connection.send(make.welcome(advertisements=[]))
    log = await stop(process)

    # then: it authenticated with the token, and its DEBUG log (websockets' handshake headers included)
    # shows neither the token nor any part of it beyond its kind
    assert connection.headers["Authorization"] == f"Bearer {WORKER_TOKEN}"
    assert "> Authorization: Bearer [redacted]" in log
    assert WORKER_TOKEN not in log and "W" * 8 not in log
    assert "--token" not in log  # no warning: the token did not come from the command line


async def test_the_token_file_flag_connects(control_plane, processes, tmp_path):  # noqa: F811
    token_file = tmp_path / "worker-token"
    token_file.write_text(WORKER_TOKEN + "\n")
    process = await start_daemon(processes, control_plane.url, tmp_path, "--token-file", str(token_file))

    connection = await control_plane.next_connection(timeout=30)
    await connection.expect(protocol.Hello, timeout=10)
    await stop(process)

    assert connection.headers["Authorization"] == f"Bearer {WORKER_TOKEN}"


async def test_the_token_flag_still_works_but_warns_that_ps_shows_it(
    control_plane,
    processes,  # noqa: F811
    tmp_path,
):
    process = await start_daemon(processes, control_plane.url, tmp_path, "--token", WORKER_TOKEN)

    connection = await control_plane.next_connection(timeout=30)
    await connection.expect(protocol.Hello, timeout=10)
    log = await stop(process)

    assert connection.headers["Authorization"] == f"Bearer {WORKER_TOKEN}"
    assert (
        "warning: --token puts the worker token in the process list (ps); "
        "use --token-file PATH or HYPHA_WORKER_TOKEN instead"
    ) in log


async def test_a_spawned_parameter_servers_command_line_holds_no_secret(tmp_path, short_dir):
    # given: a parameter-server dispatch whose job holds an eval slice URL with its token
    lease_id, job_id = uuid.uuid4(), uuid.uuid4()
    book = LeaseBook(capacity=protocol.Resources(cpu=8, memory=32, storage=100, gpu=24))
    book.activate(
        lease_id=lease_id,
        job_id=job_id,
        role="parameter_server",
        resources=protocol.Resources(cpu=1),
        price=1.0,
        ttl=60.0,
    )
    spec = aggregate_job(
        peers=[ALICE],
        eval_config={
            "dataset": "d",
            "batch_size": 2,
            "slices": [
                {
                    "index": 0,
                    "size": 10,
                    "sha256": "0" * 64,
                    "urls": [f"http://127.0.0.1:9/d/slices/0?token={SLICE_TOKEN}"],
                }
            ],
        },
    )
    spec["job_id"] = str(job_id)
    config = WorkerConfig.model_validate({"work_dir": str(short_dir / "w"), "kill_grace": 0.5})
    manager = JobManager(config=config, book=book, server_url="ws://127.0.0.1:9/", link=ControlLink())
    message = protocol.DispatchJob(
        task_id=uuid.uuid4(),
        lease_id=lease_id,
        job_id=job_id,
        role="parameter_server",
        spec=spec,
        transfer_token="ps-transfer-token-secret",
        transfer_key="job-transfer-key-secret",
    )

    try:
        # when
        task = manager.start(message)
        for _ in range(500):
            if task.process is not None:
                break
            await asyncio.sleep(0.01)
        assert task.process is not None
        command_line = Path(f"/proc/{task.process.pid}/cmdline").read_bytes()
        job_file = None
        arguments = command_line.split(b"\0")
        if b"--job-file" in arguments:
            job_file = Path(arguments[arguments.index(b"--job-file") + 1].decode())
            job_file_mode = job_file.stat().st_mode & 0o777
            job_file_content = json.loads(job_file.read_text())
    finally:
        await manager.stop_all(timeout=10)

    # then: the process is the parameter server, and ps shows none of its secrets
    assert b"parameter_server" in command_line and b"--socket" in command_line
    for secret in (SLICE_TOKEN, "ps-transfer-token-secret", "job-transfer-key-secret"):
        assert secret.encode() not in command_line
    # the job comes in a file only this user reads, in the task's work dir
    assert job_file is not None and job_file.parent.parent == short_dir / "w"
    assert (job_file_mode, job_file_content) == (0o600, spec)


def test_the_default_trainer_gets_its_job_from_the_environment_not_its_command_line():
    config = WorkerConfig.model_validate({})
    trainer = config.find_executor("train", "diloco-transformer")

    assert "{JOB_JSON}" not in trainer.args
    assert "--job" not in trainer.args


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("> Authorization: Bearer hw_abcdefghijklmnop", "> Authorization: Bearer [redacted]"),
        ("Authorization: Token 0123456789abcdef0123", "Authorization: Token [redacted]"),
        ("headers {'Authorization': 'Bearer abc.def'}", "headers {'Authorization': 'Bearer [redacted]'}"),
        ("token hw_abcdefghijklmnopqrst in a sentence", "token hw_[redacted] in a sentence"),
        ("data node hd_abcdefghijklmnopqrst", "data node hd_[redacted]"),
        ("user hu_abcdefghijklmnopqrst", "user hu_[redacted]"),
        ("GET http://n/d/slices/0?token=abc.def&x=1", "GET http://n/d/slices/0?token=[redacted]&x=1"),
        (
            '< TEXT \'{"type":"dispatch_job","transfer_key":"k3y","transfer_token":"t0k',
            '< TEXT \'{"type":"dispatch_job","transfer_key":"[redacted]","transfer_token":"[redacted]',
        ),
        ('{"download_key": "abc"}', '{"download_key": "[redacted]"}'),
        ("lease 1234 granted; token revoked", "lease 1234 granted; token revoked"),
    ],
)
def test_redact(line, expected):
    from worker_daemon.redaction import redact

    assert redact(line) == expected


def test_the_formatter_redacts_messages_arguments_and_tracebacks():
    from worker_daemon.redaction import RedactingFormatter

    formatter = RedactingFormatter("%(levelname)s %(message)s")
    try:
        raise ValueError(f"refused Bearer {WORKER_TOKEN}")
    except ValueError:
        record = logging.LogRecord(
            "x", logging.DEBUG, __file__, 1, "> %s: %s", ("Authorization", "Bearer s3cr3t"), sys.exc_info()
        )

    text = formatter.format(record)

    assert text.startswith("DEBUG > Authorization: Bearer [redacted]\nTraceback")
    assert "s3cr3t" not in text and WORKER_TOKEN not in text
    assert text.endswith("ValueError: refused Bearer [redacted]")
