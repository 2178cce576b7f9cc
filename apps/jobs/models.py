"""Jobs: a DiLoCo training run and what it needs from the market (N trainers + 1 parameter server).

State machine (every transition records a :class:`JobEvent`; ``status_reason`` always says why)::

    PENDING ──▶ ALLOCATING ◀──▶ ALLOCATED ──▶ RUNNING ──▶ COMPLETED
       │            │              │             │
       └────────────┴──────────────┴─────────────┴──▶ CANCELLED | FAILED

ALLOCATED → ALLOCATING happens when a lease is lost (expired or released) and the role is re-advertised.
RUNNING and COMPLETED are entered by training (dispatch), which builds on this allocation.
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
ROLES = (TRAINER, PARAMETER_SERVER)
ROLE_LABELS = {TRAINER: ("trainer", "trainers"), PARAMETER_SERVER: ("parameter server", "parameter servers")}

DEFAULT_EXECUTORS = {
    TRAINER: {"class": "train", "name": "diloco-transformer"},
    PARAMETER_SERVER: {"class": "aggregate", "name": "parameter-server"},
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


class Job(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending", "pending"
        ALLOCATING = "allocating", "allocating"
        ALLOCATED = "allocated", "allocated"
        RUNNING = "running", "running"
        COMPLETED = "completed", "completed"
        CANCELLED = "cancelled", "cancelled"
        FAILED = "failed", "failed"

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
    num_trainers = models.PositiveIntegerField(default=2)
    #: ``{role: {"resources": {...}, "executor": {"class", "name"}, "bid": float, "max": float}}``
    requirements = models.JSONField()
    #: The rest of the DiLoCo specification (model, data, optimizers, rounds), kept for dispatch.
    spec = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    allocated_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["owner", "status"]), models.Index(fields=["status"])]

    def __str__(self) -> str:
        return self.name or str(self.id)

    @property
    def is_final(self) -> bool:
        return self.status in self.FINAL

    def requirement(self, role: str) -> RoleRequirement:
        entry = self.requirements[role]
        return RoleRequirement(
            role=role,
            count=self.num_trainers if role == TRAINER else 1,
            resources=Resources.model_validate(entry["resources"]),
            executor=ExecutorDescriptor.model_validate(entry.get("executor") or DEFAULT_EXECUTORS[role]),
            bid=float(entry["bid"]),
            max_price=float(entry["max"]),
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
