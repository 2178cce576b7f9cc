"""The data node's small-slice paths, from outside: real HTTP requests to a real data node (``build_app`` on a
loopback port) with real slice tokens — slices read straight into the answer, and batch requests
(``POST /datasets/<name>/slices``), including what a hostile token holder sends."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from data_node import batches, tokens
from data_node.server import ServedDataset, build_app
from data_node.slices import scan

KEY = "k" * 64
PATH = "/datasets/corpus/slices"


def signed(index: int, *, dataset: str = "corpus", key: str = KEY, expires_in: float = 60) -> str:
    return tokens.sign(
        key, dataset=dataset, index=index, job="job-1", peer="rig-a", expires=int(time.time() + expires_in)
    )


def body(*entries: tuple[int, str]) -> dict:
    return {"slices": [{"index": index, "token": token} for index, token in entries]}


def split(answer: bytes) -> list[tuple[int, int, str, bytes]]:
    """A batch's answer as (index, size, sha256, bytes) per slice, by the documented framing."""
    slices = []
    position = 0
    while position < len(answer):
        end = answer.index(b"\n", position)
        index, size, digest = answer[position:end].decode("ascii").split(" ")
        start = end + 1
        data = answer[start : start + int(size)]
        assert len(data) == int(size)
        slices.append((int(index), int(size), digest, data))
        position = start + int(size)
    return slices


@pytest.fixture
def corpus(tmp_path) -> Path:
    """Slices 0..4 of distinct sizes (100, 200, …, 500 bytes) and slice 5 of 3000 bytes."""
    directory = tmp_path / "corpus"
    directory.mkdir()
    for index in range(5):
        (directory / f"{index:05d}.safetensors").write_bytes(bytes([index]) * (100 * (index + 1)))
    (directory / "00005.safetensors").write_bytes(b"L" * 3000)
    return directory


def contents(corpus: Path, index: int) -> bytes:
    return (corpus / f"{index:05d}.safetensors").read_bytes()


@pytest.fixture
async def client(corpus):
    # An inline limit of 1000 bytes: slices 0..4 are small, slice 5 is large.
    app = build_app(ServedDataset(name="corpus", slices=scan(corpus)), download_key=KEY, inline_limit=1000)
    async with TestClient(TestServer(app)) as test_client:
        yield test_client


# --- slices read into the answer ---------------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, 4, 5])  # small (read into the answer), and large (streamed)
async def test_small_and_large_slices_are_served_alike(client, corpus, index):
    response = await client.get(f"{PATH}/{index}", params={"token": signed(index)})

    data = await response.read()
    assert response.status == 200
    assert data == contents(corpus, index)
    assert response.headers["Content-Length"] == str(len(data))
    assert response.headers["Content-Type"] == "application/octet-stream"
    assert response.headers["X-Sha256"] == hashlib.sha256(data).hexdigest()
    status = (corpus / f"{index:05d}.safetensors").stat()
    assert response.headers["ETag"] == f'"{status.st_mtime_ns:x}-{status.st_size:x}"'  # aiohttp's own tag


async def test_a_small_slice_still_answers_ranges_and_conditional_requests(client, corpus):
    token = signed(2)
    whole = await client.get(f"{PATH}/2", params={"token": token})
    etag = whole.headers["ETag"]

    ranged = await client.get(f"{PATH}/2", params={"token": token}, headers={"Range": "bytes=10-19"})
    unchanged = await client.get(f"{PATH}/2", params={"token": token}, headers={"If-None-Match": etag})

    assert (ranged.status, await ranged.read()) == (206, contents(corpus, 2)[10:20])
    assert unchanged.status == 304


async def test_a_slice_file_cut_short_since_start_up_is_a_500_not_wrong_bytes(client, corpus):
    (corpus / "00001.safetensors").write_bytes(b"short")

    response = await client.get(f"{PATH}/1", params={"token": signed(1)})

    assert response.status == 500
    assert (await response.json())["error"] == "slice_changed"


# --- batches -------------------------------------------------------------------------------------------------


async def test_a_batch_answers_every_slice_framed_in_request_order(client, corpus):
    # when: slices 3, 0 and 4, each with its own URL's token
    response = await client.post(PATH, json=body((3, signed(3)), (0, signed(0)), (4, signed(4))))

    # then
    answer = await response.read()
    assert response.status == 200
    assert response.headers["Content-Type"] == batches.CONTENT_TYPE
    assert response.headers["X-Slice-Count"] == "3"
    assert response.headers["Content-Length"] == str(len(answer))
    assert split(answer) == [
        (index, len(contents(corpus, index)), hashlib.sha256(contents(corpus, index)).hexdigest(),
         contents(corpus, index))
        for index in (3, 0, 4)
    ]  # fmt: skip


async def test_a_batch_of_one_and_of_the_most_slices_allowed(tmp_path):
    directory = tmp_path / "many"
    directory.mkdir()
    for index in range(batches.MAX_SLICES):
        (directory / f"{index:05d}.safetensors").write_bytes(f"slice {index}".encode())
    app = build_app(ServedDataset(name="many", slices=scan(directory)), download_key=KEY)
    async with TestClient(TestServer(app)) as client:
        every = [(index, signed(index, dataset="many")) for index in range(batches.MAX_SLICES)]

        one = await client.post("/datasets/many/slices", json=body(every[7]))
        most = await client.post("/datasets/many/slices", json=body(*every))

        assert split(await one.read()) == [(7, 7, hashlib.sha256(b"slice 7").hexdigest(), b"slice 7")]
        assert [data for _, _, _, data in split(await most.read())] == [
            f"slice {index}".encode() for index in range(batches.MAX_SLICES)
        ]


async def test_before_the_registration_a_batch_is_503(corpus):
    app = build_app(ServedDataset(name="corpus", slices=scan(corpus)))
    async with TestClient(TestServer(app)) as client:
        response = await client.post(PATH, json=body((0, signed(0))))
        assert (response.status, response.headers["Retry-After"]) == (503, "5")


@pytest.mark.parametrize(
    ("raw", "detail"),
    [
        (b"", "must be JSON"),
        (b"not json", "must be JSON"),
        (b"\xff\xfe", "must be JSON"),
        (b"[1, 2]", 'one key, "slices"'),
        (b'{"slices": [], "more": 1}', 'one key, "slices"'),
        (b'{"slices": []}', "non-empty list"),
        (b'{"slices": {"index": 0}}', "non-empty list"),
        (b'{"slices": [0]}', "slices[0] must be"),
        (b'{"slices": [{"index": 0}]}', "slices[0] must be"),
        (b'{"slices": [{"index": 0, "token": "t", "dataset": "other"}]}', "slices[0] must be"),
        (b'{"slices": [{"index": "0", "token": "t"}]}', "slices[0].index"),
        (b'{"slices": [{"index": true, "token": "t"}]}', "slices[0].index"),
        (b'{"slices": [{"index": -1, "token": "t"}]}', "slices[0].index"),
        (b'{"slices": [{"index": 1.0, "token": "t"}]}', "slices[0].index"),
        (b'{"slices": [{"index": 1180591620717411303424, "token": "t"}]}', "slices[0].index"),
        (b'{"slices": [{"index": 0, "token": 5}]}', "slices[0].token"),
        (b'{"slices": [{"index": 0, "token": null}]}', "slices[0].token"),
        (
            b'{"slices": [{"index": 2, "token": "a"}, {"index": 2, "token": "b"}]}',
            "slice 2 is asked for twice",
        ),
    ],
)
async def test_a_malformed_batch_is_400_whatever_it_holds(client, raw, detail):
    response = await client.post(PATH, data=raw, headers={"Content-Type": "application/json"})

    assert response.status == 400
    answer = await response.json()
    assert answer["error"] == "bad_request"
    assert detail in answer["detail"]


async def test_too_many_slices_in_a_batch_is_400(client):
    entries = [(index, signed(index % 5)) for index in range(batches.MAX_SLICES + 1)]

    response = await client.post(PATH, json=body(*entries))

    assert response.status == 400
    assert (await response.json())["detail"] == f"at most {batches.MAX_SLICES} slices per batch, not 65"


async def test_a_body_over_the_limit_is_413_with_or_without_a_length(client):
    huge = json.dumps({"slices": [{"index": 0, "token": "x" * batches.MAX_BODY}]}).encode()

    async def chunked():
        for start in range(0, len(huge), 4096):
            yield huge[start : start + 4096]

    with_length = await client.post(PATH, data=huge, headers={"Content-Type": "application/json"})
    streamed = await client.post(PATH, data=chunked(), headers={"Content-Type": "application/json"})

    assert (with_length.status, (await with_length.json())["error"]) == (413, "too_large")
    assert (streamed.status, (await streamed.json())["error"]) == (413, "too_large")


# Each case is built when its test runs: a token signed at collection could expire before a long run gets here.
@pytest.mark.parametrize(
    ("entries", "status", "detail"),
    [
        # a token holder asking for a slice it was not given, with the token of one it was
        (lambda: [(0, signed(0)), (1, signed(0))], 403, "slice 1: the token authorises slice 0 of dataset 'corpus'"),
        # slices of another dataset in the same batch: a batch cannot mix datasets
        (lambda: [(0, signed(0)), (1, signed(1, dataset="other"))], 403, "slice 1: the token authorises slice 1 "
         "of dataset 'other', not slice 1 of corpus"),
        (lambda: [(0, signed(0)), (1, signed(1, expires_in=-1))], 401, "slice 1: the slice token expired"),
        (lambda: [(0, signed(0)), (1, signed(1, key="x" * 64))], 401, "slice 1: the slice token's signature"),
        (lambda: [(0, "garbage"), (1, signed(1))], 401, "slice 0: malformed slice token"),
        (lambda: [(0, "")], 401, "slice 0: a slice download needs the token"),
        (lambda: [(0, "a.bbbb")], 401, "slice 0: the slice token's signature does not match"),
        # a tampered token: slice 1's claims under slice 0's signature
        (lambda: [(1, f"{signed(1).split('.')[0]}.{signed(0).split('.')[1]}")], 401, "signature does not match"),
    ],
)  # fmt: skip
async def test_a_batch_with_one_token_a_get_would_refuse_is_refused_whole(client, entries, status, detail):
    response = await client.post(PATH, json=body(*entries()))

    assert response.status == status
    answer = await response.json()
    assert answer["error"] == ("unauthorized" if status == 401 else "forbidden")
    assert detail in answer["detail"]
    assert response.headers["Content-Type"].startswith("application/json")  # no slice's bytes


async def test_tokens_are_checked_before_the_slices_exist(client):
    # given: no valid token, a slice that does not exist: the answer says nothing of the slices
    response = await client.post(PATH, json=body((99, signed(3))))

    assert response.status == 403


@pytest.mark.parametrize(
    ("path", "entries", "detail"),
    [
        (PATH, lambda: [(0, signed(0)), (6, signed(6))], "dataset corpus has slices 0..5"),
        ("/datasets/other/slices", lambda: [(0, signed(0, dataset="other"))], "no such dataset or slice"),
    ],
)
async def test_unknown_slices_and_datasets_are_404(client, path, entries, detail):
    # given: tokens for exactly those (a control plane that disagrees with the node)
    response = await client.post(path, json=body(*entries()))

    assert response.status == 404
    assert (await response.json()) == {"error": "not_found", "detail": detail}


async def test_a_slice_over_the_inline_limit_is_refused_in_a_batch(client):
    response = await client.post(PATH, json=body((0, signed(0)), (5, signed(5))))

    assert response.status == 400
    answer = await response.json()
    assert answer == {
        "error": "too_large",
        "detail": "slice 5 is 3000 bytes, over this node's batch limit of 1000: download it with GET",
    }


async def test_a_node_that_streams_every_slice_refuses_every_batch_and_still_serves_gets(corpus):
    app = build_app(ServedDataset(name="corpus", slices=scan(corpus)), download_key=KEY, inline_limit=0)
    async with TestClient(TestServer(app)) as client:
        batch = await client.post(PATH, json=body((0, signed(0))))
        single = await client.get(f"{PATH}/0", params={"token": signed(0)})

        assert (batch.status, (await batch.json())["error"]) == (400, "too_large")
        assert (single.status, await single.read()) == (200, contents(corpus, 0))


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_the_batch_path_takes_only_post(client, method):
    response = await client.request(method, PATH)
    assert response.status == 405


@pytest.mark.parametrize(("value", "expected"), [("0", 0), ("65536", 65536), ("-1", None), ("1k", None)])
def test_the_inline_limit_on_the_command_line(value, expected, capsys):
    from data_node.__main__ import build_parser

    arguments = ["--server", "http://cp", "--dataset", "d", "--inline-limit", value]
    if expected is None:
        with pytest.raises(SystemExit) as refused:
            build_parser().parse_args(arguments)
        assert refused.value.code == 2
        assert "--inline-limit" in capsys.readouterr().err
    else:
        assert build_parser().parse_args(arguments).inline_limit == expected
