"""The parameter server's two outbound channels: its daemon's bridge and the control plane's model upload.

* :class:`BridgeReporter` posts progress values to ``POST http://hypha/status/send`` on the bridge's Unix
  socket (reference §1.3) and returns the control plane's reply (``{"type": "Ok"}``, ``{"type": "Done"}``).
  The parameter server sends ``{"ready": {...}}`` once it listens and ``{"round": {...}}`` after each round
  (docs/training.md). A failed send is retried (``attempts`` times in all, with doubling pauses), then
  logged and given up: the caller gets None and carries on serving trainers.
* :func:`upload_model` PUTs each final model file to ``{server}/api/jobs/{job}/model/{filename}`` with the
  parameter server's transfer token, retrying connection errors, timeouts and 5xx with backoff until
  ``deadline`` seconds have passed; a 4xx (other than 408/429) is final. ``UploadError`` if it never succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
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
    base = server_url.rstrip("/")
    give_up_at = time.monotonic() + deadline
    async with aiohttp.ClientSession() as session:
        for filename, path in files.items():
            url = f"{base}/api/jobs/{job_id}/model/{filename}"
            pause = first_pause
            attempt = 0
            while True:
                attempt += 1
                try:
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
                                logger.info(
                                    "uploaded %s (%d bytes) to %s", filename, path.stat().st_size, url
                                )
                                break
                            problem = f"HTTP {response.status}: {text[:200]}"
                            if not _retryable(response.status):
                                raise UploadError(f"the control plane refused {filename}: {problem}")
                except (aiohttp.ClientError, TimeoutError) as error:
                    problem = str(error) or type(error).__name__
                remaining = give_up_at - time.monotonic()
                if remaining <= 0:
                    raise UploadError(
                        f"cannot upload {filename} to {url} after {attempt} attempts: {problem}"
                    )
                logger.warning("uploading %s failed (attempt %d): %s; retrying", filename, attempt, problem)
                # Full jitter, so that a control plane coming back is not hit by every job at once.
                await asyncio.sleep(min(remaining, random.uniform(0, pause)))
                pause = min(pause * 2, 10.0)
