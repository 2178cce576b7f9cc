"""Workers' reputation: the workflows that know an event move its :class:`~apps.workers.models.WorkerRecord`.

* a parameter server's round report (``apps.jobs.observers.round_reported``): each trainer's update accepted,
  down-weighted or rejected (refused on arrival counts as rejected; in an unverified round, averaged counts as
  accepted), and its measured speed against its benchmark;
* the end of an ACTIVE lease (``apps.jobs.services._end_lease``): completed when its job's end ended it, lost
  otherwise; a job counts as served once the worker's last lease on it completed;
* an inference result that lost a verification (``apps.jobs.inference.verification``): counted as it is
  rejected, which happens once per result.

Counters move with ``F()`` updates in the caller's transaction, so concurrent reports never lose a count, and a
report sent again is counted once (:class:`~apps.workers.models.CountedRound`). The formula of the reliability
is on :attr:`WorkerRecord.reliability`; docs/architecture.md, "Reputation", says how the market uses it.
"""

from __future__ import annotations

import statistics
import uuid
from collections.abc import Iterable

from django.db import IntegrityError, transaction
from django.db.models import F

from apps.jobs import throughput
from apps.jobs.models import TRAINER, Round
from apps.leases.models import Lease
from apps.workers.models import CountedRound, Worker, WorkerRecord

#: Verdict → the counter it moves (apps.jobs.training.status.VERDICTS).
VERDICT_COUNTERS = {
    "accepted": "updates_accepted",
    "down-weighted": "updates_down_weighted",
    "rejected": "updates_rejected",
}


def round_reported(round_: Round) -> None:
    """Count a reported round's verdicts and speeds into its trainers' records, once per round.

    Only workers that held a trainer lease on the round's job are counted: a report names peers by id, and a
    parameter server must not move the record of a worker that never trained for its job.
    """
    if not _first_count(round_):
        return
    peers = _trainers(round_.job_id, [*round_.verdicts, *round_.participants, *round_.refused])
    counted: dict[str, str] = {}
    for peer, body in round_.verdicts.items():
        if peer in peers and isinstance(body, dict) and body.get("verdict") in VERDICT_COUNTERS:
            counted[peer] = VERDICT_COUNTERS[body["verdict"]]
    for peer in round_.refused:
        counted.setdefault(peer, "updates_rejected")
    for peer in round_.participants:  # averaged with no verdict: an unverified round
        counted.setdefault(peer, "updates_accepted")
    for field in VERDICT_COUNTERS.values():
        _add(field, [peers[peer] for peer, moved in counted.items() if moved == field and peer in peers])
    _record_speeds(round_, peers)


def lease_ended(lease: Lease, *, with_its_job: bool) -> None:
    """An ACTIVE lease ended: completed when its job's end ended it (``with_its_job``), lost otherwise. A job
    is served by the worker once its last ACTIVE lease on the job completed."""
    if not with_its_job:
        _add("leases_lost", [lease.worker_id])
        return
    _add("leases_completed", [lease.worker_id])
    # ACTIVE only: an open offer of the same worker on the job (a TEMPORARY lease) served nothing yet.
    still_held = Lease.objects.filter(
        job_id=lease.job_id, worker_id=lease.worker_id, status=Lease.Status.ACTIVE
    )
    if not still_held.exists():
        _add("jobs_served", [lease.worker_id])


def results_lost(worker_ids: list) -> None:
    """Count one lost inference result against each entry of ``worker_ids`` (a worker twice: twice)."""
    for worker_id in worker_ids:
        _add("results_lost", [worker_id])


def _first_count(round_: Round) -> bool:
    """Mark ``round_`` counted; False when it was already (a report sent again)."""
    try:
        with transaction.atomic():  # a savepoint: the caller's transaction goes on after a duplicate
            CountedRound.objects.create(round=round_)
    except IntegrityError:
        return False
    return True


def _trainers(job_id, peers: Iterable[str]) -> dict[str, uuid.UUID]:
    """Peer id (as a report writes it) → worker id, for the peers that held a trainer lease on the job."""
    ids = set()
    for peer in peers:
        try:
            ids.add(uuid.UUID(str(peer)))
        except ValueError:
            continue
    held = Lease.objects.filter(job_id=job_id, role=TRAINER, worker_id__in=ids, activated_at__isnull=False)
    return {str(worker_id): worker_id for worker_id in held.values_list("worker_id", flat=True).distinct()}


def _add(field: str, worker_ids: list, amount: int = 1) -> None:
    if not worker_ids:
        return
    WorkerRecord.objects.bulk_create(
        [WorkerRecord(worker_id=worker_id) for worker_id in set(worker_ids)], ignore_conflicts=True
    )
    WorkerRecord.objects.filter(worker_id__in=worker_ids).update(**{field: F(field) + amount})


def _record_speeds(round_: Round, peers: dict[str, uuid.UUID]) -> None:
    """Fold each trainer's speed in the round into its running mean: its samples/s per benchmark score,
    relative to the median of that ratio over the round's trainers that have both (at least two).

    The benchmark runs a standard workload and the job its own, so a raw ratio differs by job; within a round
    every trainer runs the same workload, and relative to its peers the ratio says whether a worker is as fast
    as its benchmark promised (1), slower (below 1) or faster (above 1)."""
    rates = {
        peer: metrics["samples_per_second"]
        for peer, found in round_.trainer_metrics.items()
        if peer in peers and (metrics := throughput.of_trainer(found)).get("samples_per_second")
    }
    scores = Worker.objects.filter(pk__in=[peers[peer] for peer in rates], benchmark_score__gt=0)
    ratios = {str(pk): rates[str(pk)] / score for pk, score in scores.values_list("pk", "benchmark_score")}
    if len(ratios) < 2:
        return
    median = statistics.median(ratios.values())
    worker_ids = [peers[peer] for peer in ratios]
    WorkerRecord.objects.bulk_create(
        [WorkerRecord(worker_id=worker_id) for worker_id in worker_ids], ignore_conflicts=True
    )
    # Locked: a running mean is read and written (a worker may train for two jobs at once).
    for record in WorkerRecord.objects.select_for_update().filter(worker_id__in=worker_ids).order_by("pk"):
        relative = ratios[str(record.worker_id)] / median
        mean = record.speed_vs_benchmark or 0.0
        record.speed_vs_benchmark = mean + (relative - mean) / (record.speed_rounds + 1)
        record.speed_rounds += 1
        record.save(update_fields=["speed_vs_benchmark", "speed_rounds", "updated_at"])
