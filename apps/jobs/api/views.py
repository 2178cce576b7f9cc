"""The jobs API: submit, list, inspect and cancel DiLoCo jobs. Users see their own jobs; staff see every job."""

from __future__ import annotations

from django.db.models import Prefetch, QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser, JSONParser
from rest_framework.request import Request
from rest_framework.response import Response

from apps.jobs import services, spec
from apps.jobs.api.serializers import JobCreateSerializer, JobDetailSerializer, JobSerializer
from apps.jobs.exceptions import JobNotCancellable, SpecError
from apps.jobs.models import Job
from apps.leases.models import Lease
from hypha_site.api import error_responses

INVALID_JOB_EXAMPLE = OpenApiExample(
    "invalid submission",
    value={
        "num_trainers": ["Ensure this value is less than or equal to 256."],
        "trainer": {
            "resources": {"gpu": ["Ensure this value is greater than or equal to 0."]},
            "price": {"max": ["Must be at least the bid (150)."]},
        },
        "spec": ['Expected a dictionary of items but got type "list".'],
    },
    response_only=True,
    status_codes=["400"],
)


class TomlParser(BaseParser):
    """A Hypha scheduler TOML document as text (``Content-Type: application/toml``)."""

    media_type = "application/toml"

    def parse(self, stream, media_type=None, parser_context=None) -> str:
        try:
            return stream.read().decode("utf-8")
        except UnicodeDecodeError as error:
            raise ParseError(f"TOML must be UTF-8: {error}") from None


def spec_error_body(error: SpecError) -> dict[str, list[str]]:
    """A :class:`SpecError` as a 400 body like every other: each field (a dotted path) with its messages."""
    body: dict[str, list[str]] = {}
    for item in error.errors:
        body.setdefault(item["field"] or "non_field_errors", []).append(item["message"])
    return body


DILOCO_EXAMPLE = {
    "name": "tiny-gpt",
    "model": {
        "source": {"type": "huggingface", "repository": "hypha-space/lenet", "filenames": ["config.json"]},
        "type": "causal-lm",
        "input_names": ["input_ids", "labels"],
    },
    "dataset": {"name": "tiny-text"},
    "inner_optimizer": {"learning_rate": 0.001},
    "outer_optimizer": {"learning_rate": 0.7, "momentum": 0.9},
    "rounds": {"update_rounds": 10, "inner_steps": 50},
    "num_trainers": 2,
}


@extend_schema_view(
    list=extend_schema(summary="List jobs", responses={200: JobSerializer, **error_responses(401)}),
    retrieve=extend_schema(
        summary="Show a job, its leases and its status history",
        responses={200: JobDetailSerializer, **error_responses(401, 404)},
    ),
    create=extend_schema(
        summary="Submit a job",
        description=(
            "Creates the job (PENDING) and queues its allocation: each role is advertised to the market. "
            "Every role block and every field in it is optional and has a default; unknown fields are refused, "
            "so a misspelt field cannot silently fall back to its default."
        ),
        request=JobCreateSerializer,
        responses={201: JobDetailSerializer, **error_responses(400, 401, examples=[INVALID_JOB_EXAMPLE])},
    ),
)
class JobViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin, viewsets.GenericViewSet
):
    """DiLoCo jobs. You see and cancel your own jobs; staff see and cancel every job."""

    serializer_class = JobSerializer
    parser_classes = [JSONParser]

    def get_queryset(self) -> QuerySet[Job]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular inspecting the view
            return Job.objects.none()
        jobs = Job.objects.select_related("owner").prefetch_related(
            Prefetch("leases", queryset=Lease.objects.select_related("worker").order_by("created_at"))
        )
        if self.action != "list":
            jobs = jobs.prefetch_related("events")
        if not self.request.user.is_staff:
            jobs = jobs.filter(owner=self.request.user)
        return jobs

    def get_serializer_class(self):
        if self.action == "create":
            return JobCreateSerializer
        if self.action == "list":
            return JobSerializer
        return JobDetailSerializer

    def create(self, request: Request, *args, **kwargs) -> Response:
        submission = JobCreateSerializer(data=request.data)
        submission.is_valid(raise_exception=True)
        job = services.create_job(owner=request.user, **submission.service_arguments())
        # Re-read: outside a server the allocation ran right after the commit and changed the job.
        job = self.get_queryset().get(pk=job.pk)
        return Response(JobDetailSerializer(job).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        summary="Submit a DiLoCo training job from its full specification",
        description=(
            "The body is a DiLoCo specification as JSON (model, dataset, inner and outer optimizer, rounds, "
            "batch size, trainers, and per role resources and prices; an optional `name`), or Hypha's scheduler "
            "TOML (`Content-Type: application/toml`, the `[scheduler.job]` table with the keys the original "
            "reads, and the spellings its docs used; the name then comes from `?name=`). Every mistake is "
            "reported at once, keyed by its dotted field path. The roles are advertised as for `POST /api/jobs/`; "
            "training itself is not dispatched yet."
        ),
        parameters=[OpenApiParameter("name", OpenApiTypes.STR, description="job name, for a TOML body")],
        request={"application/json": OpenApiTypes.OBJECT, "application/toml": OpenApiTypes.STR},
        responses={201: JobDetailSerializer, **error_responses(400, 401, 415)},
        examples=[OpenApiExample("a small causal LM", value=DILOCO_EXAMPLE, request_only=True)],
    )
    @action(detail=False, methods=["post"], url_path="diloco", parser_classes=[JSONParser, TomlParser])
    def diloco(self, request: Request) -> Response:
        body = request.data
        try:
            if isinstance(body, str):
                name = request.query_params.get("name", "")
                parsed = spec.parse_toml(body)
            else:
                body = dict(body) if isinstance(body, dict) else body
                name = body.pop("name", "") if isinstance(body, dict) else ""
                parsed = spec.parse_json(body)
        except SpecError as error:
            return Response(spec_error_body(error), status=status.HTTP_400_BAD_REQUEST)
        if not isinstance(name, str) or len(name) > 200:
            return Response(
                {"name": ["A string of at most 200 characters."]}, status=status.HTTP_400_BAD_REQUEST
            )
        job = services.create_job(
            owner=request.user,
            name=name,
            num_trainers=parsed.num_trainers,
            requirements=spec.to_requirements(parsed),
            spec=parsed.model_dump(mode="json"),
        )
        return Response(
            JobDetailSerializer(self.get_queryset().get(pk=job.pk)).data, status=status.HTTP_201_CREATED
        )

    @extend_schema(
        summary="Cancel a job",
        description="Closes the job's advertisements and releases every lease it holds.",
        request=None,
        responses={200: JobDetailSerializer, **error_responses(401, 404, 409)},
    )
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        job = self.get_object()
        reason = (
            "cancelled by its owner" if job.owner_id == request.user.pk else f"cancelled by {request.user}"
        )
        try:
            services.cancel_job(job, reason=reason)
        except JobNotCancellable as error:
            return Response({"detail": str(error)}, status=status.HTTP_409_CONFLICT)
        return Response(JobDetailSerializer(self.get_queryset().get(pk=job.pk)).data)
