"""Serializers of the datasets API (read-only): datasets, their slices and the data nodes serving them."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.datasets.models import DataNode, Dataset, Slice


class DataNodeSerializer(serializers.ModelSerializer):
    """A data node serving slices over HTTP(S)."""

    class Meta:
        model = DataNode
        fields = ["name", "url", "online", "last_seen_at"]
        read_only_fields = fields


class SliceSerializer(serializers.ModelSerializer):
    """One slice file: its index, size and SHA-256 (lowercase hex)."""

    class Meta:
        model = Slice
        fields = ["index", "size_bytes", "sha256"]
        read_only_fields = fields


class DatasetSerializer(serializers.ModelSerializer):
    """A dataset and the data nodes serving it (online ones first)."""

    replicas = serializers.SerializerMethodField(help_text="the data nodes serving it, online ones first")

    class Meta:
        model = Dataset
        fields = ["name", "slice_count", "total_bytes", "created_at", "replicas"]
        read_only_fields = fields

    @extend_schema_field(DataNodeSerializer(many=True))
    def get_replicas(self, dataset: Dataset) -> list[dict]:
        # Sorted here rather than in SQL: the view prefetches the replicas with their nodes once per page.
        nodes = sorted(
            (replica.node for replica in dataset.replicas.all()), key=lambda n: (not n.online, n.name)
        )
        return DataNodeSerializer(nodes, many=True).data


class DatasetDetailSerializer(DatasetSerializer):
    """A dataset, its data nodes and every slice in index order."""

    slices = SliceSerializer(many=True, read_only=True)

    class Meta(DatasetSerializer.Meta):
        fields = [*DatasetSerializer.Meta.fields, "slices"]
        read_only_fields = fields
