"""Serializers of the workers API. The token is shown once, when it is issued; its hash never leaves the server."""

from __future__ import annotations

from rest_framework import serializers
from rest_framework.validators import UniqueValidator

from apps.leases.models import Lease
from apps.workers.models import Reachable, Worker
from hypha_site.api import EnumField, ExecutorSerializer, ResourcesSerializer, StrictSerializer


class WorkerCreateSerializer(StrictSerializer):
    """A new worker; its token is returned once, in the response."""

    name = serializers.SlugField(
        max_length=100,
        help_text="Unique name: letters, digits, '-' and '_'.",
        validators=[
            UniqueValidator(queryset=Worker.objects.all(), message="A worker with this name already exists.")
        ],
    )


class WorkerLeaseSerializer(serializers.ModelSerializer):
    """A live (temporary or active) lease on the worker."""

    status = EnumField(Lease.Status, read_only=True)
    resources = ResourcesSerializer(source="*", read_only=True)

    class Meta:
        model = Lease
        fields = ["id", "job", "role", "status", "price", "resources", "expires_at", "renewals"]
        read_only_fields = fields


class WorkerSerializer(serializers.ModelSerializer):
    """A worker: what its daemon last reported, its presence, and its live leases."""

    owner = serializers.CharField(
        source="owner.username",
        read_only=True,
        allow_null=True,
        help_text="the owner's username (null for a worker created without one)",
    )
    status = EnumField(Worker.Status, read_only=True, help_text="online while its daemon is connected")
    resources = ResourcesSerializer(source="*", read_only=True, help_text="capacity its daemon last reported")
    executors = ExecutorSerializer(many=True, read_only=True)
    revoked = serializers.BooleanField(
        source="is_revoked",
        read_only=True,
        help_text="true once its token is revoked: its daemon cannot connect",
    )
    leases = WorkerLeaseSerializer(source="live_leases", many=True, read_only=True)
    reachable = EnumField(
        Reachable,
        read_only=True,
        help_text="whether trainers can connect to its parameter server's public URL, as its daemon declares: "
        '"true", "false", or "auto" (not said); the market prefers "true" for parameter servers',
    )
    benchmark_score = serializers.FloatField(
        read_only=True,
        allow_null=True,
        help_text="training samples per second on the standard benchmark workload (higher is faster); "
        "null until its daemon reports one",
    )
    benchmark = serializers.JSONField(
        read_only=True,
        help_text="the last benchmark's details: device, device_name, model, parameters, batch_size, "
        "sequence_length, threads, warmup_steps, steps, step_seconds (median), duration_seconds, slowdown, "
        "torch_version, measured_at; error and error_at when the latest run failed; {} before any",
    )

    class Meta:
        model = Worker
        fields = [
            "id",
            "name",
            "owner",
            "resources",
            "executors",
            "price_floor",
            "strategy",
            "reachable",
            "benchmark_score",
            "benchmark",
            "status",
            "last_seen_at",
            "connected_at",
            "token_hint",
            "revoked",
            "token_revoked_at",
            "created_at",
            "leases",
        ]
        read_only_fields = fields


class WorkerWithTokenSerializer(WorkerSerializer):
    """A worker and its new token. The token is shown only in this response: keep it for the daemon."""

    token = serializers.SerializerMethodField(help_text="give it to hypha-worker-daemon; shown only once")

    class Meta(WorkerSerializer.Meta):
        fields = [*WorkerSerializer.Meta.fields, "token"]
        read_only_fields = fields

    def get_token(self, worker: Worker) -> str:
        return self.context["token"]
