"""The jobs API: submit, list, inspect and cancel DiLoCo jobs. Users see their own jobs; staff see every job."""

from __future__ import annotations

from django.db.models import Prefetch, QuerySet
from drf_spectacular.utils import OpenApiExample, extend_schema, extend_schema_view
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.parsers import JSONParser
from rest_framework.request import Request
from rest_framework.response import Response

from apps.jobs import services
from apps.jobs.api.serializers import JobCreateSerializer, JobDetailSerializer, JobSerializer
from apps.jobs.exceptions import JobNotCancellable
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
