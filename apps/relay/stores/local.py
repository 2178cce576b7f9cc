"""The local relay store: a directory (``HYPHA_DATA_DIR/relay/``) this server serves itself at ``/relay/``.

Layout: ``<root>/<job>/<blob>/<part number>`` — the parts stay where they were written; a complete object is
read as their concatenation (no copy). A part is written to a temporary file and renamed into place once it
arrived whole, so a part file is always complete. URLs carry an expiry and an HMAC of method, path and
expiry under a key derived from ``SECRET_KEY`` (like S3's presigned URLs: the URL is the credential).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import urlencode

from apps.relay.exceptions import ContentMismatch, PartsMissing, RelayRefused
from apps.relay.stores.base import CHUNK, Blob

#: Where the byte views are mounted (hypha_site/urls.py).
URL_PREFIX = "/relay/"


class LocalStore:
    name = "local"

    def __init__(self, root: Path, secret_key: str) -> None:
        self.root = Path(root)
        # A key of its own, so a relay URL's signature reveals nothing usable elsewhere.
        self._key = hmac.new(secret_key.encode(), b"hypha relay urls", hashlib.sha256).digest()

    # --- paths and URLs -------------------------------------------------------------------------------

    def directory(self, job_id: str, blob: str) -> Path:
        return self.root / str(uuid.UUID(str(job_id))) / str(uuid.UUID(str(blob)))

    def part_path(self, job_id: str, blob: str, number: int) -> Path:
        return self.directory(job_id, blob) / str(int(number))

    @staticmethod
    def part_path_of_url(job_id: str, blob: str, number: int) -> str:
        return f"{URL_PREFIX}{job_id}/{blob}/{number}"

    @staticmethod
    def object_path_of_url(job_id: str, blob: str) -> str:
        return f"{URL_PREFIX}{job_id}/{blob}"

    def sign(self, method: str, path: str, expires: int) -> str:
        message = f"{method}\n{path}\n{expires}".encode()
        digest = hmac.new(self._key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def signed_url(self, method: str, path: str, *, base_url: str, lifetime: int) -> str:
        expires = math.ceil(time.time() + lifetime)  # never shorter than the lifetime
        query = urlencode({"expires": expires, "signature": self.sign(method, path, expires)})
        return f"{base_url.rstrip('/')}{path}?{query}"

    def check_signature(self, method: str, path: str, expires: str | None, signature: str | None) -> None:
        """:class:`RelayRefused` (403, as S3 answers a bad presigned URL) unless the URL is signed and unexpired."""
        if not expires or not signature or not expires.isdigit() or len(expires) > 12:
            raise RelayRefused(
                "this relay URL is not signed (expires and signature are required)", status=403
            )
        if not hmac.compare_digest(self.sign(method, path, int(expires)), signature):
            raise RelayRefused("this relay URL's signature does not match", status=403)
        if int(expires) < time.time():
            raise RelayRefused("this relay URL has expired; ask the control plane for a new one", status=403)

    # --- the Store interface --------------------------------------------------------------------------

    def begin(self, blob: Blob) -> str:
        return ""  # the directory appears with the first part

    def part_url(self, blob: Blob, number: int, *, base_url: str, lifetime: int) -> str:
        path = self.part_path_of_url(blob.job_id, blob.blob, number)
        return self.signed_url("PUT", path, base_url=base_url, lifetime=lifetime)

    def object_url(self, blob: Blob, *, base_url: str, lifetime: int) -> str:
        path = self.object_path_of_url(blob.job_id, blob.blob)
        return self.signed_url("GET", path, base_url=base_url, lifetime=lifetime)

    def stored_parts(self, blob: Blob, lengths: dict[int, int]) -> set[int]:
        stored = set()
        for number, length in lengths.items():
            try:
                if self.part_path(blob.job_id, blob.blob, number).stat().st_size == length:
                    stored.add(number)
            except FileNotFoundError:
                pass
        return stored

    def finish(self, blob: Blob, lengths: dict[int, int], *, size: int, sha256: str) -> None:
        """Hash the parts in order (a chunk at a time): the caller runs this off the request thread."""
        missing = sorted(set(lengths) - self.stored_parts(blob, lengths))
        if missing:
            raise PartsMissing(missing)
        digest = hashlib.sha256()
        total = 0
        for chunk in self.read(blob, sorted(lengths.items()), 0, sum(lengths.values())):
            digest.update(chunk)
            total += len(chunk)
        if total != size:
            raise ContentMismatch(f"the parts hold {total} bytes, not the declared {size}")
        if digest.hexdigest() != sha256:
            raise ContentMismatch(f"the parts' SHA-256 is {digest.hexdigest()}, not the declared {sha256}")

    def delete(self, blob: Blob) -> None:
        # The job's directory stays (another upload may be creating its blob there now): delete_job
        # removes it with the job's last objects.
        shutil.rmtree(self.directory(blob.job_id, blob.blob), ignore_errors=True)

    def delete_job(self, job_id: str, pending: list[Blob]) -> None:
        shutil.rmtree(self.root / str(uuid.UUID(str(job_id))), ignore_errors=True)

    # --- bytes (the views) ----------------------------------------------------------------------------

    def write_part(self, blob: Blob, number: int, chunks: Iterable[bytes], length: int) -> None:
        """Store part ``number`` from ``chunks``, which must hold exactly ``length`` bytes: 413 if more,
        400 if fewer (a cut connection); nothing of the part is kept unless all of it arrived."""
        directory = self.directory(blob.job_id, blob.blob)
        directory.mkdir(parents=True, exist_ok=True)
        temporary = directory / f".{number}.{uuid.uuid4().hex}.tmp"
        received = 0
        try:
            with temporary.open("wb") as handle:
                for chunk in chunks:
                    received += len(chunk)
                    if received > length:
                        raise RelayRefused(f"part {number} is {length} bytes; more were sent", status=413)
                    handle.write(chunk)
            if received < length:
                raise RelayRefused(
                    f"part {number} is {length} bytes; only {received} arrived (cut off?)", status=400
                )
            os.replace(temporary, self.part_path(blob.job_id, blob.blob, number))
        finally:
            temporary.unlink(missing_ok=True)

    def read(self, blob: Blob, lengths: list[tuple[int, int]], start: int, stop: int) -> Iterator[bytes]:
        """Bytes ``start`` to ``stop`` (exclusive) of the object whose parts are ``(number, length)`` in
        order, in chunks of at most :data:`CHUNK`."""
        offset = 0
        for number, length in lengths:
            part_start, part_stop = offset, offset + length
            offset = part_stop
            if part_stop <= start or part_start >= stop or length == 0:
                continue
            with self.part_path(blob.job_id, blob.blob, number).open("rb") as handle:
                handle.seek(max(start, part_start) - part_start)
                remaining = min(stop, part_stop) - max(start, part_start)
                while remaining > 0:
                    chunk = handle.read(min(CHUNK, remaining))
                    if not chunk:
                        raise OSError(f"part {number} of {blob.blob} is shorter than {length} bytes")
                    remaining -= len(chunk)
                    yield chunk

    def blobs(self) -> Iterator[tuple[str, str, float]]:
        """``(job id, blob, modified)`` of every blob directory (the sweep looks for orphans)."""
        if not self.root.is_dir():
            return
        for job_directory in self.root.iterdir():
            if not job_directory.is_dir():
                continue
            for blob_directory in job_directory.iterdir():
                try:
                    yield job_directory.name, blob_directory.name, blob_directory.stat().st_mtime
                except FileNotFoundError:
                    continue
