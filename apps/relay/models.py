"""The relay's index: which objects of a job exist, who wrote them, their replies, readers' wants, and what
the job moved through the relay. The bytes live in the store (:mod:`apps.relay.stores`), addressed by
``(job, blob)``; each upload attempt gets a fresh ``blob``, so bytes deleted after a commit never belong to
a newer upload of the same key.

An object's state machine::

    PENDING ──complete (size and SHA-256 checked)──▶ COMPLETE ──delete, with a reply──▶ DELETED
       │                                                │
       └── replaced, deleted, swept: row gone ──────────┴── delete without a reply: row gone

DELETED keeps only the row (its bytes are gone) so the writer can still read the reply the reader gave
before deleting it; the sweep removes it after ``HYPHA_RELAY_PENDING_TTL``.
"""

from __future__ import annotations

import uuid

from django.db import models


class RelayObject(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending", "pending"
        COMPLETE = "complete", "complete"
        DELETED = "deleted", "deleted (reply kept)"

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="relay_objects")
    key = models.CharField(max_length=160)
    #: The round of the key (None for none: every key has one today); orders ``model/latest``.
    round = models.PositiveIntegerField(null=True, blank=True)
    #: Where the bytes of this upload attempt are in the store (``<job>/<blob>``).
    blob = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    part_size = models.PositiveBigIntegerField()
    #: The S3 multipart upload's id while PENDING ("" for the local store, or before the store answered).
    upload_id = models.CharField(max_length=1024, blank=True)
    metadata = models.JSONField(default=dict, blank=True)
    #: The writer's peer (its worker's id, the token's ``peer`` claim) and role.
    writer = models.CharField(max_length=64)
    writer_role = models.CharField(max_length=32)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    #: Peers that were handed a GET URL of this object (each counts the object's size once as read).
    readers = models.JSONField(default=list, blank=True)
    reply_status = models.PositiveSmallIntegerField(null=True, blank=True)
    reply_body = models.JSONField(null=True, blank=True)
    replied_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [models.UniqueConstraint(fields=["job", "key"], name="relay_object_unique_key")]
        indexes = [
            models.Index(fields=["job", "status", "completed_at"]),
            models.Index(fields=["status", "created_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.key} of job {self.job_id} ({self.status})"

    @property
    def part_count(self) -> int:
        """Parts of the upload: the last may be shorter; an empty object has one empty part."""
        return max(1, -(-self.size // self.part_size))

    def part_length(self, number: int) -> int:
        """The size of part ``number`` (1-based)."""
        return max(0, min(self.part_size, self.size - (number - 1) * self.part_size))


class RelayWant(models.Model):
    """A reader asked for ``model/latest/<filename>``: the parameter server answers by uploading
    ``model/<round>/<filename>``. Handed to it once per request (``handed_at``); answered wants are deleted."""

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="relay_wants")
    key = models.CharField(max_length=160)
    requested_at = models.DateTimeField()
    handed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["requested_at", "id"]
        constraints = [models.UniqueConstraint(fields=["job", "key"], name="relay_want_unique_key")]

    def __str__(self) -> str:
        return f"want {self.key} of job {self.job_id}"


class RelayUsage(models.Model):
    """What a job moved through the relay, kept after its objects are gone (the job page shows it).

    ``objects_written`` and ``bytes_written`` count at each upload's completion; ``bytes_read`` counts an object's
    size once per distinct peer handed its GET URL (a URL minted again for the same peer, or a download
    resumed, does not count twice; a reader that never downloads still counts)."""

    job = models.OneToOneField("jobs.Job", on_delete=models.CASCADE, primary_key=True, related_name="+")
    objects_written = models.PositiveBigIntegerField(default=0)
    bytes_written = models.PositiveBigIntegerField(default=0)
    bytes_read = models.PositiveBigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"relay usage of job {self.job_id}"
