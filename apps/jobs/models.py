"""Jobs: a DiLoCo training run (N trainers + 1 parameter server) or a batch inference job (N inference
workers, docs/inference.md), and what it needs from the market.

State machine (every transition records a :class:`JobEvent`; ``status_reason`` always says why)::

    PENDING ──▶ ALLOCATING ◀──▶ ALLOCATED ──▶ RUNNING ──▶ COMPLETED
       │            │              │             │
       └────────────┴──────────────┴─────────────┴──▶ CANCELLED | FAILED

ALLOCATED → ALLOCATING happens when a lease is lost (expired or released) and the role is re-advertised.
PENDING | ALLOCATING → FAILED when the job was never fully allocated within ``allocation_timeout`` seconds of
its submission (``apps.jobs.allocation``).
RUNNING is entered when training is dispatched (the parameter server first, then the trainers, see
``apps.jobs.training``); COMPLETED when the last round is applied and the final model stored.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from apps.jobs.exceptions import JobTransitionRefused
from worker_daemon.protocol import ExecutorDescriptor, Resources

TRAINER = "trainer"
PARAMETER_SERVER = "parameter_server"
#: The one role of a batch inference job (docs/inference.md): N workers, each processing slice after slice.
INFERENCE = "inference"
#: The roles of a training job (``Job.roles`` is a job's own: an inference job has only :data:`INFERENCE`).
ROLES = (TRAINER, PARAMETER_SERVER)
INFERENCE_ROLES = (INFERENCE,)
ROLE_LABELS = {
    TRAINER: ("trainer", "trainers"),
    PARAMETER_SERVER: ("parameter server", "parameter servers"),
    INFERENCE: ("inference worker", "inference workers"),
}

DEFAULT_EXECUTORS = {
    TRAINER: {"class": "train", "name": "diloco-transformer"},
    PARAMETER_SERVER: {"class": "aggregate", "name": "parameter-server"},
    INFERENCE: {"class": "inference", "name": "batch-inference"},
}


@dataclass(frozen=True)
class RoleRequirement:
    """What one role of a job asks of each worker, and how many workers it needs."""

    role: str
    count: int
    resources: Resources
    executor: ExecutorDescriptor
    bid: float
    max_price: float
    #: How its advert weighs reachable workers: "any", "prefer" or "require" (``apps.market.targeting``).
    reachable: str = "any"
    #: Devices (GPUs) per worker, each of at least ``device_memory`` GB; 0: no device requirement.
    devices: int = 0
    device_memory: float = 0.0
    #: Offers from workers of a lower reliability are declined (``apps.workers.models.WorkerRecord``); 0: any.
    min_reliability: float = 0.0


class Job(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending", "pending"
        ALLOCATING = "allocating", "allocating"
        ALLOCATED = "allocated", "allocated"
        RUNNING = "running", "running"
        COMPLETED = "completed", "completed"
        CANCELLED = "cancelled", "cancelled"
        FAILED = "failed", "failed"

    class Kind(models.TextChoices):
        TRAINING = "training", "training"
        INFERENCE = "inference", "inference"

    FINAL = (Status.COMPLETED, Status.CANCELLED, Status.FAILED)
    TRANSITIONS = {
        Status.PENDING: {Status.ALLOCATING, Status.CANCELLED, Status.FAILED},
        Status.ALLOCATING: {Status.ALLOCATING, Status.ALLOCATED, Status.CANCELLED, Status.FAILED},
        Status.ALLOCATED: {
            Status.ALLOCATED,
            Status.ALLOCATING,
            Status.RUNNING,
            Status.CANCELLED,
            Status.FAILED,
        },
        Status.RUNNING: {
            Status.RUNNING,
            Status.ALLOCATING,
            Status.COMPLETED,
            Status.CANCELLED,
            Status.FAILED,
        },
    }

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    name = models.CharField(max_length=200, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    status_reason = models.CharField(max_length=500, blank=True)
    #: A DiLoCo training run, or a batch inference job (``spec`` is then an ``InferenceSpec``, docs/inference.md).
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.TRAINING)
    num_trainers = models.PositiveIntegerField(default=2)
    #: ``{role: {"resources": {...}, "executor": {"class", "name"}, "bid": float, "max": float}}``, and the
    #: parameter server's ``"reachable"``: "prefer" | "require" | "any" (absent: "prefer")
    requirements = models.JSONField()
    #: The rest of the DiLoCo specification (model, data, optimizers, rounds), kept for dispatch.
    spec = models.JSONField(default=dict, blank=True)
    #: ``{filename: {"size": bytes, "sha256": hex}}`` of the final model the parameter server uploaded.
    model_files = models.JSONField(default=dict, blank=True)
    #: The last round the parameter server saved with the control plane, to restart it from:
    #: ``{"round": n, "files": {filename: {"size", "sha256"}}}`` (``{}`` before the first).
    checkpoint = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    allocated_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    allocation_timeout = models.FloatField(
        default=600.0,
        help_text="Seconds after submission by which the job must have been fully allocated once, or it fails "
        "and gives back its leases (apps.jobs.allocation).",
    )
    #: ``created_at + allocation_timeout``; None for jobs submitted before the deadline existed (never due).
    allocation_deadline = models.DateTimeField(null=True, blank=True)
    #: An elastic pool's: since when the RUNNING job has had fewer than its ``min`` trainers (None: it has
    #: enough). Past the pool's ``grace`` it pauses (``apps.jobs.training.pools``).
    below_min_since = models.DateTimeField(null=True, blank=True)
    #: When the job paused below its pool's ``min`` (None: not paused); it fails ``allocation_timeout`` s later
    #: unless trainers are back to ``min`` by then.
    paused_at = models.DateTimeField(null=True, blank=True)
    #: The round after which a training job stops early (None: its spec's ``update_rounds``): set when the next
    #: round would take its cost past its ``max_cost`` (``apps.jobs.budgets``); ``plan(job)`` follows it.
    stop_after_round = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["owner", "status"]), models.Index(fields=["status"])]

    def __str__(self) -> str:
        return self.name or str(self.id)

    @property
    def is_final(self) -> bool:
        return self.status in self.FINAL

    @property
    def min_trainers(self) -> int:
        """The trainers the job starts training with (its pool's ``min``, stored in ``spec["trainers"]``);
        ``num_trainers`` is the target it grows toward. Without a pool both are ``num_trainers``."""
        pool = (self.spec or {}).get("trainers") or {}
        return min(int(pool.get("min") or self.num_trainers), self.num_trainers)

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles this job advertises and leases."""
        return INFERENCE_ROLES if self.kind == self.Kind.INFERENCE else ROLES

    def requirement(self, role: str) -> RoleRequirement:
        entry = self.requirements[role]
        count = 1
        if role == TRAINER:
            count = self.num_trainers
        elif role == INFERENCE:
            count = int((self.spec or {}).get("workers") or self.num_trainers)
        return RoleRequirement(
            role=role,
            count=count,
            resources=Resources.model_validate(entry["resources"]),
            executor=ExecutorDescriptor.model_validate(entry.get("executor") or DEFAULT_EXECUTORS[role]),
            bid=float(entry["bid"]),
            max_price=float(entry["max"]),
            # A job stored before the key existed prefers, as a new one does by default.
            reachable=entry.get("reachable", "prefer") if role == PARAMETER_SERVER else "any",
            # Jobs stored before devices existed ask for none.
            devices=int(entry["resources"].get("devices") or 0),
            device_memory=float(entry["resources"].get("device_memory") or 0.0),
            min_reliability=float(entry.get("min_reliability") or 0.0),
        )

    def transition(self, to: str, *, reason: str) -> None:
        """Move to ``to`` if allowed from the current (re-read, locked) status; record a JobEvent.

        Raises :class:`JobTransitionRefused` otherwise, e.g. a lease expiring after the job was cancelled.
        """
        with transaction.atomic():
            current = Job.objects.select_for_update().only("status").get(pk=self.pk).status
            if to not in self.TRANSITIONS.get(current, set()):
                self.status = current
                raise JobTransitionRefused(self, current, to)
            now = timezone.now()
            changes = {"status": to, "status_reason": reason[:500], "updated_at": now}
            if to == self.Status.ALLOCATED:
                changes["allocated_at"] = now
            if to in self.FINAL:
                changes["ended_at"] = now
            Job.objects.filter(pk=self.pk).update(**changes)
            for field, value in changes.items():
                setattr(self, field, value)
            if current != to or self._last_reason() != reason[:500]:
                JobEvent.objects.create(job=self, from_status=current, to_status=to, reason=reason[:500])
                from apps.jobs import observers

                observers.job_changed(self)

    def _last_reason(self) -> str:
        last = self.events.order_by("-at", "-id").first()
        return last.reason if last else ""


class JobEvent(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    from_status = models.CharField(max_length=16)
    to_status = models.CharField(max_length=16)
    reason = models.CharField(max_length=500)
    at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.from_status}→{self.to_status}: {self.reason}"


class Task(models.Model):
    """One role's process of a running job, on the worker that holds ``lease``: the parameter server or a trainer.

    State machine::

        DISPATCHED ──▶ RUNNING ──▶ EXITED | FAILED
             └────────────┴──────▶ CANCELLED

    A trainer also carries its place in the sync protocol (``sync_state``, ``round``, ``steps_in_round``)::

        TRAINING ─(ScheduleUpdate)▶ SCHEDULED ─("update")▶ UPDATING ─("update-received")▶ TRAINING … ▶ DONE
                                      ▲                        │
                                      └──("update-received")───┘  eager, told to stop while ahead

    and what performance-aware sync knows of it (``batch_size``, ``last_status_at``, ``step_interval``,
    ``update_due``; see :mod:`apps.jobs.sync`). A trainer of an eager job (``rounds.overlap = "eager"``)
    trains on while UPDATING: its step reports then count as the next round's (``ahead_steps``,
    ``ahead_samples``) until its "update-received" carries them into ``steps_in_round``; if it was told
    ``ScheduleUpdate{0}`` meanwhile (``ahead_due``), it goes on to SCHEDULED rather than TRAINING
    (docs/training.md, "Eager trainers"). Any other trainer's step while UPDATING is refused.
    """

    class Status(models.TextChoices):
        DISPATCHED = "dispatched", "dispatched"
        RUNNING = "running", "running"
        EXITED = "exited", "exited"
        FAILED = "failed", "failed"
        CANCELLED = "cancelled", "cancelled"

    class Sync(models.TextChoices):
        TRAINING = "training", "training"
        SCHEDULED = "scheduled", "update scheduled"
        UPDATING = "updating", "updating"
        DONE = "done", "done"

    LIVE = (Status.DISPATCHED, Status.RUNNING)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="tasks")
    lease = models.OneToOneField("leases.Lease", on_delete=models.CASCADE, related_name="task")
    role = models.CharField(max_length=32)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.DISPATCHED)
    #: The parameter server's public base URL, once it listens.
    url = models.CharField(max_length=500, blank=True)
    #: A parameter server's: how trainers reach it, decided when it reports ready (docs/transfers.md).
    transfer_path = models.CharField(
        max_length=8, blank=True, choices=[("direct", "direct"), ("relay", "relay")]
    )
    exit_code = models.IntegerField(null=True, blank=True)
    signal = models.IntegerField(null=True, blank=True)
    reason = models.CharField(max_length=2000, blank=True)
    log_tail = models.TextField(blank=True)
    #: Peers its transfers cannot reach, the latest report per peer (``apps.jobs.training.problems``):
    #: ``{peer: {"role", "url", "operation", "cause", "attempts", "since", "updated_at"}}``.
    transfer_problems = models.JSONField(default=dict, blank=True)
    sync_state = models.CharField(max_length=16, choices=Sync.choices, default=Sync.TRAINING)
    #: Rounds this trainer has completed (merged the parameter server's update of).
    round = models.PositiveIntegerField(default=0)
    steps_in_round = models.PositiveIntegerField(default=0)
    samples_in_round = models.PositiveBigIntegerField(default=0)
    steps_total = models.PositiveBigIntegerField(default=0)
    samples_total = models.PositiveBigIntegerField(default=0)
    last_loss = models.FloatField(null=True, blank=True)
    batch_size = models.PositiveIntegerField(default=0, help_text="Samples per step, as dispatched.")
    #: Unix time (control plane's clock) of the trainer's last step report, or of its round's start (its
    #: start, or its last ``update-received``).
    last_status_at = models.FloatField(null=True, blank=True)
    step_interval = models.FloatField(
        null=True,
        blank=True,
        help_text="Moving estimate of the seconds between the trainer's step reports (null until it reported).",
    )
    #: ``steps_in_round`` after which the trainer sends this round's update, once it was told.
    update_due = models.PositiveIntegerField(null=True, blank=True)
    #: How many step reports after the last one its daemon may answer ``Continue`` itself (``continue_for``).
    continue_granted = models.PositiveIntegerField(default=0)
    #: An eager trainer's steps (and samples) of its next round, reported while UPDATING: they become its
    #: ``steps_in_round`` (``samples_in_round``) at its "update-received".
    ahead_steps = models.PositiveIntegerField(
        default=0,
        help_text="An eager trainer's steps of its next round, trained while its update is out (updating).",
    )
    ahead_samples = models.PositiveBigIntegerField(default=0)
    #: ``ahead_steps`` after which the eager trainer was told ``ScheduleUpdate{0}`` while UPDATING (it sends
    #: its next update once it merged the last round's result); ``None`` while it was not.
    ahead_due = models.PositiveIntegerField(null=True, blank=True)
    # A daemon that lost its connection repeats its pending status and slice requests with the same id after
    # reconnecting; the reply to the last one of each is kept so a repeat is answered without being counted
    # (or claiming a second slice) twice.
    last_status_request = models.UUIDField(null=True, blank=True)
    last_status_reply = models.JSONField(default=dict, blank=True)
    last_slice_request = models.UUIDField(null=True, blank=True)
    last_slice_reply = models.JSONField(default=dict, blank=True)
    #: The ``dispatch_job`` frame sent for this task: sent again when its daemon reconnects (a frame sent while
    #: the connection was down is lost; the daemon answers a repeat without starting a second process).
    dispatch_message = models.JSONField(default=dict, blank=True)
    dispatched_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    first_step_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["dispatched_at", "id"]
        indexes = [models.Index(fields=["job", "role", "status"])]

    def __str__(self) -> str:
        return f"{self.role} task {self.id} of job {self.job_id} ({self.status})"

    @property
    def is_live(self) -> bool:
        return self.status in self.LIVE

    def finish(self, status: str, **fields) -> bool:
        """End a live task (conditional update, so a late duplicate report changes nothing); False if it had ended."""
        changes = {"status": status, "ended_at": timezone.now(), **fields}
        updated = Task.objects.filter(pk=self.pk, status__in=self.LIVE).update(**changes)
        if updated:
            for field, value in changes.items():
                setattr(self, field, value)
        return bool(updated)


class Round(models.Model):
    """One outer round of a job: what the parameter server aggregated and what the trainers reported."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="rounds")
    number = models.PositiveIntegerField(help_text="1 for the first round.")
    closed = models.BooleanField(default=False, help_text="The parameter server has applied this round.")
    participants = models.JSONField(default=list, help_text="Worker ids whose updates were averaged.")
    left_out = models.JSONField(default=list, help_text="Expected workers whose update was missing or late.")
    arrivals = models.JSONField(
        default=dict, help_text="Worker id → seconds after the round's first update that its update arrived."
    )
    refused = models.JSONField(default=dict, help_text="Worker id → why its update was refused.")
    verdicts = models.JSONField(
        default=dict,
        blank=True,
        help_text='Worker id → the parameter server\'s verdict on its update: {"verdict": "accepted" | '
        '"down-weighted" | "rejected", "reason": str, "norm_ratio": float | null, "cosine": float | null} '
        "(empty: the round was not verified; docs/training.md).",
    )
    samples = models.PositiveBigIntegerField(default=0)
    duration = models.FloatField(null=True, blank=True, help_text="Seconds from first update to close.")
    bytes_in = models.PositiveBigIntegerField(default=0)
    bytes_out = models.PositiveBigIntegerField(default=0)
    transfers = models.JSONField(
        default=dict,
        blank=True,
        help_text='Bytes at the parameter server by path and direction: {"direct": {"in": n, "out": n}, '
        '"relay": {"in": n, "out": n}} (docs/transfers.md).',
    )
    encoding = models.CharField(
        max_length=16,
        blank=True,
        default="",
        help_text="How the round's updates and result travelled: float32, float16, bfloat16 or int8 "
        "(empty: the parameter server did not say).",
    )
    discarded = models.BooleanField(
        default=False,
        help_text="The parameter server discarded the round's outer step: the previous weights and momentum "
        "stayed and trainers continued from them (docs/training.md).",
    )
    discard_reason = models.CharField(
        max_length=500,
        blank=True,
        default="",
        help_text="Why the round was discarded (its held-out loss rose, or its step was not finite).",
    )
    discard_requested_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the job's owner asked to discard this round (the next round then goes back to the "
        "weights and momentum of the round before; docs/training.md). Null: not asked.",
    )
    eval_loss = models.FloatField(null=True, blank=True)
    eval_error = models.CharField(
        max_length=500,
        blank=True,
        default="",
        help_text="Why the round has no eval loss although the job evaluates (e.g. the loss is NaN).",
    )
    #: Worker id → the metrics its trainer sent for this round (``loss``, ``samples``, …).
    trainer_metrics = models.JSONField(default=dict)
    mean_loss = models.FloatField(null=True, blank=True, help_text="Mean of the trainers' training losses.")
    created_at = models.DateTimeField(auto_now_add=True)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "number"]
        constraints = [models.UniqueConstraint(fields=["job", "number"], name="jobs_unique_round_number")]

    @property
    def reported(self) -> bool:
        """The parameter server's report of the round arrived (its samples, duration and bytes are known).

        A round is also closed when its checkpoint is saved (``training/checkpoints.py``), before its report:
        a job cancelled or failed between the two keeps a round that was applied but never reported, with no
        samples, duration or bytes. Every report carries the duration, so it tells the two apart."""
        return self.duration is not None

    def __str__(self) -> str:
        return f"round {self.number} of job {self.job_id}"


class Upload(models.Model):
    """A file a user uploaded to the control plane, e.g. a model (a zip or tar of a model directory) that a
    job's ``upload`` source names. Stored in ``HYPHA_DATA_DIR/uploads/<id>``."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="uploads")
    name = models.CharField(max_length=200)
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["owner", "name"])]

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"

    @property
    def path(self):
        from pathlib import Path

        return Path(settings.HYPHA_DATA_DIR) / "uploads" / str(self.id)


class MetricSeries(models.Model):
    """One trainer task's per-step metrics: a bounded, packed series of points (``apps.jobs.metrics``).

    ``points`` and ``tail`` hold at most ``HYPHA_METRICS_MAX_POINTS`` points of 40 bytes together; each stands
    for a bucket of steps ending at its ``step`` (``stride`` steps once the series was downsampled)."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metric_series")
    task = models.OneToOneField(Task, on_delete=models.CASCADE, related_name="metric_series")
    #: The trainer's worker, for the chart's label (the task's lease may be gone when the series is read).
    worker_id = models.CharField(max_length=64, blank=True)
    stride = models.PositiveIntegerField(default=1, help_text="Steps per point since the last downsampling.")
    steps = models.PositiveBigIntegerField(default=0, help_text="The last step the series covers.")
    #: The series' points but its newest, packed (``apps.jobs.metrics.POINT``) ...
    points = models.BinaryField(default=b"")
    #: ... and its newest (at most ``apps.jobs.metrics.TAIL_POINTS``): what a step report writes.
    tail = models.BinaryField(default=b"")

    class Meta:
        ordering = ["job", "id"]

    def __str__(self) -> str:
        return f"metric series of task {self.task_id}"


class InferenceResult(models.Model):
    """One computation of one slice of an inference job (docs/inference.md): its file is
    ``HYPHA_DATA_DIR/<path>``. An unverified slice has one, ACCEPTED when stored; a verified slice has one per
    worker that computed it, PENDING until a second computation is compared with it, then ACCEPTED (they
    agree) or DISPUTED (they do not: a third worker decides, and the loser is REJECTED). The slice is USED once
    it has an accepted result; the earliest accepted one is the slice's result."""

    class Format(models.TextChoices):
        SAFETENSORS = "safetensors", "safetensors"
        JSONL = "jsonl", "jsonl"

    class Status(models.TextChoices):
        PENDING = "pending", "pending"
        ACCEPTED = "accepted", "accepted"
        DISPUTED = "disputed", "disputed"
        REJECTED = "rejected", "rejected"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="inference_results")
    job_slice = models.ForeignKey(
        "datasets.JobSlice", on_delete=models.CASCADE, related_name="inference_results"
    )
    index = models.PositiveIntegerField(help_text="The slice's index in its dataset.")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACCEPTED)
    #: The lease (and its worker) that computed it; kept null once those are deleted.
    lease = models.ForeignKey(
        "leases.Lease", on_delete=models.SET_NULL, null=True, blank=True, related_name="inference_results"
    )
    worker = models.ForeignKey(
        "workers.Worker", on_delete=models.SET_NULL, null=True, blank=True, related_name="inference_results"
    )
    sha256 = models.CharField(max_length=64)
    size = models.PositiveBigIntegerField()
    format = models.CharField(max_length=16, choices=Format.choices)
    #: Relative to ``HYPHA_DATA_DIR``.
    path = models.CharField(max_length=500)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["job", "index", "created_at"]
        constraints = [
            # A worker computes a slice once: a second computation must come from another worker.
            models.UniqueConstraint(
                fields=["job", "index", "worker"], name="jobs_one_result_per_slice_worker"
            )
        ]
        indexes = [models.Index(fields=["job", "status", "index"])]

    def __str__(self) -> str:
        return f"{self.status} result of slice {self.index} of job {self.job_id}"
