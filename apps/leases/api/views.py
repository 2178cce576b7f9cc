"""The leases API (read-only): leases of the caller's jobs or on the caller's workers; staff see every lease."""

from __future__ import annotations

from django.db.models import Q, QuerySet
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import viewsets

from apps.leases.api.serializers import LeaseDetailSerializer, LeaseFilterSerializer, LeaseSerializer
from apps.leases.models import Lease
from hypha_site.api import FilteredListMixin, error_responses


@extend_schema_view(
    list=extend_schema(
        summary="List leases of your jobs or on your workers",
        parameters=[LeaseFilterSerializer],
        responses={200: LeaseSerializer, **error_responses(400, 401)},
    ),
    retrieve=extend_schema(
        summary="Show a lease and its history",
        responses={200: LeaseDetailSerializer, **error_responses(401, 404)},
    ),
)
class LeaseViewSet(FilteredListMixin, viewsets.ReadOnlyModelViewSet):
    """Leases: time-bounded claims of a job role on a worker. You see the leases of your jobs and those on your
    workers; staff see all."""

    filter_serializer_class = LeaseFilterSerializer
    filter_lookups = {"job": "job_id", "worker": "worker_id"}

    def get_queryset(self) -> QuerySet[Lease]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular inspecting the view
            return Lease.objects.none()
        leases = Lease.objects.select_related("worker")
        if self.action != "list":
            leases = leases.prefetch_related("events")
        if not self.request.user.is_staff:
            user = self.request.user
            leases = leases.filter(Q(job__owner=user) | Q(worker__owner=user))
        return leases

    def get_serializer_class(self):
        return LeaseSerializer if self.action == "list" else LeaseDetailSerializer
