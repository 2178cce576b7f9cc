"""The data node: serving slices over HTTP to holders of slice tokens, registering with a (fake) control plane,
and the process's lifecycle (registers, logs one line, SIGTERM → exit 0; a refused token → exit 3)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from data_node import tokens
from data_node.__main__ import EXIT_DATASET_INVALID, EXIT_OK, EXIT_REGISTRATION_REFUSED, EXIT_TOKEN_REFUSED
from data_node.prepare import prepare_text
from data_node.server import (
    RegistrationRefused,
    ServedDataset,
    TokenRefused,
    build_app,
    register,
    set_download_key,
)
from data_node.slices import InvalidDatasetDirectory, scan

TOKEN = "hd_test-token"
#: The download key the (fake) control plane gives the node.
KEY = "k" * 64


def signed(index: int, *, dataset: str = "tiny-corpus", key: str = KEY, expires_in: float = 60) -> str:
    """A slice token as the control plane signs it, for job "job-1" and worker "rig-a"."""
    return tokens.sign(
        key, dataset=dataset, index=index, job="job-1", peer="rig-a", expires=int(time.time() + expires_in)
    )


def url(index: int, **claims) -> str:
    return f"/datasets/tiny-corpus/slices/{index}?token={signed(index, **claims)}"


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
    async with TestClient(TestServer(build_app(served, download_key=KEY))) as test_client:
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
    response = await client.get(url(1))

    # then
    assert response.status == 200
    assert await response.read() == expected
    assert response.headers["Content-Length"] == str(len(expected))
    assert response.headers["X-Sha256"] == hashlib.sha256(expected).hexdigest()
    assert response.headers["ETag"]  # aiohttp's (mtime, size) tag, which its If-Range handling checks


async def test_a_range_request_gets_exactly_those_bytes(client, dataset_dir):
    expected = (dataset_dir / "00000.safetensors").read_bytes()

    # when
    response = await client.get(url(0), headers={"Range": "bytes=10-29"})

    # then
    assert response.status == 206
    assert await response.read() == expected[10:30]
    assert response.headers["Content-Range"] == f"bytes 10-29/{len(expected)}"


@pytest.mark.parametrize(
    ("dataset", "index"),
    [
        ("tiny-corpus", 3),  # index == count: the original's off-by-one crashed here
        ("tiny-corpus", 99),
        ("other", 0),
    ],
)
async def test_unknown_datasets_and_indices_are_404(client, dataset, index):
    # given: a token for exactly that (a control plane that disagrees with the node)
    token = signed(index, dataset=dataset)

    response = await client.get(f"/datasets/{dataset}/slices/{index}", params={"token": token})

    assert response.status == 404
    assert (await response.json())["error"] == "not_found"


@pytest.mark.parametrize("index_text", ["-1", "x", "0x1", "1" * 5000])
async def test_a_path_that_names_no_slice_is_refused_whatever_the_token(client, index_text):
    response = await client.get(f"/datasets/tiny-corpus/slices/{index_text}", params={"token": signed(1)})
    assert response.status == 403


# --- download tokens ------------------------------------------------------------------------------------------


async def test_a_token_in_the_authorization_header_is_accepted_too(client, dataset_dir):
    response = await client.get(
        "/datasets/tiny-corpus/slices/2", headers={"Authorization": f"Bearer {signed(2)}"}
    )
    assert response.status == 200
    assert await response.read() == (dataset_dir / "00002.safetensors").read_bytes()


@pytest.mark.parametrize(
    ("query", "detail"),
    [
        ("", "needs the token"),
        ("?token=", "needs the token"),
        ("?token=garbage", "malformed"),
        ("?token=a.bbbb", "signature does not match"),
        ("?token=abc.", "malformed"),
    ],
)
async def test_a_missing_or_malformed_token_is_401(client, query, detail):
    response = await client.get(f"/datasets/tiny-corpus/slices/1{query}")

    assert response.status == 401
    body = await response.json()
    assert body["error"] == "unauthorized"
    assert detail in body["detail"]
    assert response.headers["WWW-Authenticate"] == 'Bearer realm="slices"'


async def test_a_token_signed_with_another_key_is_401(client):
    # given: the key of another data node
    response = await client.get(url(1, key="x" * 64))

    assert response.status == 401
    assert "signature does not match" in (await response.json())["detail"]


async def test_a_tampered_token_is_401(client):
    # given: a token for slice 0 whose body is swapped for one naming slice 1
    body_0, signature_0 = signed(0).split(".")
    body_1, _signature_1 = signed(1).split(".")

    response = await client.get("/datasets/tiny-corpus/slices/1", params={"token": f"{body_1}.{signature_0}"})

    assert response.status == 401
    assert body_0 != body_1


async def test_an_expired_token_is_401(client):
    response = await client.get(url(1, expires_in=-1))

    assert response.status == 401
    assert "expired" in (await response.json())["detail"]


@pytest.mark.parametrize(
    ("path", "token_for"),
    [
        ("/datasets/tiny-corpus/slices/1", {"index": 2}),
        ("/datasets/tiny-corpus/slices/1", {"index": 1, "dataset": "other"}),
    ],
)
async def test_a_token_for_another_slice_or_dataset_is_403(client, path, token_for):
    response = await client.get(path, params={"token": signed(**token_for)})

    assert response.status == 403
    body = await response.json()
    assert body["error"] == "forbidden"
    assert "not slice 1 of tiny-corpus" in body["detail"]


async def test_before_the_registration_brings_the_key_downloads_are_503_then_served(dataset_dir):
    # given: a node that has not heard from its control plane yet
    app = build_app(ServedDataset(name="tiny-corpus", slices=scan(dataset_dir)))
    async with TestClient(TestServer(app)) as client:
        waiting = await client.get(url(0))
        health = await (await client.get("/healthz")).json()

        # when: the registration is answered with the key
        set_download_key(app, KEY)
        served = await client.get(url(0))

        # then
        assert (waiting.status, waiting.headers["Retry-After"]) == (503, "5")
        assert health == {"dataset": "tiny-corpus", "slices": 3, "registered": False}
        assert served.status == 200
        assert (await (await client.get("/healthz")).json())["registered"] is True


def test_verifying_a_token_takes_microseconds():
    # The hot path: a download verifies its token before sendfile; HMAC-SHA256 of ~150 bytes is cheap.
    token = signed(1)
    key = KEY.encode()
    started = time.perf_counter()
    for _ in range(1000):
        tokens.verify(key, token, dataset="tiny-corpus", index=1)
    assert (time.perf_counter() - started) / 1000 < 200e-6


# --- registration -------------------------------------------------------------------------------------------


class FakeControlPlane:
    """Answers POST /api/datasets/register/ with the queued statuses (then 201), recording each request."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.statuses = list(statuses or [])
        self.requests: list[tuple[str, dict]] = []
        self.download_key: str | None = KEY
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
        answer = {"name": body["name"], "slice_count": len(body["slices"])}
        if self.download_key:
            answer["download_key"] = self.download_key
        return web.json_response(answer, status=code)


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
    assert answer == {"name": "tiny-corpus", "slice_count": 3, "download_key": KEY}
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


async def start_node(*arguments: str, **environ: str) -> asyncio.subprocess.Process:
    inherited = {key: value for key, value in os.environ.items() if not key.startswith("HYPHA_DATA_NODE")}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "data_node",
        *arguments,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**inherited, "PYTHONUNBUFFERED": "1", **environ},
    )


async def test_the_node_registers_serves_and_stops_cleanly_on_sigterm(control_plane, dataset_dir):
    # given: its token in the environment, where ps does not show it
    node = await start_node(
        "--server", control_plane.url, "--dataset", str(dataset_dir), HYPHA_DATA_NODE_TOKEN=TOKEN
    )
    try:
        line = (await asyncio.wait_for(node.stderr.readline(), timeout=20)).decode()
        assert "serving dataset tiny-corpus (3 slices" in line, line
        url = control_plane.requests[0][1]["url"]
        assert url.startswith("http://127.0.0.1:")

        # when: a trainer downloads a slice from the registered URL, with a token signed with the node's key
        async with TestClient(TestServer(web.Application())) as helper:
            response = await helper.session.get(f"{url}/datasets/tiny-corpus/slices/2?token={signed(2)}")
            body = await response.read()
            refused = await helper.session.get(f"{url}/datasets/tiny-corpus/slices/2")
            refused_status = refused.status
        node.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(node.wait(), timeout=10)
    finally:
        if node.returncode is None:
            node.kill()
            await node.wait()

    # then
    assert body == (dataset_dir / "00002.safetensors").read_bytes()
    assert refused_status == 401
    assert code == EXIT_OK


async def test_the_node_exits_3_when_its_token_is_refused(control_plane, dataset_dir):
    node = await start_node(
        "--server", control_plane.url, "--token", "hd_wrong-token", "--dataset", str(dataset_dir)
    )
    try:
        code = await asyncio.wait_for(node.wait(), timeout=20)
        stderr = (await node.stderr.read()).decode()
    finally:
        if node.returncode is None:
            node.kill()
            await node.wait()
    assert code == EXIT_TOKEN_REFUSED
    # --token still works, but says that ps shows it
    assert stderr.startswith(
        "hypha-data-node: warning: --token puts the token in the process list (ps); "
        "use --token-file PATH or HYPHA_DATA_NODE_TOKEN instead\n"
    )


async def test_the_node_reads_its_token_from_a_file_and_never_logs_it(control_plane, dataset_dir, tmp_path):
    # given
    token_file = tmp_path / "data-node-token"
    token_file.write_text(f"{TOKEN}\n")

    # when
    node = await start_node(
        "--server", control_plane.url, "--token-file", str(token_file), "--dataset", str(dataset_dir),
        "--log-level", "DEBUG",
    )  # fmt: skip
    try:
        while "serving dataset" not in (
            line := (await asyncio.wait_for(node.stderr.readline(), 20)).decode()
        ):
            assert line, "the node stopped before it served"
        node.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(node.wait(), timeout=10)
        rest = (await node.stderr.read()).decode()
    finally:
        if node.returncode is None:
            node.kill()
            await node.wait()

    # then
    assert code == EXIT_OK
    assert control_plane.requests[0][0] == f"Bearer {TOKEN}"
    assert TOKEN not in line + rest


async def test_a_node_without_a_token_is_a_usage_error(control_plane, dataset_dir):
    node = await start_node("--server", control_plane.url, "--dataset", str(dataset_dir))
    code = await asyncio.wait_for(node.wait(), timeout=20)
    stderr = (await node.stderr.read()).decode()

    assert code == 2
    assert stderr.endswith(
        "error: no token: set HYPHA_DATA_NODE_TOKEN, or pass --token-file PATH (or --token)\n"
    )


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


async def test_the_node_exits_5_when_the_control_plane_gives_no_download_key(control_plane, dataset_dir):
    # given: a control plane from before download tokens
    control_plane.download_key = None

    node = await start_node("--server", control_plane.url, "--token", TOKEN, "--dataset", str(dataset_dir))
    try:
        code = await asyncio.wait_for(node.wait(), timeout=20)
        stderr = (await node.stderr.read()).decode()
    finally:
        if node.returncode is None:
            node.kill()
            await node.wait()

    assert code == EXIT_REGISTRATION_REFUSED
    assert "no download_key" in stderr
