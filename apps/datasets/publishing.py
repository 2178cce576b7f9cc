"""Slices of data nodes behind NAT, published to the relay's object store (docs/transfers.md, "Data nodes
behind NAT").

A data node that accepts no inbound connections (it registered with ``reachable`` false) cannot be downloaded
from. Instead it uploads each slice of its dataset once to the relay's store, and every download of every job
is served from there:

1. ``begin_publication(node, dataset=…, index=…, size=…, sha256=…)`` → the plan: the parts with a PUT URL each,
   ``done`` for the parts already stored (so a node that restarts sends only the missing ones).
2. The node PUTs each part (S3: presigned UploadPart URLs; local store: :mod:`apps.datasets.views`).
3. ``complete_publication(node, dataset=…, index=…)``: the store checks the size (and, locally, the SHA-256:
   a mismatch deletes the upload, 422) and the copy is COMPLETE.
4. :func:`apps.datasets.services.slice_urls` hands out, for such a node, the control plane's slice URL
   (:func:`slice_base_url`): it takes the same slice token, signed with the node's download key, and answers
   with the copy's bytes (local store) or a redirect to a presigned GET of it (S3); 503 while the slice is not
   published yet, which downloaders wait out as for a node that is down.

Where the bytes are: **S3** — the relay's bucket, ``<prefix>node-<node id>/<blob>``: a job's objects are
``<prefix><job id>/…`` with a bare UUID, so the two never collide. **Local** — a :class:`LocalStore` of its own
in ``HYPHA_DATA_DIR/published-slices/<node id>/<blob>/``, not the relay's directory, whose sweep deletes every
blob that no relay object knows.

Of the relay this imports only the leaf modules ``apps.relay.stores`` and ``apps.relay.exceptions``: the relay's
services import ``apps.jobs``, which imports this app.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from apps.datasets import tasks
from apps.datasets.exceptions import PublicationPartsMissing, PublicationRefused
from apps.datasets.models import DataNode, Dataset, DatasetReplica, PublishedSlice, Slice
from apps.relay.exceptions import ContentMismatch, PartsMissing, StoreError, UploadGone
from apps.relay.stores import Blob, LocalStore, Store, get_store
from apps.workers.models import Reachable
from hypha_site.runtime import enqueue_on_commit

#: The local store's directory of published slices, under ``HYPHA_DATA_DIR``.
PUBLISHED_DIRECTORY = "published-slices"
#: A data node's namespace in S3 starts with this (a job's is its bare UUID).
S3_NAMESPACE_PREFIX = "node-"
#: Where this app's routes are (hypha_site/api_urls.py): the slice and part byte views are under it.
URL_PREFIX = "/api/datanodes/"
#: The most parts of an upload (S3's limit).
MAX_PARTS = 10_000
#: Rows (and orphaned local blobs) one sweep handles; the next sweep takes the rest.
SWEEP_BATCH = 500

_lock = threading.Lock()
_local: tuple[tuple, LocalStore] | None = None


# --- the store --------------------------------------------------------------------------------------------


def store() -> Store:
    """The store of published slices: the relay's S3 store itself, or a local store of its own beside the
    relay's (made again when the settings it is built from change, as tests do)."""
    relay_store = get_store()
    if not isinstance(relay_store, LocalStore):
        return relay_store
    global _local
    configuration = (str(settings.HYPHA_DATA_DIR), settings.SECRET_KEY)
    with _lock:
        if _local is None or _local[0] != configuration:
            root = Path(configuration[0]) / PUBLISHED_DIRECTORY
            _local = (configuration, LocalStore(root, configuration[1]))
        return _local[1]


def blob_of(row: PublishedSlice, target: Store | None = None) -> Blob:
    """Where ``row``'s bytes are in ``target`` (the current store by default)."""
    target = target or store()
    namespace = str(row.publisher)
    if not isinstance(target, LocalStore):
        namespace = f"{S3_NAMESPACE_PREFIX}{namespace}"
    return Blob(namespace, str(row.blob), row.upload_id)


def part_path(publisher, blob, number: int) -> str:
    """The local store's URL path of a part (signed like a presigned URL; :mod:`apps.datasets.views`)."""
    return f"{URL_PREFIX}parts/{publisher}/{blob}/{int(number)}"


def publishes(node: DataNode) -> bool:
    """Whether ``node`` publishes its slices to the store: it said it accepts no inbound connections.

    ``auto`` counts as reachable (the control plane does not probe data nodes): a node behind NAT says
    ``--reachable false``."""
    return node.reachable == Reachable.FALSE


def slice_base_url(node: DataNode) -> str | None:
    """The base URL that stands for ``node`` at the control plane: ``<base>/datasets/<name>/slices/<index>``
    serves its published copies (:func:`apps.datasets.views.published_slice`). None before the node
    registered through the API (the control plane's address is the one the node reached it at)."""
    if not node.control_plane_url:
        return None
    return f"{node.control_plane_url.rstrip('/')}{URL_PREFIX}{node.pk}"


# --- publishing ---------------------------------------------------------------------------------------------


def _served_slice(node: DataNode, dataset: str, index: int, *, status: int = 400) -> Slice:
    """Slice ``index`` of ``dataset`` if ``node`` serves it (it registered the dataset), else a refusal."""
    found = Dataset.objects.filter(name=dataset).first()
    if found is None or not DatasetReplica.objects.filter(dataset=found, node=node).exists():
        raise PublicationRefused(
            f"data node {node.name} does not serve dataset {dataset!r} (it registers the datasets it serves)",
            status=status,
            field="dataset",
        )
    slice_ = found.slices.filter(index=index).first()
    if slice_ is None:
        raise PublicationRefused(
            f"dataset {dataset} has slices 0..{found.slice_count - 1}, not {index}",
            status=status,
            field="index",
        )
    return slice_


def begin_publication(
    node: DataNode, *, dataset: str, index: int, size: int, sha256: str, base_url: str
) -> dict:
    """Begin publishing slice ``index`` of ``dataset``, or resume it: the plan of its parts, ``done`` for
    those stored already (``status: complete`` and every part done once it is published).

    Refused: 409 unless ``node`` publishes (:func:`publishes`); 400 a dataset or slice it does not serve;
    409 a size or SHA-256 that is not the registered one; 413 more than the store takes."""
    if not publishes(node):
        raise PublicationRefused(
            f"data node {node.name} registered as reachable ({node.reachable}): trainers download its slices "
            "from it; only a node registered with reachable false publishes them",
            status=409,
        )
    slice_ = _served_slice(node, dataset, index)
    if (size, sha256) != (slice_.size_bytes, slice_.sha256):
        raise PublicationRefused(
            f"slice {index} of {dataset} is registered as {slice_.size_bytes} bytes with SHA-256 "
            f"{slice_.sha256}, not {size} bytes with SHA-256 {sha256}: publish the registered bytes",
            status=409,
        )
    part_size = settings.HYPHA_RELAY_PART_SIZE
    if size > settings.HYPHA_RELAY_MAX_OBJECT_BYTES or size > MAX_PARTS * part_size:
        raise PublicationRefused(
            f"slice {index} of {dataset} ({size} bytes) is larger than the store takes "
            f"(HYPHA_RELAY_MAX_OBJECT_BYTES {settings.HYPHA_RELAY_MAX_OBJECT_BYTES}, at most {MAX_PARTS} "
            f"parts of {part_size} bytes)",
            status=413,
        )
    for attempt in range(2):
        try:
            with transaction.atomic():
                row = _begin_row(node, slice_, part_size)
            break
        except IntegrityError:
            if attempt:  # two first begins of one slice raced: the second finds the first's row
                raise
    if row.status == PublishedSlice.Status.COMPLETE:
        return _plan(row, dataset, index, stored=set(range(1, row.part_count + 1)), base_url=base_url)
    row, stored = _open_in_store(row)
    return _plan(row, dataset, index, stored=stored, base_url=base_url)


def _begin_row(node: DataNode, slice_: Slice, part_size: int) -> PublishedSlice:
    existing = PublishedSlice.objects.select_for_update().filter(node=node, slice=slice_).first()
    if existing is not None and (
        existing.status == PublishedSlice.Status.COMPLETE or existing.part_size == part_size
    ):
        return existing
    if existing is not None:  # a pending upload cut into parts of another size (the setting changed)
        _delete_rows([existing])
    return PublishedSlice.objects.create(
        node=node,
        slice=slice_,
        publisher=node.pk,
        size=slice_.size_bytes,
        sha256=slice_.sha256,
        part_size=part_size,
    )


def _open_in_store(row: PublishedSlice) -> tuple[PublishedSlice, set[int]]:
    """The row with its store upload id (created if it has none, or the store forgot it) and the numbers of
    its parts stored whole. Outside any transaction: these are calls to the store."""
    target = store()
    lengths = _lengths(row)
    for _ in range(3):
        if not row.upload_id:
            created = target.begin(blob_of(row, target))
            if created and not PublishedSlice.objects.filter(pk=row.pk, upload_id="").update(
                upload_id=created
            ):
                target.delete(Blob(blob_of(row, target).job_id, str(row.blob), created))  # another begin won
            row = _reloaded(row)
            if created and not row.upload_id:
                continue
        try:
            return row, target.stored_parts(blob_of(row, target), lengths)
        except UploadGone:
            # The store aborted the upload (its own expiry, say): start it over there.
            PublishedSlice.objects.filter(pk=row.pk, upload_id=row.upload_id).update(upload_id="")
            row = _reloaded(row)
    raise StoreError("the store keeps losing this upload; try again later")


def _reloaded(row: PublishedSlice) -> PublishedSlice:
    fresh = PublishedSlice.objects.filter(pk=row.pk, blob=row.blob).first()
    if fresh is None:
        raise PublicationRefused(
            "this slice's upload was replaced or deleted meanwhile; begin again", status=409
        )
    return fresh


def _plan(row: PublishedSlice, dataset: str, index: int, *, stored: set[int], base_url: str) -> dict:
    target = store()
    lifetime = settings.HYPHA_RELAY_URL_LIFETIME
    blob = blob_of(row, target)
    parts = []
    for number in range(1, row.part_count + 1):
        done = number in stored
        if done:
            url = None
        elif isinstance(target, LocalStore):
            url = target.signed_url(
                "PUT", part_path(row.publisher, row.blob, number), base_url=base_url, lifetime=lifetime
            )
        else:
            url = target.part_url(blob, number, base_url=base_url, lifetime=lifetime)
        parts.append(
            {
                "number": number,
                "offset": (number - 1) * row.part_size,
                "size": row.part_length(number),
                "url": url,
                "done": done,
            }
        )
    return {
        **_answer(row, dataset, index),
        "part_size": row.part_size,
        "parts": parts,
        "expires_in": lifetime,
    }


def _answer(row: PublishedSlice, dataset: str, index: int) -> dict:
    return {"dataset": dataset, "index": index, "size": row.size, "sha256": row.sha256, "status": row.status}


@dataclass(frozen=True)
class Completion:
    """A publication about to be checked by its store (``answer`` set: it was complete already)."""

    row_id: int
    dataset: str
    index: int
    blob: Blob
    lengths: dict[int, int] = field(default_factory=dict)
    size: int = 0
    sha256: str = ""
    answer: dict | None = None


def prepare_completion(node: DataNode, *, dataset: str, index: int) -> Completion:
    """Step 1 of :func:`complete_publication` (database only)."""
    slice_ = _served_slice(node, dataset, index)
    row = PublishedSlice.objects.filter(node=node, slice=slice_).first()
    if row is None:
        raise PublicationRefused(
            f"no publication of slice {index} of {dataset}: begin it with POST /api/datanodes/publish/",
            status=404,
        )
    if row.status == PublishedSlice.Status.COMPLETE:
        return Completion(row.pk, dataset, index, blob_of(row), answer=_answer(row, dataset, index))
    if not row.upload_id and not isinstance(store(), LocalStore):
        raise PublicationPartsMissing(list(range(1, row.part_count + 1)))
    return Completion(row.pk, dataset, index, blob_of(row), _lengths(row), size=row.size, sha256=row.sha256)


def check_in_store(completion: Completion) -> BaseException | None:
    """Step 2 (no database; the local store hashes every byte, so run it off the request thread): None when
    the store holds the registered content, else the problem to hand to step 3."""
    try:
        store().finish(completion.blob, completion.lengths, size=completion.size, sha256=completion.sha256)
    except (PartsMissing, StoreError) as problem:
        return problem
    return None


def finish_completion(completion: Completion, problem: BaseException | None) -> dict:
    """Step 3 (database only): mark the copy COMPLETE, or act on the store's ``problem``: a mismatch deletes
    the upload (422); an upload the store lost is deleted too (409: begin again)."""
    if problem is None:
        return _mark_complete(completion)
    if isinstance(problem, PartsMissing):
        raise PublicationPartsMissing(problem.missing)
    if isinstance(problem, UploadGone | ContentMismatch):
        # A concurrent complete of the same upload may have finished it (its store upload is gone then).
        done = PublishedSlice.objects.filter(
            pk=completion.row_id, blob=completion.blob.blob, status=PublishedSlice.Status.COMPLETE
        ).first()
        if done is not None:
            return _answer(done, completion.dataset, completion.index)
        with transaction.atomic():
            _delete_rows(
                PublishedSlice.objects.select_for_update().filter(
                    pk=completion.row_id, blob=completion.blob.blob, status=PublishedSlice.Status.PENDING
                )
            )
        where = f"slice {completion.index} of {completion.dataset}"
        if isinstance(problem, ContentMismatch):
            raise PublicationRefused(f"{where}: {problem}; the upload was deleted", status=422)
        raise PublicationRefused(f"{where}: {problem}; begin the upload again", status=409)
    raise problem


def complete_publication(node: DataNode, *, dataset: str, index: int) -> dict:
    """Complete a publication whose parts are all stored: the store checks the size (and SHA-256, locally),
    then the copy is COMPLETE and downloads are served from it. Completing a complete one answers it again."""
    completion = prepare_completion(node, dataset=dataset, index=index)
    if completion.answer is not None:
        return completion.answer
    return finish_completion(completion, check_in_store(completion))


async def complete_publication_async(node: DataNode, *, dataset: str, index: int) -> dict:
    """:func:`complete_publication` for async views: the store's check (hashing a slice locally) in a thread
    of its own, so the server keeps answering meanwhile."""
    completion = await sync_to_async(prepare_completion)(node, dataset=dataset, index=index)
    if completion.answer is not None:
        return completion.answer
    problem = await asyncio.to_thread(check_in_store, completion)
    return await sync_to_async(finish_completion)(completion, problem)


def _mark_complete(completion: Completion) -> dict:
    PublishedSlice.objects.filter(
        pk=completion.row_id, blob=completion.blob.blob, status=PublishedSlice.Status.PENDING
    ).update(status=PublishedSlice.Status.COMPLETE, completed_at=timezone.now(), upload_id="")
    row = PublishedSlice.objects.filter(pk=completion.row_id, blob=completion.blob.blob).first()
    if row is None:
        raise PublicationRefused(
            "this slice's upload was replaced or deleted meanwhile; begin again", status=409
        )
    return _answer(row, completion.dataset, completion.index)


# --- what the downloads and the views read ------------------------------------------------------------------


def published_copy(node: DataNode, dataset: str, index: int) -> PublishedSlice:
    """The complete copy of slice ``index`` of ``dataset`` that ``node`` published: 404 when the node does not
    serve that slice (or no longer publishes), 503 (with the reason) while it is not published yet."""
    slice_ = _served_slice(node, dataset, index, status=404)
    if not publishes(node):
        raise PublicationRefused(
            f"data node {node.name} is reachable now: its slices are downloaded from it; ask the control "
            "plane for the slice again",
            status=404,
        )
    row = PublishedSlice.objects.filter(
        node=node, slice=slice_, status=PublishedSlice.Status.COMPLETE
    ).first()
    if row is None:
        raise PublicationRefused(
            f"slice {index} of {dataset} is not in the store yet: data node {node.name} (not reachable) is "
            "still publishing it",
            status=503,
        )
    return row


def local_part_target(publisher: str, blob: str, number: int) -> tuple[Blob, int]:
    """The pending upload ``blob`` of data node ``publisher`` and the length of its part ``number``, for the
    local store's PUT view; 404 when there is no such pending upload or part."""
    row = PublishedSlice.objects.filter(
        publisher=publisher, blob=blob, status=PublishedSlice.Status.PENDING
    ).first()
    if row is None or not 1 <= number <= row.part_count:
        raise PublicationRefused(
            "no such pending upload or part (deleted, completed or replaced?)", status=404
        )
    return blob_of(row), row.part_length(number)


def local_object(row: PublishedSlice) -> tuple[Blob, list[tuple[int, int]]]:
    """The copy's blob and ``(part number, length)`` in order, for the local store's reads."""
    return blob_of(row), sorted(_lengths(row).items())


# --- dropping and sweeping ----------------------------------------------------------------------------------


def drop_publications(node: DataNode, *, keep: Dataset | None = None) -> int:
    """Delete ``node``'s published copies (except those of dataset ``keep``): the rows now, inside the
    caller's transaction, the bytes once it commits. The number of copies dropped."""
    rows = PublishedSlice.objects.filter(node=node)
    if keep is not None:
        rows = rows.exclude(slice__dataset=keep)
    return _delete_rows(rows)


def _delete_rows(rows) -> int:
    found = list(rows)
    if not found:
        return 0
    target = store()
    blobs = [blob_of(row, target).as_list() for row in found]
    PublishedSlice.objects.filter(pk__in=[row.pk for row in found]).delete()
    enqueue_on_commit(tasks.delete_published_blobs, blobs)
    return len(found)


def sweep() -> dict:
    """One sweep (with the relay's, every ``HYPHA_RELAY_SWEEP_INTERVAL``): uploads still pending after
    ``HYPHA_RELAY_PENDING_TTL``, copies whose node or dataset was deleted or whose node no longer publishes,
    and (local store) blob directories no row knows that are older than the TTL (a part written while its
    upload was being deleted). Bounded: :data:`SWEEP_BATCH` of each per sweep."""
    cutoff = timezone.now() - timedelta(seconds=settings.HYPHA_RELAY_PENDING_TTL)
    stale = Q(status=PublishedSlice.Status.PENDING, created_at__lt=cutoff) | Q(node__isnull=True)
    stale |= Q(slice__isnull=True) | ~Q(node__reachable=Reachable.FALSE)
    ids = list(
        PublishedSlice.objects.filter(stale).order_by("created_at").values_list("pk", flat=True)[:SWEEP_BATCH]
    )
    with transaction.atomic():
        dropped = _delete_rows(PublishedSlice.objects.select_for_update().filter(pk__in=ids))
    return {"published_slices": dropped, "published_orphans": _sweep_local_orphans(cutoff.timestamp())}


def _sweep_local_orphans(older_than: float) -> int:
    target = store()
    if not isinstance(target, LocalStore):
        return 0  # S3: the bucket's AbortIncompleteMultipartUpload rule (docs/transfers.md)
    candidates = []
    for publisher, blob, modified in target.blobs():
        if modified < older_than and _is_uuid(publisher) and _is_uuid(blob):
            candidates.append((publisher, blob))
            if len(candidates) == SWEEP_BATCH:
                break
    known = {
        str(blob)
        for blob in PublishedSlice.objects.filter(blob__in=[blob for _, blob in candidates]).values_list(
            "blob", flat=True
        )
    }
    orphans = [(publisher, blob) for publisher, blob in candidates if blob not in known]
    for publisher, blob in orphans:
        target.delete(Blob(publisher, blob))
    return len(orphans)


def _is_uuid(text: str) -> bool:
    try:
        return str(uuid.UUID(text)) == text
    except ValueError:
        return False


def _lengths(row: PublishedSlice) -> dict[int, int]:
    return {number: row.part_length(number) for number in range(1, row.part_count + 1)}
