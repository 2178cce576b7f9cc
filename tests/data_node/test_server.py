"""The data node: serving slices over HTTP, registering with a (fake) control plane, and the process's
lifecycle (registers, logs one line, SIGTERM → exit 0; a refused token → exit 3)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from data_node.__main__ import EXIT_DATASET_INVALID, EXIT_OK, EXIT_TOKEN_REFUSED
from data_node.prepare import prepare_text
from data_node.server import RegistrationRefused, ServedDataset, TokenRefused, build_app, register
from data_node.slices import InvalidDatasetDirectory, scan

TOKEN = "hd_test-token"


@pytest.fixture
def dataset_dir(tmp_path) -> Path:
    """tiny-corpus: 3 slices (2, 2 and 1 sequences of 8 bytes) of a 40-byte text."""
    (tmp_path / "in.txt").write_bytes(bytes(range(40)))
    prepare_text(
        inputs=[tmp_path / "in.txt"], output=tmp_path / "tiny-corpus", seq_len=8, samples_per_slice=2
    )
    return tmp_path / "tiny-corpus"


@pytest.fixture
async def client(dataset_dir):
    served = ServedDataset(name="tiny-corpus", slices=scan(dataset_dir))
    async with TestClient(TestServer(build_app(served))) as test_client:
        yield test_client


def test_scan_hashes_every_slice_in_index_order(dataset_dir):
    # given: a stray file is ignored
    (dataset_dir / "README").write_text("notes")

    # when
    slices = scan(dataset_dir)

    # then
    assert [(s.index, s.path.name) for s in slices] == [
        (0, "00000.safetensors"),
        (1, "00001.safetensors"),
        (2, "00002.safetensors"),
    ]
    for s in slices:
        assert s.size == s.path.stat().st_size
        assert s.sha256 == hashlib.sha256(s.path.read_bytes()).hexdigest()


def test_a_gap_in_the_slices_is_refused(dataset_dir):
    (dataset_dir / "00001.safetensors").unlink()
    with pytest.raises(InvalidDatasetDirectory, match=r"missing \[1\]"):
        scan(dataset_dir)


async def test_a_slice_is_served_byte_for_byte_with_its_digest(client, dataset_dir):
    expected = (dataset_dir / "00001.safetensors").read_bytes()

    # when
    response = await client.get("/datasets/tiny-corpus/slices/1")

    # then
    assert response.status == 200
    assert await response.read() == expected
    assert response.headers["Content-Length"] == str(len(expected))
    assert response.headers["X-Sha256"] == hashlib.sha256(expected).hexdigest()
    assert response.headers["ETag"]  # aiohttp's (mtime, size) tag, which its If-Range handling checks


async def test_a_range_request_gets_exactly_those_bytes(client, dataset_dir):
    expected = (dataset_dir / "00000.safetensors").read_bytes()

    # when
    response = await client.get("/datasets/tiny-corpus/slices/0", headers={"Range": "bytes=10-29"})

    # then
    assert response.status == 206
    assert await response.read() == expected[10:30]
    assert response.headers["Content-Range"] == f"bytes 10-29/{len(expected)}"


@pytest.mark.parametrize(
    "path",
    [
        "/datasets/tiny-corpus/slices/3",  # index == count: the original's off-by-one crashed here
        "/datasets/tiny-corpus/slices/99",
        "/datasets/tiny-corpus/slices/-1",
        "/datasets/tiny-corpus/slices/x",
        "/datasets/other/slices/0",
    ],
)
async def test_unknown_datasets_and_indices_are_404(client, path):
    response = await client.get(path)
    assert response.status == 404


# --- registration -------------------------------------------------------------------------------------------


class FakeControlPlane:
    """Answers POST /api/datasets/register/ with the queued statuses (then 201), recording each request."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.statuses = list(statuses or [])
        self.requests: list[tuple[str, dict]] = []
        self.app = web.Application()
        self.app.router.add_post("/api/datasets/register/", self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((request.headers.get("Authorization", ""), body))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"detail": "Invalid data node token."}, status=401)
        code = self.statuses.pop(0) if self.statuses else 201
        if code >= 400:
            return web.json_response({"detail": f"status {code}"}, status=code)
        return web.json_response({"name": body["name"], "slice_count": len(body["slices"])}, status=code)


@pytest.fixture
async def control_plane():
    fake = FakeControlPlane()
    server = TestServer(fake.app)
    await server.start_server()
    fake.url = str(server.make_url("/")).rstrip("/")
    yield fake
    await server.close()


async def test_registration_retries_a_failing_control_plane_then_sends_every_slice(
    control_plane, dataset_dir
):
    # given
    control_plane.statuses = [503, 502]
    served = ServedDataset(name="tiny-corpus", slices=scan(dataset_dir))

    # when
    answer = await register(
        server=control_plane.url, token=TOKEN, dataset=served, public_url="http://n:1", max_delay=0.01
    )

    # then
    assert answer == {"name": "tiny-corpus", "slice_count": 3}
    assert len(control_plane.requests) == 3
    assert control_plane.requests[-1] == (
        f"Bearer {TOKEN}",
        {
            "name": "tiny-corpus",
            "url": "http://n:1",
            "slices": [{"index": s.index, "size": s.size, "sha256": s.sha256} for s in served.slices],
        },
    )


async def test_registration_with_an_unreachable_control_plane_keeps_retrying(dataset_dir, unused_tcp_port):
    served = ServedDataset(name="tiny-corpus", slices=scan(dataset_dir))
    task = asyncio.create_task(
        register(
            server=f"http://127.0.0.1:{unused_tcp_port}",
            token=TOKEN,
            dataset=served,
            public_url="http://n:1",
            max_delay=0.01,
        )  # fmt: skip
    )
    await asyncio.sleep(0.3)
    assert not task.done()
    task.cancel()


async def test_a_refused_token_and_a_conflict_are_not_retried(control_plane, dataset_dir):
    served = ServedDataset(name="tiny-corpus", slices=scan(dataset_dir))
    with pytest.raises(TokenRefused):
        await register(server=control_plane.url, token="hd_wrong", dataset=served, public_url="http://n:1")
    control_plane.statuses = [409]
    with pytest.raises(RegistrationRefused, match="409"):
        await register(server=control_plane.url, token=TOKEN, dataset=served, public_url="http://n:1")
    assert len(control_plane.requests) == 2


# --- the process --------------------------------------------------------------------------------------------


async def start_node(*arguments: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "data_node",
        *arguments,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


async def test_the_node_registers_serves_and_stops_cleanly_on_sigterm(control_plane, dataset_dir):
    # given
    node = await start_node("--server", control_plane.url, "--token", TOKEN, "--dataset", str(dataset_dir))
    try:
        line = (await asyncio.wait_for(node.stderr.readline(), timeout=20)).decode()
        assert "serving dataset tiny-corpus (3 slices" in line, line
        url = control_plane.requests[0][1]["url"]
        assert url.startswith("http://127.0.0.1:")

        # when: a trainer downloads a slice from the registered URL
        async with TestClient(TestServer(web.Application())) as helper:
            response = await helper.session.get(f"{url}/datasets/tiny-corpus/slices/2")
            body = await response.read()
        node.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(node.wait(), timeout=10)
    finally:
        if node.returncode is None:
            node.kill()
            await node.wait()

    # then
    assert body == (dataset_dir / "00002.safetensors").read_bytes()
    assert code == EXIT_OK


async def test_the_node_exits_3_when_its_token_is_refused(control_plane, dataset_dir):
    node = await start_node(
        "--server", control_plane.url, "--token", "hd_wrong", "--dataset", str(dataset_dir)
    )
    try:
        code = await asyncio.wait_for(node.wait(), timeout=20)
    finally:
        if node.returncode is None:
            node.kill()
            await node.wait()
    assert code == EXIT_TOKEN_REFUSED


async def test_the_node_exits_4_for_a_directory_without_slices(control_plane, tmp_path):
    (tmp_path / "empty").mkdir()
    node = await start_node(
        "--server", control_plane.url, "--token", TOKEN, "--dataset", str(tmp_path / "empty")
    )
    try:
        code = await asyncio.wait_for(node.wait(), timeout=20)
    finally:
        if node.returncode is None:
            node.kill()
            await node.wait()
    assert code == EXIT_DATASET_INVALID
    assert control_plane.requests == []
