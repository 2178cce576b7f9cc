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

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from apps.relay import services
from apps.relay.exceptions import RelayRefused
from apps.relay.stores import LocalStore, get_store
from hypha_site.streaming import byte_range, ranged_response, request_chunks


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
            await asyncio.to_thread(store.write_part, target, number, request_chunks(request), length)
        except OSError as error:  # the client went away mid-body (WSGI reads from its socket)
            raise RelayRefused(f"part {number} was cut off: {error}", status=400) from None
    except RelayRefused as refused:
        return _refused(refused)
    return JsonResponse({"number": number, "size": length}, headers={"ETag": f'"{number}-{length}"'})


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
    return ranged_response(
        request, size=size, span=span, read=lambda start, stop: store.read(target, lengths, start, stop)
    )
