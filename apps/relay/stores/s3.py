"""The S3 relay store: any S3-compatible object store (AWS S3, R2, MinIO, Ceph, ``rclone serve s3``) via boto3.

Bodies never pass through the control plane: it creates the multipart upload, presigns UploadPart and
GetObject URLs for the daemons, and itself only calls ListParts, CompleteMultipartUpload, HeadObject and
the deletions. An object is ``<HYPHA_RELAY_S3_PREFIX><job>/<blob>`` in ``HYPHA_RELAY_S3_BUCKET``.

Checks: ``finish`` compares each stored part's size with the plan and the completed object's size
(HeadObject) with the declared one. The SHA-256 is not checked here (that would mean reading the object
back through the control plane): every reader checks it at the end of its download.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from apps.relay.exceptions import ContentMismatch, PartsMissing, StoreError, UploadGone
from apps.relay.stores.base import Blob

#: Seconds to connect to and to wait for an answer of the store (each call; boto3 retries 3 times).
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 60.0
#: Keys per DeleteObjects call (S3's limit).
DELETE_BATCH = 1000


class S3Store:
    name = "s3"

    def __init__(
        self,
        *,
        bucket: str,
        endpoint: str | None = None,
        region: str = "us-east-1",
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        prefix: str = "hypha/",
    ) -> None:
        self.bucket = bucket
        self.endpoint = endpoint
        self.region = region
        self.prefix = prefix
        self._credentials = (access_key_id, secret_access_key)
        self._client: Any = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        """The boto3 client, made on first use (boto3 clients are thread-safe; the session is not)."""
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                access_key_id, secret_access_key = self._credentials
                config = Config(
                    signature_version="s3v4",
                    # Path-style (endpoint/bucket/key) works with every S3-compatible server; AWS's own
                    # endpoint picks its style itself.
                    s3={"addressing_style": "path" if self.endpoint else "auto"},
                    connect_timeout=CONNECT_TIMEOUT,
                    read_timeout=READ_TIMEOUT,
                    retries={"max_attempts": 3, "mode": "standard"},
                    # boto3 ≥ 1.36 adds CRC checksums to every upload by default, which several
                    # S3-compatible stores refuse; the presigned part URLs must carry none either.
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                self._client = boto3.session.Session().client(
                    "s3",
                    endpoint_url=self.endpoint,
                    region_name=self.region,
                    aws_access_key_id=access_key_id,
                    aws_secret_access_key=secret_access_key,
                    config=config,
                )
            return self._client

    def key(self, job_id: str, blob: str) -> str:
        return f"{self.prefix}{job_id}/{blob}"

    # --- the Store interface --------------------------------------------------------------------------

    def begin(self, blob: Blob) -> str:
        with _store_errors("CreateMultipartUpload"):
            answer = self.client.create_multipart_upload(
                Bucket=self.bucket,
                Key=self.key(blob.job_id, blob.blob),
                ContentType="application/octet-stream",
            )
        return answer["UploadId"]

    def part_url(self, blob: Blob, number: int, *, base_url: str, lifetime: int) -> str:
        with _store_errors("presign UploadPart"):
            return self.client.generate_presigned_url(
                "upload_part",
                Params={
                    "Bucket": self.bucket,
                    "Key": self.key(blob.job_id, blob.blob),
                    "UploadId": blob.upload_id,
                    "PartNumber": number,
                },
                ExpiresIn=lifetime,
            )

    def object_url(self, blob: Blob, *, base_url: str, lifetime: int) -> str:
        with _store_errors("presign GetObject"):
            return self.client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": self.key(blob.job_id, blob.blob)},
                ExpiresIn=lifetime,
            )

    def stored_parts(self, blob: Blob, lengths: dict[int, int]) -> set[int]:
        return {number for number, (size, _etag) in self._parts(blob).items() if lengths.get(number) == size}

    def finish(self, blob: Blob, lengths: dict[int, int], *, size: int, sha256: str) -> None:
        parts = self._parts(blob)
        missing = sorted(
            number for number, length in lengths.items() if parts.get(number, (None,))[0] != length
        )
        if missing:
            raise PartsMissing(missing)
        key = self.key(blob.job_id, blob.blob)
        with _store_errors("CompleteMultipartUpload"):
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                UploadId=blob.upload_id,
                MultipartUpload={
                    "Parts": [{"PartNumber": number, "ETag": parts[number][1]} for number in sorted(lengths)]
                },
            )
        with _store_errors("HeadObject"):
            stored = self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
        if stored != size:
            raise ContentMismatch(f"the store holds {stored} bytes, not the declared {size}")

    def delete(self, blob: Blob) -> None:
        key = self.key(blob.job_id, blob.blob)
        if blob.upload_id:
            try:
                with _store_errors("AbortMultipartUpload"):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=blob.upload_id)
            except UploadGone:
                pass  # completed, aborted or expired already
        with _store_errors("DeleteObject"):
            self.client.delete_object(Bucket=self.bucket, Key=key)

    def delete_job(self, job_id: str, pending: list[Blob]) -> None:
        for blob in pending:
            if blob.upload_id:
                try:
                    with _store_errors("AbortMultipartUpload"):
                        self.client.abort_multipart_upload(
                            Bucket=self.bucket, Key=self.key(blob.job_id, blob.blob), UploadId=blob.upload_id
                        )
                except UploadGone:
                    pass
        batch: list[dict] = []
        for key in self._keys(f"{self.prefix}{job_id}/"):
            batch.append({"Key": key})
            if len(batch) == DELETE_BATCH:
                self._delete_keys(batch)
                batch = []
        if batch:
            self._delete_keys(batch)

    # --- helpers ----------------------------------------------------------------------------------------

    def _parts(self, blob: Blob) -> dict[int, tuple[int, str]]:
        """``{part number: (size, ETag)}`` of the pending upload (ListParts, every page)."""
        if not blob.upload_id:
            raise UploadGone("the upload has not been created in the store")
        parts: dict[int, tuple[int, str]] = {}
        marker = 0
        while True:
            with _store_errors("ListParts"):
                answer = self.client.list_parts(
                    Bucket=self.bucket,
                    Key=self.key(blob.job_id, blob.blob),
                    UploadId=blob.upload_id,
                    PartNumberMarker=marker,
                )
            for part in answer.get("Parts", []):
                parts[int(part["PartNumber"])] = (int(part["Size"]), part["ETag"])
            if not answer.get("IsTruncated"):
                return parts
            following = int(answer.get("NextPartNumberMarker") or 0)
            if following <= marker:
                return parts  # a server that says "truncated" without moving on: take what it gave
            marker = following

    def _keys(self, prefix: str) -> Iterator[str]:
        token = None
        while True:
            arguments = {"Bucket": self.bucket, "Prefix": prefix}
            if token:
                arguments["ContinuationToken"] = token
            with _store_errors("ListObjectsV2"):
                answer = self.client.list_objects_v2(**arguments)
            for item in answer.get("Contents", []):
                yield item["Key"]
            token = answer.get("NextContinuationToken")
            if not answer.get("IsTruncated") or not token:
                return

    def _delete_keys(self, batch: list[dict]) -> None:
        with _store_errors("DeleteObjects"):
            answer = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        errors = [error for error in answer.get("Errors", []) if error.get("Code") != "NoSuchKey"]
        if errors:
            raise StoreError(f"DeleteObjects failed for {len(errors)} keys: {errors[0]}")


class _store_errors:
    """Turns botocore's exceptions into :class:`StoreError` (``NoSuchUpload`` into :class:`UploadGone`)."""

    def __init__(self, operation: str) -> None:
        self.operation = operation

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if error is None:
            return False
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(error, ClientError):
            code = error.response.get("Error", {}).get("Code", "")
            message = error.response.get("Error", {}).get("Message", "") or str(error)
            if code == "NoSuchUpload":
                raise UploadGone(f"{self.operation}: the store has no such upload") from None
            raise StoreError(f"{self.operation} failed: {code} {message}".strip()) from None
        if isinstance(error, BotoCoreError):
            raise StoreError(f"{self.operation} failed: {error}") from None
        return False
