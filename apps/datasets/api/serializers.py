"""Serializers of the datasets API: datasets, their slices and the data nodes serving them (read-only), and a
data node's registration of a dataset (input)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.datasets.models import DataNode, Dataset, PublishedSlice, Slice
from apps.workers.models import Reachable
from hypha_site.api import EnumField, StrictSerializer


class DataNodeSerializer(serializers.ModelSerializer):
    """A data node serving slices over HTTP(S)."""

    reachable = EnumField(
        Reachable,
        read_only=True,
        help_text='whether trainers can connect to its URL, as it declared: "true", "false" or "auto" (not said)',
    )

    class Meta:
        model = DataNode
        fields = ["name", "url", "reachable", "online", "last_seen_at"]
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


class DatasetRegisteredSerializer(DatasetDetailSerializer):
    """The answer to a data node's registration: the dataset as registered, and the node's download key."""

    download_key = serializers.SerializerMethodField(
        help_text=(
            "The key this data node verifies slice download tokens with (HMAC-SHA256, hex): every slice URL the "
            "control plane hands out carries a `token` query parameter signed with it. Derived, not stored: "
            "the same on every registration of this node until its token or the control plane's secret changes."
        )
    )

    class Meta(DatasetDetailSerializer.Meta):
        fields = [*DatasetDetailSerializer.Meta.fields, "download_key"]
        read_only_fields = fields

    def get_download_key(self, dataset: Dataset) -> str:
        return self.context["download_key"]


@extend_schema_field({"oneOf": [{"type": "boolean"}, {"type": "string", "enum": ["auto"]}]})
class ReachableField(serializers.Field):
    """``true``, ``false`` or ``"auto"`` (the spelling of ``worker_daemon.protocol.Reachable``); nothing else, not
    even ``1`` or ``"yes"``."""

    default_error_messages = {"invalid": 'Must be true, false or "auto".'}

    def to_internal_value(self, data):
        if isinstance(data, bool) or data == "auto":
            return data
        self.fail("invalid")

    def to_representation(self, value):
        return value


class SliceAnnouncementSerializer(StrictSerializer):
    """One slice file as a data node announces it."""

    index = serializers.IntegerField(min_value=0, help_text="Slice index; a dataset's slices are 0..n-1.")
    size = serializers.IntegerField(min_value=1, help_text="Size of the slice file in bytes.")
    sha256 = serializers.RegexField(
        r"^[0-9a-f]{64}$", help_text="SHA-256 of the slice file, lowercase hex.", max_length=64
    )


class DatasetRegistrationSerializer(StrictSerializer):
    """A data node announcing a dataset it serves, and the public URL it serves it from."""

    name = serializers.RegexField(
        r"^[-a-zA-Z0-9_]+$", max_length=200, help_text="The dataset directory's basename (a slug)."
    )
    url = serializers.URLField(max_length=500, help_text="Public base URL the slices are downloaded from.")
    reachable = ReachableField(
        required=False,
        default="auto",
        help_text='Whether trainers can connect to `url`: true, false (NAT, a firewall) or "auto" (not said; '
        "the default, also for a data node that sends no `reachable`).",
    )
    slices = serializers.ListField(
        child=SliceAnnouncementSerializer(), allow_empty=False, help_text="Every slice, indices 0..n-1."
    )


# --- data nodes behind NAT publishing their slices to the relay's store (apps/datasets/publishing.py) --------


class PublishedSliceKeySerializer(StrictSerializer):
    """Which slice: a dataset the calling data node serves, and the slice's index."""

    dataset = serializers.RegexField(
        r"^[-a-zA-Z0-9_]+$", max_length=200, help_text="The dataset's name (the node registered it)."
    )
    index = serializers.IntegerField(min_value=0, max_value=2**31 - 1, help_text="The slice's index.")


class PublishSliceSerializer(PublishedSliceKeySerializer):
    """A slice the calling data node publishes: its size and SHA-256 must be the registered ones."""

    size = serializers.IntegerField(
        min_value=1, max_value=2**63 - 1, help_text="The slice file's size in bytes."
    )
    sha256 = serializers.RegexField(
        r"^[0-9a-f]{64}$", max_length=64, help_text="The slice file's SHA-256, lowercase hex."
    )


class PublishedSliceSerializer(serializers.Serializer):
    """A slice's copy in the store, as its data node published it."""

    dataset = serializers.CharField()
    index = serializers.IntegerField()
    size = serializers.IntegerField()
    sha256 = serializers.CharField()
    status = EnumField(
        PublishedSlice.Status,
        help_text="`pending` while its parts are being uploaded, `complete` once downloads are served from it",
    )


class PublicationPartSerializer(serializers.Serializer):
    """One part to PUT: exactly ``size`` bytes of the file from ``offset``, with ``Content-Length``."""

    number = serializers.IntegerField(help_text="1-based")
    offset = serializers.IntegerField()
    size = serializers.IntegerField()
    url = serializers.CharField(
        allow_null=True, help_text="Where to PUT the part (signed; expires); null for a part already stored."
    )
    done = serializers.BooleanField(help_text="The store holds this part already: nothing to send.")


class PublicationPlanSerializer(PublishedSliceSerializer):
    """The parts of a slice's upload, ``done`` for those the store holds already."""

    part_size = serializers.IntegerField(help_text="Bytes per part (the last part may be shorter).")
    parts = PublicationPartSerializer(many=True)
    expires_in = serializers.IntegerField(help_text="Seconds the part URLs stay valid.")
