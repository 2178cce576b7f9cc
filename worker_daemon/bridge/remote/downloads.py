"""Downloads of one task's bridge: an HTTP session with per-call timeouts, retries, and files streamed into
place (checked against an announced size and SHA-256 when there is one). A mixin of
:class:`~worker_daemon.bridge.remote.RemoteBackend`."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from worker_daemon import telemetry
from worker_daemon.bridge.exceptions import ConnectorError
from worker_daemon.bridge.paths import FILE_MODE
from worker_daemon.bridge.peer_http import (
    Download,
    HttpStatusError,
    IntegrityError,
    error_detail,
    without_query,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

CHUNK_SIZE = 1 << 20


class Downloads:
    """HTTP calls of a task's bridge (the attributes are :class:`RemoteBackend`'s)."""

    task_id: uuid.UUID
    connect_timeout: float
    read_timeout: float
    retries: int
    retry_base: float
    retry_cap: float
    _session: aiohttp.ClientSession | None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout())
        return self._session

    def _timeout(self, read_timeout: float | None = None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=None,
            connect=self.connect_timeout,
            sock_connect=self.connect_timeout,
            sock_read=read_timeout if read_timeout is not None else self.read_timeout,
        )

    async def _with_retries(self, what: str, operation: Callable[[], Awaitable[T]]) -> T:
        """``operation`` retried on connection errors, timeouts and 5xx; a :class:`ConnectorError` (caused by
        the last error) when it still fails, or at once for another HTTP status or a bad download."""
        for attempt in range(self.retries + 1):
            try:
                return await operation()
            except HttpStatusError as error:
                if error.status < 500 or attempt == self.retries:
                    raise ConnectorError(f"{what}: {error}") from error
                failure: Exception = error
            except IntegrityError as error:
                raise ConnectorError(f"{what}: {error}") from error
            except (aiohttp.ClientError, TimeoutError) as error:
                if attempt == self.retries:
                    raise ConnectorError(f"{what}: {str(error) or type(error).__name__}") from error
                failure = error
            delay = min(self.retry_cap, self.retry_base * 2**attempt)
            logger.info(
                "task %s: %s failed (%s); retrying in %gs",
                self.task_id,
                what,
                str(failure) or type(failure).__name__,
                delay,
            )
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _download(
        self,
        url: str,
        target: Path,
        *,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        expected_size: int | None = None,
        sha256: str = "",
        read_timeout: float | None = None,
        no_content_ok: bool = False,
        operation: str = "download",
        trace_attributes: Mapping[str, Any] | None = None,
    ) -> Download:
        """``GET url`` streamed into ``target`` (via a temporary file beside it, renamed when complete and
        checked). Raises :class:`HttpStatusError` for a status other than 200 (or 204 with ``no_content_ok``,
        which writes nothing) and :class:`IntegrityError` when size or digest differ from the expected ones.
        Traced as a span named ``operation`` (with ``trace_attributes``) when tracing is on."""
        with telemetry.span(
            operation,
            **{
                "http.request.method": "GET",
                "url.full": without_query(url),
                "hypha.task_id": self.task_id,
                **(trace_attributes or {}),
            },
        ) as current:
            download = await self._download_untraced(
                url,
                target,
                params=params,
                headers=headers,
                expected_size=expected_size,
                sha256=sha256,
                read_timeout=read_timeout,
                no_content_ok=no_content_ok,
                on_status=lambda status: telemetry.annotate(current, **{"http.response.status_code": status}),
            )
            telemetry.annotate(current, **{"hypha.bytes": download.size})
            return download

    async def _download_untraced(
        self,
        url: str,
        target: Path,
        *,
        params: Mapping[str, str] | None,
        headers: Mapping[str, str] | None,
        expected_size: int | None,
        sha256: str,
        read_timeout: float | None,
        no_content_ok: bool,
        on_status: Callable[[int], None],
    ) -> Download:
        session = self._http()
        partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.part")
        try:
            async with session.get(
                url, params=params, headers=headers, timeout=self._timeout(read_timeout)
            ) as response:
                on_status(response.status)
                if response.status == 204 and no_content_ok:
                    return Download(status=204, size=0, headers=response.headers)
                if response.status != 200:
                    raise HttpStatusError(url, response.status, await error_detail(response))
                # Hashed only when a digest was announced (slices): a model file's hash would cost ~1 s/GB.
                digest = hashlib.sha256() if sha256 else None
                size = 0
                descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
                with os.fdopen(descriptor, "wb") as file:
                    async for chunk in response.content.iter_chunked(CHUNK_SIZE):
                        size += len(chunk)
                        if expected_size is not None and size > expected_size:
                            raise IntegrityError(f"more than the announced {expected_size} bytes")
                        if digest is not None:
                            digest.update(chunk)
                        file.write(chunk)
                    file.flush()
                    await asyncio.to_thread(os.fsync, file.fileno())
                if expected_size is not None and size != expected_size:
                    raise IntegrityError(f"{size} bytes, {expected_size} announced")
                if digest is not None and digest.hexdigest() != sha256.lower():
                    raise IntegrityError(
                        f"SHA-256 {digest.hexdigest()} does not match the announced {sha256}"
                    )
                os.replace(partial, target)
                return Download(status=200, size=size, headers=response.headers)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
