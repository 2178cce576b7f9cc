"""Users' uploads (e.g. a zip of a model directory): storing them within each user's quota, deleting them,
and who may download them."""

from __future__ import annotations

import uuid
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import Count, Sum

from apps.jobs.exceptions import TransferRefused
from apps.jobs.models import INFERENCE, PARAMETER_SERVER, Job, Upload
from apps.jobs.training.storage import MODEL_FILENAME, write_stream
from apps.jobs.training.tokens import transfer_key
from worker_daemon import protocol

# --- uploads ------------------------------------------------------------------------------------------------


QUOTA_HINT = "delete uploads you no longer need with DELETE /api/uploads/<id>/"


def _room(owner, *, adding: int = 0) -> int:
    """Bytes ``owner`` may still upload in one more file, counting ``adding`` bytes already written for it;
    :class:`TransferRefused` (413) when their quota (``HYPHA_UPLOAD_QUOTA_BYTES``/``_COUNT``) is used up."""
    used = Upload.objects.filter(owner=owner).aggregate(count=Count("pk"), size=Sum("size"))
    count, size = used["count"], used["size"] or 0
    if count >= settings.HYPHA_UPLOAD_QUOTA_COUNT:
        noun = "upload" if count == 1 else "uploads"
        raise TransferRefused(f"you have {count} {noun}, the most allowed; {QUOTA_HINT}", status=413)
    quota = settings.HYPHA_UPLOAD_QUOTA_BYTES
    if size + adding > quota:
        raise TransferRefused(
            f"this upload would exceed your upload quota of {quota} bytes ({size} used); {QUOTA_HINT}",
            status=413,
        )
    return quota - size - adding


def store_upload(owner, name: str, chunks, *, limit: int, declared_size: int | None = None) -> Upload:
    """Store a user's upload (e.g. a zip of a model directory) of at most ``limit`` bytes, within their quota;
    :class:`TransferRefused` when refused (400 a bad name; 413 too large or over quota), leaving no file and
    no row. ``declared_size`` (the request's ``Content-Length``) lets a body that cannot fit be refused
    before any of it is written."""
    if not MODEL_FILENAME.match(name):
        raise TransferRefused(
            f"{name!r} is not an allowed file name (letters, digits, '.', '_', '-'; at most 100)", status=400
        )
    declared = max(declared_size or 0, 0)
    if declared > limit:
        raise TransferRefused(f"the file exceeds {limit} bytes", status=413)
    room = _room(owner, adding=declared) + declared  # the owner's room before this upload
    upload_id = uuid.uuid4()
    path = Path(settings.HYPHA_DATA_DIR) / "uploads" / str(upload_id)
    # The quota bounds the stream as it arrives, too: write_stream stops past whichever bound comes first.
    try:
        entry = write_stream(path, chunks, limit=min(limit, room))
    except TransferRefused:
        if room < limit:  # the quota stopped it, not the file cap: say so
            _room(owner, adding=room + 1)
        raise
    try:
        with transaction.atomic():
            # Two uploads of one user racing: the owner's row serialises them, so both cannot pass the quota.
            get_user_model().objects.select_for_update().filter(pk=owner.pk).first()
            _room(owner, adding=entry["size"])
            return Upload.objects.create(id=upload_id, owner=owner, name=name, **entry)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def delete_upload(upload_id: str, *, user) -> None:
    """Delete an upload, its row now and its file once that commits. Its owner and staff may;
    :class:`TransferRefused` 404 for anyone else (an upload's existence is not disclosed, as for downloads)
    and 409 while a job that has not ended is built from it (its parameter server may still download it)."""
    try:
        uploads = Upload.objects.filter(pk=uuid.UUID(str(upload_id)))
    except ValueError:
        raise TransferRefused("No such upload.", status=404) from None
    if not user.is_staff:
        uploads = uploads.filter(owner=user)
    with transaction.atomic():
        upload = uploads.select_for_update().first()
        if upload is None:
            raise TransferRefused("No such upload.", status=404)
        running = (
            Job.objects.exclude(status__in=Job.FINAL)
            .filter(spec__model__source__file=str(upload.pk))
            .order_by("created_at")
            .first()
        )
        if running is not None:
            raise TransferRefused(
                f"job {running.pk} ({running.status}) is built from this upload; it can be deleted once "
                "that job has ended",
                status=409,
            )
        path = upload.path
        upload.delete()
        transaction.on_commit(lambda: path.unlink(missing_ok=True))


def resolve_upload(owner, reference: str) -> Upload | None:
    """The owner's upload named by id, or else the newest of theirs with that file name."""
    try:
        found = Upload.objects.filter(owner=owner, pk=uuid.UUID(reference)).first()
    except ValueError:
        found = None
    return found or Upload.objects.filter(owner=owner, name=reference).order_by("-created_at").first()


def authorise_upload_download(upload: Upload, *, user, token: str | None) -> None:
    """Its owner (or staff) may download an upload, and so may the parameter server (or an inference worker)
    of a job built from it."""
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
    if claims.get("role") not in (PARAMETER_SERVER, INFERENCE) or source.get("file") != str(upload.pk):
        raise TransferRefused("this token does not grant access to this upload", status=403)
