"""A client of the job bridge (hypha-protocols.md §1.3): HTTP/1.1 over the job's Unix socket.

It speaks only the documented endpoints, so it works against any Hypha-compatible bridge (ours in
:mod:`worker_daemon.bridge`, or Hypha's own). Every call raises :class:`BridgeCallError` on a transport error,
a non-2xx reply (with the reply's body in the message) or a reply that is not the documented JSON.

Timeouts: a fetch may legitimately take long (a model of many GB, a slice that is not assigned yet), so it
has none by default; a status call gets 60 s (the bridge itself gives up on its peer well before); the receive
stream waits indefinitely between events, because a round can take as long as the slowest trainer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from worker_daemon.executors.exceptions import BridgeCallError

logger = logging.getLogger(__name__)

BASE_URL = "http://hypha"
"""The host is ignored by the bridge; Hypha's client uses ``hypha`` too."""

STATUS_TIMEOUT = 60.0
SEND_TIMEOUT = 60.0
CONNECT_TIMEOUT = 30.0


@dataclass(frozen=True)
class FetchedFile:
    """One file a fetch wrote: ``path`` relative to the work dir (e.g. ``artifacts/17``)."""

    path: str
    size: int


@dataclass(frozen=True)
class ReceivedFile:
    """One file the receive stream announced: ``path`` relative to the work dir, and its sender."""

    path: str
    size: int | None
    from_peer: str | None
    #: The round of a parameter server's result (our bridge's ``round`` key; None from Hypha's bridge).
    round: int | None = None


def _raise_for_status(endpoint: str, response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body = response.read().decode("utf-8", "replace").strip()
    except httpx.HTTPError:
        body = "<unreadable body>"
    raise BridgeCallError(
        endpoint, f"HTTP {response.status_code}: {body or '<empty body>'}", status_code=response.status_code
    )


def _json_reply(endpoint: str, response: httpx.Response) -> Any:
    _raise_for_status(endpoint, response)
    try:
        return response.json()
    except ValueError as error:
        raise BridgeCallError(endpoint, f"the reply is not JSON: {response.text[:200]!r}") from error


def parse_event_data(payload: str) -> ReceivedFile | None:
    """The file an SSE ``data:`` payload announces, or ``None`` when it names none.

    Accepts what Hypha's client accepts: ``{"path", "size", "from_peer"}``, a JSON list of such pointers
    (the last one counts), or ``{"parameters": {"path": ...}}``.
    """
    try:
        value = json.loads(payload)
    except ValueError as error:
        raise BridgeCallError("/resources/receive", f"an event is not JSON: {payload[:200]!r}") from error
    if isinstance(value, list):
        if not value:
            return None
        value = value[-1]
    if isinstance(value, dict) and isinstance(value.get("parameters"), dict):
        value = value["parameters"]
    if not isinstance(value, dict) or not isinstance(value.get("path"), str):
        raise BridgeCallError("/resources/receive", f"an event names no file: {payload[:200]!r}")
    size = value.get("size")
    from_peer = value.get("from_peer")
    round_number = value.get("round")
    return ReceivedFile(
        path=value["path"],
        size=size if isinstance(size, int) and not isinstance(size, bool) else None,
        from_peer=from_peer if isinstance(from_peer, str) else None,
        round=round_number if isinstance(round_number, int) and not isinstance(round_number, bool) else None,
    )


class ReceiveStream:
    """An open ``/resources/receive`` event stream; :meth:`next_file` blocks until the next file arrives.

    One stream is meant to stay open for the whole job: files that arrive while nobody is reading wait in
    the socket and are returned by the next :meth:`next_file`.
    """

    def __init__(self, stream: Any, response: httpx.Response) -> None:
        self._stream = stream
        self._response = response
        self._lines: Iterator[str] = response.iter_lines()

    def next_file(self) -> ReceivedFile:
        """The next announced file. Comments (``: keepalive``) and other SSE fields are skipped.

        Raises :class:`BridgeCallError` when the stream ends or breaks: a bridge ends it only when it cannot
        receive any more, so waiting longer would hang the job.
        """
        try:
            for line in self._lines:
                if not line.startswith("data:"):
                    continue  # comments, blank separators, event:/id: fields
                received = parse_event_data(line[len("data:") :].strip())
                if received is not None:
                    return received
        except httpx.HTTPError as error:
            raise BridgeCallError("/resources/receive", f"the event stream broke: {error}") from error
        raise BridgeCallError("/resources/receive", "the event stream ended before a file arrived")

    def close(self) -> None:
        self._stream.__exit__(None, None, None)

    def __enter__(self) -> ReceiveStream:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


class BridgeClient:
    """The bridge of one job, reached through ``socket_path``. Not thread-safe; close it when done."""

    def __init__(
        self,
        socket_path: str | Path,
        *,
        status_timeout: float = STATUS_TIMEOUT,
        fetch_timeout: float | None = None,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.status_timeout = status_timeout
        self.fetch_timeout = fetch_timeout
        self._client = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.socket_path)),
            base_url=BASE_URL,
            timeout=httpx.Timeout(SEND_TIMEOUT, connect=CONNECT_TIMEOUT),
        )

    def _post(self, endpoint: str, body: Any, *, timeout: httpx.Timeout) -> httpx.Response:
        try:
            return self._client.post(endpoint, json=body, timeout=timeout)
        except httpx.HTTPError as error:
            raise BridgeCallError(endpoint, f"{type(error).__name__}: {error}") from error

    def fetch(self, reference: dict[str, Any]) -> list[FetchedFile]:
        """``POST /resources/fetch`` with the bare reference; the files written, paths relative to the work dir."""
        timeout = httpx.Timeout(self.fetch_timeout, connect=CONNECT_TIMEOUT)
        reply = _json_reply("/resources/fetch", self._post("/resources/fetch", reference, timeout=timeout))
        if not isinstance(reply, list) or not all(
            isinstance(item, dict) and isinstance(item.get("path"), str) for item in reply
        ):
            raise BridgeCallError("/resources/fetch", f"expected a list of {{path, size}}, got {reply!r}")
        return [FetchedFile(path=item["path"], size=int(item.get("size") or 0)) for item in reply]

    def send(self, reference: dict[str, Any], path: str) -> None:
        """``POST /resources/send``: the bridge copies ``path`` (relative to the work dir) to the peers in the
        background, so the file must stay in place until the peers can have read it."""
        timeout = httpx.Timeout(SEND_TIMEOUT, connect=CONNECT_TIMEOUT)
        response = self._post("/resources/send", {"resource": reference, "path": path}, timeout=timeout)
        _raise_for_status("/resources/send", response)

    def status(self, progress: dict[str, Any] | str) -> dict[str, Any]:
        """``POST /status/send`` with a Progress value; the scheduler's tagged reply (``{"type": ...}``)."""
        timeout = httpx.Timeout(self.status_timeout, connect=CONNECT_TIMEOUT)
        reply = _json_reply("/status/send", self._post("/status/send", progress, timeout=timeout))
        if not isinstance(reply, dict) or not isinstance(reply.get("type"), str):
            raise BridgeCallError("/status/send", f"expected a tagged reply, got {reply!r}")
        return reply

    def receive(self, reference: dict[str, Any], path: str = "incoming") -> ReceiveStream:
        """Open ``POST /resources/receive``; returns once the bridge sent the stream's headers."""
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT)
        stream = self._client.stream(
            "POST", "/resources/receive", json={"resource": reference, "path": path}, timeout=timeout
        )
        try:
            response = stream.__enter__()
        except httpx.HTTPError as error:
            raise BridgeCallError("/resources/receive", f"{type(error).__name__}: {error}") from error
        try:
            _raise_for_status("/resources/receive", response)
        except BaseException:
            stream.__exit__(None, None, None)
            raise
        return ReceiveStream(stream, response)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> BridgeClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
