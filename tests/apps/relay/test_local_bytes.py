"""The local store's byte URLs over real HTTP (pytest-django's live server): parts PUT whole or not at all,
signatures and expiry, and ranged GETs. Refusals leave no part file behind."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from apps.relay.models import RelayObject
from apps.relay.stores import LocalStore, get_store
from tests.apps.relay.conftest import LOCAL_PART_SIZE
from tests.apps.relay.world import digest, make_world, relay_files

#: Three parts: 64 KiB, 64 KiB, 10 KiB.
DATA = bytes(reversed(range(256))) * 552


@pytest.fixture
def live_world(transactional_db):
    return make_world()


def api(live_server, world, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=f"{live_server.url}/api/relay/jobs/{world.job.pk}/",
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )


def begin(live_server, world, key="results/1", data=DATA) -> dict:
    with api(live_server, world, world.server.token) as client:
        answer = client.post("uploads/", json={"key": key, "size": len(data), "sha256": digest(data)})
    assert answer.status_code == 200, answer.text
    return answer.json()


def part_files(settings) -> list[str]:
    return [name.rsplit("/", 1)[1] for name in relay_files(settings.HYPHA_DATA_DIR)]


def raw_put(url: str, headers: dict[str, str], body: bytes) -> str:
    """PUT ``body`` with exactly these headers over a plain socket, then close our side; the status line (or
    "" when the server closed without answering)."""
    parts = urlsplit(url)
    lines = [f"PUT {parts.path}?{parts.query} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as connection:
        connection.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        connection.shutdown(socket.SHUT_WR)
        answer = b""
        try:
            while chunk := connection.recv(65536):
                answer += chunk
        except OSError:
            pass
    return answer.split(b"\r\n", 1)[0].decode()


def test_parts_put_over_http_make_an_object_read_back_with_ranges(live_server, live_world, settings):
    plan = begin(live_server, live_world)
    assert plan["parts"][0]["url"].startswith(f"{live_server.url}/relay/{live_world.job.pk}/")
    for part in plan["parts"]:
        body = DATA[part["offset"] : part["offset"] + part["size"]]
        answer = httpx.put(part["url"], content=body, timeout=10)
        assert (answer.status_code, answer.json()) == (200, {"number": part["number"], "size": part["size"]})
    with api(live_server, live_world, live_world.server.token) as client:
        url = client.post("uploads/complete/", json={"key": "results/1"}).json()["url"]

    whole = httpx.get(url, timeout=10)
    ranged = httpx.get(url, headers={"Range": "bytes=65000-70000"}, timeout=10)
    tail = httpx.get(url, headers={"Range": "bytes=-100"}, timeout=10)
    rest = httpx.get(url, headers={"Range": "bytes=141000-"}, timeout=10)
    past = httpx.get(url, headers={"Range": "bytes=141312-"}, timeout=10)
    head = httpx.head(url, timeout=10)

    assert (whole.status_code, whole.content, whole.headers["Accept-Ranges"]) == (200, DATA, "bytes")
    assert (ranged.status_code, ranged.content) == (206, DATA[65000:70001])
    assert ranged.headers["Content-Range"] == "bytes 65000-70000/141312"
    assert (tail.status_code, tail.content) == (206, DATA[-100:])
    assert (rest.status_code, rest.content) == (206, DATA[141000:])
    assert (past.status_code, past.headers["Content-Range"]) == (416, "bytes */141312")
    assert (head.status_code, head.headers["Content-Length"], head.content) == (200, "141312", b"")


def test_a_part_cut_off_mid_body_is_not_kept(live_server, live_world, settings):
    plan = begin(live_server, live_world)
    part = plan["parts"][0]

    # when: the connection ends after half of the declared body
    raw_put(part["url"], {"Content-Length": str(LOCAL_PART_SIZE)}, DATA[: LOCAL_PART_SIZE // 2])

    # then (once the server has read to the end): nothing of the part is kept, and it is not done
    deadline = time.monotonic() + 30  # generous: a busy machine may be slow to get there
    while relay_files(settings.HYPHA_DATA_DIR) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert relay_files(settings.HYPHA_DATA_DIR) == []
    assert [p["done"] for p in begin(live_server, live_world)["parts"]] == [False, False, False]


@pytest.mark.parametrize(
    ("headers", "body", "status"),
    [
        ({"Content-Length": str(LOCAL_PART_SIZE + 1)}, DATA[: LOCAL_PART_SIZE + 1], "413"),
        ({"Content-Length": str(LOCAL_PART_SIZE - 1)}, DATA[: LOCAL_PART_SIZE - 1], "400"),
        ({"Transfer-Encoding": "chunked"}, b"0\r\n\r\n", "411"),
    ],
)
def test_a_part_of_the_wrong_length_is_refused_and_not_kept(
    live_server, live_world, settings, headers, body, status
):
    part = begin(live_server, live_world)["parts"][0]

    line = raw_put(part["url"], headers, body)

    assert line.split(" ")[1] == status
    assert relay_files(settings.HYPHA_DATA_DIR) == []


def test_a_forged_or_expired_url_is_a_403_and_stores_nothing(live_server, live_world, settings):
    part = begin(live_server, live_world)["parts"][0]
    store = get_store()
    assert isinstance(store, LocalStore)
    path = urlsplit(part["url"]).path
    expired = int(time.time()) - 1
    forged = part["url"].replace("signature=", "signature=A")
    unsigned = part["url"].split("?")[0]
    too_late = f"{live_server.url}{path}?expires={expired}&signature={store.sign('PUT', path, expired)}"
    other_method = f"{live_server.url}{path}?{urlsplit(part['url']).query}"

    answers = [
        httpx.put(url, content=DATA[:LOCAL_PART_SIZE], timeout=10) for url in (forged, unsigned, too_late)
    ]
    as_get = httpx.get(other_method.replace(f"/{part['number']}?", "?"), timeout=10)

    assert [(a.status_code, a.json()["detail"]) for a in answers] == [
        (403, "this relay URL's signature does not match"),
        (403, "this relay URL is not signed (expires and signature are required)"),
        (403, "this relay URL has expired; ask the control plane for a new one"),
    ]
    assert as_get.status_code == 403  # a PUT URL's signature is no GET URL's
    assert relay_files(settings.HYPHA_DATA_DIR) == []


def test_a_deleted_object_and_an_unknown_part_are_404(live_server, live_world, settings):
    plan = begin(live_server, live_world, data=b"tiny")
    part = plan["parts"][0]
    assert httpx.put(part["url"], content=b"tiny", timeout=10).status_code == 200
    with api(live_server, live_world, live_world.server.token) as client:
        url = client.post("uploads/complete/", json={"key": "results/1"}).json()["url"]
        assert client.delete("objects/", params={"key": "results/1"}).status_code == 204

    gone = httpx.get(url, timeout=10)
    late_part = httpx.put(part["url"], content=b"tiny", timeout=10)

    assert (gone.status_code, gone.json()) == (404, {"detail": "no such object (deleted?)"})
    assert late_part.status_code == 404
    assert not RelayObject.objects.exists()
    assert relay_files(settings.HYPHA_DATA_DIR) == []
