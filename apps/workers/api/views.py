"""The workers API: register a worker (and get its token), see it, revoke it, rotate its token.

Users see the workers they own; staff see every worker.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.db.models import Prefetch, QuerySet
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.jobs import services as job_services
from apps.leases.models import Lease
from apps.workers import services
from apps.workers.api.serializers import WorkerCreateSerializer, WorkerSerializer, WorkerWithTokenSerializer
from apps.workers.exceptions import WorkerOffline
from apps.workers.models import Worker
from hypha_site.api import error_responses
from hypha_site.parsers import BoundedJSONParser


@extend_schema_view(
    list=extend_schema(summary="List workers", responses={200: WorkerSerializer, **error_responses(401)}),
    retrieve=extend_schema(
        summary="Show a worker", responses={200: WorkerSerializer, **error_responses(401, 404)}
    ),
    create=extend_schema(
        summary="Register a worker",
        description="Creates a worker owned by the caller and returns its token, which is shown only this once.",
        request=WorkerCreateSerializer,
        responses={201: WorkerWithTokenSerializer, **error_responses(400, 401)},
    ),
)
class WorkerViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin, viewsets.GenericViewSet
):
    """Workers: the GPU hosts whose daemons bid for jobs. You see your own workers; staff see every worker."""

    serializer_class = WorkerSerializer
    parser_classes = [BoundedJSONParser]

    def get_queryset(self) -> QuerySet[Worker]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular inspecting the view
            return Worker.objects.none()
        workers = Worker.objects.select_related("owner").prefetch_related(
            Prefetch(
                "leases",
                queryset=Lease.objects.filter(status__in=Lease.LIVE).order_by("created_at"),
                to_attr="live_leases",
            )
        )
        if not self.request.user.is_staff:
            workers = workers.filter(owner=self.request.user)
        return workers

    def get_serializer_class(self):
        return WorkerCreateSerializer if self.action == "create" else WorkerSerializer

    def create(self, request: Request, *args, **kwargs) -> Response:
        registration = WorkerCreateSerializer(data=request.data)
        registration.is_valid(raise_exception=True)
        try:
            with transaction.atomic():
                worker, token = services.create_worker(
                    name=registration.validated_data["name"], owner=request.user
                )
        except IntegrityError:  # the same name registered concurrently, after the uniqueness check
            raise serializers.ValidationError({"name": ["A worker with this name already exists."]}) from None
        return self._with_token(worker, token, status.HTTP_201_CREATED)

    @extend_schema(
        summary="Revoke a worker's token",
        description=(
            "Its daemon is disconnected and cannot connect again, and every lease it holds ends now. "
            "Revoking a revoked worker changes nothing. Rotating the token un-revokes the worker."
        ),
        request=None,
        responses={200: WorkerSerializer, **error_responses(401, 404)},
    )
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        worker = self.get_object()
        job_services.revoke_worker(worker)
        return Response(WorkerSerializer(self.get_queryset().get(pk=worker.pk)).data)

    @extend_schema(
        summary="Issue a new token",
        description="The old token stops working at once: a daemon connected with it is disconnected. "
        "A revoked worker is un-revoked.",
        request=None,
        responses={200: WorkerWithTokenSerializer, **error_responses(401, 404)},
    )
    @action(detail=True, methods=["post"], url_path="rotate-token")
    def rotate_token(self, request: Request, pk: str | None = None) -> Response:
        worker = self.get_object()
        token = job_services.rotate_token(worker)
        return self._with_token(worker, token, status.HTTP_200_OK)

    @extend_schema(
        summary="Run a worker's benchmark (staff)",
        description=(
            "Asks the worker's daemon to run its benchmark now; the new score appears in `benchmark_score` "
            "and `benchmark` a few seconds later. A daemon that runs a task or holds a lease refuses (the "
            "score would mean nothing) and records the refusal in `benchmark.error`. Staff only; 409 when "
            "the worker is offline."
        ),
        request=None,
        responses={202: WorkerSerializer, **error_responses(401, 403, 404, 409)},
    )
    @action(detail=True, methods=["post"], permission_classes=[permissions.IsAdminUser])
    def benchmark(self, request: Request, pk: str | None = None) -> Response:
        worker = self.get_object()
        try:
            services.request_benchmark(worker)
        except WorkerOffline as error:
            return Response({"detail": str(error)}, status=status.HTTP_409_CONFLICT)
        return Response(WorkerSerializer(worker).data, status=status.HTTP_202_ACCEPTED)

    def _with_token(self, worker: Worker, token: str, code: int) -> Response:
        worker = self.get_queryset().get(pk=worker.pk)
        return Response(WorkerWithTokenSerializer(worker, context={"token": token}).data, status=code)
