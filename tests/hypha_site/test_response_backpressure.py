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

The same holds for the files Django's views serve (``hypha_site/streaming.py``): a user's 256 MiB upload,
put there through ``POST /api/uploads/`` and read back as slowly through ``GET /api/uploads/<id>/content/``.
Under ASGI, Django's ``FileResponse`` (a sync iterator) was read into a list before the first byte went out,
so the server grew by the whole file, however fast the client read.
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
from tests.modes import only_in_mode
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

#: Makes a user with an API token in the server's database; prints the token's key.
MAKE_USER = """
import json
from django.contrib.auth import get_user_model
from apps.workers.models import UserToken
user = get_user_model().objects.create_user(username="grace", password=None)
print(json.dumps({"key": UserToken.issue(user)[1]}))
"""

pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc to read VmRSS"),
    only_in_mode("embedded", "the server under test is an embedded hypha-server in either run"),
]


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


def manage_shell(environment: dict[str, str], code: str) -> dict:
    """Run ``code`` in ``manage.py shell`` on the server's database; the JSON object it printed last."""
    made = subprocess.run(
        [sys.executable, "manage.py", "shell", "--command", code],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    return json.loads(made.stdout.strip().splitlines()[-1])


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


def read_slowly(url: str, headers: dict[str, str] | None = None) -> tuple[int, httpx.Headers, int, str]:
    """GET ``url`` reading :data:`READ_SIZE` bytes at a time at :data:`READ_RATE`: status, headers, bytes,
    SHA-256."""
    digest = hashlib.sha256()
    received = 0
    started = time.monotonic()
    with httpx.Client(timeout=60) as client, client.stream("GET", url, headers=headers) as response:
        for chunk in response.iter_raw(READ_SIZE):
            digest.update(chunk)
            received += len(chunk)
            ahead = started + received / READ_RATE - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        return response.status_code, response.headers, received, digest.hexdigest()


def assert_bounded(memory: RssSampler, what: str) -> None:
    """The server's RSS, sampled through a download of ``what``, grew by less than :data:`BOUND`."""
    growth = max(memory.samples) - memory.samples[0]
    print(
        f"server RSS {memory.samples[0] / MIB:.0f} MiB, grew by {growth / MIB:.1f} MiB ({len(memory.samples)} samples)"
    )
    assert len(memory.samples) > 20, "the download ended before the server's memory was sampled"
    assert growth < BOUND, (
        f"the server's RSS grew by {growth / MIB:.0f} MiB serving {what} to a slow reader "
        f"(from {memory.samples[0] / MIB:.0f} MiB; bound {BOUND // MIB} MiB)"
    )


@pytest.mark.timeout(120)
def test_a_slowly_read_relay_download_keeps_the_servers_memory_bounded(server, tmp_path):
    # given: the real server holding a 256 MiB relay object, put there by the relay client through the API
    url, pid, environment = server
    world = manage_shell(environment, MAKE_WORLD)
    source = tmp_path / "model.safetensors"
    sha256 = write_body(source, BODY_SIZE)
    obj = asyncio.run(upload(url, world["job"], world["token"], source))
    source.unlink()  # the disk holds the body once more in the server's store: enough
    assert (obj["size"], obj["sha256"]) == (BODY_SIZE, sha256)

    # when: a client reads it far slower than the server could send it, the server's RSS sampled meanwhile
    with RssSampler(pid) as memory:
        status, _, received, received_sha256 = read_slowly(urljoin(f"{url}/", obj["url"]))

    # then: all of it arrived intact (a paused producer resumed every time), and the server stayed bounded
    assert (status, received, received_sha256) == (200, BODY_SIZE, sha256)
    assert_bounded(memory, f"a {BODY_SIZE // MIB} MiB relay object")


@pytest.mark.timeout(120)
def test_a_slowly_read_upload_download_keeps_the_servers_memory_bounded(server, tmp_path):
    # given: the real server holding a user's 256 MiB upload, put there through the API with their token
    url, pid, environment = server
    authorization = {"Authorization": f"Token {manage_shell(environment, MAKE_USER)['key']}"}
    source = tmp_path / "model.zip"
    sha256 = write_body(source, BODY_SIZE)
    with source.open("rb") as body:  # a file: httpx streams it, with its Content-Length
        stored = httpx.post(
            f"{url}/api/uploads/", params={"name": "model.zip"}, content=body, timeout=120,
            headers={**authorization, "Content-Type": "application/octet-stream"},
        )  # fmt: skip
    source.unlink()
    assert stored.status_code == 201, stored.text
    upload = stored.json()
    assert (upload["name"], upload["size"], upload["sha256"]) == ("model.zip", BODY_SIZE, sha256)

    # when: its owner reads it back far slower than the server could send it, the server's RSS sampled meanwhile
    with RssSampler(pid) as memory:
        status, headers, received, received_sha256 = read_slowly(
            f"{url}/api/uploads/{upload['id']}/content/", headers=authorization
        )

    # then: the exact bytes, announced as an attachment of the upload's name, and the server stayed bounded
    assert (status, received, received_sha256) == (200, BODY_SIZE, sha256)
    assert headers["Content-Length"] == str(BODY_SIZE)
    assert headers["Content-Disposition"] == 'attachment; filename="model.zip"'
    assert headers["Content-Type"] == "application/octet-stream"
    assert_bounded(memory, f"a {BODY_SIZE // MIB} MiB upload")
