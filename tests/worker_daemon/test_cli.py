"""``hypha-worker-daemon`` as an operator runs it: help, usage errors, exit codes, signals."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from worker_daemon import protocol
from worker_daemon.__main__ import resolve_token
from worker_daemon.exceptions import ConfigError

REPO = Path(__file__).resolve().parents[2]
HEAVY_MODULES = ("websockets", "pydantic", "pydantic_core", "torch", "django", "apps", "hypha_site")


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any HYPHA_* variable, plus ``extra``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("HYPHA_")}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def run_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker_daemon", *args],
        capture_output=True,
        text=True,
        env=env if env is not None else clean_env(),
        cwd=cwd,
        timeout=60,
    )


def test_help_is_instant_and_lists_the_exit_codes():
    result = run_cli("--help")

    assert result.returncode == 0
    assert result.stderr == ""
    assert "usage: hypha-worker-daemon [-h] [--server URL] [--token TOKEN]" in result.stdout
    assert (
        "exit codes:\n"
        "  0  clean shutdown after SIGTERM or SIGINT (held leases were released)\n"
        "  2  usage or configuration error (the message names the bad flag, key or value)\n"
        "  3  the control plane refused the token (missing, invalid or revoked)\n"
        "  4  the control plane does not support this daemon's protocol version\n"
    ) in result.stdout
    for variable in ("HYPHA_SERVER", "HYPHA_TOKEN", "HYPHA_TOKEN_FILE", "HYPHA_WORK_DIR"):
        assert variable in result.stdout


def test_help_and_the_entry_module_import_nothing_heavy():
    script = (
        "import sys\n"
        "from worker_daemon.__main__ import main\n"
        "imported_by_module = sorted(n for n in sys.modules if n.split('.')[0] in HEAVY)\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0\n"
        "imported_by_help = sorted(n for n in sys.modules if n.split('.')[0] in HEAVY)\n"
        "daemon = sorted(n for n in sys.modules if n.startswith('worker_daemon'))\n"
        "print('RESULT', imported_by_module, imported_by_help, daemon)\n"
    ).replace("HEAVY", repr(set(HEAVY_MODULES)))

    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=clean_env(), cwd=REPO, timeout=60
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        "RESULT [] [] ['worker_daemon', 'worker_daemon.__main__', 'worker_daemon.exceptions']"
    )


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.startswith("hypha-worker-daemon ")


def test_missing_token_is_a_usage_error():
    result = run_cli("--server", "http://127.0.0.1:1")

    assert result.returncode == 2
    assert result.stderr.endswith(
        "hypha-worker-daemon: error: no worker token: pass --token-file PATH, "
        "or set HYPHA_WORKER_TOKEN or HYPHA_WORKER_TOKEN_FILE\n"
    )
    assert "Traceback" not in result.stderr


def test_missing_server_is_a_usage_error():
    result = run_cli("--token", "t")

    assert result.returncode == 2
    assert result.stderr.endswith(
        "hypha-worker-daemon: error: no control plane address: pass --server URL or set HYPHA_SERVER\n"
    )


def test_bad_server_scheme_is_a_usage_error():
    result = run_cli("--server", "ftp://example.org", "--token", "t")

    assert result.returncode == 2
    assert result.stderr.endswith(
        "hypha-worker-daemon: error: --server 'ftp://example.org': "
        "the URL must start with http://, https://, ws:// or wss://\n"
    )


def test_bad_config_file_is_a_usage_error(tmp_path):
    config = tmp_path / "worker.toml"
    config.write_text('[offer]\nfloor = -1\nstrategy = "greedy"\n')

    result = run_cli(
        "--server", "http://127.0.0.1:1", "--config", str(config), env=clean_env(HYPHA_WORKER_TOKEN="t")
    )

    assert result.returncode == 2
    assert result.stderr == (
        f"hypha-worker-daemon: error: {config}: offer.floor: Input should be greater than or equal to 0 "
        "(got -1); offer.strategy.type: Input should be 'whole' or 'flexible' (got 'greedy')\n"
    )


def test_missing_config_file_is_a_usage_error(tmp_path):
    result = run_cli(
        "--server",
        "http://127.0.0.1:1",
        "--config",
        str(tmp_path / "nope.toml"),
        env=clean_env(HYPHA_WORKER_TOKEN="t"),
    )

    assert result.returncode == 2
    assert result.stderr == f"hypha-worker-daemon: error: config file {tmp_path / 'nope.toml'} not found\n"


def test_bad_cli_price_is_a_usage_error():
    result = run_cli("--server", "http://127.0.0.1:1", "--token", "t", "--price", "-3")

    assert result.returncode == 2
    assert "offer.price: Input should be greater than or equal to 0 (got -3.0)" in result.stderr


def test_bad_parameter_server_flag_is_a_usage_error():
    result = run_cli("--server", "http://127.0.0.1:1", "--token", "t", "--ps-public-url", "ps:1")

    assert result.returncode == 2
    assert "parameter_server.public_url: must be an http:// or https:// URL with a host" in result.stderr


# --- token sources ------------------------------------------------------------------------------------------


def test_token_precedence(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("  from-file\n")
    environ = {"HYPHA_TOKEN": "from-env", "HYPHA_TOKEN_FILE": str(token_file)}

    assert resolve_token(token="from-flag", token_file=None, environ=environ) == "from-flag"
    assert resolve_token(token=None, token_file=str(token_file), environ=environ) == "from-file"
    assert resolve_token(token=None, token_file=None, environ=environ) == "from-env"
    assert (
        resolve_token(token=None, token_file=None, environ={"HYPHA_TOKEN_FILE": str(token_file)})
        == "from-file"
    )


def test_the_worker_token_variables_come_before_their_older_names(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-new-file\n")
    environ = {
        "HYPHA_WORKER_TOKEN": "from-new",
        "HYPHA_TOKEN": "from-old",
        "HYPHA_TOKEN_FILE": "/nonexistent",
    }

    assert resolve_token(token=None, token_file=None, environ=environ) == "from-new"
    assert (
        resolve_token(
            token=None,
            token_file=None,
            environ={"HYPHA_WORKER_TOKEN_FILE": str(token_file), "HYPHA_TOKEN_FILE": "/nonexistent"},
        )
        == "from-new-file"
    )


def test_token_file_problems_are_config_errors(tmp_path):
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match=r"^the worker token from HYPHA_TOKEN_FILE .*/empty is empty$"):
        resolve_token(token=None, token_file=None, environ={"HYPHA_TOKEN_FILE": str(tmp_path / "empty")})
    with pytest.raises(ConfigError, match=r"^HYPHA_TOKEN_FILE: token file .*/missing not found$"):
        resolve_token(token=None, token_file=None, environ={"HYPHA_TOKEN_FILE": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match=r"^no worker token"):
        resolve_token(token=None, token_file=None, environ={"HYPHA_TOKEN": ""})


# --- the real process against a scripted control plane ------------------------------------------------------


@pytest.fixture
async def processes() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Daemon processes started by a test; always killed (by pid) at the end."""
    started: list[asyncio.subprocess.Process] = []
    yield started
    for process in started:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


async def start_daemon(
    processes, server_url: str, tmp_path: Path, *options: str, benchmark: bool = False
) -> asyncio.subprocess.Process:
    """The real CLI daemon; without its start benchmark unless asked (it costs seconds of CPU)."""
    token_file = tmp_path / "token"
    token_file.write_text("secret-token\n")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "worker_daemon",
        "--server",
        server_url,
        "--work-dir",
        str(tmp_path),
        "--log-level",
        "info",
        *([] if benchmark else ["--no-benchmark"]),
        *options,
        env=clean_env(HYPHA_TOKEN_FILE=str(token_file)),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    processes.append(process)
    return process


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT])
async def test_signal_releases_leases_and_exits_0(control_plane, processes, tmp_path, make, signal_number):
    process = await start_daemon(processes, control_plane.url, tmp_path)
    connection = await control_plane.next_connection(timeout=30)
    hello = await connection.expect(protocol.Hello, timeout=10)
    assert connection.headers["Authorization"] == "Bearer secret-token"
    advertisement = make.advertisement(resources={"cpu": 0.1})
    await connection.send(make.welcome(advertisements=[advertisement]))
    offer = await connection.expect(protocol.Offer)
    assert offer.resources == hello.resources  # whole strategy: everything it has
    lease_id = uuid.uuid4()
    await connection.send(
        protocol.LeaseGranted(
            lease_id=lease_id,
            advertisement_id=advertisement.advertisement_id,
            job_id=advertisement.job_id,
            role="trainer",
            resources=offer.resources,
            price=offer.price,
            expires_in=30.0,
        )
    )
    await connection.send(protocol.RenewLease(lease_id=lease_id, expires_in=30.0))
    await connection.expect(protocol.LeaseRenewed)  # the grant was processed before the signal

    process.send_signal(signal_number)

    release = await connection.expect(protocol.ReleaseLease)
    assert (release.lease_id, release.reason) == (lease_id, "daemon shutting down")
    await connection.send(protocol.LeaseEnded(lease_id=lease_id, status="released"))
    _, stderr = await asyncio.wait_for(process.communicate(), 10)
    assert process.returncode == 0
    log = stderr.decode()
    assert f"received {signal_number.name}; shutting down" in log
    assert f"lease {lease_id} granted" in log
    assert f"releasing lease {lease_id}: daemon shutting down" in log
    assert "shut down cleanly" in log


async def test_refused_token_exits_3(control_plane, processes, tmp_path):
    process = await start_daemon(processes, control_plane.url, tmp_path)
    connection = await control_plane.next_connection(timeout=30)
    await connection.expect(protocol.Hello, timeout=10)

    await connection.close(protocol.CloseCode.INVALID_TOKEN, "invalid token")

    _, stderr = await asyncio.wait_for(process.communicate(), 10)
    assert process.returncode == 3
    assert "the control plane closed the connection: code 4001 (INVALID_TOKEN), reason 'invalid token'" in (
        stderr.decode()
    )
    assert "Traceback" not in stderr.decode()


# --- the benchmark and the slowdown knob ------------------------------------------------------------------


async def test_the_daemon_benchmarks_at_start_and_offers_with_its_score(
    control_plane, processes, tmp_path, make
):
    # given: the real CLI daemon with its start benchmark on (the default), one core, slowed 1.5×
    process = await start_daemon(processes, control_plane.url, tmp_path, "--slowdown", "1.5", benchmark=True)
    connection = await control_plane.next_connection(timeout=30)

    # when: it connects at once, without waiting for the benchmark
    hello = await connection.expect(protocol.Hello, timeout=10)
    assert hello.benchmark is None
    await connection.send(make.welcome(advertisements=[make.advertisement(resources={"cpu": 0.1})]))

    # then: no offer until the benchmark ends; its result follows the hello, and the offer carries the score
    report = await connection.expect(protocol.BenchmarkReport, timeout=90)
    assert report.request_id is None and report.benchmark is not None
    assert (report.benchmark.model, report.benchmark.slowdown) == ("tiny-gpt-2x128", 1.5)
    offer = await connection.expect(protocol.Offer)
    assert offer.benchmark_score == report.benchmark.score
    process.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.wait_for(process.communicate(), 10)
    assert "running the worker benchmark (no offers until it ends)" in stderr.decode()
    assert f"worker benchmark: {report.benchmark.score:.1f} samples/s" in stderr.decode()


def test_the_benchmark_subcommand_prints_the_score(tmp_path):
    config = tmp_path / "worker.toml"
    config.write_text("slowdown = 1.0\n[resources]\ncpu = 1\n")

    result = run_cli("benchmark", "--config", str(config), "--json", env=clean_env(OMP_NUM_THREADS="1"))

    assert result.returncode == 0, result.stderr
    measured = protocol.BenchmarkResult.model_validate_json(result.stdout)
    assert (measured.device, measured.threads, measured.slowdown) == ("cpu", 1, 1.0)
    assert measured.score > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--slowdown", "0.5"), "slowdown: Input should be greater than or equal to 1 (got 0.5)"),
        (("--slowdown", "nan"), "slowdown: Input should be a finite number (got nan)"),
    ],
)
def test_a_bad_slowdown_is_a_usage_error(args, message):
    daemon = run_cli("--server", "http://127.0.0.1:1", "--token", "t", *args)
    measure = run_cli("benchmark", *args)

    for result in (daemon, measure):
        assert result.returncode == 2
        assert message in result.stderr
