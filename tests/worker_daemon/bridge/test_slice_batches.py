"""The bridge's prefetch in batches, against a real data node (``data_node.server`` on a loopback port, real
slice tokens) and an in-process control plane (the ``answerer`` fixture): small slices claimed together come
in one ``POST``; once a dataset's slices are known to be small the prefetch keeps one place more, so that its
top-ups are batches of two (large slices: one ``GET`` per top-up, as many places as asked); nodes without
batches, the control plane's relay URLs and failed batches fall back to one ``GET`` per slice."""

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
from worker_daemon.bridge.remote.batched import BATCH_SLICE_LIMIT, BatchTarget, batch_target

TASK = uuid.UUID(int=7)
JOB = "0f5b1f0e-2f7c-4a43-9b8e-3a1c2d4e5f61"
KEY = "k" * 64
DATA = SchedulerReference(peer="control-plane", dataset="stdlib")
COUNT = 12


def data(index: int) -> bytes:
    return f"slice {index} ".encode() * (index + 3)


def large(index: int) -> bytes:
    """A slice just over the small-slice bound (1 MiB): streamed by the node, never batched."""
    return bytes([index]) * (BATCH_SLICE_LIMIT + 1 + index)


class Node:
    """A real data node serving slices 0..COUNT-1 of "stdlib" (``content`` of each index), recording each
    request's method and path, and how many slices each answer held."""

    def __init__(self, directory: Path, *, batches: bool = True, content=data) -> None:
        directory.mkdir()
        for index in range(COUNT):
            (directory / f"{index:05d}.safetensors").write_bytes(content(index))
        self.requests: list[tuple[str, str]] = []
        #: Per request in order: its method and how many slices the answer held (a batch's ``X-Slice-Count``).
        self.answered: list[tuple[str, int]] = []
        self.app = build_app(ServedDataset(name="stdlib", slices=scan(directory)), download_key=KEY)
        if not batches:  # a node from before batches: its slices by GET only
            self.app = web.Application()
            self.app.router.add_get("/datasets/{name}/slices/{index}", self._older)
            self._served = {index: data(index) for index in range(COUNT)}

        @web.middleware
        async def record(request: web.Request, handler):
            self.requests.append((request.method, request.path))
            response = await handler(request)
            self.answered.append((request.method, int(response.headers.get("X-Slice-Count", 1))))
            return response

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


def answer(base: str, index: int, *, sha256: str | None = None, content=data) -> dict:
    """``slice_assigned`` as the control plane answers it: the node's URL with a real slice token."""
    token = tokens.sign(
        KEY, dataset="stdlib", index=index, job=JOB, peer="rig-a", expires=int(time.time() + 600)
    )
    return {
        "index": index,
        "size": len(content(index)),
        "sha256": sha256 or hashlib.sha256(content(index)).hexdigest(),
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

    # then: that one came by GET; it is small, so three places (one more than asked): the three prefetched
    # came in one batch, checked, not acked
    await wait_for_cache(work, ["1", "2", "3"])
    assert (node.posts(), node.gets()) == (1, [0])
    assert [(work / PREFETCH_DIR / name).read_bytes() for name in ("1", "2", "3")] == [
        data(i) for i in (1, 2, 3)
    ]
    assert acks(answerer) == [0]

    # when: it takes the next two
    assert [await fetch(backend, work) for _ in range(2)] == [("1", len(data(1))), ("2", len(data(2)))]

    # then: handed out in claim order and acked then; once one prefetched slice is left, two places are
    # free: the top-up is a batch of two (4 and 5)
    assert (work / "artifacts" / "2").read_bytes() == data(2)
    assert acks(answerer) == [0, 1, 2]
    await wait_for_cache(work, ["3", "4", "5"])
    assert (node.posts(), node.gets()) == (2, [0])


async def test_with_small_slices_the_default_prefetch_tops_up_in_batches_of_two(
    make_backend, answerer, node, work
):
    # given: a trainer with the default prefetch (2) and a dataset of small slices (≤ 1 MiB)
    backend = make_backend()
    answerer.slice_answers = [answer(node.url, index) for index in range(COUNT)]

    # when: it takes seven slices, one after another
    handed = [await fetch(backend, work) for _ in range(7)]

    # then: slice 0 showed the slices are small, so the prefetch keeps one place more (3): after the first
    # hand-out a batch of three, then a batch of two each time one prefetched slice is left — never a GET
    # (slices 1-3, 4-5, 6-7, 8-9)
    await wait_for_cache(work, ["7", "8", "9"])
    assert [name for name, _ in handed] == [str(index) for index in range(7)]
    assert node.answered == [("GET", 1), ("POST", 3), ("POST", 2), ("POST", 2), ("POST", 2)]
    assert node.gets() == [0]
    assert all((work / "artifacts" / str(index)).read_bytes() == data(index) for index in range(7))
    assert acks(answerer) == list(range(7))

    # when: the task ends holding three prefetched slices: none of them is acknowledged (its lease returns them)
    await backend.close()
    await asyncio.sleep(0.05)
    assert acks(answerer) == list(range(7))
    assert len(answerer.of_type(protocol.FetchSlice)) == 10


async def test_with_large_slices_the_prefetch_keeps_its_places_and_tops_up_one_by_one(
    make_backend, answerer, tmp_path, work
):
    # given: a dataset of slices just over 1 MiB, and a trainer with the default prefetch (2)
    big = Node(tmp_path / "large", content=large)
    await big.start()
    try:
        backend = make_backend()
        answerer.slice_answers = [answer(big.url, index, content=large) for index in range(COUNT)]

        # when: it takes five slices
        handed = [await fetch(backend, work) for _ in range(5)]

        # then: two places, each top-up one slice by GET; no batch, and never a third slice held
        await wait_for_cache(work, ["5", "6"])
        assert [name for name, _ in handed] == [str(index) for index in range(5)]
        assert big.posts() == 0
        assert sorted(big.gets()) == list(range(7))
        assert (work / "artifacts" / "4").read_bytes() == large(4)
        assert acks(answerer) == list(range(5))
        assert len(answerer.of_type(protocol.FetchSlice)) == 7
    finally:
        await big.server.close()


async def test_a_deeper_prefetch_tops_up_in_batches_when_one_slice_is_left(
    make_backend, answerer, node, work
):
    backend = make_backend(prefetch=4)
    answerer.slice_answers = [answer(node.url, index) for index in range(COUNT)]

    handed = [await fetch(backend, work) for _ in range(7)]
    await wait_for_cache(work, ["7", "8", "9"])

    # then: GET 0 and, the slices being small (4 + 1 places), a batch of 1-5 at the first fetch; then a batch
    # of four once one slice is left (after fetch 4): 6-9
    assert [name for name, _ in handed] == [str(index) for index in range(7)]
    assert (node.posts(), node.gets()) == (2, [0])
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
        await wait_for_cache(work, ["5", "6", "7", "8", "9"])

        # then: the first batch (1-5) answered 404, and the second (6-9) was not asked; every slice by GET, once
        assert [name for name, _ in handed] == ["0", "1", "2", "3", "4"]
        assert older.posts() == 1
        assert sorted(older.gets()) == list(range(10))
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

    # then: the batch of 1-3 failed whole, each was fetched alone, 2 was refused, and 3 came next
    assert [name for name, _ in handed] == ["0", "1", "3"]
    await wait_for_cache(work, ["4", "5", "6"])  # the prefetch goes on: a batch of 4-6 (the cache was empty)
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
    await wait_for_cache(work, ["1", "2", "3"])

    assert (node.posts(), sorted(node.gets())) == (0, [0, 1, 2, 3])


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
