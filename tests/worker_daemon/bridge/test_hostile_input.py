"""Hostile bodies on the real bridge server (Unix socket): a 4xx with the reason, never a 500, nothing
forwarded to the backend (issue 12, finding 9). The fuzz test draws strings and depths from
:mod:`tests.hostile`."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hostile import hostile_strings, nested_json
from worker_daemon.bridge import serve_bridge
from worker_daemon.bridge.server import MAX_JSON_DEPTH

from .conftest import JOB_ID, RecordingBackend

BASE = "http://hypha"
ENDPOINTS = ["/resources/fetch", "/resources/send", "/resources/receive", "/status/send"]
PEER = "12D3KooWParamServerPeerIdxxxxxxxxxxxxxxxxxxxxxxx"


def _post(client: aiohttp.ClientSession, endpoint: str, body: str):
    return client.post(
        f"{BASE}{endpoint}",
        data=body.encode("utf-8", "surrogatepass"),
        headers={"Content-Type": "application/json"},
    )


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_a_50k_deep_body_is_a_400(client: aiohttp.ClientSession, backend: RecordingBackend, endpoint):
    async with _post(client, endpoint, nested_json(50_000)) as response:
        assert response.status == 400
        assert await response.text() == (
            f"Failed to parse the request body as JSON: nested more than {MAX_JSON_DEPTH} levels deep"
        )
    assert backend.calls == []


async def test_a_status_at_the_depth_limit_is_forwarded(
    client: aiohttp.ClientSession, backend: RecordingBackend
):
    # given: {"status": {..., "future": [{"k": [... "x" ...]}]}}: MAX_JSON_DEPTH deep in all
    value = json.loads(nested_json(MAX_JSON_DEPTH - 2, leaf="x"))
    progress = {"status": {"batch_size": 2, "round_time": 17.5, "future": value}}

    async with client.post(f"{BASE}/status/send", json=progress) as response:
        assert response.status == 200
    assert backend.calls == [("status", {"job_id": JOB_ID, "progress": progress})]


@pytest.mark.parametrize(
    ("escape", "message"),
    [
        ("\\u0000", "Null characters are not allowed."),
        ("\\ud800", "Surrogate characters are not allowed: U+D800."),
    ],
)
async def test_nul_and_lone_surrogates_are_a_422_naming_where(
    client: aiohttp.ClientSession, backend: RecordingBackend, escape, message
):
    bodies = {
        "/status/send": f'{{"metrics": {{"round": 1, "metrics": {{"lo{escape}ss": 0.5}}}}}}',
        "/resources/send": f'{{"resource": {{"type": "peers", "peers": ["{PEER}"], "strategy": {{"type": "All"}}}},'
        f' "path": "a{escape}b"}}',
        "/resources/fetch": f'{{"type": "uri", "value": "http://x/{escape}"}}',
    }
    where = {
        "/status/send": f"metrics.metrics.lo{escape}ss",
        "/resources/send": "path",
        "/resources/fetch": "value",
    }
    for endpoint, body in bodies.items():
        async with _post(client, endpoint, body) as response:
            assert response.status == 422, endpoint
            assert await response.text() == (
                f"Failed to deserialize the JSON body into the target type: {where[endpoint]}: {message}"
            )
    assert backend.calls == []


def _answers(requests: list[tuple[str, str]]) -> list[tuple[int, str]]:
    """Start a real bridge, send ``requests`` (endpoint, body), return (status, body) of each; close it."""

    async def exchange() -> list[tuple[int, str]]:
        with tempfile.TemporaryDirectory(prefix="hb-") as directory:
            work_dir = Path(directory)
            server = await serve_bridge(
                socket_path=work_dir / "bridge.sock",
                work_dir=work_dir,
                backend=RecordingBackend(),
                job_id=JOB_ID,
                keepalive_interval=0.05,
                status_timeout=1.0,
            )
            answers = []
            try:
                connector = aiohttp.UnixConnector(path=str(server.socket_path))
                timeout = aiohttp.ClientTimeout(total=5)
                async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                    for endpoint, body in requests:
                        async with _post(session, endpoint, body) as response:
                            # an accepted receive is an endless event stream: its status is the answer
                            text = "" if endpoint == "/resources/receive" else await response.text()
                            answers.append((response.status, text))
            finally:
                await server.close()
            return answers

    return asyncio.run(exchange())


@settings(
    max_examples=30,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(text=hostile_strings(), depth=st.sampled_from([0, 3, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 50_000]))
def test_hostile_bodies_never_get_a_server_error(text, depth):
    quoted = json.dumps(text)
    deep = nested_json(depth, leaf=text)
    peers = f'{{"type": "peers", "peers": [{quoted}], "strategy": {{"type": "All"}}}}'
    requests = [
        ("/status/send", deep),
        ("/status/send", f'{{"metrics": {{"round": 1, "metrics": {{{quoted}: {deep}}}}}}}'),
        ("/status/send", f'{{"status": {{"batch_size": 1, "round_time": 1.0, {quoted}: {deep}}}}}'),
        ("/resources/fetch", f'{{"type": "uri", "value": {quoted}}}'),
        ("/resources/fetch", f'{{"type": "huggingface", "repository": {quoted}, "filenames": [{quoted}]}}'),
        ("/resources/send", f'{{"resource": {peers}, "path": {quoted}}}'),
        ("/resources/receive", f'{{"resource": {peers}, "path": {quoted}}}'),
    ]
    for (endpoint, _), (status, body) in zip(requests, _answers(requests), strict=True):
        # a 5xx only as the bridge's own JSON error of a backend failure (the recording backend's file I/O)
        assert status < 500 or json.loads(body).keys() == {"error", "detail"}, (
            endpoint,
            status,
            body[:300],
            ascii(text)[:100],
        )
