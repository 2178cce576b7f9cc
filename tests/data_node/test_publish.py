"""A data node behind NAT (``--reachable false``) publishes its slices to the control plane's store: a real
``python -m data_node`` process and :class:`data_node.publish.Publisher` against a real running control plane
(pytest-django's live server, local store). Trainers then get the control plane's URLs for its slices and
download the registered bytes from there."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from asgiref.sync import sync_to_async

from data_node.publish import Publisher, PublishRefused
from data_node.slices import scan

PART_SIZE = 64 << 10
#: Slice 0 is three parts (64, 64 and 22 KiB), slice 1 two, slice 2 one.
SLICES = [bytes(range(256)) * 600, b"second slice " * 6000, b"third"]


@pytest.fixture
def control_plane(transactional_db, live_server, settings, tmp_path):
    """The live server on the local store with small parts; deletions queued on commit run at once."""
    from hypha_site.celery import app as celery_app

    eager = celery_app.conf.task_always_eager
    celery_app.conf.task_always_eager = True
    settings.HYPHA_DATA_DIR = tmp_path / "control-plane"
    settings.HYPHA_RELAY_STORE = "local"
    settings.HYPHA_RELAY_PART_SIZE = PART_SIZE
    settings.HYPHA_RELAY_URL_LIFETIME = 900
    yield live_server
    celery_app.conf.task_always_eager = eager


@pytest.fixture
def node_token(control_plane) -> str:
    from apps.datasets import services

    _node, token = services.create_data_node(name="data-nat", url="http://10.1.2.3:1")
    return token


@pytest.fixture
def dataset_dir(tmp_path) -> Path:
    directory = tmp_path / "nat-corpus"
    directory.mkdir()
    for index, data in enumerate(SLICES):
        (directory / f"{index:05d}.safetensors").write_bytes(data)
    return directory


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@sync_to_async
def published() -> list[tuple]:
    from apps.datasets.models import PublishedSlice

    return list(PublishedSlice.objects.order_by("slice__index").values_list("slice__index", "status"))


@sync_to_async
def slice_urls(index: int) -> list[str]:
    from apps.datasets import services
    from apps.datasets.models import Dataset

    return services.slice_urls(Dataset.objects.get(name="nat-corpus"), index, job_id="job-1", peer="rig-a")


@sync_to_async
def register(token: str) -> None:
    """What the node's registration sends, with ``reachable: false``."""
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    body = {
        "name": "nat-corpus",
        "url": "http://10.1.2.3:1",
        "reachable": False,
        "slices": [{"index": i, "size": len(data), "sha256": digest(data)} for i, data in enumerate(SLICES)],
    }
    assert client.post("/api/datasets/register/", body, format="json").status_code in (200, 201)


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


async def read_until(process: asyncio.subprocess.Process, text: str, timeout: float = 60) -> list[str]:
    """stderr lines up to the first one holding ``text``."""
    lines = []
    async with asyncio.timeout(timeout):
        while True:
            line = (await process.stderr.readline()).decode()
            assert line, f"the node exited before saying {text!r}:\n{''.join(lines)}"
            lines.append(line)
            if text in line:
                return lines


async def stop(process: asyncio.subprocess.Process) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(process.wait(), timeout=15)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_node_behind_nat_publishes_its_slices_and_trainers_download_them_from_the_store(
    control_plane, node_token, dataset_dir
):
    arguments = ["--server", control_plane.url, "--dataset", str(dataset_dir), "--reachable", "false"]

    # when: the node starts behind NAT
    node = await start_node(*arguments, HYPHA_DATA_NODE_TOKEN=node_token)
    try:
        lines = await read_until(node, "slices of nat-corpus are in the store")
    finally:
        code = await stop(node)

    # then: it registered, published every slice, said so, and stopped cleanly on SIGTERM
    assert any("serving dataset nat-corpus (3 slices" in line for line in lines), lines
    assert any("publishing 3 slices of nat-corpus to the control plane's store" in line for line in lines)
    assert (
        lines[-1]
        .rstrip()
        .endswith(
            f"all 3 slices of nat-corpus are in the store (3 published now, 0 were already; "
            f"{sum(map(len, SLICES))} bytes sent)"
        )
    )
    assert code == 0
    assert await published() == [(0, "complete"), (1, "complete"), (2, "complete")]

    # and: each slice's URL is the control plane's, and downloads the registered bytes
    async with aiohttp.ClientSession() as session:
        for index, data in enumerate(SLICES):
            [url] = await slice_urls(index)
            assert url.startswith(f"{control_plane.url}/api/datanodes/")
            async with session.get(url) as response:
                assert response.status == 200
                body = await response.read()
            assert (len(body), digest(body)) == (len(data), digest(data))

    # when: the node starts again
    node = await start_node(*arguments, HYPHA_DATA_NODE_TOKEN=node_token)
    try:
        lines = await read_until(node, "slices of nat-corpus are in the store")
    finally:
        code = await stop(node)

    # then: nothing is sent again
    assert lines[-1].rstrip().endswith("(0 published now, 3 were already; 0 bytes sent)")
    assert code == 0


async def test_sigterm_while_publishing_stops_the_node_cleanly(control_plane, node_token, tmp_path):
    # given: a dataset of one 8 MiB slice (128 parts)
    directory = tmp_path / "big-corpus"
    directory.mkdir()
    (directory / "00000.safetensors").write_bytes(os.urandom(8 << 20))
    node = await start_node(
        "--server", control_plane.url, "--dataset", str(directory), "--reachable", "false",
        HYPHA_DATA_NODE_TOKEN=node_token,
    )  # fmt: skip

    # when: SIGTERM as soon as it starts publishing
    try:
        await read_until(node, "publishing 1 slices of big-corpus")
    finally:
        code = await stop(node)

    # then
    assert code == 0


async def test_the_publisher_sends_only_the_parts_the_store_lacks(control_plane, node_token, dataset_dir):
    await register(node_token)
    slices = scan(dataset_dir)
    # given: the first part of slice 0 is stored already (a node stopped mid-slice)
    async with aiohttp.ClientSession() as session:
        plan = await _begin(session, control_plane.url, node_token, slices[0])
        first = plan["parts"][0]
        async with session.put(first["url"], data=SLICES[0][: first["size"]]) as response:
            assert response.status == 200

    # when
    result = await Publisher(
        server=control_plane.url, token=node_token, dataset="nat-corpus", slices=slices
    ).run()

    # then
    assert result == {"published": 3, "already": 0, "bytes": sum(map(len, SLICES)) - PART_SIZE}
    assert await published() == [(0, "complete"), (1, "complete"), (2, "complete")]


async def test_a_failure_is_retried_until_it_passes(control_plane, node_token, dataset_dir, caplog):
    await register(node_token)
    slices = scan(dataset_dir)
    # given: slice 2's file was changed on disk after the node scanned it (the store refuses the bytes)
    path = dataset_dir / "00002.safetensors"
    path.write_bytes(b"THIRD")
    publisher = Publisher(
        server=control_plane.url, token=node_token, dataset="nat-corpus", slices=slices, retry_base=0.05
    )

    # when: it publishes, and the file is put back while it retries
    caplog.set_level(logging.WARNING, logger="data_node")
    running = asyncio.create_task(publisher.run())
    async with asyncio.timeout(30):
        while "publishing slice 2 of nat-corpus failed" not in caplog.text:
            await asyncio.sleep(0.05)
    path.write_bytes(SLICES[2])
    result = await asyncio.wait_for(running, timeout=30)

    # then: the refusal was logged and retried; all are published
    assert (
        "answered 422: POST /api/datanodes/publish/complete/: slice 2 of nat-corpus: the parts' SHA-256"
        in (caplog.text)
    )
    assert result["published"] == 3
    assert await published() == [(0, "complete"), (1, "complete"), (2, "complete")]


async def test_a_refused_token_stops_the_publisher(control_plane, node_token, dataset_dir):
    await register(node_token)
    publisher = Publisher(
        server=control_plane.url, token="hd_wrong", dataset="nat-corpus", slices=scan(dataset_dir)
    )

    with pytest.raises(PublishRefused) as refused:
        await publisher.run()

    assert refused.value.status == 401
    assert await published() == []


async def _begin(session: aiohttp.ClientSession, server: str, token: str, slice_) -> dict:
    body = {"dataset": "nat-corpus", "index": slice_.index, "size": slice_.size, "sha256": slice_.sha256}
    async with session.post(
        f"{server}/api/datanodes/publish/", json=body, headers={"Authorization": f"Bearer {token}"}
    ) as response:
        assert response.status == 200
        return await response.json()
