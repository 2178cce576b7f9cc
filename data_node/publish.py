"""Publishing a dataset's slices to the control plane's store, for a data node that accepts no inbound
connections (``--reachable false``: behind NAT or a firewall).

Nobody can download from such a node, so after registering it uploads each slice, once, to the relay's object
store (the control plane's own directory, or S3) through the control plane's publishing API, and trainers of
every job download the slices from there (docs/transfers.md, "Data nodes behind NAT"). For each slice:

1. ``POST /api/datanodes/publish/`` ``{"dataset", "index", "size", "sha256"}`` (the node's token, as for its
   registration) → the parts to PUT, each with a signed URL, ``done`` for those the store holds already: a
   node that restarts sends only what is missing; a published slice answers ``status: complete``.
2. ``PUT`` each missing part's exact bytes to its URL, streamed from the file a chunk at a time.
3. ``POST /api/datanodes/publish/complete/`` ``{"dataset", "index"}``: the store checks the size (and the
   SHA-256, on the local store).

:class:`Publisher` does this for every slice in index order, in the background while the node serves: a
failure (the control plane or the store unreachable, a 5xx, a part refused, an upload the store lost) is
retried with exponential backoff and full jitter; only a refused token (401) or a slice the store cannot take
(413) stops it. Cancelling it (SIGTERM) stops it at once; what was stored stays for the next start.

No Django here: this runs on the data node's host, which installs the daemon requirements only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import urllib.parse
from pathlib import Path
from typing import Any

import aiohttp

from data_node.slices import SliceFile
from worker_daemon.relay import file_part

log = logging.getLogger("data_node")

PUBLISH_PATH = "/api/datanodes/publish/"
COMPLETE_PATH = "/api/datanodes/publish/complete/"
#: Bytes per read and write of a part's body.
CHUNK = 1 << 20
#: Bytes per second the control plane is assumed to hash at least when it completes a local upload (the
#: complete call's read timeout grows with the slice's size).
COMPLETE_HASH_RATE = 50 << 20
#: Seconds between two progress lines while slices keep being published.
PROGRESS_INTERVAL = 5.0


class PublishError(Exception):
    """The control plane or the store answered ``status`` (``detail``: its reason)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"answered {status}: {detail}" if detail else f"answered {status}")
        self.status = status
        self.detail = detail


class PublishRefused(PublishError):
    """An answer that retrying cannot change: the token is refused (401) or a slice is too large (413)."""


class Publisher:
    """Publishes the slices of dataset ``dataset`` (``slices``: as the node scanned and registered them) to the
    control plane at ``server`` with the node's ``token`` (see the module)."""

    def __init__(
        self,
        *,
        server: str,
        token: str,
        dataset: str,
        slices: list[SliceFile],
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        retry_base: float = 1.0,
        retry_cap: float = 60.0,
    ) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self.dataset = dataset
        self.slices = list(slices)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.retry_base = retry_base
        self.retry_cap = retry_cap

    async def run(self) -> dict:
        """Publish every slice not published yet; ``{"published", "already", "bytes"}`` once all are (slices
        published now, slices the store held already, bytes sent). Failures are retried until they pass;
        :class:`PublishRefused` is raised for those that cannot."""
        total = len(self.slices)
        log.info(
            "publishing %d slices of %s to the control plane's store (not reachable)", total, self.dataset
        )
        published = already = sent = 0
        last_line = time.monotonic()
        async with aiohttp.ClientSession() as session:
            for position, slice_ in enumerate(self.slices, start=1):
                attempt = 0
                while True:
                    try:
                        count = await self.publish(session, slice_)
                        break
                    except PublishRefused:
                        raise
                    # ValueError, KeyError: an answer that is not the API's JSON (a proxy's error page).
                    except (
                        PublishError,
                        aiohttp.ClientError,
                        TimeoutError,
                        OSError,
                        ValueError,
                        KeyError,
                    ) as error:
                        delay = random.uniform(0, min(self.retry_cap, self.retry_base * 2**attempt))
                        attempt += 1
                        log.warning(
                            "publishing slice %d of %s failed (%s); retrying in %.1f s",
                            slice_.index,
                            self.dataset,
                            str(error) or type(error).__name__,
                            delay,
                        )
                        await asyncio.sleep(delay)
                if count is None:
                    already += 1
                    continue
                published += 1
                sent += count
                if time.monotonic() - last_line >= PROGRESS_INTERVAL or position == total:
                    last_line = time.monotonic()
                    log.info(
                        "published slice %d of %s (%d of %d)", slice_.index, self.dataset, position, total
                    )
        log.info(
            "all %d slices of %s are in the store (%d published now, %d were already; %d bytes sent)",
            total,
            self.dataset,
            published,
            already,
            sent,
        )
        return {"published": published, "already": already, "bytes": sent}

    async def publish(self, session: aiohttp.ClientSession, slice_: SliceFile) -> int | None:
        """Publish one slice: the bytes sent, or None when the store held it already."""
        plan = await self._call(
            session,
            PUBLISH_PATH,
            {"dataset": self.dataset, "index": slice_.index, "size": slice_.size, "sha256": slice_.sha256},
        )
        if plan.get("status") == "complete":
            return None
        sent = 0
        for part in plan["parts"]:
            if not part["done"]:
                await self._put(session, slice_.path, part)
                sent += int(part["size"])
        await self._call(
            session,
            COMPLETE_PATH,
            {"dataset": self.dataset, "index": slice_.index},
            extra_read=slice_.size / COMPLETE_HASH_RATE,
        )
        return sent

    async def _put(self, session: aiohttp.ClientSession, path: Path, part: dict) -> None:
        url = urllib.parse.urljoin(f"{self.server}/", part["url"])
        async with session.put(
            url,
            data=file_part(path, int(part["offset"]), int(part["size"])),
            headers={"Content-Length": str(part["size"]), "Content-Type": "application/octet-stream"},
            timeout=self._timeout(),
        ) as response:
            body = await response.read()
            if response.status >= 300:
                # The URL's query (its signature) never goes into a message.
                where = urllib.parse.urlsplit(url)._replace(query="").geturl()
                raise PublishError(response.status, f"PUT {where}: {_detail(body)}")

    async def _call(
        self, session: aiohttp.ClientSession, path: str, body: dict, *, extra_read: float = 0.0
    ) -> dict[str, Any]:
        async with session.post(
            self.server + path,
            json=body,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=self._timeout(extra_read),
        ) as response:
            raw = await response.read()
            if response.status in (401, 413):
                raise PublishRefused(response.status, f"POST {path}: {_detail(raw)}")
            if response.status >= 300:
                raise PublishError(response.status, f"POST {path}: {_detail(raw)}")
            return json.loads(raw)

    def _timeout(self, extra_read: float = 0.0) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout + extra_read
        )


def _detail(raw: bytes) -> str:
    """The reason in an error answer: ``detail`` (or the field errors) of our JSON, ``Message`` of an S3 XML
    error, or the text."""
    text = raw[:4000].decode(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        return str(body.get("detail", body))[:500]
    if "<Message>" in text:
        return text.split("<Message>", 1)[1].split("</Message>", 1)[0]
    return text.strip()[:500]
