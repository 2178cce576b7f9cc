"""The relay API (``/api/relay/jobs/<job id>/…``): begin/resume and complete uploads, find, reply to, want
and delete objects. Callers are a job's live tasks with their transfer token (``Authorization: Bearer``);
no user session or user token is taken here.

The views are async: a long poll (``wait``) sleeps on the event loop instead of holding a thread, and a
local upload's completion hashes its parts in a thread of its own. Each database step runs through
``sync_to_async`` (Django gives every request its own thread for those).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async
from drf_spectacular.utils import (
    OpenApiResponse,
    PolymorphicProxySerializer,
    extend_schema,
)
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from apps.relay import exceptions as relay_exceptions
from apps.relay import services
from apps.relay.api.serializers import (
    BeginUploadSerializer,
    DeleteQuerySerializer,
    KeySerializer,
    ObjectQuerySerializer,
    RelayObjectListSerializer,
    RelayObjectSerializer,
    ReplyAnswerSerializer,
    ReplyQuerySerializer,
    ReplySerializer,
    UploadPlanSerializer,
    WaitSerializer,
    WantAcceptedSerializer,
    WantsSerializer,
)
from hypha_site.api import ErrorSerializer, error_responses
from hypha_site.async_views import AsyncAPIView

#: Seconds between two looks at the index while a long poll waits.
POLL_INTERVAL = 0.25

TOKEN_NOTE = (
    " Authorised by the job's transfer token of a live task (`Authorization: Bearer <token>`); the job must "
    "not have ended (409)."
)
ERRORS_422 = OpenApiResponse(
    response=ErrorSerializer,
    description="The stored bytes are not the declared size or SHA-256; the upload was deleted.",
)
ERRORS_503 = OpenApiResponse(
    response=ErrorSerializer, description="The relay's object store failed; retry later."
)


def _refusals(*codes: int) -> dict:
    responses = error_responses(*[code for code in codes if code not in (422, 503)])
    if 422 in codes:
        responses[422] = ERRORS_422
    responses[503] = ERRORS_503
    return responses


class RelayAPIView(AsyncAPIView):
    """An async view of the relay: authentication and permissions are the handlers' own (transfer tokens);
    refusals of the services become their HTTP answers."""

    authentication_classes: list = []
    permission_classes: list = []
    answer = staticmethod(relay_exceptions.answer)


async def _caller(request: Request, job_id) -> services.Caller:
    return await sync_to_async(services.authorise)(job_id, _bearer(request))


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _base_url(request: Request) -> str:
    """This server as the caller reached it: the local store's URLs point here."""
    return request.build_absolute_uri("/")


def _valid(serializer_class: type[serializers.Serializer], data: Any) -> dict:
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


async def _poll(caller_of: Callable[[], Any], fetch: Callable[[services.Caller], Any], wait: float) -> Any:
    """``fetch(caller)`` until it answers (not None) or ``wait`` seconds passed; the caller is authorised again
    at each look, so a task that ends or a job that finishes stops the wait with its refusal."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        caller = await caller_of()
        found = await sync_to_async(fetch)(caller)
        remaining = deadline - loop.time()
        if found or remaining <= 0:
            return found
        await asyncio.sleep(min(POLL_INTERVAL, remaining))


class UploadsView(RelayAPIView):
    @extend_schema(
        summary="Begin or resume an upload to the relay",
        description=(
            "Begin an upload of `key`, or resume it: the same key, size and sha256 again returns the same "
            "upload with `done: true` for the parts already stored, so only the others are sent again. PUT "
            "each part's exact bytes to its `url` (with `Content-Length`), then complete the upload. A pending "
            "upload of the key with other content is replaced; a complete one is answered as it is when the "
            "content is the same (`status: complete`), else 409." + TOKEN_NOTE
        ),
        request=BeginUploadSerializer,
        responses={200: UploadPlanSerializer, **_refusals(400, 401, 403, 404, 409, 413)},
    )
    async def post(self, request: Request, job_id) -> Response:
        caller = await _caller(request, job_id)
        data = _valid(BeginUploadSerializer, request.data)
        plan = await sync_to_async(services.begin_upload)(caller, **data, base_url=_base_url(request))
        return Response(plan)


class UploadCompleteView(RelayAPIView):
    @extend_schema(
        summary="Complete an upload",
        description=(
            "Every part must be stored (else 400 with `missing`: their numbers). The local store hashes the "
            "parts: a size or SHA-256 that is not the declared one deletes the upload (422). S3 checks the size "
            "(HeadObject); the SHA-256 is checked by every reader at the end of its download. Completing a "
            "complete object answers it again." + TOKEN_NOTE
        ),
        request=KeySerializer,
        responses={200: RelayObjectSerializer, **_refusals(400, 401, 403, 404, 409, 422)},
    )
    async def post(self, request: Request, job_id) -> Response:
        caller = await _caller(request, job_id)
        key = _valid(KeySerializer, request.data)["key"]
        return Response(await services.complete_upload_async(caller, key=key, base_url=_base_url(request)))


OBJECT_OR_LIST = PolymorphicProxySerializer(
    component_name="RelayObjectOrList",
    serializers=[RelayObjectSerializer, RelayObjectListSerializer],
    resource_type_field_name=None,
)


class ObjectsView(RelayAPIView):
    @extend_schema(
        summary="Find a relay object, or list those under a prefix",
        description=(
            "`key`: the complete object (with a GET URL that supports Range), or 204 when it is not complete "
            "after `wait` seconds; `model/latest/<filename>` is the newest complete `model/<round>/<filename>`. "
            "`prefix`: `{objects: [...]}`, the complete objects under it, oldest first, at most 100, waiting "
            "up to `wait` seconds while there are none. The caller's role must be allowed to read the key or "
            "the prefix's namespace (updates: the parameter server only)." + TOKEN_NOTE
        ),
        parameters=[ObjectQuerySerializer],
        responses={
            200: OBJECT_OR_LIST,
            204: OpenApiResponse(description="not complete within `wait`"),
            **_refusals(400, 401, 403, 404, 409),
        },
    )
    async def get(self, request: Request, job_id) -> Response:
        await _caller(request, job_id)
        query = _valid(ObjectQuerySerializer, request.query_params)
        base_url = _base_url(request)
        if "key" in query:
            found = await _poll(
                lambda: _caller(request, job_id),
                lambda caller: services.get_object(caller, key=query["key"], base_url=base_url),
                query["wait"],
            )
            return Response(found) if found else Response(status=204)
        found = await _poll(
            lambda: _caller(request, job_id),
            lambda caller: services.list_objects(caller, prefix=query["prefix"], base_url=base_url),
            query["wait"],
        )
        return Response({"objects": found or []})

    @extend_schema(
        summary="Delete a relay object",
        description=(
            "Its writer, or the parameter server, deletes an object it is done with (the writer also an upload "
            "it abandons); the store's bytes go once that is committed. An object with a reply keeps the reply "
            "for its writer." + TOKEN_NOTE
        ),
        parameters=[DeleteQuerySerializer],
        responses={204: OpenApiResponse(description="deleted"), **_refusals(400, 401, 403, 404, 409)},
    )
    async def delete(self, request: Request, job_id) -> Response:
        caller = await _caller(request, job_id)
        key = _valid(DeleteQuerySerializer, request.query_params)["key"]
        await sync_to_async(services.delete_object)(caller, key=key)
        return Response(status=204)


class ObjectReplyView(RelayAPIView):
    @extend_schema(
        summary="Wait for the reply to a relay object",
        description=(
            "The writer (or a reader) gets the reply a reader gave, or 204 when there is none after `wait` "
            "seconds." + TOKEN_NOTE
        ),
        parameters=[ReplyQuerySerializer],
        responses={
            200: ReplyAnswerSerializer,
            204: OpenApiResponse(description="no reply within `wait`"),
            **_refusals(400, 401, 403, 404, 409),
        },
    )
    async def get(self, request: Request, job_id) -> Response:
        await _caller(request, job_id)
        query = _valid(ReplyQuerySerializer, request.query_params)
        found = await _poll(
            lambda: _caller(request, job_id),
            lambda caller: services.get_reply(caller, key=query["key"]),
            query["wait"],
        )
        return Response(found) if found else Response(status=204)

    @extend_schema(
        summary="Reply to a relay object",
        description=(
            "A reader answers an object (the parameter server answers an update with the status and body its "
            "HTTP handler gave). Set once: the same reply again is a no-op, another one a 409." + TOKEN_NOTE
        ),
        request=ReplySerializer,
        responses={200: ReplyAnswerSerializer, **_refusals(400, 401, 403, 404, 409)},
    )
    async def post(self, request: Request, job_id) -> Response:
        caller = await _caller(request, job_id)
        data = _valid(ReplySerializer, request.data)
        return Response(await sync_to_async(services.set_reply)(caller, **data))


class ObjectWantView(RelayAPIView):
    @extend_schema(
        summary="Ask for an object published on demand",
        description=(
            "A reader asks for `model/latest/<filename>`; the parameter server sees it in `wants/` and answers "
            "by uploading `model/<round>/<filename>`." + TOKEN_NOTE
        ),
        request=KeySerializer,
        responses={202: WantAcceptedSerializer, **_refusals(400, 401, 403, 404, 409)},
    )
    async def post(self, request: Request, job_id) -> Response:
        caller = await _caller(request, job_id)
        key = _valid(KeySerializer, request.data)["key"]
        return Response(await sync_to_async(services.want)(caller, key=key), status=202)


class WantsView(RelayAPIView):
    @extend_schema(
        summary="The keys readers want published (the parameter server only)",
        description=(
            "The keys wanted since they were last handed out, waiting up to `wait` seconds while there are "
            "none; each is handed out once per request (a reader still waiting asks again)." + TOKEN_NOTE
        ),
        parameters=[WaitSerializer],
        responses={200: WantsSerializer, **_refusals(400, 401, 403, 404, 409)},
    )
    async def get(self, request: Request, job_id) -> Response:
        await _caller(request, job_id)
        wait = _valid(WaitSerializer, request.query_params)["wait"]
        found = await _poll(lambda: _caller(request, job_id), services.take_wants, wait)
        return Response({"wants": found or []})
