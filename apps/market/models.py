"""The market: advertisements (a job role asking for workers) and the offers daemons answer with.

Advertisement::

    OPEN ──(enough offers accepted)──▶ FILLED
      │ └─(window closed short)──▶ OPEN again, attempt + 1, after a bounded backoff
      └──(job cancelled / role no longer needed)──▶ CANCELLED

Offer::

    OPEN ──▶ ACCEPTED     chosen; its TEMPORARY lease became ACTIVE
      ├───▶ DECLINED     lost to better offers, price above the private max, or the advert closed
      └───▶ EXPIRED      its temporary lease ran out before a decision

The ``max_price`` of an advertisement is private to the job owner and the control plane; daemons only see
``bid``.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q

from apps.workers.models import ResourceColumns
from worker_daemon.protocol import ExecutorDescriptor


class Advertisement(ResourceColumns):
    class Status(models.TextChoices):
        OPEN = "open", "open"
        FILLED = "filled", "filled"
        CANCELLED = "cancelled", "cancelled"

    class Reachability(models.TextChoices):
        """How the advert weighs whether a worker accepts inbound connections (:mod:`apps.market.targeting`,
        "Reachability")."""

        ANY = "any", "any"
        PREFER = "prefer", "prefer reachable"
        REQUIRE = "require", "require reachable"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="advertisements")
    role = models.CharField(max_length=32)
    wanted = models.PositiveIntegerField(help_text="Workers still needed for the role.")
    executors = models.JSONField(default=list)
    devices = models.PositiveIntegerField(default=0, help_text="Devices (GPUs) per worker; 0: none needed.")
    device_memory = models.FloatField(default=0, help_text="GB of memory per device.")
    bid = models.FloatField(help_text="Public price per worker, broadcast to daemons.")
    max_price = models.FloatField(help_text="Private maximum; offers above it are declined.")
    reachable = models.CharField(
        max_length=8,
        choices=Reachability.choices,
        default=Reachability.ANY,
        help_text="Whether workers that accept inbound connections are preferred, required, or neither.",
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.OPEN)
    attempt = models.PositiveIntegerField(default=0)
    window_closes_at = models.DateTimeField(help_text="When the current attempt stops collecting offers.")
    next_attempt_at = models.DateTimeField(null=True, blank=True, help_text="When to re-advertise, if short.")
    targets = models.JSONField(
        default=list,
        blank=True,
        help_text="Ids of the workers the current attempt was sent to (those that could offer, best first; "
        "see apps.market.targeting); its close goes to them.",
    )
    asked = models.JSONField(
        default=dict,
        blank=True,
        help_text="Worker id → how many attempts were sent to it; the least asked are asked first.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["status", "window_closes_at"]), models.Index(fields=["job", "role"])]

    def __str__(self) -> str:
        return f"{self.role} advert for job {self.job_id} ({self.status}, {self.wanted} wanted)"

    @property
    def executor_descriptors(self) -> list[ExecutorDescriptor]:
        return [ExecutorDescriptor.model_validate(item) for item in self.executors]

    def executor_keys(self) -> set[tuple[str, str]]:
        """The ``(class, name)`` of every executor the role needs (as ``Worker.executor_keys``)."""
        return {descriptor.key() for descriptor in self.executor_descriptors}


class Offer(ResourceColumns):
    class Status(models.TextChoices):
        OPEN = "open", "open"
        ACCEPTED = "accepted", "accepted"
        DECLINED = "declined", "declined"
        EXPIRED = "expired", "expired"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    advertisement = models.ForeignKey(Advertisement, on_delete=models.CASCADE, related_name="offers")
    worker = models.ForeignKey("workers.Worker", on_delete=models.CASCADE, related_name="offers")
    attempt = models.PositiveIntegerField()
    price = models.FloatField()
    score = models.FloatField(help_text="price per weighted capacity; lower wins")
    benchmark_score = models.FloatField(
        null=True, blank=True, help_text="the worker's benchmark score (samples/s) the offer carried"
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.OPEN)
    reason = models.CharField(max_length=300, blank=True)
    lease = models.OneToOneField(
        "leases.Lease", on_delete=models.SET_NULL, null=True, blank=True, related_name="offer"
    )
    expires_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["score", "created_at"]
        constraints = [
            # A worker has at most one open offer per advertisement: a retried or duplicated frame
            # cannot reserve the same worker twice.
            models.UniqueConstraint(
                fields=["advertisement", "worker"],
                condition=Q(status="open"),
                name="one_open_offer_per_worker",
            )
        ]

    def __str__(self) -> str:
        return f"offer {self.price} by {self.worker_id} ({self.status})"
