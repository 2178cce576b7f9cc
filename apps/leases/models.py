"""Leases: time-bounded claims of a job on a worker's resources, and the event log of their transitions.

State machine (every transition records a :class:`LeaseEvent`)::

    TEMPORARY ──activate──▶ ACTIVE ──renew──▶ ACTIVE
        │                     │
        ├──expire──▶ EXPIRED ◀┤
        └──release─▶ RELEASED ◀┘

A TEMPORARY lease holds a worker while its offer is open; ACTIVE leases must be renewed before
``expires_at``. EXPIRED and RELEASED are final. When the lease clock resumes after the control plane stood
still (:class:`LeaseClock`), ACTIVE leases get one TTL from the restart (event ``extended``, status unchanged). Every transition is a conditional UPDATE on the current
status (and, for renew/activate, on ``expires_at`` still being in the future), so two processes racing on
the same lease cannot both win: on PostgreSQL the second UPDATE waits for the first's row lock and then
re-checks its WHERE clause against the committed row.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

from django.db import models, transaction
from django.db.models import Q
from django.utils import timezone

from apps.leases.exceptions import LeaseTransitionRefused
from apps.workers.models import ResourceColumns


class Lease(ResourceColumns):
    class Status(models.TextChoices):
        TEMPORARY = "temporary", "temporary"
        ACTIVE = "active", "active"
        EXPIRED = "expired", "expired"
        RELEASED = "released", "released"

    LIVE = (Status.TEMPORARY, Status.ACTIVE)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    worker = models.ForeignKey("workers.Worker", on_delete=models.PROTECT, related_name="leases")
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="leases")
    role = models.CharField(max_length=32)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.TEMPORARY)
    status_reason = models.CharField(max_length=300, blank=True)
    price = models.FloatField()
    devices = models.JSONField(
        default=list, blank=True, help_text="Device indices (CUDA ordinals) the lease holds on its worker."
    )
    expires_at = models.DateTimeField()
    renewals = models.PositiveIntegerField(default=0)
    renewal_requested_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    activated_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["status", "expires_at"]),
            models.Index(fields=["worker", "status"]),
            models.Index(fields=["job", "status"]),
        ]

    def __str__(self) -> str:
        return f"{self.role} lease {self.id} on {self.worker_id} ({self.status})"

    @property
    def is_live(self) -> bool:
        return self.status in self.LIVE

    # --- transitions ----------------------------------------------------------------------------------

    def activate(self, *, ttl: timedelta) -> None:
        """TEMPORARY → ACTIVE, if the temporary lease has not run out."""
        now = timezone.now()
        self._transition(
            allowed_from=Q(status=self.Status.TEMPORARY, expires_at__gt=now),
            changes={"status": self.Status.ACTIVE, "expires_at": now + ttl, "activated_at": now},
            event=LeaseEvent.Kind.ACTIVATED,
            refused="only an unexpired temporary lease can be activated",
        )

    def renew(self, *, ttl: timedelta) -> None:
        """ACTIVE → ACTIVE with ``expires_at = now + ttl``; refused once it has run out (expiry wins)."""
        now = timezone.now()
        self._transition(
            allowed_from=Q(status=self.Status.ACTIVE, expires_at__gt=now),
            changes={
                "expires_at": now + ttl,
                "renewals": models.F("renewals") + 1,
                "renewal_requested_at": None,
            },
            event=LeaseEvent.Kind.RENEWED,
            refused="only an unexpired active lease can be renewed",
        )

    def expire(self, *, reason: str = "not renewed before it ran out") -> None:
        """TEMPORARY|ACTIVE → EXPIRED, only once ``expires_at`` has passed."""
        now = timezone.now()
        self._transition(
            allowed_from=Q(status__in=self.LIVE, expires_at__lte=now),
            changes={"status": self.Status.EXPIRED, "ended_at": now, "status_reason": reason[:300]},
            event=LeaseEvent.Kind.EXPIRED,
            refused="only a live lease past its expiry can expire",
            detail=reason,
        )

    def release(self, *, reason: str) -> None:
        """TEMPORARY|ACTIVE → RELEASED, at any time (offer lost, job cancelled, worker gave it back)."""
        now = timezone.now()
        self._transition(
            allowed_from=Q(status__in=self.LIVE),
            changes={"status": self.Status.RELEASED, "ended_at": now, "status_reason": reason[:300]},
            event=LeaseEvent.Kind.RELEASED,
            refused="only a live lease can be released",
            detail=reason,
        )

    def _transition(
        self, *, allowed_from: Q, changes: dict, event: str, refused: str, detail: str = ""
    ) -> None:
        with transaction.atomic():
            previous = self.status
            updated = Lease.objects.filter(allowed_from, pk=self.pk).update(**changes)
            self.refresh_from_db()
            if updated != 1:
                raise LeaseTransitionRefused(self, event, f"{refused} (lease is {self.status})")
            LeaseEvent.objects.create(
                lease=self,
                kind=event,
                from_status=previous,
                to_status=self.status,
                expires_at=self.expires_at,
                detail=detail[:300],
            )


class LeaseEvent(models.Model):
    class Kind(models.TextChoices):
        CREATED = "created", "created"
        ACTIVATED = "activated", "activated"
        RENEWED = "renewed", "renewed"
        EXPIRED = "expired", "expired"
        RELEASED = "released", "released"
        #: ACTIVE → ACTIVE: the lease clock resumed after a stop and gave the lease one TTL from the restart.
        EXTENDED = "extended", "extended"

    lease = models.ForeignKey(Lease, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    from_status = models.CharField(max_length=16, blank=True)
    to_status = models.CharField(max_length=16)
    expires_at = models.DateTimeField(null=True)
    detail = models.CharField(max_length=300, blank=True)
    at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.kind} {self.from_status}→{self.to_status}"


class LeaseClock(models.Model):
    """When the lease clock last ran: one row (``pk=1``), written by every lease tick.

    Renewals are asked for, and leases expired, only while the clock runs and the gateway is up, so the
    time the control plane stood still (a restart, an outage) must not count against a lease: when the
    clock finds that it has not run for longer than a stall, it *resumes* — every ACTIVE lease that was
    alive when it last ran gets at least one TTL from the resume (``apps.leases.services.resume_clock``).
    ``resumed_at``/``stopped_for`` record the last resume, for the logs, the admin and the renewal rule
    that asks daemons to confirm those leases at once.
    """

    SINGLETON = 1

    id = models.PositiveSmallIntegerField(primary_key=True, default=SINGLETON, editable=False)
    ticked_at = models.DateTimeField(help_text="when the lease clock last ran")
    resumed_at = models.DateTimeField(
        null=True, blank=True, help_text="when the lease clock last resumed after a stop"
    )
    stopped_for = models.FloatField(default=0.0, help_text="seconds the clock stood still before that resume")
    resumptions = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"lease clock (last ran {self.ticked_at:%Y-%m-%d %H:%M:%S} UTC)"
