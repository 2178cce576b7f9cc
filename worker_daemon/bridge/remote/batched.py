"""Batch downloads of small slices: several claimed slices from one data node in one request
(``POST <node>/datasets/<name>/slices``, the format in ``docs/configuration.md`` and :mod:`data_node.batches`).
A mixin of :class:`~worker_daemon.bridge.remote.RemoteBackend`.

No new token and no protocol change: each slice goes with the token of its own ``GET`` URL (the control
plane's ``slice_assigned``), and the node checks each as the ``GET`` would. Only URLs of the shape the control
plane hands out for a data node (``…/datasets/<name>/slices/<index>?token=…``) are batched, and never the
control plane's own (slices a node behind NAT published to the relay's store: no batch endpoint there). A
node that answers a batch 404 or 405 (older than batches) is not asked again by this task.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path

from aiohttp.http_exceptions import LineTooLong

from worker_daemon import protocol, telemetry
from worker_daemon.bridge.paths import FILE_MODE
from worker_daemon.bridge.peer_http import CachedSlice, HttpStatusError, IntegrityError, error_detail
from worker_daemon.bridge.remote.downloads import CHUNK_SIZE, Downloads

#: The answer's media type.
BATCH_CONTENT_TYPE = "application/x-hypha-slices"
#: Largest slice fetched in a batch (the data node's default limit): larger ones stream better alone.
BATCH_SLICE_LIMIT = 1 << 20
#: Most slices in one batch (the data node's limit).
BATCH_MAX_SLICES = 64
#: Longest frame line: index, size, 64 hex digits and separators.
_MAX_LINE = 128
_SLICE_PATH = re.compile(r"^(?P<prefix>.*)/datasets/(?P<dataset>[^/]+)/slices/(?P<index>\d+)$")


@dataclass(frozen=True, slots=True)
class BatchTarget:
    """Where a claimed slice can be fetched in a batch: the node's batch URL and the slice's token."""

    url: str
    token: str


def batch_target(url: str, *, index: int, control_plane: str | None) -> BatchTarget | None:
    """The batch URL and token of a slice URL the control plane handed out, or None when it is no data
    node's slice URL with a token (or is the control plane's own, which has no batch endpoint)."""
    parts = urllib.parse.urlsplit(url)
    match = _SLICE_PATH.match(parts.path)
    if parts.scheme not in ("http", "https") or match is None or int(match["index"]) != index:
        return None
    query = urllib.parse.parse_qs(parts.query)
    if list(query) != ["token"] or len(query["token"]) != 1:
        return None
    base = parts._replace(path=f"{match['prefix']}/datasets/{match['dataset']}/slices", query="", fragment="")
    batch_url = base.geturl()
    if control_plane and batch_url.startswith(control_plane.rstrip("/") + "/"):
        return None
    return BatchTarget(url=batch_url, token=query["token"][0])


class SliceBatches(Downloads):
    """Batch downloads (the attributes are :class:`RemoteBackend`'s)."""

    server_url: str | None
    work_dir: Path
    #: Batch URLs that answered 404 or 405: nodes without batches, asked one slice at a time.
    _batchless: set[str]

    def _batch_target(self, assigned: protocol.SliceAssigned) -> BatchTarget | None:
        """Where ``assigned`` can be fetched in a batch: from its first node, if small enough."""
        if not assigned.urls or assigned.index is None or assigned.size > BATCH_SLICE_LIMIT:
            return None
        target = batch_target(assigned.urls[0], index=assigned.index, control_plane=self.server_url)
        if target is None or target.url in self._batchless:
            return None
        return target

    async def _download_batch(
        self, dataset: str, url: str, members: list[tuple[protocol.SliceAssigned, str]], cache: Path
    ) -> list[CachedSlice]:
        """``members`` (each claimed slice with its token) from the node's batch ``url`` into ``cache``, in
        order, each checked against the size and SHA-256 the control plane announced. All or nothing: on any
        error (raised: :class:`HttpStatusError`, :class:`IntegrityError`, aiohttp's, timeouts) no file is
        left. A 404 or 405 (or a 200 of another media type) also marks ``url`` as a node without batches."""
        with telemetry.span(
            "slice batch download",
            **{
                "http.request.method": "POST",
                "url.full": url,
                "hypha.task_id": self.task_id,
                "hypha.dataset": dataset,
                "hypha.slices": len(members),
            },
        ) as current:
            written: list[Path] = []
            try:
                partials = await self._receive_batch(url, members, cache, written)
                # One thread hop for every file's fsync, then the renames: a file in the cache is whole.
                await asyncio.to_thread(_fsync_all, partials)
                cached = []
                for (assigned, _token), partial in zip(members, partials, strict=True):
                    target = cache / str(assigned.index)
                    os.replace(partial, target)
                    written.append(target)
                    cached.append(
                        CachedSlice(dataset=dataset, index=assigned.index, size=assigned.size, path=target)
                    )
            except BaseException:
                for path in written:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                raise
            telemetry.annotate(current, **{"hypha.bytes": sum(item.size for item in cached)})
            return cached

    async def _receive_batch(
        self,
        url: str,
        members: list[tuple[protocol.SliceAssigned, str]],
        cache: Path,
        written: list[Path],
    ) -> list[Path]:
        """POST the batch and write each slice of the answer to a partial file in ``cache`` (each added to
        ``written`` before it is opened); the partial files, in order."""
        body = {"slices": [{"index": assigned.index, "token": token} for assigned, token in members]}
        partials = []
        async with self._http().post(url, json=body, timeout=self._timeout()) as response:
            if response.status in (404, 405):
                self._batchless.add(url)
            if response.status != 200:
                raise HttpStatusError(url, response.status, await error_detail(response))
            if response.content_type != BATCH_CONTENT_TYPE:
                self._batchless.add(url)
                raise IntegrityError(f"a batch answered {response.content_type!r}, not {BATCH_CONTENT_TYPE}")
            for assigned, _token in members:
                expected = f"{assigned.index} {assigned.size} "
                try:
                    line = await response.content.readuntil(b"\n", max_size=_MAX_LINE)
                except LineTooLong:
                    line = b"(a line too long)"
                text = line.decode("ascii", "replace")
                if not text.startswith(expected) or not text.endswith("\n"):
                    raise IntegrityError(
                        f"the batch's frame for slice {assigned.index} ({assigned.size} bytes) reads {text!r}"
                    )
                partial = cache / f".{assigned.index}.{uuid.uuid4().hex[:8]}.part"
                written.append(partial)
                partials.append(partial)
                digest = hashlib.sha256()
                descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
                with os.fdopen(descriptor, "wb") as file:
                    left = assigned.size
                    while left:
                        chunk = await response.content.read(min(left, CHUNK_SIZE))
                        if not chunk:
                            raise IntegrityError(
                                f"the batch ended {left} bytes short of slice {assigned.index}"
                            )
                        left -= len(chunk)
                        digest.update(chunk)
                        file.write(chunk)
                if digest.hexdigest() != assigned.sha256.lower():
                    raise IntegrityError(
                        f"slice {assigned.index}: SHA-256 {digest.hexdigest()} does not match the announced "
                        f"{assigned.sha256}"
                    )
            if await response.content.read(1):
                raise IntegrityError("the batch's answer holds more than the slices asked for")
        return partials


def _fsync_all(paths: list[Path]) -> None:
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
