"""The workers API: register a worker (and get its token), see it, revoke it, rotate its token.

Every signed-in user sees the pool: each worker's public facts (``PublicWorkerSerializer``). Its owner and staff
see all of it (``WorkerSerializer``) and are the only ones who may act on it: for anyone else, revoking or
rotating is a 404, as for an unknown worker.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.db.models import Prefetch, QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.jobs import services as job_services
from apps.leases.models import Lease
from apps.workers import services
from apps.workers.api.serializers import (
    WorkerCreateSerializer,
    WorkerEntrySerializer,
    WorkerSerializer,
    WorkerWithTokenSerializer,
)
from apps.workers.exceptions import WorkerOffline
from apps.workers.models import Worker
from hypha_site.api import error_responses
from hypha_site.parsers import BoundedJSONParser

#: ``?mine=true`` lists only the workers the caller owns.
MINE = OpenApiParameter(
    "mine",
    OpenApiTypes.BOOL,
    description="true: only the workers you own (the full view of each); default: the whole pool",
)


@extend_schema_view(
    list=extend_schema(
        summary="List workers",
        description=(
            "The pool: every worker, sorted by name. The workers you own (staff: every worker) come in the "
            'full view (`Worker`, `"view": "full"`); the others in the public view (`PublicWorker`, '
            '`"view": "public"`): name, presence, resources, '
            "executors, price floor, benchmark score and the live leases of your own jobs on it, never its "
            "owner, its token or another user's leases."
        ),
        parameters=[MINE],
        responses={200: WorkerEntrySerializer(many=True), **error_responses(400, 401)},
    ),
    retrieve=extend_schema(
        summary="Show a worker",
        description="The full view (`Worker`) for its owner and staff; the public view (`PublicWorker`) for "
        "every other user.",
        responses={200: WorkerEntrySerializer, **error_responses(401, 404)},
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
    """Workers: the GPU hosts whose daemons bid for jobs. Everyone sees the pool's public facts; owners and staff
    see all of their workers and act on them."""

    serializer_class = WorkerSerializer
    parser_classes = [BoundedJSONParser]

    def get_queryset(self) -> QuerySet[Worker]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular inspecting the view
            return Worker.objects.none()
        # Each lease's job, for the public view: it keeps only the caller's own jobs' leases.
        live = Lease.objects.filter(status__in=Lease.LIVE).select_related("job").order_by("created_at")
        workers = Worker.objects.select_related("owner", "record").prefetch_related(
            Prefetch("leases", queryset=live, to_attr="live_leases")
        )
        user = self.request.user
        if self.action == "list":
            return workers.filter(owner=user) if self._only_mine() else workers
        if self.action == "retrieve" or user.is_staff:
            return workers
        # Seeing is for everyone; acting (revoke, rotate) only on the workers one manages.
        return workers.filter(owner=user)

    def _only_mine(self) -> bool:
        """The ``mine`` query parameter: a boolean as DRF reads one ("true", "false", "1", "0", …), else a 400."""
        field = serializers.BooleanField(required=False, default=False)
        raw = self.request.query_params.get("mine")
        if raw is None:
            return False
        try:
            return field.run_validation(raw)
        except serializers.ValidationError as error:
            raise serializers.ValidationError({"mine": error.detail}) from None

    def get_serializer_class(self):
        if self.action == "create":
            return WorkerCreateSerializer
        return WorkerEntrySerializer if self.action in ("list", "retrieve") else WorkerSerializer

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
