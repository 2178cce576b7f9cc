"""Bodies that never sit whole in the server's memory: request bodies read a chunk at a time, file downloads,
and ranged downloads of stored bytes (the relay's and published slices').

Under ASGI, Django 5.2 turns a response with a *sync* iterator — ``FileResponse`` included — into a list
before sending it (``StreamingHttpResponse.__aiter__`` runs ``sync_to_async(list)``): a 256 MiB model file grew
the server by 256 MiB, and again for each download (bench/relay.py, issue 14). :func:`file_response` gives an
async iterator under ASGI, reading one chunk at a time in a thread, so memory stays at one chunk (with the
backpressure of :mod:`hypha_site.http_body`, also for a slow reader); under WSGI, Django's own
``FileResponse``.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from django.core.handlers.asgi import ASGIRequest
from django.http import FileResponse, HttpResponse, StreamingHttpResponse
from django.utils.http import content_disposition_header

#: Bytes per read of a downloaded file.
CHUNK = 1 << 20


_RANGE = re.compile(r"bytes=(\d{0,19})-(\d{0,19})")


def request_chunks(request) -> Iterator[bytes]:
    """The request body, a chunk at a time (never ``request.body``). Read from Django's request, not DRF's
    ``request.stream``, which is ``None`` without a ``Content-Length``: a chunked upload was stored empty."""
    raw = getattr(request, "_request", request)
    while chunk := raw.read(CHUNK):
        yield chunk


async def in_thread(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """``chunks`` read one at a time in a thread, so the event loop never waits on the disk."""
    try:
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            yield chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            await asyncio.to_thread(close)


def _file_chunks(handle: BinaryIO) -> Iterator[bytes]:
    try:
        while chunk := handle.read(CHUNK):
            yield chunk
    finally:
        handle.close()


def byte_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """``(start, stop)`` (stop exclusive) of a single ``Range: bytes=…`` header; None to send all of it (no
    header, or one not served: several ranges, another unit, a malformed one — RFC 9110 lets a server ignore
    those); ``"unsatisfiable"`` when it starts past the end."""
    match = _RANGE.fullmatch(header.strip()) if header else None
    if match is None or not (match[1] or match[2]):
        return None
    if match[1]:
        start = int(match[1])
        if match[2] and int(match[2]) < start:
            return None  # invalid: ignored
        if start >= size:
            return "unsatisfiable"
        return start, min(int(match[2]) + 1 if match[2] else size, size)
    suffix = int(match[2])
    if suffix == 0 or size == 0:
        return "unsatisfiable"
    return max(0, size - suffix), size


def ranged_response(
    request,
    *,
    size: int,
    span: tuple[int, int] | None,
    read: Callable[[int, int], Iterator[bytes]],
    headers: dict[str, str] | None = None,
) -> HttpResponse:
    """200 (``span`` None: all ``size`` bytes) or 206 (``span`` = :func:`byte_range`'s ``(start, stop)``) with
    the bytes ``read(start, stop)`` yields, streamed (an async iterator under ASGI, reading in a thread); no
    body for HEAD or an empty span. The caller answers an unsatisfiable range itself (416)."""
    start, stop = span or (0, size)
    headers = {"Accept-Ranges": "bytes", "Content-Length": str(stop - start), **(headers or {})}
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
    status = 206 if span is not None else 200
    if request.method == "HEAD" or start == stop:
        return HttpResponse(b"", status=status, content_type="application/octet-stream", headers=headers)
    chunks = read(start, stop)
    content = in_thread(chunks) if isinstance(request, ASGIRequest) else chunks
    return StreamingHttpResponse(
        content, status=status, content_type="application/octet-stream", headers=headers
    )


def file_response(
    request,
    path: Path,
    *,
    content_type: str = "application/octet-stream",
    filename: str | None = None,
) -> StreamingHttpResponse:
    """A response streaming the file at ``path``; with ``filename`` it is sent as an attachment of that name.
    ``FileNotFoundError`` when the file is gone."""
    raw = getattr(request, "_request", request)  # a DRF Request wraps Django's
    if not isinstance(raw, ASGIRequest):
        return FileResponse(
            path.open("rb"),
            content_type=content_type,
            as_attachment=filename is not None,
            filename=filename or "",
        )
    # Opened here, as FileResponse does: a file deleted or replaced after the view returns is still the one
    # whose length the response announces.
    handle = path.open("rb")
    size = os.fstat(handle.fileno()).st_size
    response = StreamingHttpResponse(in_thread(_file_chunks(handle)), content_type=content_type)
    response._resource_closers.append(handle.close)  # a response never sent still closes the file
    response["Content-Length"] = str(size)
    if filename is not None:
        response["Content-Disposition"] = content_disposition_header(True, filename)
    return response
