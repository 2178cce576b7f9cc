"""The datasets API (read-only): every authenticated user sees every dataset and the data nodes serving it,
since trainers of any job download from them."""

from __future__ import annotations

from django.db.models import Prefetch, QuerySet
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import viewsets

from apps.datasets.api.serializers import DatasetDetailSerializer, DatasetSerializer
from apps.datasets.models import Dataset, DatasetReplica
from hypha_site.api import error_responses


@extend_schema_view(
    list=extend_schema(summary="List datasets", responses={200: DatasetSerializer, **error_responses(401)}),
    retrieve=extend_schema(
        summary="Show a dataset and its slices",
        responses={200: DatasetDetailSerializer, **error_responses(401, 404)},
    ),
)
class DatasetViewSet(viewsets.ReadOnlyModelViewSet):
    """Datasets registered by data nodes: their slices and the nodes serving them. Looked up by name."""

    lookup_field = "name"
    lookup_value_regex = r"[-a-zA-Z0-9_]+"

    def get_queryset(self) -> QuerySet[Dataset]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular inspecting the view
            return Dataset.objects.none()
        datasets = Dataset.objects.prefetch_related(
            Prefetch("replicas", queryset=DatasetReplica.objects.select_related("node"))
        )
        if self.action != "list":
            datasets = datasets.prefetch_related("slices")
        return datasets

    def get_serializer_class(self):
        return DatasetSerializer if self.action == "list" else DatasetDetailSerializer
