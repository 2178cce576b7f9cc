"""The parameter server's two outbound channels: its daemon's bridge and the control plane's file uploads.

* :class:`BridgeReporter` posts progress values to ``POST http://hypha/status/send`` on the bridge's Unix
  socket (reference §1.3) and returns the control plane's reply (``{"type": "Ok"}``, ``{"type": "Done"}``).
  The parameter server sends ``{"ready": {...}}`` once it listens and ``{"round": {...}}`` after each round
  (docs/training.md). A failed send is retried (``attempts`` times in all, with doubling pauses), then
  logged and given up: the caller gets None and carries on serving trainers.
* :func:`upload_model` PUTs each final model file to ``{server}/api/jobs/{job}/model/{filename}`` with the
  parameter server's transfer token, retrying connection errors, timeouts and 5xx with backoff until
  ``deadline`` seconds have passed; a 4xx (other than 408/429) is final. ``UploadError`` if it never succeeds.
* :func:`upload_checkpoint` does the same for a round's checkpoint files, to
  ``{server}/api/jobs/{job}/checkpoint/{round}/{filename}`` (the weights at a base round only, the manifest
  ``round.json`` last: it completes the copy); :func:`download_checkpoint` fetches the files of the control
  plane's copy back — the base round's weights, the results since, the last momentum and manifest — for a
  parameter server that resumes where the job's previous one stopped, checking each file's size and SHA-256
  (``parameter_server.checkpoints.adopt_round`` replays them and checks the weights' digest).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from parameter_server.exceptions import UploadError

logger = logging.getLogger("parameter_server")

# The bridge bounds the control plane's answer to 10 s (its status_timeout); a little more here.
STATUS_TIMEOUT = aiohttp.ClientTimeout(total=15, connect=5)
UPLOAD_TIMEOUT = aiohttp.ClientTimeout(total=600, connect=10, sock_read=60)


class BridgeReporter:
    """Reports to the daemon's bridge on ``socket_path`` (see the module docstring)."""

    def __init__(self, socket_path: str | Path, *, attempts: int = 4, first_pause: float = 0.5) -> None:
        self.socket_path = str(socket_path)
        self.attempts = attempts
        self.first_pause = first_pause
        self._session: aiohttp.ClientSession | None = None

    async def send(self, value: dict[str, Any] | str) -> dict[str, Any] | None:
        """Post ``value``; the reply object, or None after ``attempts`` failures (each logged)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.socket_path))
        pause = self.first_pause
        for attempt in range(1, self.attempts + 1):
            try:
                async with self._session.post(
                    "http://hypha/status/send", json=value, timeout=STATUS_TIMEOUT
                ) as response:
                    body = await response.text()
                    if response.status == 200:
                        reply = await response.json(content_type=None)
                        if isinstance(reply, dict):
                            return reply
                        problem = f"a reply that is not an object: {body[:200]!r}"
                    else:
                        problem = f"HTTP {response.status}: {body[:200]}"
            except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as error:
                problem = str(error) or type(error).__name__
            logger.warning("status report failed (attempt %d/%d): %s", attempt, self.attempts, problem)
            if attempt < self.attempts:
                await asyncio.sleep(pause)
                pause *= 2
        logger.error("giving up on the status report %s", str(value)[:200])
        return None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _retryable(status: int) -> bool:
    return status >= 500 or status in (408, 429)


async def upload_model(
    *,
    server_url: str,
    job_id: str,
    token: str,
    files: dict[str, Path],
    deadline: float = 60.0,
    first_pause: float = 0.5,
) -> None:
    """Upload ``files`` (filename → path) as the job's final model; see the module docstring."""
    await _upload_files(
        f"{server_url.rstrip('/')}/api/jobs/{job_id}/model/",
        token=token,
        files=files,
        deadline=deadline,
        first_pause=first_pause,
    )


async def upload_checkpoint(
    *,
    server_url: str,
    job_id: str,
    round_number: int,
    token: str,
    files: dict[str, Path],
    deadline: float = 600.0,
    first_pause: float = 0.5,
) -> None:
    """Upload a round's checkpoint ``files`` (in order, the manifest last); see the module docstring."""
    await _upload_files(
        f"{server_url.rstrip('/')}/api/jobs/{job_id}/checkpoint/{round_number}/",
        token=token,
        files=files,
        deadline=deadline,
        first_pause=first_pause,
    )


async def _patiently(
    once: Callable[[], Awaitable[str | None]],
    *,
    what: str,
    doing: str,
    name: str,
    give_up_at: float,
    first_pause: float,
) -> None:
    """Call ``once`` until it succeeds (returns None): a problem it returns, a connection error or a timeout
    is retried with full-jitter backoff until ``give_up_at`` (then ``UploadError`` saying it could not
    ``what``); an ``UploadError`` it raises is final."""
    pause = first_pause
    attempt = 0
    while True:
        attempt += 1
        try:
            problem = await once()
            if problem is None:
                return
        except (aiohttp.ClientError, TimeoutError) as error:
            problem = str(error) or type(error).__name__
        remaining = give_up_at - time.monotonic()
        if remaining <= 0:
            raise UploadError(f"cannot {what} after {attempt} attempts: {problem}")
        logger.warning("%s %s failed (attempt %d): %s; retrying", doing, name, attempt, problem)
        # Full jitter, so that a control plane coming back is not hit by every job at once.
        await asyncio.sleep(min(remaining, random.uniform(0, pause)))
        pause = min(pause * 2, 10.0)


async def _upload_files(
    base: str, *, token: str, files: dict[str, Path], deadline: float, first_pause: float
) -> None:
    give_up_at = time.monotonic() + deadline
    async with aiohttp.ClientSession() as session:
        for filename, path in files.items():
            url = f"{base}{filename}"

            async def put(filename: str = filename, path: Path = path, url: str = url) -> str | None:
                with open(path, "rb") as body:
                    async with session.put(
                        url,
                        data=body,
                        headers={
                            "Authorization": f"Bearer {token}",
                            "Content-Type": "application/octet-stream",
                            "Content-Length": str(path.stat().st_size),
                        },
                        timeout=UPLOAD_TIMEOUT,
                    ) as response:
                        text = await response.text()
                        if 200 <= response.status < 300:
                            logger.info("uploaded %s (%d bytes) to %s", filename, path.stat().st_size, url)
                            return None
                        problem = f"HTTP {response.status}: {text[:200]}"
                        if not _retryable(response.status):
                            raise UploadError(f"the control plane refused {filename}: {problem}")
                        return problem

            await _patiently(
                put,
                what=f"upload {filename} to {url}",
                doing="uploading",
                name=filename,
                give_up_at=give_up_at,
                first_pause=first_pause,
            )


async def download_checkpoint(
    *,
    server_url: str,
    uri: str,
    token: str,
    files: dict[str, tuple[int, str]],
    directory: Path,
    deadline: float = 600.0,
    first_pause: float = 0.5,
) -> None:
    """Fetch a saved round's ``files`` (name → (size, sha256)) from ``{server}{uri}{name}`` into
    ``directory``, checking each one's size and SHA-256; retried like the uploads. ``UploadError`` (a transfer
    to or from the control plane failed) if a file cannot be had, or arrives other than announced."""
    give_up_at = time.monotonic() + deadline
    base = server_url.rstrip("/") + uri
    async with aiohttp.ClientSession() as session:
        for name, (size, sha256) in files.items():
            url = f"{base}{name}"

            async def get(
                name: str = name, size: int = size, sha256: str = sha256, url: str = url
            ) -> str | None:
                digest = hashlib.sha256()
                received = 0
                async with session.get(
                    url, headers={"Authorization": f"Bearer {token}"}, timeout=UPLOAD_TIMEOUT
                ) as response:
                    if response.status != 200:
                        problem = f"HTTP {response.status}: {(await response.text())[:200]}"
                        if not _retryable(response.status):
                            raise UploadError(f"the control plane refused {name}: {problem}")
                        return problem
                    with open(directory / name, "wb") as target:
                        async for chunk in response.content.iter_chunked(1 << 20):
                            received += len(chunk)
                            if received > size:
                                break
                            digest.update(chunk)
                            target.write(chunk)
                if received != size or digest.hexdigest() != sha256:
                    raise UploadError(
                        f"{url}: got {received} bytes with SHA-256 {digest.hexdigest()}, "
                        f"expected {size} bytes with {sha256}"
                    )
                logger.info("downloaded %s (%d bytes)", url, received)
                return None

            await _patiently(
                get,
                what=f"download {url}",
                doing="downloading",
                name=name,
                give_up_at=give_up_at,
                first_pause=first_pause,
            )
