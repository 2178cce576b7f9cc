"""A real ``hypha-server`` process for the tests that need one (TLS, data files, slow clients)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_environment(data_dir: Path, **extra: str) -> dict[str, str]:
    """This process's environment without Hypha's settings or services: the embedded default on ``data_dir``."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith("HYPHA_")}
    for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "SECRET_KEY_FILE"):
        environment.pop(name, None)
    environment.update(DJANGO_SETTINGS_MODULE="hypha_site.settings", HYPHA_DATA_DIR=str(data_dir), **extra)
    return environment


@contextlib.contextmanager
def running_server(arguments: list[str], *, port: int, environment: dict[str, str]) -> Iterator[None]:
    """``python -m hypha_site.server --log-level WARNING *arguments``, until it accepts connections on
    ``port`` (60 s at most); SIGTERM (then SIGKILL) on exit."""
    process = subprocess.Popen(
        [sys.executable, "-m", "hypha_site.server", "--log-level", "WARNING", *arguments],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "the server did not listen in time"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        yield
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
