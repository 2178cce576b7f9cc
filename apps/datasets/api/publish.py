"""The publishing API of data nodes behind NAT (``/api/datanodes/publish/…``): a data node that registered with
``reachable: false`` uploads its slices to the relay's store, once, and trainers download them from there
(:mod:`apps.datasets.publishing`, docs/transfers.md "Data nodes behind NAT"). The caller is the data node,
with its own token (``Authorization: Bearer hd_…``), as for its registration.

The views are async: completing a publication on the local store hashes the slice, which runs in a thread of
its own instead of the one thread Django gives every synchronous view under ASGI.
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from apps.datasets import publishing
from apps.datasets.api.serializers import (
    PublicationPlanSerializer,
    PublishedSliceKeySerializer,
    PublishedSliceSerializer,
    PublishSliceSerializer,
)
from apps.datasets.api.views import DataNodeAuthentication, IsDataNode
from apps.relay import exceptions as relay_exceptions
from hypha_site.api import ErrorSerializer, error_responses
from hypha_site.async_views import AsyncAPIView
from hypha_site.parsers import BoundedJSONParser

NODE_NOTE = (
    " Called by a data node with its own token (`Authorization: Bearer hd_…`), for a dataset it registered "
    "with `reachable: false`."
)


def _refusals(*codes: int) -> dict:
    responses = error_responses(*[code for code in codes if code not in (422, 503)])
    if 422 in codes:
        responses[422] = OpenApiResponse(
            response=ErrorSerializer,
            description="The stored bytes are not the slice's size or SHA-256; the upload was deleted.",
        )
    responses[503] = OpenApiResponse(response=ErrorSerializer, description="The store failed; retry later.")
    return responses


class DataNodeAsyncView(AsyncAPIView):
    """DRF's APIView with an async ``dispatch`` for data nodes: authentication (a database query) runs in a
    thread, the handlers are coroutines, and refusals of :mod:`apps.datasets.publishing` become their HTTP
    answers (a store failure a 503)."""

    authentication_classes = [DataNodeAuthentication]
    permission_classes = [IsDataNode]
    parser_classes = [BoundedJSONParser]

    answer = staticmethod(relay_exceptions.answer)  # PublicationRefused is a relay refusal


def _valid(serializer_class: type[serializers.Serializer], data: Any) -> dict:
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


class PublishView(DataNodeAsyncView):
    @extend_schema(
        summary="Begin or resume publishing a slice to the store",
        description=(
            "Begin uploading slice `index` of `dataset` to the relay's store, or resume it: asking again "
            "returns the same upload with `done: true` for the parts already stored, so only the others are "
            "sent again; a published slice answers `status: complete` with every part done. PUT each part's "
            "exact bytes to its `url` (with `Content-Length`), then complete the publication. `size` and "
            "`sha256` must be the registered ones (409). 400 a dataset or slice the node does not serve; 409 a "
            "node registered as reachable (its slices are downloaded from it); 413 a slice larger than the "
            "store takes." + NODE_NOTE
        ),
        request=PublishSliceSerializer,
        responses={200: PublicationPlanSerializer, **_refusals(400, 401, 409, 413)},
        tags=["datasets"],
    )
    async def post(self, request: Request) -> Response:
        data = _valid(PublishSliceSerializer, request.data)
        plan = await sync_to_async(publishing.begin_publication)(
            request.auth, **data, base_url=request.build_absolute_uri("/")
        )
        return Response(plan)


class PublishCompleteView(DataNodeAsyncView):
    @extend_schema(
        summary="Complete a slice's publication",
        description=(
            "Every part must be stored (else 400 with `missing`: their numbers). The local store hashes the "
            "parts: a size or SHA-256 that is not the slice's deletes the upload (422). S3 checks the size; "
            "the SHA-256 is checked by every downloader. From then on, downloads of the slice at this node "
            "are served from the store. Completing a complete publication answers it again; 404 when none "
            "was begun." + NODE_NOTE
        ),
        request=PublishedSliceKeySerializer,
        responses={200: PublishedSliceSerializer, **_refusals(400, 401, 404, 409, 422)},
        tags=["datasets"],
    )
    async def post(self, request: Request) -> Response:
        data = _valid(PublishedSliceKeySerializer, request.data)
        return Response(await publishing.complete_publication_async(request.auth, **data))
