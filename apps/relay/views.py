"""The local store's bytes at ``/relay/<job>/<blob>[/<part>]``: PUT a part, GET (or HEAD) the object with
``Range``. The signed URL is the credential (:class:`apps.relay.stores.LocalStore`); with the S3 store these
routes answer 404 (the URLs point at the store).

Bodies stream a chunk at a time both ways. A part's body is read from the request in chunks (never
``request.body``) into a temporary file renamed into place once whole. A GET streams the parts' bytes: under
ASGI (daphne) from an async iterator whose reads run in a thread, under WSGI from a plain iterator — each
handler consumes the other kind by collecting it into a list first, which would hold the body in memory.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from apps.relay import services
from apps.relay.exceptions import RelayRefused
from apps.relay.stores import CHUNK, LocalStore, get_store

_RANGE = re.compile(r"bytes=(\d{0,19})-(\d{0,19})")


def _refused(refused: RelayRefused, **headers: str) -> JsonResponse:
    return JsonResponse(refused.body(), status=refused.status, headers=headers or None)


def _local_store() -> LocalStore:
    store = get_store()
    if not isinstance(store, LocalStore):
        raise RelayRefused("the relay keeps its objects in S3; this server serves no relay bytes", status=404)
    return store


@csrf_exempt  # the signed URL is the credential; daemons send no CSRF token
async def part(request: HttpRequest, job_id, blob, number: int) -> HttpResponse:
    """PUT exactly the part's bytes (``Content-Length`` required): 200, 400 shorter or cut off, 411 no
    length, 413 longer, 403 a bad or expired signature, 404 no such pending upload. Nothing of a refused
    part is kept; a part sent again replaces the stored one."""
    if request.method != "PUT":
        return JsonResponse({"detail": "PUT a part here"}, status=405, headers={"Allow": "PUT"})
    try:
        store = _local_store()
        store.check_signature(
            "PUT",
            LocalStore.part_path_of_url(job_id, blob, number),
            request.GET.get("expires"),
            request.GET.get("signature"),
        )
        target, length = await sync_to_async(services.local_part_target)(str(job_id), str(blob), number)
        # Without Content-Length (and without Transfer-Encoding) an HTTP request has no body.
        declared = request.headers.get(
            "Content-Length", "" if "Transfer-Encoding" in request.headers else "0"
        )
        if not declared.isdigit():
            raise RelayRefused("Content-Length is required (the part's exact size)", status=411)
        if int(declared) > length:
            raise RelayRefused(f"part {number} is {length} bytes, not {declared}", status=413)
        if int(declared) < length:
            raise RelayRefused(f"part {number} is {length} bytes, not {declared}", status=400)
        try:
            await asyncio.to_thread(store.write_part, target, number, _body_chunks(request), length)
        except OSError as error:  # the client went away mid-body (WSGI reads from its socket)
            raise RelayRefused(f"part {number} was cut off: {error}", status=400) from None
    except RelayRefused as refused:
        return _refused(refused)
    return JsonResponse({"number": number, "size": length}, headers={"ETag": f'"{number}-{length}"'})


def _body_chunks(request: HttpRequest) -> Iterator[bytes]:
    while chunk := request.read(CHUNK):
        yield chunk


@csrf_exempt
async def object_bytes(request: HttpRequest, job_id, blob) -> HttpResponse:
    """GET (or HEAD) a complete object: 200 all of it, 206 one range (``Range: bytes=a-b``, ``a-``, ``-n``),
    416 a range past its end; 403 a bad or expired signature, 404 no such object (deleted)."""
    if request.method not in ("GET", "HEAD"):
        return JsonResponse({"detail": "GET the object here"}, status=405, headers={"Allow": "GET, HEAD"})
    try:
        store = _local_store()
        store.check_signature(
            "GET",
            LocalStore.object_path_of_url(job_id, blob),
            request.GET.get("expires"),
            request.GET.get("signature"),
        )
        target, lengths, size = await sync_to_async(services.local_object_target)(str(job_id), str(blob))
        span = byte_range(request.headers.get("Range"), size)
    except RelayRefused as refused:
        return _refused(refused)
    if span == "unsatisfiable":
        return JsonResponse(
            {"detail": f"the range is past the object's end ({size} bytes)"},
            status=416,
            headers={"Content-Range": f"bytes */{size}"},
        )
    start, stop = span or (0, size)
    headers = {"Accept-Ranges": "bytes", "Content-Length": str(stop - start)}
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
    status = 206 if span is not None else 200
    if request.method == "HEAD" or start == stop:
        return HttpResponse(b"", status=status, content_type="application/octet-stream", headers=headers)
    chunks = store.read(target, lengths, start, stop)
    content = _in_thread(chunks) if isinstance(request, ASGIRequest) else chunks
    return StreamingHttpResponse(
        content, status=status, content_type="application/octet-stream", headers=headers
    )


async def _in_thread(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """``chunks`` read one at a time in a thread, so the event loop never waits on the disk."""
    try:
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            yield chunk
    finally:
        await asyncio.to_thread(chunks.close)


def byte_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """``(start, stop)`` (stop exclusive) of a single ``Range: bytes=…`` header; None to send the whole object
    (no header, or one we do not serve: several ranges, another unit, a malformed one — RFC 9110 lets a
    server ignore those); ``"unsatisfiable"`` when it starts past the end."""
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
