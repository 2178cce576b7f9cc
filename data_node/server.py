"""The data node's HTTP server and its registration with the control plane.

``GET /datasets/<name>/slices/<index>`` streams slice file ``index`` from disk (aiohttp's ``FileResponse``:
``Content-Length``, ``Range`` → 206, sendfile where available), with the slice's SHA-256 as ``X-Sha256``.
The ``ETag`` is aiohttp's own (mtime and size): aiohttp matches ``If-None-Match``/``If-Range`` against the tag
it computes, so replacing it with the digest would break those conditional requests. An unknown dataset or an index outside ``0..n-1`` is a 404 (the original's ``index > len`` check
let ``index == len`` crash the node). The slice list and digests are computed once at start-up: the files must
not change while the node serves them (the control plane holds their digests).

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
import random
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from data_node import tokens
from data_node.slices import SliceFile

log = logging.getLogger("data_node")

REGISTER_PATH = "/api/datasets/register/"


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


def build_app(dataset: ServedDataset, *, download_key: str | None = None) -> web.Application:
    """The aiohttp application serving ``dataset``'s slices to holders of tokens signed with ``download_key``
    (or, when ``None``, with the key :func:`set_download_key` sets later)."""
    key_holder = DownloadKey(download_key)

    async def get_slice(request: web.Request) -> web.StreamResponse:
        key = key_holder.value
        if key is None:
            return _error(
                503,
                "not_ready",
                "this data node has not been registered with its control plane yet",
                {"Retry-After": "5"},
            )
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
            if error.status == 401:
                return _error(
                    401, "unauthorized", error.detail, {"WWW-Authenticate": 'Bearer realm="slices"'}
                )
            return _error(error.status, "forbidden", error.detail)
        if name != dataset.name or index < 0:
            return _error(404, "not_found", "no such dataset or slice")
        if index >= len(dataset.slices):  # ``>=``: index == count is past the end too
            return _error(404, "not_found", f"dataset {dataset.name} has slices 0..{len(dataset.slices) - 1}")
        slice_ = dataset.slices[index]
        return web.FileResponse(
            slice_.path,
            headers={
                "X-Sha256": slice_.sha256,
                "Content-Type": "application/octet-stream",
            },
        )

    async def health(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "dataset": dataset.name,
                "slices": len(dataset.slices),
                "registered": key_holder.value is not None,
            }
        )

    app = web.Application()
    app[DOWNLOAD_KEY] = key_holder
    app.router.add_get("/datasets/{name}/slices/{index}", get_slice)
    app.router.add_get("/healthz", health)
    return app


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
