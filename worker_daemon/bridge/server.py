"""The bridge's HTTP/1.1 server on a Unix socket (aiohttp), compatible with executors written for Hypha.

Endpoints (§1.3 of the protocol reference)::

    GET  /openapi.json         a minimal OpenAPI document
    POST /resources/fetch      body: a bare Reference (uri | huggingface | scheduler | parameter-server;
                               a uri may be a path on the control plane: :func:`is_control_plane_path`)
                               → [{"path": "artifacts/<name>", "size": n}, ...]
    POST /resources/send       body: {"resource": <peers>, "path": "<file>"}
                               → 200 with an empty body at once; the transfer runs in the background
    POST /resources/receive    body: {"resource": <peers, strategy All>, "path": "incoming"?}
                               → text/event-stream: ``data: {"path":…,"size":…,"from_peer":…}`` per file
                                 (plus ``"round": r`` for a round's result from our parameter server),
                                 ``: keepalive`` every ``keepalive_interval`` seconds
    POST /status/send          body: a Progress value → the backend's reply as JSON, never empty

Handler errors are ``{"error": kind, "detail": message}`` (see :mod:`.exceptions`); bodies that do not
deserialise get a plain-text 400 (syntax, or nested deeper than :data:`MAX_JSON_DEPTH`), 422 (shape, or a
string holding NUL or a lone surrogate, which no path, peer or the control plane's database can take) or 415
(content type), never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from worker_daemon import bounded_json, telemetry
from worker_daemon.bridge.backend import BridgeBackend
from worker_daemon.bridge.exceptions import (
    BridgeError,
    BridgeIOError,
    ConnectorError,
    InvalidRequest,
    NetworkError,
)
from worker_daemon.bridge.paths import make_directory, relative_posix, resolve_in, restrict_file
from worker_daemon.bridge.references import (
    HuggingFaceReference,
    ParameterServerReference,
    PeersReference,
    ReceiveRequest,
    SendRequest,
    UriReference,
    parse_progress,
    reference_adapter,
)

logger = logging.getLogger(__name__)

Model = TypeVar("Model", bound=BaseModel)

SOCKET_MODE = 0o600
#: How deep a request body may nest: Hypha's bodies nest 3 or 4 levels; json.loads recurses per level, and a
#: 50,000-deep body was a RecursionError (a 500).
MAX_JSON_DEPTH = 64
ARTIFACTS_DIR = "artifacts"
OPENAPI_DOCUMENT: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "Hypha job bridge", "version": "0.1.0"},
    "paths": {
        "/openapi.json": {"get": {"summary": "This document"}},
        "/resources/fetch": {"post": {"summary": "Fetch a resource into artifacts/"}},
        "/resources/send": {"post": {"summary": "Send a file to peers in the background"}},
        "/resources/receive": {"post": {"summary": "Server-sent events, one per received file"}},
        "/status/send": {"post": {"summary": "Report progress; returns the scheduler's reply"}},
    },
}


def is_control_plane_path(value: str) -> bool:
    """Our extension: a ``uri`` that is a path (``/api/uploads/<id>/content/``, an inference job's uploaded
    model) names a file on the control plane, which the backend fetches with the task's transfer token."""
    return value.startswith("/") and not value.startswith("//")


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _json_response(value: Any) -> web.Response:
    return web.json_response(value, dumps=_compact)


def _error_response(error: BridgeError) -> web.Response:
    return web.json_response({"error": error.kind, "detail": str(error)}, status=error.status, dumps=_compact)


async def _read_json(request: web.Request) -> Any:
    """The request body as JSON, or the plain-text 415/400 axum's ``Json`` extractor gives."""
    mime = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if not (mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))):
        raise web.HTTPUnsupportedMediaType(text="Expected request with `Content-Type: application/json`")
    body = await request.read()
    try:
        value = bounded_json.loads(body, max_depth=MAX_JSON_DEPTH)
    except ValueError as error:  # TooDeep, JSONDecodeError and UnicodeDecodeError
        raise web.HTTPBadRequest(text=f"Failed to parse the request body as JSON: {error}") from None
    for path, message in bounded_json.hostile_strings(value):
        location = ".".join(bounded_json.escape_hostile(str(part)) for part in path) or "body"
        raise web.HTTPUnprocessableEntity(
            text=f"Failed to deserialize the JSON body into the target type: {location}: {message}"
        )
    return value


def _shape_error(error: ValidationError | ValueError) -> web.HTTPUnprocessableEntity:
    if isinstance(error, ValidationError):
        first = error.errors(include_url=False)[0]
        location = ".".join(str(part) for part in first["loc"]) or "body"
        message = f"{location}: {first['msg']}"
    else:
        message = str(error)
    return web.HTTPUnprocessableEntity(
        text=f"Failed to deserialize the JSON body into the target type: {message}"
    )


async def _parse(request: web.Request, model: type[Model]) -> Model:
    value = await _read_json(request)
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise _shape_error(error) from None


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except BridgeError as error:
        if error.status >= 500:
            logger.warning("bridge %s failed: %s: %s", request.path, error.kind, error)
        return _error_response(error)
    except OSError as error:
        logger.warning("bridge %s failed with an I/O error: %s", request.path, error)
        return _error_response(BridgeIOError(str(error)))


@web.middleware
async def _traced(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A span per request (``bridge POST /status/send``) with its status code, when tracing is on. Outermost,
    so it sees the answer :func:`_errors` made of a bridge error; an event stream's span lasts as long as it."""
    if not telemetry.enabled():
        return await handler(request)
    with telemetry.span(
        f"bridge {request.method} {request.path}",
        **{"http.request.method": request.method, "url.path": request.path},
    ) as current:
        try:
            response = await handler(request)
        except web.HTTPException as error:  # the plain-text 400/415/422 answers are raised
            telemetry.annotate(current, **{"http.response.status_code": error.status})
            raise
        telemetry.annotate(current, **{"http.response.status_code": response.status})
        return response


class BridgeServer:
    """A running bridge. Use :func:`serve_bridge` to start one and :meth:`close` to stop it."""

    def __init__(
        self,
        *,
        socket_path: Path,
        work_dir: Path,
        backend: BridgeBackend,
        job_id: str | None,
        keepalive_interval: float,
        status_timeout: float,
        fetch_timeout: float,
        shutdown_timeout: float,
    ) -> None:
        self.socket_path = socket_path
        self.work_dir = work_dir
        self.backend = backend
        self.job_id = job_id
        self.keepalive_interval = keepalive_interval
        self.status_timeout = status_timeout
        self.fetch_timeout = fetch_timeout
        self.shutdown_timeout = shutdown_timeout
        self._closing = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        self._runner: web.AppRunner | None = None

    # --- lifecycle -------------------------------------------------------------------------------------------

    async def _start(self) -> None:
        app = web.Application(middlewares=[_traced, _errors])
        app.router.add_get("/openapi.json", self._openapi)
        app.router.add_post("/resources/fetch", self._fetch)
        app.router.add_post("/resources/send", self._send)
        app.router.add_post("/resources/receive", self._receive)
        app.router.add_post("/status/send", self._status)
        # handler_cancellation: a fetch or an SSE stream whose executor went away stops its backend work.
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=self.shutdown_timeout
        )
        await runner.setup()
        site = web.UnixSite(runner, str(self.socket_path))
        try:
            await site.start()
            # The socket exists with the umask's mode for the moment before this chmod; the work dir that
            # holds it is private to the job's user, which closes that window in practice.
            os.chmod(self.socket_path, SOCKET_MODE)
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner

    async def close(self) -> None:
        """Stop serving: end open event streams, cancel background sends, remove the socket. Idempotent."""
        self._closing.set()
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    async def __aenter__(self) -> BridgeServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- handlers --------------------------------------------------------------------------------------------

    async def _openapi(self, request: web.Request) -> web.Response:
        return _json_response(OPENAPI_DOCUMENT)

    async def _fetch(self, request: web.Request) -> web.Response:
        value = await _read_json(request)
        try:
            reference = reference_adapter.validate_python(value)
        except ValidationError as error:
            raise _shape_error(error) from None
        if isinstance(reference, PeersReference):
            raise InvalidRequest("unsupported strategy")
        if isinstance(reference, UriReference) and not (
            reference.value.startswith(("http://", "https://")) or is_control_plane_path(reference.value)
        ):
            raise InvalidRequest(f"unsupported uri scheme: {reference.value!r}")
        if isinstance(reference, HuggingFaceReference):
            if not reference.repository.strip():
                raise InvalidRequest("huggingface repository must not be blank")
            if not reference.filenames:
                raise InvalidRequest("huggingface filenames must not be empty")
        if isinstance(reference, ParameterServerReference):
            if not reference.peer.strip():
                raise InvalidRequest("parameter-server peer must not be blank")
            if not reference.filenames:
                raise InvalidRequest("parameter-server filenames must not be empty")
        artifacts_dir = make_directory(self.work_dir, ARTIFACTS_DIR)
        try:
            async with asyncio.timeout(self.fetch_timeout):
                files = await self.backend.fetch(reference=reference, artifacts_dir=artifacts_dir)
        except TimeoutError:
            raise NetworkError(f"fetch timed out after {self.fetch_timeout} s") from None
        reply = []
        for name, size in files:
            path = self._reported_file(artifacts_dir, name)
            reply.append({"path": relative_posix(path, base=self.work_dir), "size": size})
        return _json_response(reply)

    async def _send(self, request: web.Request) -> web.Response:
        body = await _parse(request, SendRequest)
        path = resolve_in(self.work_dir, body.path)
        task = asyncio.create_task(self._send_in_background(body.resource, path))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return web.Response(status=200)

    async def _send_in_background(self, reference: PeersReference, path: Path) -> None:
        try:
            await self.backend.send(reference=reference, path=path)
        except asyncio.CancelledError:
            raise
        except Exception:
            # Hypha only logs here too: the executor already has its 200 and no channel to hear of this.
            logger.exception("sending %s to %s failed", path, reference.peers)

    async def _receive(self, request: web.Request) -> web.StreamResponse:
        body = await _parse(request, ReceiveRequest)
        directory = make_directory(self.work_dir, body.path)
        response = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)  # sends the headers now: the executor blocks until it has them
        # Unbounded: the backend writes one file per event (a round's result), so an executor that reads late
        # finds every file its events name.
        events: asyncio.Queue[tuple[Any, ...] | None] = asyncio.Queue()
        pump = asyncio.create_task(self._pump_received(body.resource, directory, events))
        closing = asyncio.create_task(self._closing.wait())
        getter: asyncio.Task | None = None
        try:
            while not self._closing.is_set():
                getter = asyncio.create_task(events.get())
                done, _ = await asyncio.wait(
                    {getter, closing}, timeout=self.keepalive_interval, return_when=asyncio.FIRST_COMPLETED
                )
                if getter not in done:
                    getter.cancel()
                    if closing in done:
                        break
                    await response.write(b": keepalive\n\n")
                    continue
                item = getter.result()
                if item is None:  # the backend cannot receive (any more): end the stream, as Hypha does
                    break
                name, size, from_peer, *more = item
                path = self._reported_file(directory, name)
                event = {
                    **(more[0] if more else {}),
                    "path": relative_posix(path, base=self.work_dir),
                    "size": size,
                    "from_peer": from_peer,
                }
                await response.write(f"data: {_compact(event)}\n\n".encode())
        except (ConnectionResetError, BridgeError) as error:
            logger.info("event stream for %s ended: %s", body.path, error)
        finally:
            # The handler is cancelled when the executor disconnects: every helper task goes with it.
            pending = [task for task in (getter, closing, pump) if task is not None]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    async def _pump_received(
        self, reference: PeersReference, directory: Path, events: asyncio.Queue[tuple[Any, ...] | None]
    ) -> None:
        iterator: AsyncIterator[tuple[Any, ...]] = self.backend.receive(
            reference=reference, directory=directory
        )
        try:
            async for item in iterator:
                await events.put(item)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("receiving into %s failed", directory)
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        await events.put(None)

    async def _status(self, request: web.Request) -> web.Response:
        value = await _read_json(request)
        try:
            parse_progress(value)
        except ValueError as error:  # pydantic's ValidationError is a ValueError
            raise _shape_error(error) from None
        try:
            async with asyncio.timeout(self.status_timeout):
                reply = await self.backend.status(job_id=self.job_id, progress=value)
        except TimeoutError:
            raise NetworkError(f"no reply to the status within {self.status_timeout} s") from None
        if not isinstance(reply, dict) or not isinstance(reply.get("type"), str):
            raise ConnectorError(f"the backend's status reply is not a tagged object: {reply!r}")
        return _json_response(reply)

    # --- helpers ---------------------------------------------------------------------------------------------

    def _reported_file(self, directory: Path, name: str) -> Path:
        """A file a backend wrote, checked against the path rules and made ``0600``.

        Checked against the work dir as well as ``directory``: an executor that swapped ``directory`` for a
        symlink after the request was checked would otherwise have the file reported from wherever it
        points."""
        try:
            path = resolve_in(directory, name)
            restrict_file(path, base=self.work_dir)
        except BridgeError as error:
            raise ConnectorError(f"the backend reported a file outside its directory: {error}") from None
        return path


async def serve_bridge(
    *,
    socket_path: Path | str,
    work_dir: Path | str,
    backend: BridgeBackend,
    job_id: str | None = None,
    keepalive_interval: float = 5.0,
    status_timeout: float = 10.0,
    fetch_timeout: float = 3600.0,
    shutdown_timeout: float = 2.0,
) -> BridgeServer:
    """Start serving the bridge on ``socket_path`` (mode 0600) for the job in ``work_dir``.

    ``job_id`` is passed to :meth:`BridgeBackend.status`. ``status_timeout`` and ``fetch_timeout`` bound the
    backend's calls (answered as ``network_error``); ``keepalive_interval`` is the SSE comment period;
    ``shutdown_timeout`` is how long :meth:`BridgeServer.close` waits for in-flight requests.
    """
    server = BridgeServer(
        socket_path=Path(socket_path),
        work_dir=Path(work_dir).resolve(),
        backend=backend,
        job_id=job_id,
        keepalive_interval=keepalive_interval,
        status_timeout=status_timeout,
        fetch_timeout=fetch_timeout,
        shutdown_timeout=shutdown_timeout,
    )
    await server._start()
    return server
