"""Serializers of the leases API (read-only): leases and the event log of their transitions."""

from __future__ import annotations

from rest_framework import serializers

from apps.leases.models import Lease, LeaseEvent
from hypha_site.api import EnumField, ResourcesSerializer, status_filter, uuid_filter
from worker_daemon.protocol import PRICE_MEANING


class LeaseEventSerializer(serializers.ModelSerializer):
    """A transition of the lease (or its renewal), with the expiry it set."""

    kind = EnumField(LeaseEvent.Kind, read_only=True)

    class Meta:
        model = LeaseEvent
        fields = ["kind", "from_status", "to_status", "expires_at", "detail", "at"]
        read_only_fields = fields


class LeaseSerializer(serializers.ModelSerializer):
    """A time-bounded claim of a job role on a worker's resources."""

    worker = serializers.CharField(source="worker.name", read_only=True, help_text="the worker's name")
    status = EnumField(Lease.Status, read_only=True)
    resources = ResourcesSerializer(source="*", read_only=True)
    devices = serializers.ListField(
        child=serializers.IntegerField(),
        read_only=True,
        help_text="the device indices (CUDA ordinals) the lease holds on its worker; its tasks see only these",
    )

    class Meta:
        model = Lease
        fields = [
            "id",
            "job",
            "role",
            "worker",
            "status",
            "status_reason",
            "price",
            "resources",
            "devices",
            "expires_at",
            "renewals",
            "created_at",
            "activated_at",
            "ended_at",
        ]
        read_only_fields = fields
        extra_kwargs = {"price": {"help_text": f"the agreed price, {PRICE_MEANING}"}}


class LeaseDetailSerializer(LeaseSerializer):
    """A lease and the history of its transitions."""

    events = LeaseEventSerializer(many=True, read_only=True)

    class Meta(LeaseSerializer.Meta):
        fields = [*LeaseSerializer.Meta.fields, "events"]
        read_only_fields = fields


class LeaseFilterSerializer(serializers.Serializer):
    job = uuid_filter("only the leases of this job")
    worker = uuid_filter("only the leases on this worker (its id)")
    status = status_filter(Lease.Status, "only leases in this status")
    role = serializers.CharField(required=False, max_length=32, help_text="only leases of this role")
