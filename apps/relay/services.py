"""Relay workflows (docs/transfers.md, "Relay"): who may upload, read, reply to, want and delete a job's
objects, the index that records them, and their lifecycle. Bytes never pass through here: the store mints
URLs (:mod:`apps.relay.stores`), and the views hand them out.

Every function takes a :class:`Caller` from :func:`authorise` (the job's transfer token of a live task) and
raises :class:`~apps.relay.exceptions.RelayRefused` with the HTTP status to answer: 400 bad input, 401 no or
bad token, 403 a role that may not touch the key, 404 nothing there, 409 a state that refuses it, 413 too
large, 422 content that does not match its declaration. A refusal changes nothing.

Bytes of deleted uploads go after the transaction commits (Celery tasks in :mod:`apps.relay.tasks`), so a
rolled-back deletion never loses bytes; each upload attempt has its own blob, so those deletions never touch
a newer upload of the same key.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from apps.jobs.models import Job, Task
from apps.jobs.training.tokens import transfer_key
from apps.relay import keys, tasks
from apps.relay.exceptions import ContentMismatch, PartsMissing, RelayRefused, StoreError, UploadGone
from apps.relay.models import RelayObject, RelayUsage, RelayWant
from apps.relay.stores import Blob, LocalStore, get_store
from hypha_site.runtime import enqueue_on_commit
from worker_daemon import protocol
from worker_daemon.bounded_json import hostile_strings

#: The largest metadata object and reply body (bytes of their compact JSON).
MAX_METADATA_BYTES = 8 * 1024
MAX_REPLY_BYTES = 8 * 1024
#: The most parts of an upload (S3's limit; it also bounds the size of a plan).
MAX_PARTS = 10_000
#: The most objects one listing returns.
MAX_LISTED = 100
#: Rows (and jobs, and orphaned local blobs) one sweep handles; the next sweep takes the rest.
SWEEP_BATCH = 500
_SHA256 = re.compile(r"[0-9a-f]{64}")
_METADATA_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class Caller:
    """A live task of the job, as its transfer token names it."""

    job: Job
    peer: str
    role: str


# --- authorisation ------------------------------------------------------------------------------------------


def authorise(job_id: Any, token: str | None) -> Caller:
    """The caller whose transfer token ``token`` is: 404 no such job, 401 no token, a bad signature, an
    expired token or another job's, 409 a job in a final state, 403 a token whose task is not live."""
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        raise RelayRefused("No such job.", status=404)
    if not token:
        raise RelayRefused("a transfer token is required (Authorization: Bearer …)", status=401)
    try:
        claims = protocol.verify_transfer_token(transfer_key(job.pk), token, job_id=str(job.pk))
    except protocol.TransferTokenError as error:
        raise RelayRefused(str(error), status=401) from None
    if job.is_final:
        raise RelayRefused(f"job {job.pk} is {job.status}", status=409)
    task = Task.objects.select_related("lease").filter(job=job, lease_id=claims.get("lease")).first()
    if (
        task is None
        or not task.is_live
        or task.role != claims["role"]
        or str(task.lease.worker_id) != claims["peer"]
    ):
        raise RelayRefused(f"this token's task of job {job.pk} is not live", status=403)
    return Caller(job=job, peer=claims["peer"], role=claims["role"])


# --- uploads ------------------------------------------------------------------------------------------------


def begin_upload(caller: Caller, *, key: str, size: Any, sha256: Any, metadata: Any, base_url: str) -> dict:
    """Begin an upload of ``key``, or resume it: the plan of its parts, ``done`` for those stored already.

    The same key, size and SHA-256 again returns the same upload (or, once complete, the object as
    ``status: complete``); a pending upload with other content is replaced; a complete one with other
    content is a 409."""
    parsed = keys.parse_key(key)
    if not keys.may_write(caller.role, caller.peer, parsed):
        raise keys.write_refusal(caller.role, parsed)
    size = _checked_size(size)
    sha256 = _checked_sha256(sha256)
    metadata = checked_metadata(metadata)
    part_size = settings.HYPHA_RELAY_PART_SIZE
    if size > MAX_PARTS * part_size:
        raise RelayRefused(f"size {size} needs more than {MAX_PARTS} parts of {part_size} bytes", status=413)
    for attempt in range(2):
        try:
            with transaction.atomic():
                upload = _begin_row(
                    caller, parsed, size=size, sha256=sha256, metadata=metadata, part_size=part_size
                )
            break
        except IntegrityError:
            if attempt:  # two first begins of one key raced: the second finds the first's row
                raise
    if upload.status == RelayObject.Status.COMPLETE:
        return _plan(upload, stored=set(range(1, upload.part_count + 1)), base_url=base_url)
    upload, stored = _open_in_store(upload)
    return _plan(upload, stored=stored, base_url=base_url)


def _begin_row(caller: Caller, key: keys.Key, *, size: int, sha256: str, metadata: dict, part_size: int):
    existing = RelayObject.objects.select_for_update().filter(job=caller.job, key=key.text).first()
    if existing is not None and existing.status == RelayObject.Status.COMPLETE:
        if (existing.size, existing.sha256) == (size, sha256):
            return existing  # an idempotent retry of an upload that completed
        raise RelayRefused(
            f"{key.text} exists with other content (size {existing.size}, sha256 {existing.sha256}); "
            "objects are immutable",
            status=409,
        )
    same_content = existing is not None and (existing.size, existing.sha256, existing.part_size) == (
        size,
        sha256,
        part_size,
    )
    if same_content and existing.status == RelayObject.Status.PENDING:
        existing.metadata, existing.writer, existing.writer_role = metadata, caller.peer, caller.role
        existing.save(update_fields=["metadata", "writer", "writer_role"])
        return existing
    if existing is not None:  # a pending upload of other content, or a delivered object's leftover row
        _delete_row(existing)
    return RelayObject.objects.create(
        job=caller.job,
        key=key.text,
        round=key.round,
        size=size,
        sha256=sha256,
        part_size=part_size,
        metadata=metadata,
        writer=caller.peer,
        writer_role=caller.role,
    )


def _open_in_store(upload: RelayObject) -> tuple[RelayObject, set[int]]:
    """The upload with its store upload id (created if it has none, or the store forgot it) and the numbers
    of its parts stored whole. Outside any transaction: these are calls to the store."""
    store = get_store()
    lengths = _lengths(upload)
    for _ in range(3):
        if not upload.upload_id:
            created = store.begin(_blob(upload))
            if created and not RelayObject.objects.filter(pk=upload.pk, upload_id="").update(
                upload_id=created
            ):
                store.delete(Blob(str(upload.job_id), str(upload.blob), created))  # another begin won
            upload = _reloaded(upload)
            if created and not upload.upload_id:
                continue
        try:
            return upload, store.stored_parts(_blob(upload), lengths)
        except UploadGone:
            # The store aborted the upload (its own expiry, say): start it over there.
            RelayObject.objects.filter(pk=upload.pk, upload_id=upload.upload_id).update(upload_id="")
            upload = _reloaded(upload)
    raise StoreError("the store keeps losing this upload; try again later")


def _reloaded(upload: RelayObject) -> RelayObject:
    fresh = RelayObject.objects.filter(pk=upload.pk, blob=upload.blob).first()
    if fresh is None:
        raise RelayRefused(f"the upload of {upload.key} was replaced or deleted meanwhile", status=409)
    return fresh


def _plan(upload: RelayObject, *, stored: set[int], base_url: str) -> dict:
    store = get_store()
    lifetime = settings.HYPHA_RELAY_URL_LIFETIME
    blob = _blob(upload)
    parts = []
    for number in range(1, upload.part_count + 1):
        done = number in stored
        parts.append(
            {
                "number": number,
                "offset": (number - 1) * upload.part_size,
                "size": upload.part_length(number),
                "url": None if done else store.part_url(blob, number, base_url=base_url, lifetime=lifetime),
                "done": done,
            }
        )
    return {
        "key": upload.key,
        "size": upload.size,
        "sha256": upload.sha256,
        "part_size": upload.part_size,
        "parts": parts,
        "expires_in": lifetime,
        "status": upload.status,
    }


@dataclass(frozen=True)
class Completion:
    """An upload about to be checked by its store (``answer`` set: it was complete already)."""

    object_id: int
    key: str
    blob: Blob
    lengths: dict[int, int] = field(default_factory=dict)
    size: int = 0
    sha256: str = ""
    answer: dict | None = None


def prepare_completion(caller: Caller, *, key: str, base_url: str) -> Completion:
    """Step 1 of :func:`complete_upload` (database only)."""
    parsed = keys.parse_key(key)
    if not keys.may_write(caller.role, caller.peer, parsed):
        raise keys.write_refusal(caller.role, parsed)
    upload = RelayObject.objects.filter(job=caller.job, key=parsed.text).first()
    if upload is None or upload.status == RelayObject.Status.DELETED:
        raise RelayRefused(f"no upload of {parsed.text}: begin it with POST uploads/", status=404)
    if upload.status == RelayObject.Status.COMPLETE:
        # Uploaded again with the same content (an idempotent retry, or the PS publishing the same round
        # again for a want): the same object, and it answers the wants made until now.
        _answer_wants(upload, timezone.now())
        return Completion(upload.pk, upload.key, _blob(upload), answer=_answer(upload, base_url=base_url))
    if not upload.upload_id and get_store().name != LocalStore.name:
        raise PartsMissing(list(range(1, upload.part_count + 1)))
    return Completion(
        upload.pk, upload.key, _blob(upload), _lengths(upload), size=upload.size, sha256=upload.sha256
    )


def check_in_store(completion: Completion) -> BaseException | None:
    """Step 2 (no database; the local store hashes every byte, so run it off the request thread): None when
    the store holds the declared content, else the refusal or store error to hand to step 3."""
    try:
        get_store().finish(
            completion.blob, completion.lengths, size=completion.size, sha256=completion.sha256
        )
    except (PartsMissing, StoreError) as problem:
        return problem
    return None


def finish_completion(completion: Completion, problem: BaseException | None, *, base_url: str) -> dict:
    """Step 3 (database only): mark the upload COMPLETE and count it, or act on the store's ``problem``: a
    mismatch deletes the upload (422); an upload the store lost is deleted too (409, begin again)."""
    if problem is None:
        return _mark_complete(completion, base_url=base_url)
    if isinstance(problem, PartsMissing):
        raise problem
    if isinstance(problem, UploadGone | ContentMismatch):
        # A concurrent complete of the same upload may have finished it (its store upload is gone then).
        done = RelayObject.objects.filter(
            pk=completion.object_id, blob=completion.blob.blob, status=RelayObject.Status.COMPLETE
        ).first()
        if done is not None:
            return _answer(done, base_url=base_url)
        with transaction.atomic():
            upload = (
                RelayObject.objects.select_for_update()
                .filter(pk=completion.object_id, blob=completion.blob.blob, status=RelayObject.Status.PENDING)
                .first()
            )
            if upload is not None:
                _delete_row(upload)
        if isinstance(problem, ContentMismatch):
            raise RelayRefused(f"{completion.key}: {problem}; the upload was deleted", status=422)
        raise RelayRefused(f"{completion.key}: {problem}; begin the upload again", status=409)
    raise problem


def complete_upload(caller: Caller, *, key: str, base_url: str) -> dict:
    """Complete an upload whose parts are all stored: the store checks size (and SHA-256, locally), then the
    object is COMPLETE and visible to readers. The three steps in this thread; :func:`complete_upload_async`
    runs the store's check off the event loop's database thread."""
    completion = prepare_completion(caller, key=key, base_url=base_url)
    if completion.answer is not None:
        return completion.answer
    return finish_completion(completion, check_in_store(completion), base_url=base_url)


async def complete_upload_async(caller: Caller, *, key: str, base_url: str) -> dict:
    """:func:`complete_upload` for async views: the database steps on Django's database thread, the store's
    check (hashing gigabytes locally) in a thread of its own so the server keeps answering meanwhile."""
    completion = await sync_to_async(prepare_completion)(caller, key=key, base_url=base_url)
    if completion.answer is not None:
        return completion.answer
    problem = await asyncio.to_thread(check_in_store, completion)
    return await sync_to_async(finish_completion)(completion, problem, base_url=base_url)


def _mark_complete(completion: Completion, *, base_url: str) -> dict:
    now = timezone.now()
    with transaction.atomic():
        updated = RelayObject.objects.filter(
            pk=completion.object_id, blob=completion.blob.blob, status=RelayObject.Status.PENDING
        ).update(status=RelayObject.Status.COMPLETE, completed_at=now, upload_id="")
        upload = RelayObject.objects.filter(pk=completion.object_id, blob=completion.blob.blob).first()
        if upload is None:
            raise RelayRefused(
                f"the upload of {completion.key} was replaced or deleted meanwhile", status=409
            )
        if not updated:
            return _answer(upload, base_url=base_url)  # a concurrent complete won: the same object
        _count(upload.job_id, objects_written=1, bytes_written=upload.size)
        _answer_wants(upload, now)
    return _answer(upload, base_url=base_url)


def _answer_wants(upload: RelayObject, now) -> None:
    """A complete ``model/<round>/<file>`` answers the wants for ``model/latest/<file>`` made until ``now``."""
    parsed = keys.parse_key(upload.key)
    if parsed.namespace == keys.MODEL:
        RelayWant.objects.filter(
            job_id=upload.job_id, key=f"model/latest/{parsed.filename}", requested_at__lte=now
        ).delete()


# --- reading ------------------------------------------------------------------------------------------------


def get_object(caller: Caller, *, key: str, base_url: str) -> dict | None:
    """The complete object ``key`` (``model/latest/<file>``: the newest complete ``model/<round>/<file>``)
    with a GET URL for the caller, or None while there is none."""
    parsed = keys.parse_key(key)
    if not keys.may_read(caller.role, parsed):
        raise keys.read_refusal(parsed.text)
    complete = RelayObject.objects.filter(job=caller.job, status=RelayObject.Status.COMPLETE)
    if parsed.latest:
        found = (
            complete.filter(key__startswith="model/", key__endswith=f"/{parsed.filename}")
            .order_by("-round", "-completed_at")
            .first()
        )
    else:
        found = complete.filter(key=parsed.text).first()
    if found is None:
        return None
    return _handed_out(caller, [found], base_url=base_url)[0]


def list_objects(caller: Caller, *, prefix: str, base_url: str) -> list[dict]:
    """The complete objects under ``prefix`` (the caller may read all of its namespace or none: 403), oldest
    first, at most :data:`MAX_LISTED`, each with a GET URL for the caller."""
    namespace = keys.parse_prefix(prefix)
    if not keys.may_read_namespace(caller.role, namespace):
        raise keys.read_refusal(f"{namespace}/")
    found = list(
        RelayObject.objects.filter(
            job=caller.job, status=RelayObject.Status.COMPLETE, key__startswith=prefix
        ).order_by("completed_at", "id")[:MAX_LISTED]
    )
    return _handed_out(caller, found, base_url=base_url) if found else []


def _handed_out(caller: Caller, found: list[RelayObject], *, base_url: str) -> list[dict]:
    """``found`` as answers with GET URLs; each object's size counts as read once per distinct reader."""
    first_reads = [upload for upload in found if caller.peer not in upload.readers]
    if first_reads:
        with transaction.atomic():
            counted = 0
            for upload in RelayObject.objects.select_for_update().filter(pk__in=[u.pk for u in first_reads]):
                if caller.peer not in upload.readers:
                    upload.readers = [*upload.readers, caller.peer]
                    upload.save(update_fields=["readers"])
                    counted += upload.size
            if counted:
                _count(caller.job.pk, bytes_read=counted)
    return [_answer(upload, base_url=base_url) for upload in found]


# --- replies, wants, deletion -------------------------------------------------------------------------------


def set_reply(caller: Caller, *, key: str, status: Any, body: Any) -> dict:
    """A reader answers a complete object (the PS answers an update with its HTTP handler's status and
    body). Set once: the same reply again is a no-op, another one a 409."""
    parsed = keys.parse_key(key)
    if not keys.may_read(caller.role, parsed):
        raise RelayRefused(f"only a reader of {parsed.text} may reply to it", status=403)
    if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
        raise RelayRefused("status must be an integer from 100 to 599", status=400, field="status")
    body = _checked_json_object(body, field_name="body", limit=MAX_REPLY_BYTES)
    with transaction.atomic():
        upload = (
            RelayObject.objects.select_for_update()
            .filter(job=caller.job, key=parsed.text, status=RelayObject.Status.COMPLETE)
            .first()
        )
        if upload is None:
            raise RelayRefused(f"no object {parsed.text}", status=404)
        if upload.reply_status is not None:
            if (upload.reply_status, upload.reply_body) != (status, body):
                raise RelayRefused(f"{parsed.text} has another reply already", status=409)
        else:
            upload.reply_status, upload.reply_body, upload.replied_at = status, body, timezone.now()
            upload.save(update_fields=["reply_status", "reply_body", "replied_at"])
    return {"status": status, "body": body}


def get_reply(caller: Caller, *, key: str) -> dict | None:
    """The reply to ``key`` (its writer or a reader asks), None while there is none; 404 if no such object
    (a delivered object keeps its reply until the sweep)."""
    parsed = keys.parse_key(key)
    if not (keys.may_write(caller.role, caller.peer, parsed) or keys.may_read(caller.role, parsed)):
        raise RelayRefused(f"only the writer or a reader of {parsed.text} may read its reply", status=403)
    upload = RelayObject.objects.filter(job=caller.job, key=parsed.text).first()
    if upload is None:
        raise RelayRefused(f"no object {parsed.text}", status=404)
    if upload.reply_status is None:
        return None
    return {"status": upload.reply_status, "body": upload.reply_body}


def want(caller: Caller, *, key: str) -> dict:
    """A reader asks for ``model/latest/<filename>`` to be published (again)."""
    parsed = keys.parse_key(key)
    if not parsed.latest:
        raise RelayRefused("only model/latest/<filename> can be wanted", status=400, field="key")
    if not keys.may_read(caller.role, parsed):
        raise keys.read_refusal(parsed.text)
    for attempt in range(2):
        try:
            with transaction.atomic():
                RelayWant.objects.update_or_create(
                    job=caller.job, key=parsed.text, defaults={"requested_at": timezone.now()}
                )
            break
        except IntegrityError:
            if attempt:
                raise
    return {"key": parsed.text}


def take_wants(caller: Caller) -> list[str]:
    """The keys wanted since they were last handed out (the parameter server only); hands them out."""
    if caller.role != keys.PARAMETER_SERVER:
        raise RelayRefused("only the job's parameter server answers wants", status=403)
    with transaction.atomic():
        wanted = list(
            RelayWant.objects.select_for_update()
            .filter(job=caller.job)
            .filter(Q(handed_at__isnull=True) | Q(requested_at__gt=F("handed_at")))
        )
        if wanted:
            RelayWant.objects.filter(pk__in=[w.pk for w in wanted]).update(handed_at=timezone.now())
    return [w.key for w in wanted]


def delete_object(caller: Caller, *, key: str) -> None:
    """Its writer or the parameter server (the reader of updates, the writer of the rest) deletes an object it
    is done with (a writer also an upload it abandons): the row now (a replied object keeps a row with its
    reply for the writer), the bytes after commit. Trainers, which read results and models every other
    trainer reads too, delete only their own updates."""
    parsed = keys.parse_key(key)
    if parsed.latest:
        raise RelayRefused(
            "model/latest/<filename> is an alias: delete model/<round>/<filename>", status=400, field="key"
        )
    writer = keys.may_write(caller.role, caller.peer, parsed)
    if not (writer or caller.role == keys.PARAMETER_SERVER):
        raise RelayRefused(f"only the writer or the parameter server may delete {parsed.text}", status=403)
    visible = [RelayObject.Status.COMPLETE, *([RelayObject.Status.PENDING] if writer else [])]
    with transaction.atomic():
        upload = (
            RelayObject.objects.select_for_update()
            .filter(job=caller.job, key=parsed.text, status__in=visible)
            .first()
        )
        if upload is None:
            raise RelayRefused(f"no object {parsed.text}", status=404)
        if upload.status == RelayObject.Status.COMPLETE and upload.reply_status is not None:
            blob = _blob(upload)
            upload.status, upload.deleted_at = RelayObject.Status.DELETED, timezone.now()
            upload.save(update_fields=["status", "deleted_at"])
            enqueue_on_commit(tasks.delete_blobs, [blob.as_list()])
        else:
            _delete_row(upload)


# --- lifecycle ----------------------------------------------------------------------------------------------


def forget_job(job_id: Any) -> int:
    """Delete every relay object and want of a job: the rows now (inside the caller's transaction), the bytes
    once it commits. The job's usage counters stay. The number of objects deleted."""
    with transaction.atomic():
        uploads = RelayObject.objects.filter(job_id=job_id)
        pending = [
            Blob(str(job_id), str(blob), upload_id)
            for blob, upload_id in uploads.filter(status=RelayObject.Status.PENDING)
            .exclude(upload_id="")
            .values_list("blob", "upload_id")
        ]
        deleted, _ = uploads.delete()
        RelayWant.objects.filter(job_id=job_id).delete()
        enqueue_on_commit(tasks.delete_job_bytes, str(job_id), [blob.as_list() for blob in pending])
    return deleted


def sweep() -> dict:
    """One sweep (beat runs it every ``HYPHA_RELAY_SWEEP_INTERVAL``): uploads still pending after
    ``HYPHA_RELAY_PENDING_TTL``, delivered objects' rows kept that long for their replies, every object of
    jobs in a final state, and (local store) blob directories no row knows that are older than the TTL
    (a part written while its upload was being deleted). Bounded: :data:`SWEEP_BATCH` of each per sweep."""
    cutoff = timezone.now() - timedelta(seconds=settings.HYPHA_RELAY_PENDING_TTL)
    with transaction.atomic():
        stale = list(
            RelayObject.objects.select_for_update()
            .filter(status=RelayObject.Status.PENDING, created_at__lt=cutoff)
            .order_by("created_at")[:SWEEP_BATCH]
        )
        for upload in stale:
            _delete_row(upload)
        delivered, _ = RelayObject.objects.filter(
            pk__in=list(
                RelayObject.objects.filter(
                    status=RelayObject.Status.DELETED, deleted_at__lt=cutoff
                ).values_list("pk", flat=True)[:SWEEP_BATCH]
            )
        ).delete()
    # order_by(): the models' default ordering would put its columns into the DISTINCT.
    ended = list(
        RelayObject.objects.filter(job__status__in=Job.FINAL)
        .order_by()
        .values_list("job_id", flat=True)
        .distinct()[:SWEEP_BATCH]
    )
    ended += list(
        RelayWant.objects.filter(job__status__in=Job.FINAL)
        .exclude(job_id__in=ended)
        .order_by()
        .values_list("job_id", flat=True)
        .distinct()[:SWEEP_BATCH]
    )
    for job_id in ended:
        forget_job(job_id)
    return {
        "pending": len(stale),
        "delivered": delivered,
        "jobs": len(ended),
        "orphans": _sweep_local_orphans(cutoff.timestamp()),
    }


def _sweep_local_orphans(older_than: float) -> int:
    store = get_store()
    if not isinstance(store, LocalStore):
        return 0  # S3: configure the bucket's AbortIncompleteMultipartUpload rule (docs/transfers.md)
    candidates = []
    for job_id, blob, modified in store.blobs():
        if modified < older_than:
            candidates.append((job_id, blob))
            if len(candidates) == SWEEP_BATCH:
                break
    known = {
        str(blob)
        for blob in RelayObject.objects.filter(
            blob__in=[blob for _, blob in candidates if _is_uuid(blob)]
        ).values_list("blob", flat=True)
    }
    orphans = [(job_id, blob) for job_id, blob in candidates if blob not in known]
    for job_id, blob in orphans:
        if _is_uuid(job_id) and _is_uuid(blob):
            store.delete(Blob(job_id, blob))
    return len(orphans)


def job_relay_summary(job: Job | Any) -> dict:
    """What ``job`` (a Job or its id) moved through the relay: ``{"objects", "bytes_written",
    "bytes_read"}`` — objects completed over its life, their bytes, and bytes handed to readers (each
    object's size once per distinct reader given its URL). Zeros for a job that never used the relay."""
    job_id = job.pk if isinstance(job, Job) else job
    usage = RelayUsage.objects.filter(job_id=job_id).first()
    if usage is None:
        return {"objects": 0, "bytes_written": 0, "bytes_read": 0}
    return {
        "objects": usage.objects_written,
        "bytes_written": usage.bytes_written,
        "bytes_read": usage.bytes_read,
    }


# --- validation and helpers ---------------------------------------------------------------------------------


def checked_metadata(value: Any) -> dict:
    """A flat JSON object of strings, integers, finite floats, booleans and lists of strings, ≤ 8 KiB, with
    names of letters, digits, ``_``, ``.``, ``-`` (at most 64); 400 (field ``metadata``) otherwise."""
    if value is None:
        return {}
    value = _checked_json_object(value, field_name="metadata", limit=MAX_METADATA_BYTES)
    for name, item in value.items():
        if not _METADATA_NAME.fullmatch(name):
            raise RelayRefused(
                f"metadata name {name[:80]!r} must be letters, digits, '_', '.', '-' (at most 64)",
                status=400,
                field="metadata",
            )
        if isinstance(item, float) and not math.isfinite(item):
            raise RelayRefused(f"metadata {name!r} must be a finite number", status=400, field="metadata")
        if isinstance(item, list) and all(isinstance(element, str) for element in item):
            continue
        if not isinstance(item, str | int | float | bool) or (isinstance(item, int) and abs(item) >= 1 << 63):
            raise RelayRefused(
                f"metadata {name!r} must be a string, a 64-bit integer, a number, a boolean or a list of strings",
                status=400,
                field="metadata",
            )
    return value


def _checked_json_object(value: Any, *, field_name: str, limit: int) -> dict:
    if not isinstance(value, dict):
        raise RelayRefused(f"{field_name} must be a JSON object", status=400, field=field_name)
    problem = next(hostile_strings(value), None)
    if problem is not None:
        raise RelayRefused(f"{field_name}: {problem[1]}", status=400, field=field_name)
    try:
        encoded = json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError):
        raise RelayRefused(
            f"{field_name} must be plain JSON (finite numbers)", status=400, field=field_name
        ) from None
    if len(encoded) > limit:
        raise RelayRefused(
            f"{field_name} is {len(encoded)} bytes of JSON; at most {limit}", status=400, field=field_name
        )
    return value


def _checked_size(size: Any) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise RelayRefused("size must be a non-negative integer (bytes)", status=400, field="size")
    limit = settings.HYPHA_RELAY_MAX_OBJECT_BYTES
    if size > limit:
        raise RelayRefused(f"size {size} exceeds the relay's limit of {limit} bytes", status=413)
    return size


def _checked_sha256(sha256: Any) -> str:
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise RelayRefused("sha256 must be 64 lower-case hexadecimal digits", status=400, field="sha256")
    return sha256


def _is_uuid(text: str) -> bool:
    return bool(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", text))


def _blob(upload: RelayObject) -> Blob:
    return Blob(str(upload.job_id), str(upload.blob), upload.upload_id)


def _lengths(upload: RelayObject) -> dict[int, int]:
    return {number: upload.part_length(number) for number in range(1, upload.part_count + 1)}


def _delete_row(upload: RelayObject) -> None:
    """Delete the row now and its bytes once the transaction commits."""
    blob = _blob(upload)
    upload.delete()
    enqueue_on_commit(tasks.delete_blobs, [blob.as_list()])


def _count(job_id: Any, **increments: int) -> None:
    RelayUsage.objects.get_or_create(job_id=job_id)
    RelayUsage.objects.filter(job_id=job_id).update(
        **{name: F(name) + amount for name, amount in increments.items()}, updated_at=timezone.now()
    )


def _answer(upload: RelayObject, *, base_url: str) -> dict:
    lifetime = settings.HYPHA_RELAY_URL_LIFETIME
    reply = (
        None if upload.reply_status is None else {"status": upload.reply_status, "body": upload.reply_body}
    )
    return {
        "key": upload.key,
        "size": upload.size,
        "sha256": upload.sha256,
        "metadata": upload.metadata,
        "writer": upload.writer,
        # Peers that were handed a GET URL (a parameter server counts them as having fetched a result).
        "readers": list(upload.readers),
        "created_at": upload.completed_at or upload.created_at,
        "url": get_store().object_url(_blob(upload), base_url=base_url, lifetime=lifetime),
        "expires_in": lifetime,
        "reply": reply,
    }


# --- the local store's byte views ---------------------------------------------------------------------------


def local_part_target(job_id: str, blob: str, number: int) -> tuple[Blob, int]:
    """The pending upload ``blob`` of job ``job_id`` and the length of its part ``number``, for the local
    store's PUT view; 404 when there is no such pending upload or part."""
    upload = RelayObject.objects.filter(job_id=job_id, blob=blob, status=RelayObject.Status.PENDING).first()
    if upload is None or not 1 <= number <= upload.part_count:
        raise RelayRefused("no such pending upload or part (deleted, completed or replaced?)", status=404)
    return _blob(upload), upload.part_length(number)


def local_object_target(job_id: str, blob: str) -> tuple[Blob, list[tuple[int, int]], int]:
    """The complete object ``blob`` of job ``job_id``: its blob, ``(part number, length)`` in order and its
    size, for the local store's GET view; 404 when it is not there (deleted, or not complete)."""
    upload = RelayObject.objects.filter(job_id=job_id, blob=blob, status=RelayObject.Status.COMPLETE).first()
    if upload is None:
        raise RelayRefused("no such object (deleted?)", status=404)
    return _blob(upload), sorted(_lengths(upload).items()), upload.size
