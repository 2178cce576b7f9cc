"""A response body the client reads slowly does not pile up in the server's memory.

A real ``hypha-server`` (embedded mode) serves a 256 MiB relay object from its local store (``GET /relay/…``)
to a client that reads 64 KiB at a time at 40 MiB/s, while this test samples the server's ``VmRSS`` every
50 ms. Without backpressure (``hypha_site/http_body.py``) daphne wrote every chunk the view produced into
Twisted's transport buffer at once, so the server grew by the part of the body the client had not read yet —
nearly all of it; with it, the view waits while the buffer is full. Only memory is asserted, never speed: a
slower machine makes the download slower, not the bound looser.

The object goes in the way a daemon puts it there: the relay client (``worker_daemon/relay.py``) through the
API, with the transfer token of a job's parameter server. The job, its tasks and leases are the relay tests'
cast (``tests/apps/relay/world.py``), made in the server's own database by ``manage.py shell`` — no market
round, as in the relay's other tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urljoin

import aiohttp
import httpx
import pytest

from tests.e2e.isolation import stop_with_parent
from tests.hypha_site.server_process import free_port, server_environment
from worker_daemon.relay import RelayClient

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
#: The object: large against the bound, small enough to keep the test near 20 s.
BODY_SIZE = 256 * MIB
#: The reader: bytes per read, and its pace (far below what the server produces on loopback).
READ_SIZE = 64 << 10
READ_RATE = 40 * MIB
#: The bound on the server's RSS growth while it serves the body (issue 14's goal for the relay).
BOUND = 64 * MIB

#: Makes the relay tests' cast in the server's database; prints the job and the parameter server's token.
MAKE_WORLD = """
import json
from tests.apps.relay.world import make_world
world = make_world()
print(json.dumps({"job": str(world.job.pk), "token": world.server.token}))
"""

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc to read VmRSS")


def rss(pid: int) -> int:
    """The resident set size of ``pid`` in bytes (``VmRSS`` of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


class RssSampler:
    """Samples a process's RSS every 50 ms in a thread while in its ``with`` block."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[int] = []
        self._stop = threading.Event()

    def __enter__(self) -> RssSampler:
        self.samples.append(rss(self.pid))
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(rss(self.pid))

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append(rss(self.pid))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, int, dict[str, str]]]:
    """``hypha-server`` (embedded) on a fresh data dir: its URL, its pid and its environment; stopped after."""
    environment = server_environment(tmp_path / "data")
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "hypha_site.server", "--log-level", "WARNING", "--port", str(port)],
            cwd=ROOT, env=environment, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
            preexec_fn=stop_with_parent,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, "the server did not answer /healthz in time"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        yield url, process.pid, environment
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def write_body(path: Path, size: int) -> str:
    """``size`` bytes (random, each MiB numbered so no two are alike) at ``path``; their SHA-256."""
    block = bytearray(os.urandom(MIB))
    digest = hashlib.sha256()
    with path.open("wb") as handle:
        for index in range(size // MIB):
            block[:8] = index.to_bytes(8, "big")
            handle.write(block)
            digest.update(block)
    return digest.hexdigest()


async def upload(url: str, job: str, token: str, source: Path) -> dict:
    """``source`` into the relay as the parameter server's ``model/1/model.safetensors``; the object."""
    async with aiohttp.ClientSession() as session:
        client = RelayClient(url, job, lambda: token, session, read_timeout=60)
        return await client.upload("model/1/model.safetensors", source)


def read_slowly(url: str) -> tuple[int, int, str]:
    """GET ``url`` reading :data:`READ_SIZE` bytes at a time at :data:`READ_RATE`: status, bytes, SHA-256."""
    digest = hashlib.sha256()
    received = 0
    started = time.monotonic()
    with httpx.Client(timeout=60) as client, client.stream("GET", url) as response:
        for chunk in response.iter_raw(READ_SIZE):
            digest.update(chunk)
            received += len(chunk)
            ahead = started + received / READ_RATE - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        return response.status_code, received, digest.hexdigest()


@pytest.mark.timeout(120)
def test_a_slowly_read_relay_download_keeps_the_servers_memory_bounded(server, tmp_path):
    # given: the real server holding a 256 MiB relay object, put there by the relay client through the API
    url, pid, environment = server
    made = subprocess.run(
        [sys.executable, "manage.py", "shell", "--command", MAKE_WORLD],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    world = json.loads(made.stdout.strip().splitlines()[-1])
    source = tmp_path / "model.safetensors"
    sha256 = write_body(source, BODY_SIZE)
    obj = asyncio.run(upload(url, world["job"], world["token"], source))
    source.unlink()  # the disk holds the body once more in the server's store: enough
    assert (obj["size"], obj["sha256"]) == (BODY_SIZE, sha256)

    # when: a client reads it far slower than the server could send it, the server's RSS sampled meanwhile
    with RssSampler(pid) as memory:
        status, received, received_sha256 = read_slowly(urljoin(f"{url}/", obj["url"]))

    # then: all of it arrived intact (a paused producer resumed every time), and the server stayed bounded
    growth = max(memory.samples) - memory.samples[0]
    print(
        f"server RSS {memory.samples[0] / MIB:.0f} MiB, grew by {growth / MIB:.1f} MiB ({len(memory.samples)} samples)"
    )
    assert (status, received, received_sha256) == (200, BODY_SIZE, sha256)
    assert len(memory.samples) > 20, "the download ended before the server's memory was sampled"
    assert growth < BOUND, (
        f"the server's RSS grew by {growth / MIB:.0f} MiB serving {BODY_SIZE // MIB} MiB to a slow reader "
        f"(from {memory.samples[0] / MIB:.0f} MiB; bound {BOUND // MIB} MiB)"
    )
