"""Serializers of the workers API. The token is shown once, when it is issued; its hash never leaves the server.

A worker has two views: the full one (:class:`WorkerSerializer`) for its owner and staff, and the public one
(:class:`PublicWorkerSerializer`) for every other signed-in user, who sees the pool but not who runs it.
"""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.validators import UniqueValidator

from apps.accounting import services as accounting
from apps.accounting.api.serializers import EARNINGS_HELP, credits_field
from apps.leases.models import Lease
from apps.workers import services
from apps.workers.models import Reachable, Worker, WorkerRecord
from hypha_site.api import EnumField, ExecutorSerializer, ResourcesSerializer, StrictSerializer
from worker_daemon.protocol import PRICE_MEANING


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
    devices = serializers.ListField(
        child=serializers.IntegerField(),
        read_only=True,
        help_text="the device indices (CUDA ordinals) the lease holds on its worker; its tasks see only these",
    )

    class Meta:
        model = Lease
        fields = ["id", "job", "role", "status", "price", "resources", "devices", "expires_at", "renewals"]
        read_only_fields = fields
        extra_kwargs = {"price": {"help_text": f"the agreed price, {PRICE_MEANING}"}}


class DeviceSerializer(serializers.Serializer):
    """One device (GPU) of a worker, as its daemon declares it."""

    index = serializers.IntegerField(read_only=True, help_text="its CUDA ordinal on the worker")
    memory = serializers.FloatField(read_only=True, help_text="its memory, GB")
    name = serializers.CharField(read_only=True, help_text="its name, as configured (may be empty)")


class ReputationSerializer(serializers.ModelSerializer):
    """A worker's record (docs/architecture.md, "Reputation"): what became of its updates and leases, the jobs it
    served, its speed against its benchmark, and the reliability the market ranks and filters its offers by."""

    reliability = serializers.FloatField(
        read_only=True,
        help_text="(accepted + down_weighted/2 + leases_completed + 1) / (all updates, leases and lost inference results + 2), in (0, 1): "
        "0.5 for a new worker; the market divides an offer's price per capacity by it (relative to 0.5) and "
        "declines offers below a job's min_reliability",
    )

    class Meta:
        model = WorkerRecord
        fields = [
            "reliability",
            "updates_accepted",
            "updates_down_weighted",
            "updates_rejected",
            "leases_completed",
            "leases_lost",
            "jobs_served",
            "results_lost",
            "speed_vs_benchmark",
            "speed_rounds",
        ]
        read_only_fields = fields


class PublicWorkerSerializer(serializers.ModelSerializer):
    """A worker of the pool as any signed-in user sees it: what it offers, and nothing of who runs it.

    Its public facts are its name, presence, capacity, executors, price floor and benchmark score, and the live
    leases of *your own* jobs on it. Never its owner, its token or the token's state, its presence log, its
    benchmark's details (device names, library versions, error text) or another user's leases: a user must not
    learn who runs a worker, nor another user's jobs through it, nor its reputation (its owner's business).
    """

    status = EnumField(Worker.Status, read_only=True, help_text="online while its daemon is connected")
    resources = ResourcesSerializer(source="*", read_only=True, help_text="capacity its daemon last reported")
    devices = DeviceSerializer(
        many=True,
        read_only=True,
        help_text="its devices (GPUs) as its daemon last reported them; empty when it lists none",
    )
    executors = ExecutorSerializer(many=True, read_only=True)
    price_floor = serializers.FloatField(
        read_only=True,
        help_text=f"the lowest price it offers at, as its daemon declares ({PRICE_MEANING})",
    )
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
    view = serializers.SerializerMethodField(
        help_text='which view of the worker this is: "full" for its owner and staff, "public" for everyone else'
    )
    leases = serializers.SerializerMethodField(
        help_text="the live (temporary or active) leases of your own jobs on it; another user's never show"
    )

    class Meta:
        model = Worker
        fields = [
            "id",
            "view",
            "name",
            "status",
            "resources",
            "devices",
            "executors",
            "price_floor",
            "reachable",
            "benchmark_score",
            "leases",
        ]
        read_only_fields = fields

    #: The value of ``view``: which of the two views an entry of the list is.
    VIEW = "public"

    @extend_schema_field({"type": "string", "enum": ["full", "public"]})
    def get_view(self, worker: Worker) -> str:
        return self.VIEW

    @extend_schema_field(WorkerLeaseSerializer(many=True))
    def get_leases(self, worker: Worker) -> list[dict]:
        user = self.context["request"].user
        yours = [lease for lease in worker.live_leases if lease.job.owner_id == user.pk]
        return WorkerLeaseSerializer(yours, many=True).data


class WorkerSerializer(PublicWorkerSerializer):
    """A worker as its owner and staff see it: what its daemon last reported, its presence, its token's state,
    and every live lease on it."""

    owner = serializers.CharField(
        source="owner.username",
        read_only=True,
        allow_null=True,
        help_text="the owner's username (null for a worker created without one)",
    )
    revoked = serializers.BooleanField(
        source="is_revoked",
        read_only=True,
        help_text="true once its token is revoked: its daemon cannot connect",
    )
    leases = WorkerLeaseSerializer(source="live_leases", many=True, read_only=True)
    earnings = serializers.SerializerMethodField(help_text=EARNINGS_HELP)
    reputation = serializers.SerializerMethodField(
        help_text="its record and reliability (docs/architecture.md, Reputation); its owner and staff only"
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
            "view",
            "name",
            "owner",
            "resources",
            "devices",
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
            "earnings",
            "reputation",
        ]
        read_only_fields = fields

    VIEW = "full"

    @extend_schema_field(ReputationSerializer)
    def get_reputation(self, worker: Worker) -> dict:
        # No record yet: all zero, at the prior.
        record = getattr(worker, "record", None) or WorkerRecord(worker=worker)
        return ReputationSerializer(record).data

    @extend_schema_field(credits_field())
    def get_earnings(self, worker: Worker) -> str:
        return str(accounting.worker_earnings(worker.pk))


class WorkerEntrySerializer(serializers.BaseSerializer):
    """A worker as the caller may see it: :class:`WorkerSerializer` for the workers they own (staff: every
    worker), :class:`PublicWorkerSerializer` for the rest of the pool. Needs the request in its context."""

    def to_representation(self, worker: Worker) -> dict:
        user = self.context["request"].user
        serializer = WorkerSerializer if services.manages(user, worker) else PublicWorkerSerializer
        return serializer(worker, context=self.context).data


class WorkerEntrySchema(OpenApiSerializerExtension):
    """The schema of :class:`WorkerEntrySerializer`: ``anyOf`` the two views, not ``oneOf``, because a full entry
    has every key of the public one and so matches both; ``view`` tells them apart."""

    target_class = WorkerEntrySerializer

    def map_serializer(self, auto_schema, direction) -> dict:
        views = (WorkerSerializer, PublicWorkerSerializer)
        return {"anyOf": [auto_schema.resolve_serializer(view, direction).ref for view in views]}


class WorkerWithTokenSerializer(WorkerSerializer):
    """A worker and its new token. The token is shown only in this response: keep it for the daemon."""

    token = serializers.SerializerMethodField(help_text="give it to hypha-worker-daemon; shown only once")

    class Meta(WorkerSerializer.Meta):
        fields = [*WorkerSerializer.Meta.fields, "token"]
        read_only_fields = fields

    def get_token(self, worker: Worker) -> str:
        return self.context["token"]
