"""Serializers of the jobs API: the job submission body (validated here, created by the service) and jobs."""

from __future__ import annotations

from django.db import models
from drf_spectacular.utils import extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from apps.accounting import services as accounting
from apps.accounting.api.serializers import COST_HELP, credits_field
from apps.datasets import services as dataset_services
from apps.jobs import inference, throughput
from apps.jobs import services as job_services
from apps.jobs import spec as job_spec
from apps.jobs.exceptions import SpecError
from apps.jobs.models import (
    DEFAULT_EXECUTORS,
    INFERENCE,
    PARAMETER_SERVER,
    ROLES,
    TRAINER,
    Job,
    JobEvent,
    Round,
    Task,
    Upload,
)
from apps.jobs.spec import (
    DEFAULT_ALLOCATION_TIMEOUT,
    MAX_ALLOCATION_TIMEOUT,
    MIN_ALLOCATION_TIMEOUT,
)
from apps.jobs.training import problems as transfer_problems
from apps.leases.models import Lease
from hypha_site.api import (
    EnumField,
    ExecutorSerializer,
    NumberField,
    ResourcesSerializer,
    StrictSerializer,
)
from worker_daemon.protocol import MAX_DEVICE_MEMORY, MAX_DEVICES, PRICE_MEANING

DEFAULT_RESOURCES = {"cpu": 1.0, "memory": 1.0, "storage": 0.0, "gpu": 0.0}
ALLOCATION_TIMEOUT_HELP = (
    "seconds after submission by which every role must have been leased once; a job not fully allocated by "
    "then gives back the leases it holds and fails (default 600)"
)

DEFAULT_BID = 100.0
DEFAULT_MAX_PRICE = 100.0
MAX_TRAINERS = 256

# --- the submission ---------------------------------------------------------------------------------------


@extend_schema_serializer(component_name="Resources")
class ResourcesInputSerializer(StrictSerializer):
    """Minimum resources per worker: CPU cores, memory GB, storage GB, GPU GB of VRAM."""

    cpu = NumberField(min_value=0, default=DEFAULT_RESOURCES["cpu"], help_text="CPU cores")
    memory = NumberField(min_value=0, default=DEFAULT_RESOURCES["memory"], help_text="memory, GB")
    storage = NumberField(min_value=0, default=DEFAULT_RESOURCES["storage"], help_text="storage, GB")
    gpu = NumberField(min_value=0, default=DEFAULT_RESOURCES["gpu"], help_text="GPU memory, GB of VRAM")
    devices = serializers.IntegerField(
        min_value=0,
        max_value=MAX_DEVICES,
        required=False,
        help_text="devices (GPUs) each worker gives the role alone; absent or 0: no device requirement",
    )
    device_memory = NumberField(
        min_value=0, max_value=MAX_DEVICE_MEMORY, required=False, help_text="GB of memory per device"
    )


@extend_schema_serializer(component_name="Price")
class PriceInputSerializer(StrictSerializer):
    """Price per worker: `bid` is broadcast to daemons; `max` is private, offers above it are declined."""

    bid = NumberField(min_value=0, default=DEFAULT_BID, help_text=f"public price per worker, {PRICE_MEANING}")
    max = NumberField(
        min_value=0, default=DEFAULT_MAX_PRICE, help_text=f"private maximum, at least `bid` ({PRICE_MEANING})"
    )

    def validate(self, attrs: dict) -> dict:
        if attrs["max"] < attrs["bid"]:
            raise serializers.ValidationError({"max": [f"Must be at least the bid ({attrs['bid']:.10g})."]})
        return attrs


@extend_schema_serializer(component_name="Executor")
class ExecutorInputSerializer(StrictSerializer):
    """The executor every worker of the role must offer."""

    # ``class`` is a Python keyword, so the fields are declared here rather than as class attributes.
    def get_fields(self) -> dict[str, serializers.Field]:
        return {
            "class": serializers.CharField(min_length=1, max_length=64, help_text="e.g. train, aggregate"),
            "name": serializers.CharField(min_length=1, max_length=128, help_text="e.g. diloco-transformer"),
        }


class _RoleInputSerializer(StrictSerializer):
    role: str

    resources = ResourcesInputSerializer(required=False)
    price = PriceInputSerializer(required=False)

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        fields["executor"] = ExecutorInputSerializer(
            required=False,
            default=DEFAULT_EXECUTORS[self.role],
            help_text=f"default: class {DEFAULT_EXECUTORS[self.role]['class']!r}, "
            f"name {DEFAULT_EXECUTORS[self.role]['name']!r}",
        )
        return fields


@extend_schema_serializer(component_name="TrainerRequirement")
class TrainerInputSerializer(_RoleInputSerializer):
    """What each trainer must have, what the job pays it, and the executor it runs."""

    role = TRAINER


class ReachablePolicy(models.TextChoices):
    """How a job weighs whether its parameter server's worker accepts inbound connections
    (``apps.market.models.Advertisement.Reachability``, which the market applies)."""

    PREFER = "prefer", "prefer"
    REQUIRE = "require", "require"
    ANY = "any", "any"


REACHABLE_HELP = (
    "whether its worker must accept inbound connections: `prefer` (default) ranks workers that declare "
    "`reachable = true` first (others count 5 % dearer), `require` takes only those, `any` ignores it; an "
    "unreachable parameter server is served through the relay"
)


@extend_schema_serializer(component_name="ParameterServerRequirement")
class ParameterServerInputSerializer(_RoleInputSerializer):
    """What the parameter server must have, what the job pays it, the executor it runs, and whether its worker
    must accept inbound connections."""

    role = PARAMETER_SERVER

    reachable = EnumField(ReachablePolicy, default=ReachablePolicy.PREFER, help_text=REACHABLE_HELP)


@extend_schema_serializer(component_name="JobSubmission")
class JobCreateSerializer(StrictSerializer):
    """A DiLoCo job: how many trainers, what each role needs and pays, and the rest of the specification."""

    name = serializers.CharField(max_length=200, allow_blank=True, default="", help_text="a label for you")
    num_trainers = serializers.IntegerField(
        min_value=1,
        max_value=MAX_TRAINERS,
        default=2,
        help_text="trainers to lease (plus one parameter server)",
    )
    trainer = TrainerInputSerializer(required=False)
    parameter_server = ParameterServerInputSerializer(required=False)
    spec = serializers.DictField(
        default=dict,
        help_text="The rest of the DiLoCo specification (model, dataset, optimizers, rounds, and optionally "
        "preprocessor, batch_size, trainers, evaluation, training, seed), checked as `POST /api/jobs/diloco/` "
        "checks a spec; `num_trainers`, the roles and `allocation_timeout` are this body's own fields and "
        "refused inside it. Non-empty, the job trains; default {}: a job that only leases workers.",
    )
    allocation_timeout = NumberField(
        min_value=MIN_ALLOCATION_TIMEOUT,
        max_value=MAX_ALLOCATION_TIMEOUT,
        default=DEFAULT_ALLOCATION_TIMEOUT,
        help_text=ALLOCATION_TIMEOUT_HELP,
    )

    def validate(self, attrs: dict) -> dict:
        # A non-empty spec makes a training job (apps.jobs.training.plans.is_training_job), parsed again at every
        # dispatch: it must pass every check of /api/jobs/diloco/ here, or a careless or hostile one is stored
        # and fails only after its leases were taken (and the private-URL check would be one POST away).
        if attrs["spec"]:
            self._check_training_spec(attrs)
        return attrs

    def _check_training_spec(self, attrs: dict) -> None:
        """Parse the spec with the submission's own fields, and pin it (``attrs``) as it will be stored."""
        misplaced = {key: [SUBMISSION_FIELD_IN_SPEC] for key in SUBMISSION_FIELDS if key in attrs["spec"]}
        if misplaced:
            raise serializers.ValidationError({"spec": misplaced})
        document = {
            **attrs["spec"],
            "trainer": _role_spec(attrs[TRAINER]),
            "parameter_server": _role_spec(attrs[PARAMETER_SERVER]),
            "allocation_timeout": attrs["allocation_timeout"],
        }
        errors: list[tuple[str, str]] = []
        # An omitted num_trainers is the pool's target when the spec has a pool (as in a DiLoCo spec); one given
        # must agree with it (said here, at num_trainers: the spec's own check would name the whole spec).
        pool = document.get("trainers")
        target = pool.get("target") if isinstance(pool, dict) else None
        if "num_trainers" in self.initial_data or target is None:
            # A target that is not a count of trainers is the spec's to report (at spec.trainers.target).
            valid_target = (
                isinstance(target, int) and not isinstance(target, bool) and 1 <= target <= MAX_TRAINERS
            )
            if valid_target and target != attrs["num_trainers"]:
                errors.append(
                    (
                        "num_trainers",
                        f"{attrs['num_trainers']} differs from spec.trainers.target ({target}); give one.",
                    )
                )
            else:
                document["num_trainers"] = attrs["num_trainers"]
        try:
            parsed = job_spec.parse_json(document)
        except SpecError as error:
            errors.extend((item["field"], item["message"]) for item in error.errors)
        if errors:
            raise serializers.ValidationError(_nested_errors(errors)) from None
        owner = self.context["request"].user
        problems = job_services.training_problems(parsed, owner)
        if problems:
            raise serializers.ValidationError(
                _nested_errors(
                    (field, message) for field, messages in problems.items() for message in messages
                )
            )
        attrs["num_trainers"] = parsed.num_trainers
        attrs["spec"] = job_services.spec_for_storage(parsed, owner)

    def service_arguments(self) -> dict:
        """Keyword arguments of :func:`apps.jobs.services.create_job` (besides ``owner``)."""
        data = self.validated_data
        return {
            "name": data["name"],
            "num_trainers": data["num_trainers"],
            "requirements": {role: _stored_requirement(data[role]) for role in ROLES},
            "spec": data["spec"],
            "allocation_timeout": data["allocation_timeout"],
        }


#: Fields of the submission that a DiLoCo spec also has: given once, outside ``spec``.
SUBMISSION_FIELDS = ("name", "num_trainers", TRAINER, PARAMETER_SERVER, "allocation_timeout")
SUBMISSION_FIELD_IN_SPEC = "A field of the submission itself: give it next to `spec`, not inside it."


def _role_spec(block: dict) -> dict:
    """A validated role block as the DiLoCo spec's role (its executor is the job's requirement alone)."""
    role = {"resources": dict(block["resources"]), "price": dict(block["price"])}
    if "reachable" in block:
        role["reachable"] = block["reachable"]
    return role


def _nested_errors(errors) -> dict:
    """``(dotted spec path, message)`` pairs as a 400 body like the serializer's own: the submission's fields
    (``num_trainers``, the roles, ``allocation_timeout``) at the top, the rest under ``spec``, each path as
    nested objects (``{"spec": {"model": {"type": [...]}}}``); an error of the whole spec, or of an object that
    also has errors inside, is its ``non_field_errors``."""
    body: dict = {}
    for path, message in errors:
        parts = [part for part in path.split(".") if part] if path else []
        if not parts or parts[0] not in SUBMISSION_FIELDS:
            parts = ["spec", *parts]
        node = body
        for part in parts[:-1]:
            child = node.get(part)
            if isinstance(child, list):
                child = node[part] = {"non_field_errors": child}
            node = node.setdefault(part, {}) if child is None else child
        leaf = node.get(parts[-1])
        if isinstance(leaf, dict):
            leaf.setdefault("non_field_errors", []).append(message)
        else:
            node.setdefault(parts[-1], []).append(message)
    return body


def _stored_requirement(block: dict) -> dict:
    """The submitted role block in the shape :meth:`apps.jobs.models.Job.requirement` reads."""
    stored = {
        "resources": dict(block["resources"]),
        "executor": dict(block["executor"]),
        "bid": block["price"]["bid"],
        "max": block["price"]["max"],
    }
    if "reachable" in block:
        stored["reachable"] = block["reachable"]
    return stored


# --- jobs -------------------------------------------------------------------------------------------------


class PriceSerializer(serializers.Serializer):
    """Price per worker: `bid` is public, `max` is private to the job's owner and staff."""

    bid = serializers.FloatField(read_only=True, help_text=PRICE_MEANING)
    max = serializers.FloatField(read_only=True, help_text=PRICE_MEANING)


class RoleRequirementSerializer(serializers.Serializer):
    """A role of the job as it was submitted (defaults filled in)."""

    resources = ResourcesSerializer(read_only=True)
    price = PriceSerializer(read_only=True)
    executor = ExecutorSerializer(read_only=True)


class ParameterServerRoleSerializer(RoleRequirementSerializer):
    """The parameter server's role as it was submitted (defaults filled in)."""

    reachable = EnumField(ReachablePolicy, read_only=True, help_text=REACHABLE_HELP)


def submitted_role(job: Job, role: str) -> dict:
    """The stored requirement of ``role`` in the shape it was submitted in."""
    entry = job.requirements.get(role) or {}
    submitted = {
        "resources": {name: entry.get("resources", {}).get(name, 0.0) for name in DEFAULT_RESOURCES},
        "price": {"bid": entry.get("bid"), "max": entry.get("max")},
        "executor": entry.get("executor") or DEFAULT_EXECUTORS[role],
    }
    if role == PARAMETER_SERVER:
        submitted["reachable"] = entry.get("reachable", "prefer")  # absent: "prefer", as Job.requirement
    return submitted


class DataProgressSerializer(serializers.Serializer):
    epoch = serializers.IntegerField(allow_null=True)
    available = serializers.IntegerField()
    assigned = serializers.IntegerField()
    used = serializers.IntegerField()
    total = serializers.IntegerField()


class JobLeaseSerializer(serializers.ModelSerializer):
    """A lease the job holds (or held) on a worker."""

    worker = serializers.CharField(source="worker.name", read_only=True, help_text="the worker's name")
    worker_id = serializers.UUIDField(
        read_only=True, help_text="the worker's id: its entry is GET /api/workers/{worker_id}/"
    )
    status = EnumField(Lease.Status, read_only=True)
    devices = serializers.ListField(
        child=serializers.IntegerField(),
        read_only=True,
        help_text="the device indices (CUDA ordinals) the lease holds on its worker; its tasks see only these",
    )

    class Meta:
        model = Lease
        fields = ["id", "role", "worker", "worker_id", "status", "devices", "expires_at", "renewals", "price"]
        read_only_fields = fields
        extra_kwargs = {"price": {"help_text": f"the agreed price, {PRICE_MEANING}"}}


class JobEventSerializer(serializers.ModelSerializer):
    """A transition of the job's status, and why."""

    class Meta:
        model = JobEvent
        fields = ["from_status", "to_status", "reason", "at"]
        read_only_fields = fields


class JobSerializer(serializers.ModelSerializer):
    """A job, its allocation status (`status_reason` says why) and its leases."""

    owner = serializers.CharField(source="owner.username", read_only=True, help_text="the owner's username")
    status = EnumField(Job.Status, read_only=True)
    kind = EnumField(Job.Kind, read_only=True, help_text="training (DiLoCo) or inference (docs/inference.md)")
    trainer = serializers.SerializerMethodField(help_text="a training job's trainer role; null for inference")
    parameter_server = serializers.SerializerMethodField(
        help_text="a training job's parameter server role; null for inference"
    )
    inference = serializers.SerializerMethodField(
        help_text="an inference job's worker role (docs/inference.md); null for training"
    )
    spec = serializers.DictField(
        read_only=True,
        help_text="the rest of the DiLoCo specification, as submitted (an inference job's: its inference "
        "specification, docs/inference.md)",
    )
    leases = JobLeaseSerializer(many=True, read_only=True)

    class Meta:
        model = Job
        fields = [
            "id",
            "name",
            "owner",
            "status",
            "status_reason",
            "kind",
            "num_trainers",
            "trainer",
            "parameter_server",
            "inference",
            "spec",
            "leases",
            "created_at",
            "allocated_at",
            "ended_at",
            "allocation_timeout",
        ]
        read_only_fields = fields
        extra_kwargs = {"allocation_timeout": {"help_text": ALLOCATION_TIMEOUT_HELP}}

    @extend_schema_field(RoleRequirementSerializer(allow_null=True))
    def get_trainer(self, job: Job) -> dict | None:
        return submitted_role(job, TRAINER) if TRAINER in job.roles else None

    @extend_schema_field(ParameterServerRoleSerializer(allow_null=True))
    def get_parameter_server(self, job: Job) -> dict | None:
        return submitted_role(job, PARAMETER_SERVER) if PARAMETER_SERVER in job.roles else None

    @extend_schema_field(RoleRequirementSerializer(allow_null=True))
    def get_inference(self, job: Job) -> dict | None:
        return submitted_role(job, INFERENCE) if INFERENCE in job.roles else None


class ThroughputSerializer(serializers.Serializer):
    """Throughput and device facts (see docs/observability.md): rates per second of train time; each is null
    when no trainer reported it."""

    samples_per_second = serializers.FloatField(allow_null=True, help_text="samples per second")
    tokens_per_second = serializers.FloatField(
        allow_null=True, help_text="tokens per second (token models only)"
    )
    peak_memory_bytes = serializers.FloatField(
        allow_null=True, help_text="peak CUDA memory allocated, bytes (CUDA only)"
    )
    mfu = serializers.FloatField(
        allow_null=True,
        help_text="model FLOPs utilisation, 6 × parameters × tokens/s ÷ the device's peak FLOPS (0..1); null "
        "when the device's peak is unknown",
    )


class RoundThroughputSerializer(ThroughputSerializer):
    """A round's throughput: rates summed over its trainers, the highest peak memory, the mean MFU; and each
    trainer's own (by worker id)."""

    trainers = serializers.DictField(
        child=serializers.DictField(child=serializers.FloatField()),
        help_text="by worker id: the samples_per_second, tokens_per_second, peak_memory_bytes and mfu it "
        "reported (those it has)",
    )


class VerdictSerializer(serializers.Serializer):
    """The parameter server's verdict on one trainer's update in a round (docs/training.md)."""

    verdict = serializers.ChoiceField(
        choices=["accepted", "down-weighted", "rejected"],
        help_text="rejected: left out of the round's mean; down-weighted: counted with a smaller weight "
        "(e.g. its norm clipped)",
    )
    reason = serializers.CharField(help_text="why (empty for an accepted update); at most 500 characters")
    norm_ratio = serializers.FloatField(
        allow_null=True, help_text="its norm ÷ the round's median update norm; null when not measured"
    )
    cosine = serializers.FloatField(
        allow_null=True,
        help_text="its cosine similarity to the mean of the other updates; null when not measured (fewer "
        "than 3 updates)",
    )
    validation_loss = serializers.FloatField(
        required=False,
        allow_null=True,
        help_text="the held-out loss of the global weights with this update alone applied; present only in "
        "rounds that ran the validation step (`rounds.verification.validation_every`)",
    )
    loss_ratio = serializers.FloatField(
        required=False,
        allow_null=True,
        help_text="validation_loss ÷ the global weights' held-out loss; over "
        "`rounds.verification.max_validation_rise` the update is rejected",
    )

    def to_representation(self, instance: object) -> dict:
        body = super().to_representation(instance)
        for name in ("validation_loss", "loss_ratio"):  # only a round that validated has them
            if isinstance(instance, dict) and name not in instance:
                body.pop(name, None)
        return body


class RoundSerializer(serializers.ModelSerializer):
    """One outer round: what the parameter server averaged, the global model's eval loss, and the trainers'
    reported metrics (by worker id)."""

    class Meta:
        model = Round
        fields = [
            "number",
            "closed",
            "participants",
            "left_out",
            "refused",
            "verdicts",
            "samples",
            "duration",
            "arrivals",
            "bytes_in",
            "bytes_out",
            "transfers",
            "encoding",
            "mean_loss",
            "eval_loss",
            "eval_error",
            "discarded",
            "discard_reason",
            "discard_requested_at",
            "trainer_metrics",
            "throughput",
            "created_at",
            "closed_at",
            "reported",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "closed": {"help_text": "the parameter server applied this round (its report or its checkpoint)"},
            "samples": {"help_text": "samples the round's participants trained on; 0 until `reported`"},
            "bytes_in": {"help_text": "bytes of updates the parameter server received in the round, encoded"},
            "bytes_out": {
                "help_text": "bytes the parameter server sent in the round, encoded: the round's result to "
                "each participant that fetched it (round 1: the initial model files too); 0 until `reported`"
            },
            "duration": {
                "help_text": "seconds from the round's first update to its close; null until `reported`"
            },
        }

    throughput = serializers.SerializerMethodField(
        help_text="the trainers' samples/s, tokens/s, peak device memory and MFU in this round"
    )
    verdicts = serializers.DictField(
        child=VerdictSerializer(),
        read_only=True,
        help_text="by worker id: the parameter server's verdict on its update in this round; empty when the "
        "round was not verified (the job's aggregation does not verify, or an older parameter server). A "
        "trainer rejected in `rounds.verification.max_rejections` (default `HYPHA_MAX_REJECTIONS`, 3) rounds "
        "in a row loses its lease and the role is advertised again",
    )

    @extend_schema_field(RoundThroughputSerializer)
    def get_throughput(self, round_: Round) -> dict:
        return throughput.of_round(round_.trainer_metrics)

    reported = serializers.BooleanField(
        read_only=True,
        help_text="the parameter server's report of the round arrived, so its samples, duration and bytes are "
        "known; false for a round closed by its checkpoint alone (the job ended before the report came)",
    )


class TransferProblemSerializer(serializers.Serializer):
    """A peer a task's transfers cannot reach (the latest report; it goes once the peer answers again)."""

    peer = serializers.CharField(
        read_only=True,
        help_text="the parameter server's peer id (its worker id), or the data node's host:port",
    )
    role = serializers.ChoiceField(
        choices=["parameter_server", "data_node"], read_only=True, help_text="what the peer is"
    )
    url = serializers.CharField(read_only=True, help_text="what was called, without its query")
    operation = serializers.CharField(read_only=True, help_text="e.g. 'round 3 update', 'slice download (…)'")
    cause = serializers.CharField(read_only=True, help_text="the last failure, e.g. 'Connect call failed …'")
    attempts = serializers.IntegerField(read_only=True, help_text="failed attempts in a row")
    since = serializers.DateTimeField(read_only=True, help_text="when the first of them failed")
    updated_at = serializers.DateTimeField(read_only=True, help_text="when the last report came")


class JobTransferProblemSerializer(TransferProblemSerializer):
    """A transfer problem of one of the job's tasks, and whose."""

    task = serializers.UUIDField(read_only=True, help_text="the task that reported it")
    task_status = EnumField(Task.Status, read_only=True)
    worker = serializers.CharField(read_only=True, help_text="the name of the task's worker")


class TaskSerializer(serializers.ModelSerializer):
    """A role's process on a worker: its status, exit, and (trainers) its progress in the sync protocol."""

    worker = serializers.CharField(source="lease.worker.name", read_only=True, help_text="the worker's name")
    worker_id = serializers.UUIDField(source="lease.worker_id", read_only=True)
    status = EnumField(Task.Status, read_only=True)
    sync_state = EnumField(Task.Sync, read_only=True)
    transfer_problems = serializers.SerializerMethodField(
        help_text="peers its transfers cannot reach now (or could not when it failed), the oldest first"
    )

    class Meta:
        model = Task
        fields = [
            "id",
            "role",
            "worker",
            "worker_id",
            "status",
            "url",
            "sync_state",
            "round",
            "steps_in_round",
            "ahead_steps",
            "steps_total",
            "samples_total",
            "batch_size",
            "step_interval",
            "last_loss",
            "exit_code",
            "signal",
            "reason",
            "log_tail",
            "transfer_problems",
            "dispatched_at",
            "started_at",
            "first_step_at",
            "ended_at",
        ]
        read_only_fields = fields

    @extend_schema_field(TransferProblemSerializer(many=True))
    def get_transfer_problems(self, task: Task) -> list[dict]:
        shown = transfer_problems.entries(task) if transfer_problems.shown(task) else []
        return TransferProblemSerializer(shown, many=True).data


class InferenceProgressSerializer(serializers.Serializer):
    """An inference job's slices with an accepted result, of all its slices, and its verification
    (docs/inference.md, "Verification")."""

    slices_done = serializers.IntegerField()
    slices_total = serializers.IntegerField()
    verified = serializers.IntegerField(help_text="slices settled by two workers' agreeing results")
    disputed = serializers.IntegerField(
        help_text="slices whose computations disagree, awaiting another worker"
    )
    rejected = serializers.IntegerField(help_text="results that lost a verification")


class JobDetailSerializer(JobSerializer):
    """A job with its leases, tasks, rounds, data-slice progress, model files and the history of its status."""

    progress = serializers.SerializerMethodField(
        help_text="an inference job's slices done (their results stored) of all; null for a training job"
    )

    transfer_problems = serializers.SerializerMethodField(
        help_text="peers (parameter server, data nodes) the job's running or failed tasks cannot reach, the "
        "oldest first; each goes once its peer answers again"
    )
    events = JobEventSerializer(many=True, read_only=True)
    tasks = TaskSerializer(many=True, read_only=True)
    rounds = RoundSerializer(many=True, read_only=True)
    throughput = serializers.SerializerMethodField(
        help_text="the job's throughput: the latest round's samples/s and tokens/s (summed over its trainers), "
        "the highest peak device memory and the mean MFU over its rounds"
    )
    data = serializers.SerializerMethodField(help_text="slices of the current epoch by state")
    model_files = serializers.DictField(
        read_only=True, help_text="the final model's files: {name: {size, sha256}}; download at …/model"
    )
    cost = serializers.SerializerMethodField(help_text=COST_HELP)
    below_min_since = serializers.DateTimeField(
        read_only=True,
        allow_null=True,
        help_text="an elastic pool's: since when the running job has had fewer than its min trainers (null: enough)",
    )
    paused_at = serializers.DateTimeField(
        read_only=True,
        allow_null=True,
        help_text="when the job paused below its pool's min for longer than the grace (null: not paused); it "
        "fails allocation_timeout seconds later unless trainers are back to min (docs/training.md, Elastic pools)",
    )

    class Meta(JobSerializer.Meta):
        fields = [
            *JobSerializer.Meta.fields,
            "cost",
            "below_min_since",
            "paused_at",
            "transfer_problems",
            "tasks",
            "rounds",
            "throughput",
            "data",
            "progress",
            "model_files",
            "events",
        ]
        read_only_fields = fields

    @extend_schema_field(InferenceProgressSerializer(allow_null=True))
    def get_progress(self, job: Job) -> dict | None:
        return inference.progress(job) if inference.is_inference_job(job) else None

    @extend_schema_field(JobTransferProblemSerializer(many=True))
    def get_transfer_problems(self, job: Job) -> list[dict]:
        return JobTransferProblemSerializer(transfer_problems.of_job(job), many=True).data

    @extend_schema_field(credits_field())
    def get_cost(self, job: Job) -> str:
        return str(accounting.job_cost(job.pk))

    @extend_schema_field(ThroughputSerializer)
    def get_throughput(self, job: Job) -> dict:
        return throughput.of_job(job.rounds.all())

    @extend_schema_field(DataProgressSerializer)
    def get_data(self, job: Job) -> dict:
        return dataset_services.progress(job)


class JobSubmittedSerializer(JobDetailSerializer):
    """The job just submitted, and why the connected fleet cannot serve it now (it is accepted all the same:
    workers may connect; a job not fully allocated within its `allocation_timeout` fails)."""

    warnings = serializers.SerializerMethodField(
        help_text="e.g. '2 of the 6 trainers cannot be served now: 4 connected workers fit the trainer role'; "
        "empty when the connected workers can serve every role"
    )

    class Meta(JobDetailSerializer.Meta):
        fields = [*JobDetailSerializer.Meta.fields, "warnings"]
        read_only_fields = fields

    def get_warnings(self, job: Job) -> list[str]:
        return list(self.context.get("warnings", []))


class UploadSerializer(serializers.ModelSerializer):
    """A file you uploaded; name it (by id or file name) in a job's `{"type": "upload", "file": …}` source."""

    class Meta:
        model = Upload
        fields = ["id", "name", "size", "sha256", "created_at"]
        read_only_fields = fields


# --- GET /api/jobs/{id}/metrics/ (documentation only: apps.jobs.metrics.job_metrics builds the body) ---------


def _number_list(help_text: str) -> serializers.ListField:
    return serializers.ListField(child=serializers.FloatField(allow_null=True), help_text=help_text)


class MetricPointsSerializer(serializers.Serializer):
    step = serializers.ListField(
        child=serializers.IntegerField(),
        help_text="The last step of each point's bucket (the trainer's count).",
    )
    time = _number_list("Unix time of the bucket's last step (the control plane's clock).")
    count = serializers.ListField(child=serializers.IntegerField(), help_text="Steps each point stands for.")
    loss = _number_list("Count-weighted mean training loss of the bucket's steps.")
    loss_min = _number_list("Lowest loss in the bucket.")
    loss_max = _number_list("Highest loss in the bucket.")
    lr = _number_list("Learning rate.")
    samples_per_second = _number_list("Samples per second of step time.")
    tokens_per_second = _number_list("Tokens per second of step time (token models only).")


class TrainerMetricsSerializer(serializers.Serializer):
    task = serializers.UUIDField()
    worker_id = serializers.CharField()
    worker = serializers.CharField(help_text="The worker's name.")
    stride = serializers.IntegerField(help_text="Steps per point (doubles each time the series is merged).")
    steps = serializers.IntegerField(help_text="The last step the series covers.")
    points = MetricPointsSerializer()


class MeanLossSerializer(serializers.Serializer):
    step = serializers.ListField(child=serializers.IntegerField())
    loss = serializers.ListField(child=serializers.FloatField())
    trainers = serializers.ListField(
        child=serializers.IntegerField(), help_text="How many trainers had a loss in each bucket."
    )


class RoundMetricsSerializer(serializers.Serializer):
    number = serializers.IntegerField()
    closed = serializers.BooleanField()
    closed_at = serializers.DateTimeField(allow_null=True)
    mean_loss = serializers.FloatField(allow_null=True)
    eval_loss = serializers.FloatField(allow_null=True)
    bytes_in = serializers.IntegerField()
    bytes_out = serializers.IntegerField()
    samples = serializers.IntegerField()
    duration = serializers.FloatField(allow_null=True)
    throughput = RoundThroughputSerializer(help_text="the trainers' samples/s, tokens/s, peak memory and MFU")


class JobMetricsSerializer(serializers.Serializer):
    job = serializers.UUIDField()
    status = serializers.CharField()
    final = serializers.BooleanField()
    max_points = serializers.IntegerField(help_text="The points kept per series (HYPHA_METRICS_MAX_POINTS).")
    trainers = TrainerMetricsSerializer(many=True)
    mean = MeanLossSerializer()
    rounds = RoundMetricsSerializer(many=True)
