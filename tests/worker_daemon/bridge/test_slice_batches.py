"""The bridge's prefetch in batches, against a real data node (``data_node.server`` on a loopback port, real
slice tokens) and an in-process control plane (the ``answerer`` fixture): small slices claimed together come
in one ``POST``; nodes without batches, the control plane's relay URLs and failed batches fall back to one
``GET`` per slice."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from data_node import tokens
from data_node.server import ServedDataset, build_app
from data_node.slices import scan
from worker_daemon import protocol
from worker_daemon.bridge.references import SchedulerReference
from worker_daemon.bridge.remote import PREFETCH_DIR, RemoteBackend
from worker_daemon.bridge.remote.batched import BatchTarget, batch_target

TASK = uuid.UUID(int=7)
JOB = "0f5b1f0e-2f7c-4a43-9b8e-3a1c2d4e5f61"
KEY = "k" * 64
DATA = SchedulerReference(peer="control-plane", dataset="stdlib")
COUNT = 12


def data(index: int) -> bytes:
    return f"slice {index} ".encode() * (index + 3)


class Node:
    """A real data node serving slices 0..COUNT-1 of "stdlib", recording each request's method and path."""

    def __init__(self, directory: Path, *, batches: bool = True) -> None:
        directory.mkdir()
        for index in range(COUNT):
            (directory / f"{index:05d}.safetensors").write_bytes(data(index))
        self.requests: list[tuple[str, str]] = []
        self.app = build_app(ServedDataset(name="stdlib", slices=scan(directory)), download_key=KEY)
        if not batches:  # a node from before batches: its slices by GET only
            self.app = web.Application()
            self.app.router.add_get("/datasets/{name}/slices/{index}", self._older)
            self._served = {index: data(index) for index in range(COUNT)}

        @web.middleware
        async def record(request: web.Request, handler):
            self.requests.append((request.method, request.path))
            return await handler(request)

        self.app.middlewares.append(record)
        self.server = TestServer(self.app)
        self.url = ""

    async def _older(self, request: web.Request) -> web.Response:
        return web.Response(body=self._served[int(request.match_info["index"])])

    async def start(self) -> None:
        await self.server.start_server(access_log=None)
        self.url = str(self.server.make_url("")).rstrip("/")

    def posts(self) -> int:
        return sum(method == "POST" for method, _ in self.requests)

    def gets(self) -> list[int]:
        return [int(path.rsplit("/", 1)[1]) for method, path in self.requests if method == "GET"]


def answer(base: str, index: int, *, sha256: str | None = None) -> dict:
    """``slice_assigned`` as the control plane answers it: the node's URL with a real slice token."""
    token = tokens.sign(
        KEY, dataset="stdlib", index=index, job=JOB, peer="rig-a", expires=int(time.time() + 600)
    )
    return {
        "index": index,
        "size": len(data(index)),
        "sha256": sha256 or hashlib.sha256(data(index)).hexdigest(),
        "urls": [f"{base}/datasets/stdlib/slices/{index}?token={token}"],
    }


@pytest.fixture
async def node(tmp_path):
    started = Node(tmp_path / "stdlib")
    await started.start()
    yield started
    await started.server.close()


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "work" / "artifacts").mkdir(parents=True)
    return tmp_path / "work"


@pytest.fixture
async def make_backend(link, work):
    made: list[RemoteBackend] = []

    def make(prefetch: int = 2, server_url: str | None = None) -> RemoteBackend:
        backend = RemoteBackend(
            task_id=TASK,
            job_id=JOB,
            link=link,
            work_dir=work,
            server_url=server_url,
            request_timeout=2.0,
            connect_timeout=2.0,
            read_timeout=5.0,
            retry_base=0.01,
            prefetch=prefetch,
        )
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.close()


def acks(answerer) -> list[int]:
    posted = [*answerer.sent, *answerer.link.queued]
    return [message.index for message in posted if isinstance(message, protocol.SliceAck)]


async def wait_for_cache(work: Path, names: list[str]) -> None:
    deadline = asyncio.get_running_loop().time() + 5
    while sorted(p.name for p in (work / PREFETCH_DIR).iterdir()) != sorted(names):
        assert asyncio.get_running_loop().time() < deadline, sorted(
            p.name for p in (work / PREFETCH_DIR).iterdir()
        )
        await asyncio.sleep(0.01)


async def fetch(backend: RemoteBackend, work: Path) -> tuple[str, int]:
    (handed,) = await backend.fetch(reference=DATA, artifacts_dir=work / "artifacts")
    return handed


async def test_the_prefetch_of_small_slices_comes_in_one_batch(make_backend, answerer, node, work):
    # given: a trainer with the default prefetch (2)
    backend = make_backend()
    answerer.slice_answers = [answer(node.url, index) for index in range(COUNT)]

    # when: it takes its first slice
    assert await fetch(backend, work) == ("0", len(data(0)))

    # then: that one came by GET; the two prefetched came in one batch, checked, not acked
    await wait_for_cache(work, ["1", "2"])
    assert (node.posts(), node.gets()) == (1, [0])
    assert [(work / PREFETCH_DIR / name).read_bytes() for name in ("1", "2")] == [data(1), data(2)]
    assert acks(answerer) == [0]

    # when: it takes the next two
    assert [await fetch(backend, work) for _ in range(2)] == [("1", len(data(1))), ("2", len(data(2)))]

    # then: handed out in claim order and acked then; with two places, one frees at a time: one GET each
    assert (work / "artifacts" / "2").read_bytes() == data(2)
    assert acks(answerer) == [0, 1, 2]
    await wait_for_cache(work, ["3", "4"])
    assert (node.posts(), node.gets()) == (1, [0, 3, 4])


async def test_a_deeper_prefetch_tops_up_in_batches_when_one_slice_is_left(
    make_backend, answerer, node, work
):
    backend = make_backend(prefetch=4)
    answerer.slice_answers = [answer(node.url, index) for index in range(COUNT)]

    handed = [await fetch(backend, work) for _ in range(7)]
    await wait_for_cache(work, ["7", "8", "9", "10"])

    # then: GET 0 and a batch of 1-4 at the first fetch; then a batch of three each time one slice is left
    # (after fetches 4 and 7): 5-7, 8-10
    assert [name for name, _ in handed] == [str(index) for index in range(7)]
    assert (node.posts(), node.gets()) == (3, [0])
    assert acks(answerer) == list(range(7))
    assert all((work / "artifacts" / str(index)).read_bytes() == data(index) for index in range(7))


async def test_a_node_without_batches_is_asked_once_then_slice_by_slice(
    make_backend, answerer, tmp_path, work
):
    older = Node(tmp_path / "older", batches=False)
    await older.start()
    try:
        backend = make_backend(prefetch=4)
        answerer.slice_answers = [answer(older.url, index) for index in range(COUNT)]

        handed = [await fetch(backend, work) for _ in range(5)]
        await wait_for_cache(work, ["5", "6", "7"])

        # then: the first batch (1-4) answered 404, and the second (5-7) was not asked; every slice by GET, once
        assert [name for name, _ in handed] == ["0", "1", "2", "3", "4"]
        assert older.posts() == 1
        assert sorted(older.gets()) == list(range(8))
    finally:
        await older.server.close()


async def test_a_batch_with_a_wrong_slice_falls_back_and_the_slice_is_refused_alone(
    make_backend, answerer, node, work
):
    # given: the control plane announces another digest for slice 2 (a tampered copy, say)
    backend = make_backend()
    answerer.slice_answers = [
        answer(node.url, 0),
        answer(node.url, 1),
        answer(node.url, 2, sha256=hashlib.sha256(b"the original").hexdigest()),
        *(answer(node.url, index) for index in range(3, COUNT)),
    ]

    # when
    handed = [await fetch(backend, work) for _ in range(3)]

    # then: the batch of 1 and 2 failed whole, each was fetched alone, 2 was refused, and 3 came next
    assert [name for name, _ in handed] == ["0", "1", "3"]
    await wait_for_cache(work, ["4", "5"])  # the prefetch goes on: a batch of 4 and 5
    assert node.posts() == 2
    assert sorted(node.gets()) == [0, 1, 2, 3]
    assert not (work / "artifacts" / "2").exists()
    assert acks(answerer) == [0, 1, 3]


async def test_a_hostile_node_answer_is_never_written_as_a_slice(make_backend, answerer, tmp_path, work):
    # given: a node whose batch answers frame other bytes than the slices asked for
    hostile = Node(tmp_path / "hostile", batches=False)

    async def lying_batch(request: web.Request) -> web.Response:
        forged = b"".join(f"{i} {len(data(i))} x\n".encode() + b"X" * len(data(i)) for i in (1, 2))
        return web.Response(body=forged, content_type="application/x-hypha-slices")

    hostile.app.router.add_post("/datasets/{name}/slices", lying_batch)
    await hostile.start()
    try:
        backend = make_backend()
        answerer.slice_answers = [answer(hostile.url, index) for index in range(COUNT)]

        handed = [await fetch(backend, work) for _ in range(3)]

        # then: the forged bytes failed their digests; the slices came by GET, right
        assert [name for name, _ in handed] == ["0", "1", "2"]
        assert [(work / "artifacts" / str(i)).read_bytes() for i in range(3)] == [data(i) for i in range(3)]
        assert hostile.posts() == 1
    finally:
        await hostile.server.close()


async def test_slices_behind_the_relay_are_never_batched(make_backend, answerer, node, work):
    # given: the control plane is the node's URL (a node behind NAT: its slices come from the relay's store)
    backend = make_backend(server_url=node.url + "/")
    answerer.slice_answers = [answer(node.url, index) for index in range(COUNT)]

    await fetch(backend, work)
    await wait_for_cache(work, ["1", "2"])

    assert (node.posts(), sorted(node.gets())) == (0, [0, 1, 2])


@pytest.mark.parametrize(
    ("url", "index", "expected"),
    [
        ("http://n:1/datasets/d/slices/3?token=t", 3, BatchTarget("http://n:1/datasets/d/slices", "t")),
        ("https://n/pre/fix/datasets/d/slices/3?token=a.b", 3, BatchTarget("https://n/pre/fix/datasets/d/slices", "a.b")),
        ("http://n:1/datasets/d/slices/3?token=t", 4, None),  # another slice than claimed
        ("http://n:1/datasets/d/slices/3", 3, None),  # no token
        ("http://n:1/datasets/d/slices/3?token=t&x=1", 3, None),  # more than a token
        ("http://n:1/datasets/d/slices/3?token=t&token=u", 3, None),
        ("http://n:1/models/3?token=t", 3, None),
        ("ftp://n/datasets/d/slices/3?token=t", 3, None),
        ("http://cp/api/datanodes/9/datasets/d/slices/3?token=t", 3, None),  # the control plane's relay
    ],
)  # fmt: skip
def test_which_slice_urls_are_batched(url, index, expected):
    assert batch_target(url, index=index, control_plane="http://cp") == expected


async def test_a_claim_told_to_wait_never_stands_before_a_slice_the_trainer_holds(
    make_backend, answerer, node, work
):
    """At an epoch's end a top-up's two claims race: the control plane may tell the first to wait ("none yet":
    the trainer holds an unacknowledged slice — the one the second claim just got). Places are handed out in
    order; if the waiting place came first, the trainer would wait for a slice that comes only once the slice
    behind it is acknowledged, which it blocks (tests/e2e/test_batchnorm.py starved a trainer so)."""
    # given: slice 0, then a top-up whose first claim is told to wait and whose second gets slice 1; after
    # that nothing more (every later claim is told to wait)
    backend = make_backend()
    answerer.slice_answers = [answer(node.url, 0), {"retry_in": 0.05}, answer(node.url, 1)]
    assert await fetch(backend, work) == ("0", len(data(0)))

    # when: the executor asks for the next slice
    handed = await asyncio.wait_for(fetch(backend, work), timeout=10)

    # then: it gets slice 1 at once, not after the waiting claim
    assert handed == ("1", len(data(1)))
    assert acks(answerer) == [0, 1]


async def test_a_place_told_to_wait_never_stands_before_a_slice_a_later_top_up_claimed(
    make_backend, answerer, node, work
):
    """A place told to wait ("none yet": the trainer held an unacknowledged slice then) is asked again after its
    ``retry_in``; if a later top-up claims a slice meanwhile, the trainer holds that one, so the control plane
    tells the waiting place to wait again — for ever, while the slice behind it is never handed out (a trainer
    starved until its round closed without it: tests/e2e/test_batchnorm.py in CI)."""
    # given: slice 0; a top-up that gets slice 1 and a "none yet, ask again in 2 s"; the next top-up gets
    # slice 2; after that every claim is told to wait (the trainer holds slice 2)
    backend = make_backend()
    answerer.slice_answers = [
        answer(node.url, 0),
        answer(node.url, 1),
        {"retry_in": 2.0},
        answer(node.url, 2),
    ]
    assert await fetch(backend, work) == ("0", len(data(0)))
    assert await fetch(backend, work) == ("1", len(data(1)))

    # when: the executor asks for the next slice
    handed = await asyncio.wait_for(fetch(backend, work), timeout=10)

    # then: it gets slice 2, the one the trainer holds
    assert handed == ("2", len(data(2)))
    assert acks(answerer) == [0, 1, 2]
