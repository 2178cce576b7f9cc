"""The bytes of published slices (:mod:`apps.datasets.publishing`), under ``/api/datanodes/``:

* ``GET /api/datanodes/<node id>/datasets/<name>/slices/<index>?token=…`` — what
  :func:`apps.datasets.services.slice_urls` hands out for a data node that is not reachable: the same slice
  token the node itself would check (signed with its download key). The local store's copy is served here
  (``Range`` supported); an S3 copy is a 302 to a presigned GET of it. 503 while the node has not published
  the slice yet (downloaders wait, as for a node that is down). Errors are the data node's JSON
  ``{"error", "detail"}``.
* ``PUT /api/datanodes/parts/<node id>/<blob>/<number>?expires=…&signature=…`` — a part of a publication to
  the local store (the signed URL is the credential, as with the relay's own parts).

Bodies stream a chunk at a time both ways: a part is read from the request in chunks into a temporary file
renamed into place once whole; a GET streams the parts' bytes (under ASGI from an async iterator whose reads
run in a thread).
"""

from __future__ import annotations

import asyncio

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from apps.datasets import publishing, services
from apps.datasets.exceptions import PublicationRefused
from apps.datasets.models import DataNode
from apps.relay.exceptions import RelayRefused, StoreError
from apps.relay.stores import LocalStore
from data_node import tokens
from hypha_site.streaming import byte_range, ranged_response, request_chunks

#: Seconds a downloader is asked to wait before it asks again for a slice not published yet.
RETRY_AFTER = "10"
ERRORS = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 503: "not_ready"}


def _error(status: int, detail: str, **headers: str) -> JsonResponse:
    return JsonResponse(
        {"error": ERRORS.get(status, "refused"), "detail": detail}, status=status, headers=headers or None
    )


def _token(request: HttpRequest) -> str | None:
    token = request.GET.get("token")
    if token is None:
        authorization = request.headers.get("Authorization", "")
        if authorization[:7].lower() == "bearer ":
            token = authorization[7:].strip()
    return token


def _slice_copy(node_id, name: str, index: int, token: str | None):
    """The node and its complete copy of the slice, once the token is checked (before the path, as the data
    node does, so a caller without a token learns nothing of which slices exist)."""
    node = DataNode.objects.filter(pk=node_id).first()
    if node is None:
        raise tokens.SliceTokenError(401, "no such data node")
    tokens.verify(services.download_key(node).encode(), token, dataset=name, index=index)
    return node, publishing.published_copy(node, name, index)


@csrf_exempt
async def published_slice(request: HttpRequest, node_id, name: str, index: int) -> HttpResponse:
    """GET (or HEAD) slice ``index`` of ``name`` as data node ``node_id`` published it: 200 (206 for one
    range, 416 past the end) from the local store, 302 to the S3 object; 401 no, a bad or an expired token,
    403 a token for another slice, 404 a slice the node does not serve, 503 not published yet."""
    if request.method not in ("GET", "HEAD"):
        return JsonResponse({"detail": "GET the slice here"}, status=405, headers={"Allow": "GET, HEAD"})
    try:
        _node, copy = await sync_to_async(_slice_copy)(node_id, name, index, _token(request))
        target = publishing.store()
        blob, lengths = publishing.local_object(copy)
        if not isinstance(target, LocalStore):
            location = await asyncio.to_thread(
                target.object_url, blob, base_url="", lifetime=settings.HYPHA_RELAY_URL_LIFETIME
            )
            return HttpResponse(status=302, headers={"Location": location, "Cache-Control": "no-store"})
    except tokens.SliceTokenError as error:
        if error.status == 401:
            return _error(401, error.detail, **{"WWW-Authenticate": 'Bearer realm="slices"'})
        return _error(error.status, error.detail)
    except PublicationRefused as refused:
        extra = {"Retry-After": RETRY_AFTER} if refused.status == 503 else {}
        return _error(refused.status, refused.detail, **extra)
    except StoreError as error:
        return _error(503, f"the store failed: {error}", **{"Retry-After": RETRY_AFTER})
    size = copy.size
    span = byte_range(request.headers.get("Range"), size)
    if span == "unsatisfiable":
        return JsonResponse(
            {"error": "range", "detail": f"the range is past the slice's end ({size} bytes)"},
            status=416,
            headers={"Content-Range": f"bytes */{size}"},
        )
    return ranged_response(
        request,
        size=size,
        span=span,
        read=lambda start, stop: target.read(blob, lengths, start, stop),
        headers={"X-Sha256": copy.sha256},
    )


@csrf_exempt  # the signed URL is the credential; data nodes send no CSRF token
async def published_part(request: HttpRequest, node_id, blob, number: int) -> HttpResponse:
    """PUT exactly the part's bytes (``Content-Length`` required) to the local store: 200, 400 shorter or cut
    off, 411 no length, 413 longer, 403 a bad or expired signature, 404 no such pending upload (or the store is
    S3, whose part URLs point at S3). Nothing of a refused part is kept; a part sent again replaces it."""
    if request.method != "PUT":
        return JsonResponse({"detail": "PUT a part here"}, status=405, headers={"Allow": "PUT"})
    try:
        target = publishing.store()
        if not isinstance(target, LocalStore):
            raise RelayRefused("the store is S3: parts go there, not here", status=404)
        target.check_signature(
            "PUT",
            publishing.part_path(node_id, blob, number),
            request.GET.get("expires"),
            request.GET.get("signature"),
        )
        where, length = await sync_to_async(publishing.local_part_target)(str(node_id), str(blob), number)
        # Without Content-Length (and without Transfer-Encoding) an HTTP request has no body.
        declared = request.headers.get(
            "Content-Length", "" if "Transfer-Encoding" in request.headers else "0"
        )
        if not declared.isdigit():
            raise RelayRefused("Content-Length is required (the part's exact size)", status=411)
        if int(declared) != length:
            raise RelayRefused(
                f"part {number} is {length} bytes, not {declared}",
                status=413 if int(declared) > length else 400,
            )
        try:
            await asyncio.to_thread(target.write_part, where, number, request_chunks(request), length)
        except OSError as error:  # the client went away mid-body (WSGI reads from its socket)
            raise RelayRefused(f"part {number} was cut off: {error}", status=400) from None
    except (RelayRefused, PublicationRefused) as refused:
        return JsonResponse({"detail": refused.detail}, status=refused.status)
    return JsonResponse({"number": number, "size": length}, headers={"ETag": f'"{number}-{length}"'})
