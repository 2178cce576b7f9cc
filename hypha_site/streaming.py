"""File downloads that never hold the file in the server's memory.

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
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from django.core.handlers.asgi import ASGIRequest
from django.http import FileResponse, StreamingHttpResponse
from django.utils.http import content_disposition_header

#: Bytes per read of a downloaded file.
CHUNK = 1 << 20


async def _chunks(handle: BinaryIO) -> AsyncIterator[bytes]:
    try:
        while chunk := await asyncio.to_thread(handle.read, CHUNK):
            yield chunk
    finally:
        await asyncio.to_thread(handle.close)


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
    response = StreamingHttpResponse(_chunks(handle), content_type=content_type)
    response._resource_closers.append(handle.close)  # a response never sent still closes the file
    response["Content-Length"] = str(size)
    if filename is not None:
        response["Content-Disposition"] = content_disposition_header(True, filename)
    return response
