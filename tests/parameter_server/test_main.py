"""``python -m parameter_server`` as a real process: arguments, the ready report, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from tests.parameter_server.conftest import ALICE, JOB_ID, PS_PEER, TRANSFER_KEY, aggregate_job, auth, token

REPOSITORY = Path(__file__).resolve().parents[2]


def environment(**overrides: str) -> dict[str, str]:
    values = {
        **os.environ,
        "PYTHONPATH": str(REPOSITORY),
        "HYPHA_TRANSFER_KEY": TRANSFER_KEY,
        "HYPHA_TRANSFER_TOKEN": token(PS_PEER, role="parameter_server"),
        "HYPHA_SERVER_URL": "http://127.0.0.1:9",
    }
    values.update(overrides)
    return values


@pytest.fixture
async def spawn() -> AsyncIterator[Callable[..., asyncio.subprocess.Process]]:
    """Starts ``python -m parameter_server``; kills whatever is still running at the end of the test."""
    processes: list[asyncio.subprocess.Process] = []

    async def start(*arguments: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "parameter_server",
            *arguments,
            cwd=REPOSITORY,
            env=env or environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_bad_arguments_and_jobs_exit_2_quickly(spawn, tmp_path):
    cases = [
        (["--socket", "s", "--work-dir", str(tmp_path)], environment()),  # no --job
        (["--socket", "s", "--work-dir", str(tmp_path), "--job", "{nope"], environment()),
        (["--socket", "s", "--work-dir", str(tmp_path), "--job", "{}"], environment()),
        (
            ["--socket", "s", "--work-dir", str(tmp_path), "--job", json.dumps(aggregate_job(peers=[ALICE]))],
            environment(HYPHA_TRANSFER_KEY=""),
        ),
    ]
    for arguments, env in cases:
        process = await spawn(*arguments, env=env)
        output, _ = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 2, output.decode()
    assert "torch" not in output.decode()


async def test_help_lists_the_exit_codes(spawn):
    process = await spawn("--help")
    output, _ = await asyncio.wait_for(process.communicate(), 30)

    assert process.returncode == 0
    assert "143  stopped by SIGTERM" in output.decode()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_the_process_reports_ready_serves_and_stops_on_sigterm(
    spawn, bridge, status_backend, short_tmp, receiver
):
    # given
    port = free_port()
    job = json.dumps(aggregate_job(peers=[ALICE], update_rounds=3), separators=(",", ":"))
    process = await spawn(
        "--socket",
        str(bridge.socket_path),
        "--work-dir",
        str(short_tmp / "work"),
        "--job",
        job,
        "--port",
        str(port),
        "--public-url",
        f"http://localhost:{port}/",
        env=environment(HYPHA_SERVER_URL=receiver.url),
    )

    # when
    try:
        (ready,) = await status_backend.wait_for("ready", timeout=60)
    except TimeoutError:
        process.kill()
        raise AssertionError((await process.communicate())[0].decode()) from None

    # then
    assert ready == {"url": f"http://localhost:{port}", "round": 0}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(f"http://127.0.0.1:{port}/healthz", headers=auth(ALICE)) as response,
    ):
        assert (response.status, await response.json()) == (200, {"job": JOB_ID, "round": 1})
    checkpoints = sorted(path.name for path in (short_tmp / "work" / "checkpoints").iterdir())
    assert checkpoints == ["round-000000000"]
    assert receiver.saved == 0  # the control plane has round 0 before the server says it is ready

    # when
    process.send_signal(signal.SIGTERM)

    # then
    output, _ = await asyncio.wait_for(process.communicate(), 10)
    assert process.returncode == 143, output.decode()
    assert "stopped by a signal" in output.decode()
