"""Datasets, the data nodes that serve them, and each job's bookkeeping of which slice is trained on by whom.

A data node announces a dataset (its directory's basename) as slices ``0..n-1`` with each file's size and
SHA-256, so every replica can be checked to serve the same bytes. A job trains on one dataset in epochs: each
epoch has one :class:`JobSlice` per slice, and every transition records a :class:`SliceEvent`::

    AVAILABLE ──assign(lease)──▶ ASSIGNED ──ack(same lease)──▶ USED
        ▲                           │
        └──release (lease ended)────┘

Unlike the original tracker (hypha-protocols.md §5), a slice counts as used only once the trainer that got it
acknowledges it, and a slice whose lease ends before the acknowledgement goes back to AVAILABLE. Every
transition is a conditional UPDATE on the current status (and on the assigned lease), so two processes racing
on the same row cannot both win: on PostgreSQL the second UPDATE waits for the first's row lock and then
re-checks its WHERE clause against the committed row.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models, transaction
from django.db.models import Q
from django.utils import timezone

from apps.datasets.exceptions import SliceTransitionRefused
from apps.workers.models import Reachable, hash_token, new_token

DATA_NODE_TOKEN_PREFIX = "hd_"


class Dataset(models.Model):
    """A dataset as its data nodes announce it; its slices are fixed once registered."""

    name = models.SlugField(max_length=200, unique=True, help_text="The data directory's basename.")
    slice_count = models.PositiveIntegerField()
    total_bytes = models.PositiveBigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class DataNode(models.Model):
    """A host that serves dataset slices over HTTP(S) at ``url``; it authenticates with a token stored hashed."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="data_nodes", null=True, blank=True
    )
    name = models.SlugField(max_length=100, unique=True)
    url = models.URLField(max_length=500, help_text="Public base URL the slices are downloaded from.")
    reachable = models.CharField(
        max_length=8,
        choices=Reachable.choices,
        default=Reachable.AUTO,
        help_text="Whether trainers can connect to its URL, as it declares when it registers (--reachable).",
    )
    #: The control plane's base URL as this node reached it when it last registered. A node that accepts no
    #: inbound connections (``reachable`` false) publishes its slices to the relay's store, and trainers get
    #: its slices at this address instead of its own (apps/datasets/publishing.py).
    control_plane_url = models.URLField(
        max_length=500,
        blank=True,
        help_text="The control plane's URL as the node reached it at its last registration: slices of a node "
        "that is not reachable are downloaded from the control plane at this address (its published copies).",
    )
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    online = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @classmethod
    def create_with_token(cls, *, name: str, url: str, owner=None) -> tuple[DataNode, str]:
        """Create a data node and return it with its token, which is shown once and stored only hashed."""
        token = new_token(DATA_NODE_TOKEN_PREFIX)
        node = cls.objects.create(name=name, url=url, owner=owner, token_hash=hash_token(token))
        return node, token


class DatasetReplica(models.Model):
    """A data node serves a dataset (it registered it)."""

    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="replicas")
    node = models.ForeignKey(DataNode, on_delete=models.CASCADE, related_name="replicas")
    registered_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["dataset", "node__name"]
        constraints = [
            models.UniqueConstraint(fields=["dataset", "node"], name="datasets_one_replica_per_node")
        ]

    def __str__(self) -> str:
        return f"{self.dataset} on {self.node}"


class Slice(models.Model):
    """One file of a dataset: slice ``index`` of ``0..slice_count-1``."""

    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="slices")
    index = models.PositiveIntegerField()
    size_bytes = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64, help_text="SHA-256 of the slice file, lowercase hex.")

    class Meta:
        ordering = ["dataset", "index"]
        constraints = [
            models.UniqueConstraint(fields=["dataset", "index"], name="datasets_unique_slice_index")
        ]

    def __str__(self) -> str:
        return f"{self.dataset_id}[{self.index}]"


class JobSlice(models.Model):
    """The state of one slice in one epoch of one job's training."""

    class Status(models.TextChoices):
        AVAILABLE = "available", "available"
        ASSIGNED = "assigned", "assigned"
        USED = "used", "used"

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="data_slices")
    slice = models.ForeignKey(Slice, on_delete=models.PROTECT, related_name="job_slices")
    epoch = models.PositiveIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.AVAILABLE)
    # RESTRICT, not PROTECT: deleting the job deletes its leases and its slices together, which RESTRICT allows.
    assigned_lease = models.ForeignKey(
        "leases.Lease", on_delete=models.RESTRICT, null=True, blank=True, related_name="data_slices"
    )
    assigned_at = models.DateTimeField(null=True, blank=True)
    used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "epoch", "slice__index"]
        constraints = [
            models.UniqueConstraint(fields=["job", "slice", "epoch"], name="datasets_unique_job_slice_epoch")
        ]
        indexes = [
            models.Index(fields=["job", "epoch", "status"]),
            models.Index(fields=["assigned_lease", "status"]),
        ]

    def __str__(self) -> str:
        return f"slice {self.slice_id} of job {self.job_id}, epoch {self.epoch} ({self.status})"

    # --- transitions ----------------------------------------------------------------------------------

    def assign(self, lease) -> None:
        """AVAILABLE → ASSIGNED to ``lease``."""
        now = timezone.now()
        self._transition(
            from_status=self.Status.AVAILABLE,
            allowed_from=Q(),
            changes={
                "status": self.Status.ASSIGNED,
                "assigned_lease": lease,
                "assigned_at": now,
                "used_at": None,
            },
            event=SliceEvent.Kind.ASSIGNED,
            lease=lease,
            refused="only an available slice can be assigned",
        )

    def ack(self, lease) -> None:
        """ASSIGNED → USED, only by the lease it was assigned to."""
        self._transition(
            from_status=self.Status.ASSIGNED,
            allowed_from=Q(assigned_lease=lease),
            changes={"status": self.Status.USED, "used_at": timezone.now()},
            event=SliceEvent.Kind.ACKNOWLEDGED,
            lease=lease,
            refused=f"only a slice assigned to lease {lease.pk} can be acknowledged by it",
        )

    def reopen(self, lease, *, reason: str) -> None:
        """ASSIGNED → AVAILABLE by the live lease it was assigned to: it computed the slice, and the slice
        waits for another worker's computation (an inference job's verification, docs/inference.md)."""
        self._transition(
            from_status=self.Status.ASSIGNED,
            allowed_from=Q(assigned_lease=lease),
            changes={"status": self.Status.AVAILABLE, "assigned_lease": None, "assigned_at": None},
            event=SliceEvent.Kind.RELEASED,
            lease=lease,
            refused=f"only a slice assigned to lease {lease.pk} can be reopened by it",
            detail=reason,
        )

    def release(self, lease, *, reason: str = "lease ended before the acknowledgement") -> None:
        """ASSIGNED → AVAILABLE, when the lease it was assigned to has ended (expired or released) unacknowledged."""
        from apps.leases.models import Lease

        if Lease.objects.filter(pk=lease.pk, status__in=Lease.LIVE).exists():
            self.refresh_from_db()
            raise SliceTransitionRefused(self, SliceEvent.Kind.RELEASED, f"lease {lease.pk} is still live")
        self._transition(
            from_status=self.Status.ASSIGNED,
            allowed_from=Q(assigned_lease=lease),
            changes={"status": self.Status.AVAILABLE, "assigned_lease": None, "assigned_at": None},
            event=SliceEvent.Kind.RELEASED,
            lease=lease,
            refused=f"only a slice assigned to lease {lease.pk} can be released from it",
            detail=reason,
        )

    def _transition(
        self,
        *,
        from_status: str,
        allowed_from: Q,
        changes: dict,
        event: str,
        lease,
        refused: str,
        detail: str = "",
    ) -> None:
        with transaction.atomic():
            updated = JobSlice.objects.filter(allowed_from, pk=self.pk, status=from_status).update(**changes)
            self.refresh_from_db()
            if updated != 1:
                raise SliceTransitionRefused(self, event, f"{refused} (slice is {self.status})")
            SliceEvent.objects.create(
                job_slice=self,
                kind=event,
                from_status=from_status,
                to_status=self.status,
                lease=lease,
                detail=detail[:300],
            )


class SliceEvent(models.Model):
    class Kind(models.TextChoices):
        ASSIGNED = "assigned", "assigned"
        ACKNOWLEDGED = "acknowledged", "acknowledged"
        RELEASED = "released", "released"

    job_slice = models.ForeignKey(JobSlice, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    from_status = models.CharField(max_length=16)
    to_status = models.CharField(max_length=16)
    lease = models.ForeignKey(
        "leases.Lease", on_delete=models.RESTRICT, null=True, blank=True, related_name="slice_events"
    )
    detail = models.CharField(max_length=300, blank=True)
    at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.kind} {self.from_status}→{self.to_status}"


class PublishedSlice(models.Model):
    """A copy of one slice of a data node that accepts no inbound connections, in the relay's object store
    (apps/datasets/publishing.py): the node uploads it once, and every job's trainers download it from there.

    ``PENDING`` while the node uploads its parts, ``COMPLETE`` once the store holds exactly the registered size
    (and, on the local store, SHA-256). The bytes are addressed by ``(publisher, blob)``; each upload attempt
    gets a fresh ``blob``, so bytes deleted after a commit never belong to a newer attempt. A deleted node or
    dataset leaves the row with ``node`` or ``slice`` null: the sweep deletes its bytes, then the row."""

    class Status(models.TextChoices):
        PENDING = "pending", "pending"
        COMPLETE = "complete", "complete"

    node = models.ForeignKey(
        DataNode, on_delete=models.SET_NULL, null=True, blank=True, related_name="published_slices"
    )
    slice = models.ForeignKey(
        Slice, on_delete=models.SET_NULL, null=True, blank=True, related_name="published_copies"
    )
    #: The node's id, kept after the node is deleted: its bytes are under it in the store.
    publisher = models.UUIDField(editable=False)
    blob = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    part_size = models.PositiveBigIntegerField()
    #: The S3 multipart upload's id while PENDING ("" for the local store, or before the store answered).
    upload_id = models.CharField(max_length=1024, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField(auto_now_add=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            models.UniqueConstraint(fields=["node", "slice"], name="datasets_one_published_copy_per_node")
        ]
        indexes = [models.Index(fields=["status", "created_at"])]

    def __str__(self) -> str:
        return f"{self.slice} published by {self.node} ({self.status})"

    @property
    def part_count(self) -> int:
        """Parts of the upload: the last may be shorter."""
        return max(1, -(-self.size // self.part_size))

    def part_length(self, number: int) -> int:
        """The size of part ``number`` (1-based)."""
        return max(0, min(self.part_size, self.size - (number - 1) * self.part_size))
