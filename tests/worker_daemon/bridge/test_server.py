from __future__ import annotations

import asyncio
import logging
import os
import stat
from pathlib import Path

import aiohttp
import pytest

from worker_daemon.bridge import serve_bridge
from worker_daemon.bridge.exceptions import ConnectorError, NetworkError

from .conftest import JOB_ID, KEEPALIVE, RecordingBackend

BASE = "http://hypha"
PS = "12D3KooWParamServerPeerIdxxxxxxxxxxxxxxxxxxxxxxx"
SCHEDULER = "12D3KooWSchedulerPeerIdxxxxxxxxxxxxxxxxxxxxxxxxxx"
# The references of §2.2's LeNet/MNIST job.
LENET = {
    "type": "huggingface",
    "repository": "hypha-space/lenet",
    "revision": None,
    "filenames": ["config.json", "model.safetensors", "configuration_lenet.py", "modeling_lenet.py"],
    "token": None,
}
DATA = {"type": "scheduler", "peer": SCHEDULER, "dataset": "mnist"}
UPDATES = {"type": "peers", "peers": [PS], "strategy": {"type": "All"}, "resource": None}


async def next_data_frame(stream: aiohttp.StreamReader) -> bytes:
    """The next SSE frame (lines up to and including the blank line) that is not a keep-alive comment."""
    while True:
        frame = b""
        while (line := await asyncio.wait_for(stream.readline(), 2)) != b"\n":
            frame += line
        if frame != b": keepalive\n":
            return frame + b"\n"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- lifecycle ---------------------------------------------------------------------------------------------------


async def test_socket_is_0600_and_close_removes_it(socket_path: Path, work_dir: Path) -> None:
    # when
    server = await serve_bridge(socket_path=socket_path, work_dir=work_dir, backend=RecordingBackend())
    # then
    assert stat.S_ISSOCK(socket_path.stat().st_mode)
    assert mode(socket_path) == 0o600
    await server.close()
    assert not socket_path.exists()
    await server.close()  # idempotent


async def test_openapi_document(client: aiohttp.ClientSession) -> None:
    async with client.get(f"{BASE}/openapi.json") as response:
        assert response.status == 200
        document = await response.json()
    assert document["openapi"] == "3.1.0"
    assert "/openapi.json" in document["paths"]


# --- fetch -------------------------------------------------------------------------------------------------------


async def test_fetch_huggingface_writes_0600_files_and_lists_them(
    client: aiohttp.ClientSession, backend: RecordingBackend, work_dir: Path
) -> None:
    # given
    reference = LENET | {"filenames": ["config.json", "nested/model.safetensors"]}
    # when
    async with client.post(f"{BASE}/resources/fetch", json=reference) as response:
        status, body = response.status, await response.text()
    # then
    assert status == 200
    assert body == (
        '[{"path":"artifacts/config.json","size":22},{"path":"artifacts/nested/model.safetensors","size":35}]'
    )
    assert (
        work_dir / "artifacts/nested/model.safetensors"
    ).read_bytes() == b"content of nested/model.safetensors"
    assert mode(work_dir / "artifacts/config.json") == 0o600
    assert mode(work_dir / "artifacts/nested/model.safetensors") == 0o600
    ((name, arguments),) = backend.calls
    assert name == "fetch"
    assert arguments["reference"].model_dump(mode="json") == reference
    assert arguments["artifacts_dir"] == work_dir.resolve() / "artifacts"


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        (DATA, [{"path": "artifacts/17", "size": 13}]),
        (
            {"type": "uri", "value": "https://example.org/files/weights.bin"},
            [{"path": "artifacts/weights.bin", "size": 22}],
        ),
        (
            {"type": "uri", "value": "http://example.org/a.txt", "unknown": True},
            [{"path": "artifacts/a.txt", "size": 16}],
        ),
    ],
)
async def test_fetch_scheduler_and_uri(
    client: aiohttp.ClientSession, reference: dict, expected: list
) -> None:
    async with client.post(f"{BASE}/resources/fetch", json=reference) as response:
        assert response.status == 200
        assert await response.json() == expected


@pytest.mark.parametrize(
    ("reference", "detail"),
    [
        (UPDATES, "unsupported strategy"),
        ({"type": "uri", "value": "file:///etc/passwd"}, "unsupported uri scheme: 'file:///etc/passwd'"),
        (LENET | {"repository": "  "}, "huggingface repository must not be blank"),
        (LENET | {"filenames": []}, "huggingface filenames must not be empty"),
    ],
)
async def test_fetch_refuses_unsupported_references(
    client: aiohttp.ClientSession, backend: RecordingBackend, work_dir: Path, reference: dict, detail: str
) -> None:
    async with client.post(f"{BASE}/resources/fetch", json=reference) as response:
        assert response.status == 400
        assert await response.json() == {"error": "invalid_request", "detail": detail}
    assert backend.calls == []
    assert not (work_dir / "artifacts").exists()


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (NetworkError("scheduler unreachable"), "network_error"),
        (ConnectorError("data node refused"), "connector_error"),
        (OSError(28, "No space left on device"), "io_error"),
    ],
)
async def test_fetch_backend_failure_is_a_500_of_its_kind(
    client: aiohttp.ClientSession, backend: RecordingBackend, error: Exception, kind: str
) -> None:
    backend.fail_with = error
    async with client.post(f"{BASE}/resources/fetch", json=DATA) as response:
        assert response.status == 500
        assert await response.json() == {"error": kind, "detail": str(error)}


async def test_fetch_of_a_file_the_backend_put_outside_is_a_connector_error(
    client: aiohttp.ClientSession, backend: RecordingBackend
) -> None:
    async with client.post(f"{BASE}/resources/fetch", json=LENET | {"filenames": ["../escape"]}) as response:
        assert response.status == 500
        assert (await response.json())["error"] == "connector_error"


async def test_fetch_into_an_artifacts_dir_linked_out_is_refused(
    client: aiohttp.ClientSession, backend: RecordingBackend, work_dir: Path, tmp_path: Path
) -> None:
    # given: the executor plants artifacts -> a directory outside
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", work_dir / "artifacts")
    # when
    async with client.post(f"{BASE}/resources/fetch", json=DATA) as response:
        status, body = response.status, await response.json()
    # then
    assert (status, body) == (
        400,
        {"error": "invalid_request", "detail": "path leaves the work dir: 'artifacts'"},
    )
    assert backend.calls == []
    assert list((tmp_path / "outside").iterdir()) == []


async def test_fetch_of_a_file_the_executor_linked_out_is_not_reported(
    client: aiohttp.ClientSession, backend: RecordingBackend, work_dir: Path, tmp_path: Path
) -> None:
    # given: artifacts/17 is a link to a file outside (the recording backend writes through it, as a
    # careless backend would)
    (tmp_path / "secret").write_bytes(b"keep")
    (tmp_path / "secret").chmod(0o644)
    (work_dir / "artifacts").mkdir()
    os.symlink(tmp_path / "secret", work_dir / "artifacts" / "17")
    # when
    async with client.post(f"{BASE}/resources/fetch", json=DATA) as response:
        status, body = response.status, await response.json()
    # then: not reported, and the mode of the file outside is untouched
    assert status == 500
    assert body["error"] == "connector_error"
    assert "leaves the work dir" in body["detail"]
    assert mode(tmp_path / "secret") == 0o644


# --- bodies that do not deserialise ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint", ["/resources/fetch", "/resources/send", "/resources/receive", "/status/send"]
)
async def test_undeserialisable_bodies_get_plain_text_4xx(
    client: aiohttp.ClientSession, backend: RecordingBackend, endpoint: str
) -> None:
    cases = [
        ({"data": b"{not json", "headers": {"Content-Type": "application/json"}}, 400),
        ({"json": {"type": "peers", "strategy": "All"}}, 422),
        ({"json": [1, 2]}, 422),
        ({"data": b"{}", "headers": {"Content-Type": "text/plain"}}, 415),
        ({"data": b"{}"}, 415),
    ]
    for options, expected in cases:
        async with client.post(f"{BASE}{endpoint}", **options) as response:
            assert (response.status, response.content_type) == (expected, "text/plain"), options
            assert await response.text() != ""
    assert backend.calls == []


# --- send --------------------------------------------------------------------------------------------------------


async def test_send_answers_an_empty_200_before_the_backend_finishes(
    client: aiohttp.ClientSession, backend: RecordingBackend, work_dir: Path
) -> None:
    # given
    (work_dir / "delta.safetensors").write_bytes(b"gradient")
    # when
    async with client.post(
        f"{BASE}/resources/send", json={"resource": UPDATES, "path": "delta.safetensors"}
    ) as response:
        status, body = response.status, await response.read()
    # then
    assert (status, body) == (200, b"")
    assert not backend.send_finished.is_set()
    ((name, arguments),) = backend.calls
    assert name == "send"
    assert arguments["path"] == work_dir.resolve() / "delta.safetensors"
    assert arguments["reference"].model_dump(mode="json") == UPDATES
    backend.release_send.set()
    await asyncio.wait_for(backend.send_finished.wait(), 2)


async def test_send_failure_in_the_background_is_only_logged(
    client: aiohttp.ClientSession, backend: RecordingBackend, work_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # given: a backend that fails once the executor has its answer
    backend.send_error = ConnectorError("peer gone")
    backend.release_send.set()
    with caplog.at_level(logging.ERROR, logger="worker_daemon.bridge.server"):
        # when
        async with client.post(
            f"{BASE}/resources/send", json={"resource": UPDATES, "path": "missing"}
        ) as response:
            assert (response.status, await response.read()) == (200, b"")
        for _ in range(200):
            if caplog.records:
                break
            await asyncio.sleep(0.01)
    # then
    assert [record.getMessage() for record in caplog.records] == [
        f"sending {work_dir.resolve() / 'missing'} to ['{PS}'] failed"
    ]


@pytest.mark.parametrize("path", ["/etc/passwd", "../delta", "a/../../delta", "escape/delta"])
async def test_send_refuses_paths_outside_the_work_dir(
    client: aiohttp.ClientSession, backend: RecordingBackend, work_dir: Path, tmp_path: Path, path: str
) -> None:
    # given: a symlink out of the work dir
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", work_dir / "escape")
    # when
    async with client.post(f"{BASE}/resources/send", json={"resource": UPDATES, "path": path}) as response:
        status, body = response.status, await response.json()
    # then
    assert status == 400
    assert body["error"] == "invalid_request"
    assert backend.calls == []


@pytest.mark.parametrize(
    ("links", "path"),
    [
        ({"out": "/etc"}, "out/passwd"),  # a directory link out of the work dir
        ({"delta.safetensors": "{outside}/secret"}, "delta.safetensors"),  # a file link out
        ({"c": "{outside}", "b": "c", "a": "b"}, "a/secret"),  # a chain of links, each inside
        ({"loop-a": "loop-b", "loop-b": "loop-a"}, "loop-a/x"),  # a loop
    ],
)
async def test_send_refuses_symlinks_leaving_the_work_dir(
    client: aiohttp.ClientSession,
    backend: RecordingBackend,
    work_dir: Path,
    tmp_path: Path,
    links: dict,
    path: str,
) -> None:
    # given
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_bytes(b"not yours")
    for name, target in reversed(links.items()):
        os.symlink(target.format(outside=tmp_path / "outside"), work_dir / name)
    # when
    async with client.post(f"{BASE}/resources/send", json={"resource": UPDATES, "path": path}) as response:
        status, body = response.status, await response.json()
    # then
    assert (status, body["error"]) == (400, "invalid_request")
    assert backend.calls == []


async def test_send_through_a_symlink_to_a_directory_inside_is_fine(
    client: aiohttp.ClientSession, backend: RecordingBackend, work_dir: Path
) -> None:
    # given: out -> updates, inside the work dir
    (work_dir / "updates").mkdir()
    (work_dir / "updates" / "delta.safetensors").write_bytes(b"gradient")
    os.symlink("updates", work_dir / "out")
    # when
    async with client.post(
        f"{BASE}/resources/send", json={"resource": UPDATES, "path": "out/delta.safetensors"}
    ) as response:
        assert (response.status, await response.read()) == (200, b"")
    # then: the backend gets the resolved path
    ((name, arguments),) = backend.calls
    assert (name, arguments["path"]) == ("send", work_dir.resolve() / "updates" / "delta.safetensors")
    backend.release_send.set()
    await asyncio.wait_for(backend.send_finished.wait(), 2)


# --- receive (SSE) -----------------------------------------------------------------------------------------------


async def test_receive_streams_one_event_per_file_and_keepalives(
    client: aiohttp.ClientSession, backend: RecordingBackend, work_dir: Path
) -> None:
    # when: the headers arrive before any file does
    response = await client.post(f"{BASE}/resources/receive", json={"resource": UPDATES})
    try:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream"
        # then: a keep-alive comment while idle
        assert await asyncio.wait_for(response.content.readline(), KEEPALIVE * 5) == b": keepalive\n"
        assert await response.content.readline() == b"\n"
        # and one event per delivered file
        await backend.incoming.put((PS, b"weights-1", PS))
        await backend.incoming.put(("other.bin", b"w2", "12D3KooWOther"))
        frames = [await next_data_frame(response.content), await next_data_frame(response.content)]
    finally:
        response.close()
    assert frames == [
        f'data: {{"path":"incoming/{PS}","size":9,"from_peer":"{PS}"}}\n\n'.encode(),
        b'data: {"path":"incoming/other.bin","size":2,"from_peer":"12D3KooWOther"}\n\n',
    ]
    assert (work_dir / "incoming" / PS).read_bytes() == b"weights-1"
    assert mode(work_dir / "incoming" / PS) == 0o600
    assert backend.calls[0][1]["directory"] == work_dir.resolve() / "incoming"
    # and the backend's receive is cancelled once the executor is gone
    await asyncio.wait_for(backend.receive_cancelled.wait(), KEEPALIVE * 10)


async def test_receive_into_a_chosen_dir_ends_when_the_server_closes(
    bridge, client: aiohttp.ClientSession, backend: RecordingBackend, work_dir: Path
) -> None:
    response = await client.post(
        f"{BASE}/resources/receive", json={"resource": UPDATES, "path": "results/r1"}
    )
    assert response.status == 200
    assert (work_dir / "results/r1").is_dir()
    # when
    await bridge.close()
    # then: the stream ends cleanly
    remainder = await asyncio.wait_for(response.content.read(), 3)
    assert set(remainder.split(b"\n")) <= {b": keepalive", b""}
    response.close()


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"resource": UPDATES | {"strategy": {"type": "One"}}}, 422),
        ({"resource": DATA}, 422),
        ({"resource": UPDATES, "path": "/tmp"}, 400),
        ({"resource": UPDATES, "path": "../x"}, 400),
    ],
)
async def test_receive_refusals(
    client: aiohttp.ClientSession, backend: RecordingBackend, body: dict, status: int
) -> None:
    async with client.post(f"{BASE}/resources/receive", json=body) as response:
        assert response.status == status
        if status == 400:
            assert (await response.json())["error"] == "invalid_request"
    assert backend.calls == []


@pytest.mark.parametrize("path", [None, "out", "out/", "out/sub"])
async def test_receive_into_a_dir_linked_out_is_refused_and_creates_nothing(
    client: aiohttp.ClientSession, backend: RecordingBackend, work_dir: Path, tmp_path: Path, path: str | None
) -> None:
    # given: out -> outside and incoming -> outside (the default receive dir)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", work_dir / "out")
    os.symlink(tmp_path / "outside", work_dir / "incoming")
    body = {"resource": UPDATES} if path is None else {"resource": UPDATES, "path": path}
    # when
    async with client.post(f"{BASE}/resources/receive", json=body) as response:
        status, answer = response.status, await response.json()
    # then
    assert (status, answer["error"]) == (400, "invalid_request")
    assert "leaves the work dir" in answer["detail"]
    assert backend.calls == []
    assert list((tmp_path / "outside").iterdir()) == []


async def test_receive_through_a_symlink_to_a_directory_inside_is_fine(
    client: aiohttp.ClientSession, backend: RecordingBackend, work_dir: Path
) -> None:
    # given: out -> results, inside the work dir
    (work_dir / "results").mkdir()
    os.symlink("results", work_dir / "out")
    # when
    response = await client.post(f"{BASE}/resources/receive", json={"resource": UPDATES, "path": "out/r1"})
    try:
        assert response.status == 200
        await backend.incoming.put(("weights", b"w", PS))
        frame = await next_data_frame(response.content)
    finally:
        response.close()
    # then: created and reported at its real place
    assert frame == f'data: {{"path":"results/r1/weights","size":1,"from_peer":"{PS}"}}\n\n'.encode()
    assert backend.calls[0][1]["directory"] == work_dir.resolve() / "results" / "r1"


# --- status ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("progress", "reply"),
    [
        (
            {"status": {"batch_size": 2, "round_time": 17.5, "future": [1]}},
            {"type": "ScheduleUpdate", "counter": 3},
        ),
        ({"metrics": {"round": 1, "metrics": {"loss": 0.25}}}, {"type": "Ok"}),
        ("update", {"type": "Ok"}),
        ("update-received", {"type": "Done"}),
        ({"update": None}, {"type": "Continue"}),
        ("updated", {"type": "Error"}),
    ],
)
async def test_status_is_forwarded_verbatim_and_the_reply_returned(
    client: aiohttp.ClientSession, backend: RecordingBackend, progress: object, reply: dict
) -> None:
    backend.status_replies.append(reply)
    async with client.post(f"{BASE}/status/send", json=progress) as response:
        assert response.status == 200
        assert await response.json() == reply
    assert backend.calls == [("status", {"job_id": JOB_ID, "progress": progress})]


async def test_status_failures(client: aiohttp.ClientSession, backend: RecordingBackend) -> None:
    # backend error
    backend.fail_with = NetworkError("request timed out")
    async with client.post(f"{BASE}/status/send", json="update") as response:
        assert (response.status, await response.json()) == (
            500,
            {"error": "network_error", "detail": "request timed out"},
        )
    # backend too slow (status_timeout is 1 s in the fixture)
    backend.fail_with = None
    backend.status_delay = 1.5
    async with client.post(f"{BASE}/status/send", json="update") as response:
        assert (response.status, await response.json()) == (
            500,
            {"error": "network_error", "detail": "no reply to the status within 1.0 s"},
        )
    # an empty reply is never passed on as an empty body
    backend.status_delay = 0
    backend.status_replies.append(None)
    async with client.post(f"{BASE}/status/send", json="update") as response:
        assert response.status == 500
        assert (await response.json())["error"] == "connector_error"
