"""What every relay store does, and the names its callers share.

A store keeps the bytes of an upload attempt (a *blob*: ``<job>/<blob uuid>``) as numbered parts while it is
pending and as one object once complete, and mints URLs that let a holder PUT one part or GET the object
(with ``Range``) without any other credential, for ``lifetime`` seconds. The control plane's index
(:class:`apps.relay.models.RelayObject`) decides who gets which URL; a store never looks at the database.

Every method that talks to a remote store raises :class:`apps.relay.exceptions.StoreError` (or a subclass)
when the store fails; :class:`~apps.relay.exceptions.PartsMissing` when ``finish`` finds parts missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

#: Bytes per read and write of a body (both stores and the views): large enough to keep the loops cheap,
#: small against any memory bound.
CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Blob:
    """Where one upload attempt's bytes are: its job, its blob id and (S3) its multipart upload id."""

    job_id: str
    blob: str
    upload_id: str = ""

    def as_list(self) -> list[str]:
        """JSON-friendly, for a Celery task's arguments."""
        return [self.job_id, self.blob, self.upload_id]

    @classmethod
    def from_list(cls, value: list[str]) -> Blob:
        job_id, blob, upload_id = value
        return cls(str(job_id), str(blob), str(upload_id))


class Store(Protocol):
    name: str

    def begin(self, blob: Blob) -> str:
        """Start an upload; the store's upload id ("" where it needs none)."""

    def part_url(self, blob: Blob, number: int, *, base_url: str, lifetime: int) -> str:
        """A URL to PUT part ``number`` (1-based) of ``blob`` to, valid ``lifetime`` seconds."""

    def stored_parts(self, blob: Blob, lengths: dict[int, int]) -> set[int]:
        """The numbers of the parts stored whole: present with exactly ``lengths[number]`` bytes."""

    def finish(self, blob: Blob, lengths: dict[int, int], *, size: int, sha256: str) -> None:
        """Make the parts one object and check it: :class:`PartsMissing` when parts are missing (the upload
        stays as it is); :class:`ContentMismatch` when the size (or, where the store can tell, the SHA-256)
        is not the declared one (the caller deletes the upload)."""

    def object_url(self, blob: Blob, *, base_url: str, lifetime: int) -> str:
        """A URL to GET the complete object (``Range`` supported), valid ``lifetime`` seconds."""

    def delete(self, blob: Blob) -> None:
        """Delete the blob's bytes, pending or complete; deleting what is not there is no error."""

    def delete_job(self, job_id: str, pending: list[Blob]) -> None:
        """Delete every byte of the job (``pending`` are its uploads still open in the store)."""
