"""Dataset workflows: data nodes registering datasets, and each job's claims on its slices, epoch by epoch.

How a job's training consumes its dataset:

1. ``prepare_job(job, name)`` creates epoch 0: one AVAILABLE :class:`JobSlice` per slice of the dataset.
2. A trainer's lease asks ``claim_next(job, lease)`` for a slice; it gets the AVAILABLE slice with the lowest
   (epoch, index) whose earlier epochs are all USED, ASSIGNED to its lease. Claims are made with the database,
   not Python locks: the candidate rows are locked with ``SELECT … FOR UPDATE SKIP LOCKED`` on PostgreSQL, so
   concurrent claimers each take a different row without waiting on each other; on SQLite the IMMEDIATE
   transaction serialises all writers.
3. Once the trainer has the slice (its bridge hands it to the executor) it calls
   ``acknowledge(job, lease, index)``: ASSIGNED → USED.
4. When a lease ends, ``release_for_lease(lease)`` puts its unacknowledged slices back to AVAILABLE, in the
   epoch they were claimed in.
5. When every slice of the newest epoch has been handed out (USED, or ASSIGNED to someone) and nothing is
   claimable, the next claim starts epoch + 1 (new AVAILABLE rows) and claims from it. A slice another lease
   still holds in the old epoch (a trainer's prefetch) is not handed out in the new one until it is USED; if
   its lease ends first, it goes out again in its own epoch, before anything of the new one. While nothing is
   claimable ``claim_next`` returns ``None``: the caller waits and asks again. The original stole other peers'
   slices instead; with acknowledgements and releases nothing is lost.

The guarantee (docs/training.md, "The order of events", step 6), for each job and each training slice
(the held-out evaluation slices are never handed out):

* **Once per epoch.** Each (slice, epoch) row is acknowledged (USED) by exactly one lease, once: its
  transitions are conditional UPDATEs, and an acknowledgement by another lease, or a second one, is refused
  (a repeat by the same lease is answered idempotently). A row whose lease ends unacknowledged returns to
  AVAILABLE and is handed out again, lowest epoch first; so as long as the job claims, every epoch that has
  started is eventually USED slice for slice, none skipped and none doubled.
* **One holder at a time, epochs in order.** A slice's epoch e + 1 is assigned only after its epoch e is USED,
  so no two leases ever hold the same slice (ASSIGNED) at once, and a lease never holds one slice twice.
* **Nobody waits on another's prefetch.** When every AVAILABLE row is behind a slice another lease holds,
  the next epoch starts for the other slices: a trainer waiting for its round to close keeps its prefetch, and
  waiting for it could wait for the very round the claimer's data would finish. A slice held often may so fall
  some epochs behind the others; it catches up, in order, once it is used or released.

What it is not:

* USED means *handed to a trainer's executor*, not *in the global model*: a slice a trainer was handed is not
  handed out again in that epoch when that trainer's update for the round is then left out (late, lost with
  its lease) or refused by the parameter server. The guarantee is "each slice once per epoch among updates
  that counted" only for rounds that leave no trainer out and refuse no update.
* Once a trainer's executor has a slice (USED) the control plane no longer knows when it is done with it: the
  slice's next epoch may go to another trainer while the first still trains on it. Lowest-epoch-first makes
  that happen only after every other slice of the epoch has been handed out.
* ``None`` (ask again) only while the claimer itself holds an unacknowledged slice, or while another
  claimer has locked the one claimable row this instant.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
import urllib.parse
from collections.abc import Iterable

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count, Exists, Max, OuterRef, Q
from django.utils import timezone

from apps.datasets import publishing
from apps.datasets.exceptions import (
    DatasetConflict,
    DatasetNotFound,
    InvalidDataset,
    JobAlreadyPrepared,
    JobNotPrepared,
    LeaseNotEligible,
    SliceNotFound,
)
from apps.datasets.models import DataNode, Dataset, DatasetReplica, JobSlice, Slice
from apps.leases.models import Lease
from apps.workers.models import Reachable, hash_token
from data_node import tokens as slice_tokens

SLUG = re.compile(r"^[-a-zA-Z0-9_]+$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


# --- data nodes ---------------------------------------------------------------------------------------------


def create_data_node(*, name: str, url: str, owner=None) -> tuple[DataNode, str]:
    """Register a data node; returns it with its token (shown once, stored hashed)."""
    return DataNode.create_with_token(name=name, url=url, owner=owner)


def authenticate_data_node(token: str) -> DataNode | None:
    """The data node holding ``token``, or ``None``."""
    return DataNode.objects.filter(token_hash=hash_token(token)).first()


def download_key(node: DataNode) -> str:
    """The key ``node`` verifies slice tokens with: derived from ``SECRET_KEY``, the node's id and its token's
    hash, never stored. The node gets it in the answer to its registration; a new node token (or a new
    ``SECRET_KEY``) makes a new key, and the node learns it when it registers again."""
    return hmac.new(
        settings.SECRET_KEY.encode(), f"data-node:{node.pk}:{node.token_hash}".encode(), hashlib.sha256
    ).hexdigest()


# --- datasets -----------------------------------------------------------------------------------------------


def _validated_slices(name: str, slices: Iterable[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Slices sorted by index, checked to be exactly ``0..n-1`` with sizes and lowercase SHA-256 digests."""
    if not SLUG.match(name or "") or len(name) > 200:
        raise InvalidDataset(f"dataset name {name!r} must be a slug (letters, digits, '-', '_'; ≤ 200 chars)")
    checked = []
    for entry in slices:
        try:
            index, size, sha256 = entry
        except (TypeError, ValueError):
            raise InvalidDataset(f"dataset {name}: slice {entry!r} is not (index, size, sha256)") from None
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise InvalidDataset(f"dataset {name}: slice index {index!r} is not a non-negative integer")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidDataset(
                f"dataset {name}: slice {index} has size {size!r}; it must be a positive integer"
            )
        if not isinstance(sha256, str) or not SHA256_HEX.match(sha256):
            raise InvalidDataset(f"dataset {name}: slice {index} has no lowercase hex SHA-256 ({sha256!r})")
        checked.append((index, size, sha256))
    checked.sort()
    if not checked:
        raise InvalidDataset(f"dataset {name} has no slices")
    indices = [index for index, _size, _sha256 in checked]
    if indices != list(range(len(checked))):
        # The original counted whatever its directory listing held, in OS order; ours must be 0..n-1 exactly.
        raise InvalidDataset(
            f"dataset {name}: slice indices must be 0..{len(checked) - 1}, each once; got {indices}"
        )
    return checked


def register_dataset(node: DataNode, name: str, slices: Iterable[tuple[int, int, str]]) -> Dataset:
    """Record that ``node`` serves dataset ``name`` made of ``slices`` = ``[(index, size_bytes, sha256), …]``.

    The first registration of a name creates the dataset and its slices. Registering the same slices again
    (by the same node: idempotent; by another node: it becomes a replica) changes nothing else. Any
    difference (slice count, a size or a digest) raises :class:`DatasetConflict` and registers nothing:
    every replica must serve identical bytes, and jobs may already be training on them. Malformed slices raise
    :class:`InvalidDataset`. The node is marked online and seen now.
    """
    checked = _validated_slices(name, slices)
    with transaction.atomic():
        dataset = Dataset.objects.select_for_update().filter(name=name).first()
        if dataset is None:
            try:
                with transaction.atomic():  # a savepoint: a concurrent first registration may win the name
                    dataset = Dataset.objects.create(
                        name=name,
                        slice_count=len(checked),
                        total_bytes=sum(size for _index, size, _sha256 in checked),
                    )
                    Slice.objects.bulk_create(
                        Slice(dataset=dataset, index=index, size_bytes=size, sha256=sha256)
                        for index, size, sha256 in checked
                    )
            except IntegrityError:
                dataset = Dataset.objects.select_for_update().get(name=name)
                _check_same_slices(dataset, node, checked)
        else:
            _check_same_slices(dataset, node, checked)
        DatasetReplica.objects.get_or_create(dataset=dataset, node=node)
        DataNode.objects.filter(pk=node.pk).update(online=True, last_seen_at=timezone.now())
    node.refresh_from_db(fields=["online", "last_seen_at"])
    return dataset


def _check_same_slices(dataset: Dataset, node: DataNode, checked: list[tuple[int, int, str]]) -> None:
    registered = list(dataset.slices.order_by("index").values_list("index", "size_bytes", "sha256"))
    if registered == checked:
        return
    if len(registered) != len(checked):
        difference = f"it has {len(registered)} slices, {node.name} announced {len(checked)}"
    else:
        index = next(i for i, (old, new) in enumerate(zip(registered, checked, strict=True)) if old != new)
        difference = (
            f"slice {index} is {registered[index][1]} bytes with SHA-256 {registered[index][2]}, "
            f"{node.name} announced {checked[index][1]} bytes with SHA-256 {checked[index][2]}"
        )
    nodes = (
        ", ".join(dataset.replicas.values_list("node__name", flat=True).order_by("node__name")) or "nobody"
    )
    raise DatasetConflict(
        f"dataset {dataset.name} is already registered (served by {nodes}) with different slices: {difference}; "
        "every replica must serve identical files: register changed data under a new name"
    )


def replicas(dataset: Dataset) -> list[DataNode]:
    """The data nodes serving ``dataset``, online ones first, then by name (trainers download from these)."""
    return list(DataNode.objects.filter(replicas__dataset=dataset).order_by("-online", "name"))


# --- slice download URLs ------------------------------------------------------------------------------------

#: The ``peer`` of the parameter server's eval slice tokens (a trainer's is its worker id).
PARAMETER_SERVER_PEER = slice_tokens.PARAMETER_SERVER_PEER
# How long a trainer's slice URLs and the parameter server's eval slice URLs stay valid:
# settings.HYPHA_SLICE_TOKEN_LIFETIME and HYPHA_EVAL_SLICE_TOKEN_LIFETIME (the reasons are given there).


def slice_urls(
    dataset: Dataset, index: int, *, job_id, peer: str, lifetime: float | None = None
) -> list[str]:
    """``GET`` URLs of slice ``index`` of ``dataset`` at each data node serving it (online ones first), each
    with a ``token`` query parameter signed with that node's :func:`download_key`: it names the dataset, the
    slice, job ``job_id`` and ``peer`` (the downloading worker's id, or
    :data:`PARAMETER_SERVER_PEER`) and expires ``lifetime`` seconds from now.

    A node that accepts no inbound connections (``reachable`` false) is stood for by the control plane
    (:func:`apps.datasets.publishing.slice_base_url`): the same path and token there serve the copy the node
    published to the relay's store (503 until it has), for as long as the token lives."""
    if lifetime is None:
        lifetime = settings.HYPHA_SLICE_TOKEN_LIFETIME
    expires = int(time.time() + lifetime)
    urls = []
    for node in replicas(dataset):
        base = publishing.slice_base_url(node) if publishing.publishes(node) else node.url
        if not base:
            continue
        token = slice_tokens.sign(
            download_key(node),
            dataset=dataset.name,
            index=index,
            job=str(job_id),
            peer=str(peer),
            expires=expires,
        )
        query = urllib.parse.urlencode({"token": token})
        urls.append(f"{base.rstrip('/')}/datasets/{dataset.name}/slices/{index}?{query}")
    return urls


# --- a job's slices -----------------------------------------------------------------------------------------


def prepare_job(job, dataset_name: str, *, exclude: Iterable[int] = ()) -> Dataset:
    """Create epoch 0 of ``job`` on dataset ``dataset_name``: one AVAILABLE job slice per slice, except the
    slice indices in ``exclude`` (held out for evaluation: never trained on).

    Idempotent for the same dataset; :class:`JobAlreadyPrepared` if the job trains on another dataset,
    :class:`DatasetNotFound` if no data node registered that name.
    """
    with transaction.atomic():
        dataset = Dataset.objects.filter(name=dataset_name).first()
        if dataset is None:
            raise DatasetNotFound(f"no dataset {dataset_name!r} is registered")
        # Lock the job, so two preparations of one job cannot both insert epoch 0.
        list(type(job).objects.select_for_update().filter(pk=job.pk).values_list("pk", flat=True))
        existing = JobSlice.objects.filter(job=job).select_related("slice__dataset").first()
        if existing is not None:
            if existing.slice.dataset_id != dataset.pk:
                raise JobAlreadyPrepared(
                    f"job {job.pk} trains on dataset {existing.slice.dataset.name}, not {dataset.name}"
                )
            return dataset
        JobSlice.objects.bulk_create(
            JobSlice(job=job, slice=slice_, epoch=0)
            for slice_ in dataset.slices.exclude(index__in=list(exclude)).order_by("index")
        )
    return dataset


def current_epoch(job) -> int:
    """The job's newest epoch; :class:`JobNotPrepared` if it has none."""
    epoch = JobSlice.objects.filter(job=job).aggregate(epoch=Max("epoch"))["epoch"]
    if epoch is None:
        raise JobNotPrepared(f"job {job.pk} has no slices; prepare it for a dataset first")
    return epoch


def _lock_eligible_lease(job, lease: Lease) -> Lease:
    # Holding the lease's row lock until commit means the lease cannot end (its transitions are conditional
    # UPDATEs, which wait for this lock) between this check and the assignment: a lease that ends after the
    # claim commits finds the slice ASSIGNED to it and ``release_for_lease`` puts it back.
    locked = Lease.objects.select_for_update().filter(pk=lease.pk).first()
    if locked is None or locked.job_id != job.pk or locked.status != Lease.Status.ACTIVE:
        state = "missing" if locked is None else f"{locked.status}, of job {locked.job_id}"
        raise LeaseNotEligible(f"lease {lease.pk} ({state}) is not an active lease of job {job.pk}")
    return locked


def _frontier_rows(job):
    """The job's rows whose earlier epochs are all USED (each slice's *frontier*: the only row of it that can
    be assigned)."""
    earlier_unused = JobSlice.objects.filter(
        job=OuterRef("job"), slice=OuterRef("slice"), epoch__lt=OuterRef("epoch")
    ).exclude(status=JobSlice.Status.USED)
    return JobSlice.objects.filter(~Exists(earlier_unused), job=job)


def _claimable(job) -> JobSlice | None:
    """The AVAILABLE row with the lowest (epoch, index) that is its slice's *frontier* — every earlier epoch of
    that slice is USED — locked, skipping rows other claimers have locked.

    Only a slice's frontier row can ever be assigned, so a slice is held by at most one lease at a time and its
    epochs are used in order. The frontier condition is safe under concurrency without locking the earlier
    rows: USED is final and epochs are only ever added above the existing ones, so once a row is a frontier
    it stays one until it is used itself; and two claimers after the same slice contend for the same row."""
    return (
        _frontier_rows(job)
        .select_for_update(skip_locked=True, of=("self",))
        .filter(status=JobSlice.Status.AVAILABLE)
        .select_related("slice")
        .order_by("epoch", "slice__index")
        .first()
    )


def claim_next(job, lease: Lease) -> JobSlice | None:
    """Assign the next slice to ``lease`` and return it, or ``None``: nothing can be handed out now, ask again.

    The next slice is the AVAILABLE one with the lowest (epoch, index) whose earlier epochs are all USED (see
    :func:`_claimable`): a slice released by a lease that ended goes out again in its own epoch before anything
    of a later epoch, and a slice someone holds (a trainer's prefetch) is never handed to another lease in the
    next epoch meanwhile.

    When nothing is claimable (every slice of the newest epoch E is USED, held, or behind a held one), epoch
    E + 1 starts (new AVAILABLE rows) and the slice is claimed from it — unless ``lease`` itself still holds a
    slice it has not acknowledged (it has data to go on with). Slices other leases hold never hold the rest
    up: a trainer waiting for its round to close keeps its prefetch, and waiting for it could wait for the very
    round this trainer's data would finish; epoch E + 1 goes on with the slices not held (and so on: a slice
    held long falls some epochs behind, never doubled).

    Each call claims one more slice (a trainer may prefetch); asking again does not return a slice it holds.
    Raises :class:`LeaseNotEligible` unless ``lease`` is an ACTIVE lease of ``job``, :class:`JobNotPrepared`
    if the job has no slices.
    """
    with transaction.atomic():
        lease = _lock_eligible_lease(job, lease)
        candidate = _claimable(job)
        if candidate is None:
            epoch = current_epoch(job)
            if _frontier_rows(job).filter(status=JobSlice.Status.AVAILABLE).exists():
                # Claimable rows appeared since the first look (another claimer committed a new epoch: each
                # statement sees the latest commits) or are locked by other claimers this instant: look
                # again, and ask the caller to come back only when every one of them is locked.
                candidate = _claimable(job)
                if candidate is None:
                    return None
                candidate.assign(lease)
                return candidate
            if JobSlice.objects.filter(
                job=job, assigned_lease=lease, status=JobSlice.Status.ASSIGNED
            ).exists():
                return None
            # Two claimers may both start the next epoch: the unique (job, slice, epoch) makes the second
            # insert wait for the first and then skip, and both claim from the same new rows.
            slice_ids = JobSlice.objects.filter(job=job, epoch=epoch).values_list("slice_id", flat=True)
            JobSlice.objects.bulk_create(
                [JobSlice(job=job, slice_id=slice_id, epoch=epoch + 1) for slice_id in slice_ids],
                ignore_conflicts=True,
            )
            candidate = _claimable(job)
            if candidate is None:
                return None
        candidate.assign(lease)
    return candidate


def acknowledge(job, lease: Lease, index: int) -> JobSlice:
    """Mark slice ``index`` USED by ``lease``, which it must be assigned to (in the current epoch, or in an
    earlier one the lease claimed it in before the next began).

    Idempotent: acknowledging again a slice this lease already used returns it unchanged (a lost reply is
    retried). Raises :class:`SliceNotFound` for an index outside the dataset, and
    :class:`~apps.datasets.exceptions.SliceTransitionRefused` if the slice is not ASSIGNED to ``lease``.
    """
    with transaction.atomic():
        rows = JobSlice.objects.select_for_update(of=("self",)).filter(job=job, slice__index=index)
        job_slice = (
            rows.filter(assigned_lease=lease, status=JobSlice.Status.ASSIGNED)
            .select_related("slice")
            .order_by("epoch")
            .first()
        )
        if job_slice is None:
            epoch = current_epoch(job)
            job_slice = rows.filter(epoch=epoch).select_related("slice").first()
            if job_slice is None:
                raise SliceNotFound(f"job {job.pk} has no slice {index} in epoch {epoch}")
            used = rows.filter(assigned_lease=lease, status=JobSlice.Status.USED).order_by("-epoch").first()
            if used is not None:
                return used
        job_slice.ack(lease)
    return job_slice


def release_for_lease(
    lease: Lease, *, reason: str = "lease ended before the acknowledgement"
) -> list[JobSlice]:
    """Put the slices ASSIGNED to ``lease`` back to AVAILABLE; call it once the lease has ended.

    Slices the lease acknowledged stay USED. Returns the released slices, by epoch and index. Raises
    :class:`~apps.datasets.exceptions.SliceTransitionRefused` (releasing nothing) while the lease is live.
    """
    with transaction.atomic():
        held = list(
            JobSlice.objects.select_for_update(of=("self",))
            .filter(assigned_lease=lease, status=JobSlice.Status.ASSIGNED)
            .select_related("slice")
            .order_by("epoch", "slice__index")
        )
        for job_slice in held:
            job_slice.release(lease, reason=reason)
    return held


def progress(job) -> dict:
    """``{epoch, available, assigned, used, total}`` of the job's current epoch (``epoch`` is ``None`` and
    every count 0 before ``prepare_job``)."""
    rows = JobSlice.objects.filter(job=job)
    epoch = rows.aggregate(epoch=Max("epoch"))["epoch"]
    if epoch is None:
        return {"epoch": None, "available": 0, "assigned": 0, "used": 0, "total": 0}
    counts = rows.filter(epoch=epoch).aggregate(
        available=Count("pk", filter=Q(status=JobSlice.Status.AVAILABLE)),
        assigned=Count("pk", filter=Q(status=JobSlice.Status.ASSIGNED)),
        used=Count("pk", filter=Q(status=JobSlice.Status.USED)),
        total=Count("pk"),
    )
    return {"epoch": epoch, **counts}


def register_from_node(
    node: DataNode,
    *,
    name: str,
    url: str,
    slices: Iterable[tuple[int, int, str]],
    reachable: bool | str = "auto",
    control_plane_url: str = "",
) -> tuple[Dataset, bool]:
    """A data node's own announcement: record its public ``url`` and whether trainers can connect to it
    (``reachable``: true, false or "auto"), and :func:`register_dataset` ``name``.

    ``control_plane_url`` is this server's base URL as the node reached it (kept unless empty): a node that
    is not reachable is downloaded from through the control plane at that address, from the copies it
    publishes (:mod:`apps.datasets.publishing`). A node serves one dataset: its published copies of any other
    dataset are dropped, and all of them when it registers as reachable (bytes deleted after the commit).

    Returns the dataset and whether this call created it. All or nothing: when the registration is refused
    (:class:`InvalidDataset`, :class:`DatasetConflict`) the node's URL and reachability are left unchanged too.
    """
    declared = Reachable.of(reachable)
    with transaction.atomic():
        existed = Dataset.objects.filter(name=name).exists()
        if node.url != url or node.reachable != declared:
            DataNode.objects.filter(pk=node.pk).update(url=url, reachable=declared)
            node.url, node.reachable = url, declared
        if control_plane_url and node.control_plane_url != control_plane_url:
            DataNode.objects.filter(pk=node.pk).update(control_plane_url=control_plane_url)
            node.control_plane_url = control_plane_url
        dataset = register_dataset(node, name, slices)
        publishing.drop_publications(node, keep=dataset if publishing.publishes(node) else None)
    return dataset, not existed
