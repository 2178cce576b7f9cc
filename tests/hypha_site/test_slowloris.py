"""Slowloris (issue 12, finding 10): a client that opens connections and sends a request's headers slowly, or
half of them and then nothing, must not hold a connection of ``hypha-server`` for long. A real daphne process;
raw sockets. ``HYPHA_HTTP_HEADER_TIMEOUT`` is 2 s here; the windows asserted are generous (15 s), and
Twisted's own idle timeout (60 s) is longer than the whole test."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.hypha_site.server_process import free_port, running_server, server_environment

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 15.0


@pytest.fixture
def server(tmp_path: Path):
    """``hypha-server web`` (embedded) with a 2 s header deadline; yields its port."""
    port = free_port()
    environment = server_environment(
        tmp_path / "data",
        HYPHA_HTTP_HEADER_TIMEOUT="2",
    )
    with running_server(["--port", str(port)], port=port, environment=environment):
        yield port


def closed_within(connection: socket.socket, seconds: float, *, trickle: bytes | None) -> bytes | None:
    """What the server sent before closing ``connection``, or None if it was still open after ``seconds``.
    With ``trickle``, those bytes are sent every half second meanwhile (a header line at a time)."""
    connection.settimeout(0.5)
    received = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = connection.recv(4096)
        except TimeoutError:
            if trickle is not None:
                try:
                    connection.sendall(trickle)
                except OSError:
                    return received
            continue
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    return None


def test_a_half_sent_request_line_is_closed_within_the_window(server):
    with socket.create_connection(("127.0.0.1", server)) as connection:
        connection.sendall(b"GET /healthz HT")

        received = closed_within(connection, WINDOW, trickle=None)

    assert received is not None, "the connection was still open"
    assert received.startswith(b"HTTP/1.1 408 ")


def test_headers_trickled_a_line_at_a_time_are_cut_off_within_the_window(server):
    with socket.create_connection(("127.0.0.1", server)) as connection:
        connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")

        received = closed_within(connection, WINDOW, trickle=b"X-Slow: 1\r\n")

    assert received is not None, "the connection was still open"
    assert received.startswith(b"HTTP/1.1 408 ")


def test_a_prompt_client_is_served_and_may_keep_its_connection(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server}") as client:
        first = client.get("/healthz")
        time.sleep(0.5)
        second = client.get("/healthz")

    assert (first.status_code, second.status_code) == (200, 200)
    assert first.json() == {"status": "ok"}
