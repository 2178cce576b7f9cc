"""Users' uploads (e.g. a zip of a model directory) and who may download them."""

from __future__ import annotations

import uuid
from pathlib import Path

from django.conf import settings

from apps.jobs.exceptions import TransferRefused
from apps.jobs.models import PARAMETER_SERVER, Job, Upload
from apps.jobs.training.storage import MODEL_FILENAME, write_stream
from apps.jobs.training.tokens import transfer_key
from worker_daemon import protocol

# --- uploads ------------------------------------------------------------------------------------------------


def store_upload(owner, name: str, chunks, *, limit: int) -> Upload:
    """Store a user's upload (e.g. a zip of a model directory); :class:`TransferRefused` when refused."""
    if not MODEL_FILENAME.match(name):
        raise TransferRefused(
            f"{name!r} is not an allowed file name (letters, digits, '.', '_', '-'; at most 100)", status=400
        )
    upload_id = uuid.uuid4()
    entry = write_stream(Path(settings.HYPHA_DATA_DIR) / "uploads" / str(upload_id), chunks, limit=limit)
    return Upload.objects.create(id=upload_id, owner=owner, name=name, **entry)


def resolve_upload(owner, reference: str) -> Upload | None:
    """The owner's upload named by id, or else the newest of theirs with that file name."""
    try:
        found = Upload.objects.filter(owner=owner, pk=uuid.UUID(reference)).first()
    except ValueError:
        found = None
    return found or Upload.objects.filter(owner=owner, name=reference).order_by("-created_at").first()


def authorise_upload_download(upload: Upload, *, user, token: str | None) -> None:
    """Its owner (or staff) may download an upload, and so may the parameter server of a job built from it."""
    if user is not None and user.is_authenticated:
        if user.pk == upload.owner_id or user.is_staff:
            return
        # Someone else's upload is a 404, as for jobs: its existence is not disclosed.
        raise TransferRefused("No such upload.", status=404)
    if not token:
        raise TransferRefused("authentication required", status=401)
    body = token.partition(".")[0]
    try:
        import base64
        import json

        job_id = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))).get("job")
        job = Job.objects.filter(pk=uuid.UUID(str(job_id))).first()
    except (ValueError, TypeError, AttributeError):
        job = None
    if job is None:
        raise TransferRefused("invalid transfer token", status=401)
    try:
        claims = protocol.verify_transfer_token(transfer_key(job.pk), token, job_id=str(job.pk))
    except protocol.TransferTokenError as error:
        raise TransferRefused(str(error), status=401) from None
    source = (job.spec.get("model") or {}).get("source") or {}
    if claims.get("role") != PARAMETER_SERVER or source.get("file") != str(upload.pk):
        raise TransferRefused("this token does not grant access to this upload", status=403)
