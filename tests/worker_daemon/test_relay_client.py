"""The relay client against a real running control plane (pytest-django's live server, local store) and a
real S3 server on loopback (``rclone serve s3``): uploads and downloads, resumption after cut connections
(a TCP proxy between the client and the server cuts them), expired URLs, integrity checks, errors, and the
memory of a 1 GB transfer."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
from asgiref.sync import sync_to_async

from tests.apps.relay.world import S3Server, make_world, relay_files, start_s3_server, use_s3
from tests.modes import only_in_mode
from worker_daemon.relay import RelayClient, RelayError, RelayIntegrityError

PART_SIZE = 256 << 10
#: 1 MiB + 1000 bytes: five parts of 256 KiB.
DATA = (bytes(range(256)) * 4100)[: (1 << 20) + 1000]


@pytest.fixture
def world(transactional_db, settings, tmp_path):
    from hypha_site.celery import app as celery_app

    # Deletions are Celery tasks queued on commit: run them at once (no Celery worker runs in tests; with
    # REDIS_URL they would wait in the broker). As tests/apps/conftest.py does for the app tests.
    eager = celery_app.conf.task_always_eager
    celery_app.conf.task_always_eager = True
    settings.HYPHA_DATA_DIR = tmp_path / "control-plane"
    settings.HYPHA_RELAY_STORE = "local"
    settings.HYPHA_RELAY_PART_SIZE = PART_SIZE
    settings.HYPHA_RELAY_URL_LIFETIME = 900
    yield make_world()
    celery_app.conf.task_always_eager = eager


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "update.safetensors"
    path.write_bytes(DATA)
    return path


def relay(url: str, world, peer, session: aiohttp.ClientSession, **options) -> RelayClient:
    return RelayClient(
        url, str(world.job.pk), lambda: peer.token, session, connect_timeout=5, read_timeout=30, **options
    )


class CuttingProxy:
    """A TCP proxy to the live server that records what the client sends and can cut a connection once:
    after ``cut_up`` more bytes from the client, or ``cut_down`` more bytes to it."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        self.target = (parts.hostname, parts.port)
        self.sent = bytearray()
        self.cut_up: int | None = None
        self.cut_down: int | None = None

    async def __aenter__(self) -> CuttingProxy:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        self._transports: list = []
        self._handlers: set[asyncio.Task] = set()
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for transport in self._transports:
            transport.abort()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    def requests(self) -> list[str]:
        """``METHOD path`` of every request the client sent (a part's path ends in its number)."""
        found = re.findall(rb"(PUT|POST|GET|DELETE) (/[^ ?]*)[^ ]* HTTP/1\.1", bytes(self.sent))
        return [f"{method.decode()} {path.decode()}" for method, path in found]

    def ranges(self) -> list[str]:
        return [value.decode() for value in re.findall(rb"\r\nRange: ([^\r]+)\r\n", bytes(self.sent))]

    async def _connection(self, client_reader, client_writer) -> None:
        self._handlers.add(asyncio.current_task())
        server_reader, server_writer = await asyncio.open_connection(*self.target)
        self._transports += [client_writer.transport, server_writer.transport]

        async def pipe(reader, writer, upstream: bool) -> None:
            try:
                while data := await reader.read(65536):
                    budget = self.cut_up if upstream else self.cut_down
                    if budget is not None and len(data) >= budget:
                        if upstream:
                            self.sent += data[:budget]
                            self.cut_up = None
                        else:
                            self.cut_down = None
                        writer.write(data[:budget])
                        await writer.drain()
                        # Let the receiver take in what arrived before the cut (a client drops what it
                        # buffered but had not read when the connection breaks).
                        await asyncio.sleep(0.3)
                        client_writer.transport.abort()
                        server_writer.transport.abort()
                        return
                    if budget is not None:
                        if upstream:
                            self.cut_up = budget - len(data)
                        else:
                            self.cut_down = budget - len(data)
                    if upstream:
                        self.sent += data
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.transport.abort() if writer.transport.is_closing() else writer.close()

        await asyncio.gather(
            pipe(client_reader, server_writer, True),
            pipe(server_reader, client_writer, False),
            return_exceptions=True,
        )


# --- the round trip -----------------------------------------------------------------------------------------


async def test_an_update_travels_to_the_parameter_server_and_its_reply_back(
    live_server, world, source, tmp_path
):
    trainer, server = world.trainers[0], world.server
    key = f"updates/1/{trainer.peer}"
    async with aiohttp.ClientSession() as session:
        as_trainer = relay(live_server.url, world, trainer, session)
        as_server = relay(live_server.url, world, server, session)

        obj = await as_trainer.upload(key, source, metadata={"samples": 12})
        [listed] = await as_server.list("updates/", wait=5)
        size = await as_server.download(listed, tmp_path / "received")
        await as_server.reply(key, 200, {"accepted": True})
        reply = await as_trainer.wait_reply(key, wait=5)
        await as_server.delete(key)
        after = await as_server.list("updates/")

    assert (obj["key"], obj["size"], obj["sha256"], obj["metadata"]) == (
        key,
        len(DATA),
        hashlib.sha256(DATA).hexdigest(),
        {"samples": 12},
    )
    assert (listed["key"], size, (tmp_path / "received").read_bytes() == DATA) == (key, len(DATA), True)
    assert reply == {"status": 200, "body": {"accepted": True}}
    assert after == []
    assert [p.name for p in tmp_path.iterdir() if "relay-partial" in p.name] == []


async def test_a_model_is_wanted_published_and_found_as_latest(live_server, world, tmp_path):
    trainer, server = world.trainers[0], world.server
    config = tmp_path / "config.json"
    config.write_bytes(b'{"n_layer": 1}')
    async with aiohttp.ClientSession() as session:
        as_trainer = relay(live_server.url, world, trainer, session)
        as_server = relay(live_server.url, world, server, session)

        missing = await as_trainer.get("model/latest/config.json")
        await as_trainer.want("model/latest/config.json")
        wanted = await as_server.wants(wait=5)
        await as_server.upload("model/3/config.json", config, metadata={"round": 3})
        latest = await as_trainer.get("model/latest/config.json", wait=5)
        no_more = await as_server.wants()

    assert (missing, wanted, no_more) == (None, ["model/latest/config.json"], [])
    assert (latest["key"], latest["metadata"]) == ("model/3/config.json", {"round": 3})


async def test_an_error_answer_is_a_relay_error_with_its_status_and_detail(live_server, world):
    async with aiohttp.ClientSession() as session:
        as_trainer = relay(live_server.url, world, world.trainers[0], session)
        with pytest.raises(RelayError) as refused:
            await as_trainer.list("updates/")

    assert (refused.value.status, refused.value.detail) == (
        403,
        "only the job's parameter server may read updates/",
    )


# --- resumption -----------------------------------------------------------------------------------------------


def label(request: str) -> str:
    """``PUT /relay/<job>/<blob>/3`` → ``3``; ``POST /api/relay/jobs/<job>/uploads/complete/`` → ``POST complete``."""
    method, path = request.split(" ")
    return path.rsplit("/", 1)[1] if method == "PUT" else f"{method} {path.rstrip('/').rsplit('/', 1)[1]}"


async def test_an_upload_cut_mid_part_asks_again_and_sends_only_the_missing_parts(
    live_server, world, source, settings
):
    key = f"updates/1/{world.trainers[0].peer}"
    async with CuttingProxy(live_server.url) as proxy, aiohttp.ClientSession() as session:
        client = relay(
            proxy.url, world, world.trainers[0], session, part_attempts=1, upload_rounds=2, retry_delay=0.05
        )
        proxy.cut_up = int(2.5 * PART_SIZE)  # in part 3's body

        obj = await client.upload(key, source)

    assert [label(request) for request in proxy.requests()] == [
        "POST uploads",
        "1",
        "2",
        "3",
        "POST uploads",
        "3",
        "4",
        "5",
        "POST complete",
    ]
    assert obj["size"] == len(DATA)


async def test_a_later_upload_call_resumes_what_an_earlier_one_left(live_server, world, source, settings):
    key = f"updates/1/{world.trainers[0].peer}"
    async with CuttingProxy(live_server.url) as proxy, aiohttp.ClientSession() as session:
        client = relay(proxy.url, world, world.trainers[0], session, part_attempts=1, upload_rounds=1)
        proxy.cut_up = int(3.5 * PART_SIZE)
        with pytest.raises(aiohttp.ClientError):
            await client.upload(key, source)
        # the server (another thread) notices the cut part a moment later and removes what it had of it
        deadline = time.monotonic() + 30  # generous: a busy machine may be slow to get there
        while any(name.endswith(".tmp") for name in relay_files(settings.HYPHA_DATA_DIR)):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        kept = relay_files(settings.HYPHA_DATA_DIR)
        inodes = {name: (settings.HYPHA_DATA_DIR / "relay" / name).stat().st_ino for name in kept}
        proxy.sent.clear()

        obj = await client.upload(key, source)

    assert [name.rsplit("/", 1)[1] for name in kept] == ["1", "2", "3"]
    assert [r.rsplit("/", 1)[-1] for r in proxy.requests() if r.startswith("PUT")] == ["4", "5"]
    # the parts sent before were not written again
    assert {name: (settings.HYPHA_DATA_DIR / "relay" / name).stat().st_ino for name in kept} == inodes
    assert obj["sha256"] == hashlib.sha256(DATA).hexdigest()


async def test_a_download_cut_mid_body_resumes_with_a_range(live_server, world, source, tmp_path):
    key = f"updates/1/{world.trainers[0].peer}"
    async with CuttingProxy(live_server.url) as proxy, aiohttp.ClientSession() as session:
        await relay(live_server.url, world, world.trainers[0], session).upload(key, source)
        as_server = relay(proxy.url, world, world.server, session, retry_delay=0.05)
        obj = await as_server.get(key)
        proxy.cut_down = 600_000

        size = await as_server.download(obj, tmp_path / "received")

    assert size == len(DATA)
    assert (tmp_path / "received").read_bytes() == DATA
    assert len(proxy.ranges()) == 1
    start = int(proxy.ranges()[0].removeprefix("bytes=").removesuffix("-"))
    assert 0 < start < 600_000  # from the bytes already on disk, not from 0


async def test_an_expired_download_url_is_renewed_once(live_server, world, source, tmp_path, settings):
    key = f"updates/1/{world.trainers[0].peer}"
    settings.HYPHA_RELAY_URL_LIFETIME = 2
    async with aiohttp.ClientSession() as session:
        await relay(live_server.url, world, world.trainers[0], session).upload(key, source)
        as_server = relay(live_server.url, world, world.server, session)
        obj = await as_server.get(key)
        await asyncio.sleep(3.1)

        size = await as_server.download(obj, tmp_path / "received")

    assert (size, (tmp_path / "received").read_bytes() == DATA) == (len(DATA), True)


async def test_a_download_whose_sha256_differs_is_refused_and_leaves_nothing(
    live_server, world, source, tmp_path
):
    key = f"updates/1/{world.trainers[0].peer}"
    async with aiohttp.ClientSession() as session:
        await relay(live_server.url, world, world.trainers[0], session).upload(key, source)
        as_server = relay(live_server.url, world, world.server, session)
        obj = await as_server.get(key)

        with pytest.raises(RelayIntegrityError, match="SHA-256"):
            await as_server.download({**obj, "sha256": "0" * 64}, tmp_path / "received")

    assert sorted(p.name for p in tmp_path.iterdir()) == ["control-plane", "update.safetensors"]


# --- S3 ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory) -> S3Server:
    yield from start_s3_server(tmp_path_factory.mktemp("s3"))


async def test_the_client_moves_objects_through_s3(live_server, world, settings, s3_server, tmp_path):
    data = os.urandom((5 << 20) + 4321)  # two parts of the 5 MiB S3 minimum
    (tmp_path / "big").write_bytes(data)
    key = f"updates/2/{world.trainers[1].peer}"
    # Everyone reaches the store through the proxy (presigned URLs sign the host they name).
    async with CuttingProxy(s3_server.endpoint) as proxy, aiohttp.ClientSession() as session:
        prefix = use_s3(settings, S3Server(endpoint=proxy.url, bucket=s3_server.bucket, root=s3_server.root))
        await relay(live_server.url, world, world.trainers[1], session).upload(key, tmp_path / "big")
        as_server = relay(live_server.url, world, world.server, session, retry_delay=0.05)
        obj = await as_server.get(key)
        proxy.sent.clear()
        proxy.cut_down = 3 << 20  # the download is cut once: the client resumes with a range

        size = await as_server.download(obj, tmp_path / "received")
        await as_server.delete(key)

    assert (size, (tmp_path / "received").read_bytes() == data) == (len(data), True)
    assert len(proxy.ranges()) == 1
    assert await sync_to_async(s3_server.keys)(prefix) == []


# --- memory -----------------------------------------------------------------------------------------------------


class PeakRss:
    """The peak resident set size of this process (the live server runs in it) sampled every 10 ms, as
    growth over the RSS when sampling began: /proc/self/statm, not ru_maxrss, which never falls and so
    would hide this test's growth behind an earlier test's peak."""

    def __enter__(self) -> PeakRss:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.baseline = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.baseline

    def _rss(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self.page

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._rss())


@pytest.mark.slow
@pytest.mark.timeout(180)
@only_in_mode("embedded", "the client's memory does not depend on how the control plane runs")
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc to measure memory")
async def test_a_gigabyte_goes_up_and_down_in_bounded_memory(live_server, world, tmp_path, settings):
    settings.HYPHA_RELAY_PART_SIZE = 16 << 20
    source = tmp_path / "huge"
    with source.open("wb") as handle:  # sparse-ish: 1 MiB of random bytes every 64 MiB, holes between
        handle.truncate(1 << 30)
        for offset in range(0, 1 << 30, 64 << 20):
            handle.seek(offset)
            handle.write(os.urandom(1 << 20))
    key = f"updates/1/{world.trainers[0].peer}"
    started = time.monotonic()

    with PeakRss() as memory:
        async with aiohttp.ClientSession() as session:
            obj = await relay(live_server.url, world, world.trainers[0], session).upload(key, source)
            as_server = relay(live_server.url, world, world.server, session)
            size = await as_server.download(await as_server.get(key), tmp_path / "received")

    assert (obj["size"], size) == (1 << 30, 1 << 30)
    assert os.path.getsize(tmp_path / "received") == 1 << 30
    assert memory.growth < 64 << 20, f"RSS grew by {memory.growth >> 20} MiB"
    print(
        f"1 GiB up and down in {time.monotonic() - started:.1f} s; RSS growth {memory.growth / (1 << 20):.1f} MiB"
    )
