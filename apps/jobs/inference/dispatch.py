"""Dispatch of an inference job's workers: once its leases are ACTIVE, each gets a task whose job JSON names
the model, the slices (claimed from the control plane) and where the results go (docs/inference.md)."""

from __future__ import annotations

from apps.datasets import services as dataset_services
from apps.datasets.exceptions import DatasetError
from apps.datasets.models import JobSlice
from apps.jobs.models import INFERENCE, Job, Task
from apps.jobs.spec import inference as inference_spec
from apps.jobs.spec import source_reference
from apps.jobs.training.dispatch import CONTROL_PLANE_PEER
from apps.jobs.training.tokens import transfer_token
from apps.leases.models import Lease
from apps.workers import services as worker_services
from worker_daemon import protocol

#: The epoch an inference job's slices live in: each slice is processed once.
EPOCH = 0


def is_inference_job(job: Job) -> bool:
    return job.kind == Job.Kind.INFERENCE


def spec_of(job: Job) -> inference_spec.InferenceSpec:
    """The job's stored spec, validated (it was validated at submission; a stored spec is trusted no more)."""
    return inference_spec.parse_json(job.spec)


def model_artifact(parsed: inference_spec.InferenceSpec) -> dict:
    """The Fetch reference of the model, as the parameter server gets it for the same source: a Hub or URL
    reference; an upload as a path on the control plane (fetched with the task's transfer token); a config as
    is (a model with random weights, for tests and benchmarks)."""
    source = parsed.model.source
    if source.type == "upload":
        return {"type": "uri", "value": f"/api/uploads/{source.file}/content/"}
    if source.type == "config":
        return {"type": "config", "config": dict(source.config)}
    return source_reference(source)


def job_json(job: Job) -> dict:
    parsed = spec_of(job)
    return inference_spec.to_job_json(
        parsed,
        job_id=str(job.pk),
        model_artifact=model_artifact(parsed),
        data_reference={"type": "scheduler", "peer": CONTROL_PLANE_PEER, "dataset": parsed.dataset.name},
        results_reference={
            "type": "peers",
            "peers": [CONTROL_PLANE_PEER],
            "strategy": {"type": "One"},
            "resource": None,
        },
    )


def start(job: Job) -> str | None:
    """Dispatch every worker of an ALLOCATED inference job and move it to RUNNING. Returns ``None`` when
    dispatched (or nothing to do), else why it cannot start (the caller fails the job). Idempotent."""
    if not is_inference_job(job) or job.status != Job.Status.ALLOCATED or job.tasks.exists():
        return None
    name = spec_of(job).dataset.name
    try:
        # Made at submission; again here (idempotent) for a job whose slices were never prepared.
        dataset_services.prepare_job(job, name)
    except DatasetError as error:
        return str(error)
    count = dispatch_workers(job)
    done, total = slice_counts(job)
    job.transition(
        Job.Status.RUNNING,
        reason=f"RUNNING: {count} inference worker{'s' if count != 1 else ''} dispatched; {done} of {total} "
        "slices done",
    )
    return None


def dispatch_workers(job: Job) -> int:
    """Dispatch a task on each ACTIVE inference lease of ``job`` that has none (its first workers, or a
    replacement of a lost one: the slices the lost one held went back to AVAILABLE with its lease)."""
    envelope = None
    dispatched = 0
    leases = job.leases.filter(role=INFERENCE, status=Lease.Status.ACTIVE, task__isnull=True)
    for lease in leases.select_related("worker"):
        envelope = envelope or job_json(job)
        task = Task.objects.create(job=job, lease=lease, role=INFERENCE)
        message = protocol.DispatchJob(
            task_id=task.pk,
            lease_id=lease.pk,
            job_id=job.pk,
            role=INFERENCE,
            spec=envelope,
            transfer_token=transfer_token(lease),
        )
        # Kept for a daemon that reconnects (apps.jobs.training.dispatch.pending_dispatches sends it again).
        task.dispatch_message = message.model_dump(mode="json", by_alias=True)
        Task.objects.filter(pk=task.pk).update(dispatch_message=task.dispatch_message)
        worker_services.send_to_worker(lease.worker_id, message)
        dispatched += 1
    return dispatched


def dispatch_replacements(job: Job) -> int:
    """A RUNNING inference job goes on with the workers it has while a lost one is replaced: the task of a
    lease that ended is over (its unfinished slices went back to AVAILABLE with the lease), and a new ACTIVE
    lease is dispatched at once. Returns the tasks dispatched."""
    lost = (
        job.tasks.filter(status__in=Task.LIVE)
        .exclude(lease__status__in=Lease.LIVE)
        .select_related("lease__worker")
    )
    for task in lost:
        lease = task.lease
        reason = (
            f"the inference lease on {lease.worker.name} {lease.status} while running: {lease.status_reason}"
        )
        if task.finish(Task.Status.CANCELLED, reason=reason[:2000]):
            job.transition(Job.Status.RUNNING, reason=f"RUNNING: {reason}; a replacement is advertised")
    count = dispatch_workers(job)
    if count:
        done, total = slice_counts(job)
        job.transition(
            Job.Status.RUNNING,
            reason=f"RUNNING: {count} replacement inference worker(s) joined; {done} of {total} slices done",
        )
    return count


def slice_counts(job: Job) -> tuple[int, int]:
    """(slices USED, slices in all) of the job's one epoch."""
    rows = JobSlice.objects.filter(job=job, epoch=EPOCH)
    return rows.filter(status=JobSlice.Status.USED).count(), rows.count()


def progress(job: Job) -> dict:
    from apps.jobs.inference import verification

    done, total = slice_counts(job)
    return {"slices_done": done, "slices_total": total, **verification.counts(job)}
