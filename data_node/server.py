"""The data node's HTTP server and its registration with the control plane.

``GET /datasets/<name>/slices/<index>`` answers slice file ``index`` with its SHA-256 as ``X-Sha256``. A slice
of at most ``inline_limit`` bytes (1 MiB by default, ``--inline-limit``) is read straight into the response on
the event loop: one ``open``/``read``/``close`` from the page cache, no thread-pool hop (aiohttp's
``FileResponse`` makes two per file, which dominated the cost of a 100 KiB slice). A larger slice, and any
request with ``Range`` or a conditional header (``If-Range``, ``If-None-Match``, …), is answered by
``FileResponse``: ``Content-Length``, ``Range`` → 206, sendfile where available. The ``ETag`` is aiohttp's own
(mtime and size) on both paths: aiohttp matches ``If-None-Match``/``If-Range`` against the tag it computes, so
replacing it with the digest would break those conditional requests. An unknown dataset or an index outside
``0..n-1`` is a 404 (the original's ``index > len`` check let ``index == len`` crash the node). The slice list
and digests are computed once at start-up: the files must not change while the node serves them (the control
plane holds their digests; a file found shorter than at start-up is a 500).

``POST /datasets/<name>/slices`` fetches several small slices in one request (a trainer's prefetch; see
:mod:`data_node.batches` for the request, the limits and the framed answer). Each slice in it carries its own
slice token, checked exactly as a ``GET`` checks it, so a batch gets nothing its slices' ``GET`` would not.

Every download must carry a slice token (:mod:`data_node.tokens`) signed with the download key the control plane
returned when the node registered, as the ``token`` query parameter of the URL the control plane handed out (or
as ``Authorization: Bearer …``): none, malformed, a wrong signature or expired → 401; a token for another dataset
or slice → 403; before the registration has been answered (no key yet) → 503 with ``Retry-After``. The token is
checked before the path, so whoever has none learns nothing of which slices exist. Errors are JSON
``{"error": …, "detail": …}``. The node keeps no access log: URLs carry tokens.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from data_node import batches, tokens
from data_node.slices import SliceFile

log = logging.getLogger("data_node")

REGISTER_PATH = "/api/datasets/register/"
#: Largest slice read into the response (``GET``) or a batch; larger ones are streamed from the file.
INLINE_LIMIT = 1 << 20


class RegistrationRefused(Exception):
    """The control plane refused the registration for good (bad body or a conflict): retrying cannot help."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"the control plane answered {status}: {detail}")
        self.status = status


class TokenRefused(RegistrationRefused):
    """The control plane does not know the data node token (401)."""


@dataclass(frozen=True)
class ServedDataset:
    name: str
    slices: list[SliceFile]

    @property
    def total_bytes(self) -> int:
        return sum(slice_.size for slice_ in self.slices)


class DownloadKey:
    """The node's download key (UTF-8 bytes, encoded once), ``None`` until the control plane answered the
    registration with it. Set with :func:`set_download_key`."""

    __slots__ = ("value",)

    def __init__(self, key: str | None = None) -> None:
        self.value = key.encode() if key else None


#: Where the application keeps its :class:`DownloadKey`.
DOWNLOAD_KEY = web.AppKey("download_key", DownloadKey)


def set_download_key(app: web.Application, key: str) -> None:
    """Start accepting tokens signed with ``key`` (the ``download_key`` of the registration's answer)."""
    app[DOWNLOAD_KEY].value = key.encode()


def _error(status: int, error: str, detail: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": error, "detail": detail}, status=status, headers=headers)


def _refusal(error: tokens.SliceTokenError) -> web.Response:
    if error.status == 401:
        return _error(401, "unauthorized", error.detail, {"WWW-Authenticate": 'Bearer realm="slices"'})
    return _error(error.status, "forbidden", error.detail)


#: Request headers that need ``FileResponse``'s handling (ranges, conditional requests).
_FILE_RESPONSE_HEADERS = (
    "Range",
    "If-Range",
    "If-None-Match",
    "If-Match",
    "If-Modified-Since",
    "If-Unmodified-Since",
)


class SliceChanged(Exception):
    """A slice file is not the size it had at start-up (the files must not change while the node serves)."""


def read_slice(slice_: SliceFile, prefix: bytes = b"") -> tuple[bytearray, os.stat_result]:
    """``prefix`` and the bytes of ``slice_``, read straight into one buffer, with the file's ``fstat``.

    Blocking, on purpose: for a slice of at most the inline limit, served from the page cache, one ``read``
    costs less than the two thread-pool hops that would hide it."""
    buffer = bytearray(len(prefix) + slice_.size)
    buffer[: len(prefix)] = prefix
    view = memoryview(buffer)
    position = len(prefix)
    with open(slice_.path, "rb", buffering=0) as file:
        status = os.fstat(file.fileno())
        if status.st_size != slice_.size:
            raise SliceChanged(f"{slice_.path} is {status.st_size} bytes, {slice_.size} at start-up")
        while position < len(buffer):
            count = file.readinto(view[position:])
            if not count:
                raise SliceChanged(f"{slice_.path} ended after {position - len(prefix)} bytes")
            position += count
    return buffer, status


def _etag(status: os.stat_result) -> str:
    """aiohttp's ``FileResponse`` tag for the file, so that conditional requests match either path's."""
    return f"{status.st_mtime_ns:x}-{status.st_size:x}"


def build_app(
    dataset: ServedDataset, *, download_key: str | None = None, inline_limit: int = INLINE_LIMIT
) -> web.Application:
    """The aiohttp application serving ``dataset``'s slices to holders of tokens signed with ``download_key``
    (or, when ``None``, with the key :func:`set_download_key` sets later). Slices of at most ``inline_limit``
    bytes are read into the response (``GET``) or a batch; larger ones are streamed by ``FileResponse``, and
    refused in a batch. ``0`` streams every slice and refuses every batch."""
    key_holder = DownloadKey(download_key)
    count = len(dataset.slices)

    def not_ready() -> web.Response:
        return _error(
            503,
            "not_ready",
            "this data node has not been registered with its control plane yet",
            {"Retry-After": "5"},
        )

    def no_such_slice(name: str, index: int) -> web.Response | None:
        if name != dataset.name or index < 0:
            return _error(404, "not_found", "no such dataset or slice")
        if index >= count:  # ``>=``: index == count is past the end too
            return _error(404, "not_found", f"dataset {dataset.name} has slices 0..{count - 1}")
        return None

    def changed(error: SliceChanged) -> web.Response:
        log.error("%s: restart the node to serve the files as they are now", error)
        return _error(500, "slice_changed", "a slice file changed on disk since the node started")

    async def get_slice(request: web.Request) -> web.StreamResponse:
        key = key_holder.value
        if key is None:
            return not_ready()
        name = request.match_info["name"]
        index_text = request.match_info["index"]
        # ASCII digits, and few: int() of a 5000-digit string raises (a 500 otherwise).
        index = (
            int(index_text)
            if index_text.isascii() and index_text.isdecimal() and len(index_text) < 12
            else -1
        )
        token = request.query.get("token")
        if token is None:
            authorization = request.headers.get("Authorization", "")
            if authorization[:7].lower() == "bearer ":
                token = authorization[7:].strip()
        try:
            tokens.verify(key, token, dataset=name, index=index)
        except tokens.SliceTokenError as error:
            # The path only, never the query: it holds the token.
            log.info("refused %s (%d): %s", request.path, error.status, error.detail)
            return _refusal(error)
        if (missing := no_such_slice(name, index)) is not None:
            return missing
        slice_ = dataset.slices[index]
        headers = {"X-Sha256": slice_.sha256, "Content-Type": "application/octet-stream"}
        if slice_.size <= inline_limit and not any(h in request.headers for h in _FILE_RESPONSE_HEADERS):
            try:
                body, status = read_slice(slice_)
            except SliceChanged as error:
                return changed(error)
            response = web.Response(body=body, headers=headers)
            response.etag = _etag(status)
            response.last_modified = status.st_mtime
            return response
        return web.FileResponse(slice_.path, headers=headers)

    async def get_batch(request: web.Request) -> web.StreamResponse:
        key = key_holder.value
        if key is None:
            return not_ready()
        name = request.match_info["name"]
        try:
            entries = batches.parse_request(await _body(request, batches.MAX_BODY))
        except batches.BatchRequestError as error:
            return _error(error.status, error.error, error.detail)
        for entry in entries:
            try:
                tokens.verify(key, entry.token, dataset=name, index=entry.index)
            except tokens.SliceTokenError as error:
                log.info("refused a batch of %s (%d): %s", request.path, error.status, error.detail)
                error.detail = f"slice {entry.index}: {error.detail}"
                return _refusal(error)
        for entry in entries:
            if (missing := no_such_slice(name, entry.index)) is not None:
                return missing
        chosen = [dataset.slices[entry.index] for entry in entries]
        for slice_ in chosen:
            if slice_.size > inline_limit:
                return _error(
                    400,
                    "too_large",
                    f"slice {slice_.index} is {slice_.size} bytes, over this node's batch limit of "
                    f"{inline_limit}: download it with GET",
                )
        lines = [batches.frame_line(s.index, s.size, s.sha256) for s in chosen]
        response = web.StreamResponse(
            headers={"Content-Type": batches.CONTENT_TYPE, "X-Slice-Count": str(len(chosen))}
        )
        response.content_length = sum(len(line) + s.size for line, s in zip(lines, chosen, strict=True))
        # Read the first slice before answering: a changed file is still a clean 500 then.
        try:
            frame, _ = read_slice(chosen[0], lines[0])
        except SliceChanged as error:
            return changed(error)
        await response.prepare(request)
        # One slice in memory at a time; write() waits for the socket when its buffer fills.
        for line, slice_ in zip(lines[1:], chosen[1:], strict=True):
            await response.write(frame)
            try:
                frame, _ = read_slice(slice_, line)
            except SliceChanged as error:
                log.error("%s: the batch's answer is cut short", error)
                raise  # the connection is closed mid-body: the client sees a short answer
        await response.write(frame)
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "dataset": dataset.name,
                "slices": count,
                "registered": key_holder.value is not None,
            }
        )

    app = web.Application()
    app[DOWNLOAD_KEY] = key_holder
    app.router.add_get("/datasets/{name}/slices/{index}", get_slice)
    app.router.add_post("/datasets/{name}/slices", get_batch)
    app.router.add_get("/healthz", health)
    return app


async def _body(request: web.Request, limit: int) -> bytes:
    """The request's body, or :class:`~data_node.batches.BatchRequestError` (413) past ``limit`` bytes."""
    too_large = batches.BatchRequestError(
        413, "too_large", f"a batch request's body is at most {limit} bytes"
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    body = bytearray()
    while chunk := await request.content.read(limit + 1 - len(body)):
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def register(
    *,
    server: str,
    token: str,
    dataset: ServedDataset,
    public_url: str,
    reachable: bool | str = "auto",
    timeout: float = 10.0,
    max_delay: float = 30.0,
) -> dict:
    """POST the dataset to the control plane until it answers; returns the registered dataset's JSON.

    ``reachable`` (true, false or "auto") says whether trainers can connect to ``public_url``; "auto" is not
    sent (a control plane older than the key refuses unknown keys, and leaves it "auto" anyway).

    Connection errors, timeouts and 5xx answers are retried with exponential backoff and full jitter (1 s
    doubling up to ``max_delay``), forever: a data node waits for its control plane. A 401 raises
    :class:`TokenRefused`, another 4xx :class:`RegistrationRefused`.
    """
    body = {
        "name": dataset.name,
        "url": public_url,
        "slices": [{"index": s.index, "size": s.size, "sha256": s.sha256} for s in dataset.slices],
    }
    if reachable != "auto":
        body["reachable"] = reachable
    url = server.rstrip("/") + REGISTER_PATH
    headers = {"Authorization": f"Bearer {token}"}
    attempt = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        while True:
            try:
                async with session.post(url, json=body, headers=headers) as response:
                    text = await response.text()
                    if response.status in (200, 201):
                        return await response.json(content_type=None)
                    if response.status == 401:
                        raise TokenRefused(response.status, text)
                    if 400 <= response.status < 500:
                        raise RegistrationRefused(response.status, text)
                    problem = f"{response.status} {text[:200]}"
            except (TimeoutError, aiohttp.ClientError) as error:
                problem = f"{type(error).__name__}: {error}"
            delay = random.uniform(0, min(max_delay, 2.0**attempt))
            attempt += 1
            log.warning("registration with %s failed (%s); retrying in %.1f s", url, problem, delay)
            await asyncio.sleep(delay)
