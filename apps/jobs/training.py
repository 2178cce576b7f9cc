"""Training workflows of a RUNNING job: dispatch, the sync protocol, data slices, rounds and the final model.

The order of events is in ``docs/training.md``. In short: once every lease of a job with a DiLoCo spec is
ACTIVE, the parameter server is dispatched first; when it reports ``ready`` with its URL the trainers are
dispatched; trainers report every step and are told when to sync (after a fixed H steps per round, or, with
a sample target, when :mod:`apps.jobs.sync` projects that all of them finish together); the parameter
server reports every round and asks whom to wait for when a round's first update arrives; the job completes when the last round is applied, the final model is stored and
the parameter server exited cleanly.

These functions run inside the caller's transaction (``apps.jobs.services`` wraps them and owns every
workflow that ends leases or jobs); messages to daemons go out after commit.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import re
import shutil
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Sum
from django.utils import timezone

from apps.datasets import services as dataset_services
from apps.datasets.exceptions import DatasetError
from apps.datasets.models import Dataset, Slice
from apps.jobs import observers, sync
from apps.jobs import spec as job_spec
from apps.jobs.exceptions import TaskRefused, TransferRefused
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job, Round, Task, Upload
from apps.leases.models import Lease
from apps.workers import services as worker_services
from worker_daemon import protocol

logger = logging.getLogger(__name__)

#: The peer id trainers' ``scheduler`` references name: the control plane answers their slice requests.
CONTROL_PLANE_PEER = "control-plane"
#: Files of the global model trainers fetch from the parameter server, and the parameter server uploads.
MODEL_FILES = ("config.json", "model.safetensors")
#: How long a transfer token lives (at least twice the lease TTL): short, because each live task gets a fresh
#: one with every renewal of its lease (``transfer_token`` frames), so a token that leaks is soon worthless.
TRANSFER_TOKEN_LIFETIME = 15 * 60
#: Seconds a trainer waits before asking again when every slice of the epoch is assigned to someone.
SLICE_RETRY_SECONDS = 1.0
MODEL_FILENAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,99}$")

#: At most this many of a trainer's step reports are answered by its daemon without asking ...
MAX_CONTINUE_GRANT = 10_000
#: ... and, with a sample target, at most about this many seconds of its steps (so the control plane's
#: view of a round, and the job page, is never older than that).
MAX_CONTINUE_SECONDS = 2.0
#: The clock of performance-aware sync (Unix seconds; a module attribute so tests can drive it).
sync_clock = time.time

OK = {"type": "Ok"}
CONTINUE = {"type": "Continue"}
DONE = {"type": "Done"}
ERROR = {"type": "Error"}


# --- keys and tokens -----------------------------------------------------------------------------------------


def transfer_key(job_id) -> str:
    """The job's transfer key: signs its tokens; the job's parameter server gets it to verify them."""
    return hmac.new(settings.SECRET_KEY.encode(), f"transfer:{job_id}".encode(), hashlib.sha256).hexdigest()


def transfer_token_lifetime() -> float:
    return max(TRANSFER_TOKEN_LIFETIME, 2 * settings.HYPHA_LEASE_TTL)


def transfer_token(lease: Lease) -> str:
    """A token for the task on ``lease``: its job, its worker (``peer``), the lease, the role, and an expiry."""
    return protocol.sign_transfer_token(
        transfer_key(lease.job_id),
        {
            "job": str(lease.job_id),
            "peer": str(lease.worker_id),
            "lease": str(lease.pk),
            "role": lease.role,
            "exp": int(time.time() + transfer_token_lifetime()),
        },
    )


@dataclass(frozen=True)
class FreshToken:
    lease_id: Any
    token: protocol.TransferToken


def fresh_tokens(leases: list[Lease]) -> list[FreshToken]:
    """A new transfer token for each live task bound to one of ``leases`` (sent with their renewal)."""
    if not leases:
        return []
    tasks = Task.objects.filter(lease__in=leases, status__in=Task.LIVE).select_related("lease")
    return [
        FreshToken(
            lease_id=task.lease_id,
            token=protocol.TransferToken(task_id=task.pk, transfer_token=transfer_token(task.lease)),
        )
        for task in tasks
    ]


# --- the spec of a running job ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    spec: job_spec.DiLoCoSpec
    #: H, for fixed-H sync (``rounds.inner_steps``); ``None`` with a sample target.
    steps_per_round: int | None
    #: Samples per round over all trainers, for performance-aware sync (``avg_samples_between_updates``).
    sample_target: int | None
    update_rounds: int


#: Parsed specs by job id. A job's spec never changes after submission (the admin shows it read-only), so the
#: id is the key: nothing is serialised or validated again on the per-step path.
_plans: OrderedDict[object, Plan] = OrderedDict()
PLANS_CACHED = 256


def plan(job: Job) -> Plan:
    """The validated spec of ``job`` and what follows from it (parsed once per job and process)."""
    found = _plans.get(job.pk)
    if found is None:
        parsed = job_spec.parse_json(job.spec)
        found = Plan(
            spec=parsed,
            steps_per_round=parsed.rounds.inner_steps,
            sample_target=parsed.rounds.avg_samples_between_updates,
            update_rounds=parsed.rounds.update_rounds,
        )
        _plans[job.pk] = found
        while len(_plans) > PLANS_CACHED:
            _plans.popitem(last=False)
    return found


def is_training_job(job: Job) -> bool:
    return bool(job.spec)


# --- dispatch -------------------------------------------------------------------------------------------------


def _peers_reference(worker_ids: list[str]) -> dict:
    return {"type": "peers", "peers": worker_ids, "strategy": {"type": "All"}, "resource": None}


def _slice_entry(dataset: Dataset, slice_: Slice, *, job_id, peer: str, lifetime: float) -> dict:
    return {
        "index": slice_.index,
        "size": slice_.size_bytes,
        "sha256": slice_.sha256,
        "urls": slice_urls(dataset, slice_.index, job_id=job_id, peer=peer, lifetime=lifetime),
    }


def slice_urls(
    dataset: Dataset,
    index: int,
    *,
    job_id,
    peer: str,
    lifetime: float = dataset_services.SLICE_TOKEN_LIFETIME,
) -> list[str]:
    """The data nodes' URLs of slice ``index``, each with a download token for ``peer`` of job ``job_id``
    (:func:`apps.datasets.services.slice_urls`)."""
    return dataset_services.slice_urls(dataset, index, job_id=job_id, peer=peer, lifetime=lifetime)


def evaluation_indices(parsed: job_spec.DiLoCoSpec, dataset: Dataset) -> list[int]:
    """The held-out slice indices of the job (empty without an evaluation block)."""
    evaluation = parsed.evaluation
    if evaluation is None:
        return []
    if evaluation.slices is not None:
        return sorted(set(evaluation.slices))
    count = dataset.slice_count
    return list(range(max(0, count - evaluation.holdout), count))


def start(job: Job) -> str | None:
    """Dispatch the parameter server of an ALLOCATED training job and move it to RUNNING.

    Returns ``None`` when dispatched (or nothing to do), else the reason the job cannot start (the caller fails
    the job with it). Idempotent: a job with tasks is left alone.
    """
    if not is_training_job(job) or job.status != Job.Status.ALLOCATED or job.tasks.exists():
        return None
    parsed = plan(job).spec
    dataset = Dataset.objects.filter(name=parsed.dataset.name).first()
    if dataset is None:
        return f"no data node serves dataset {parsed.dataset.name!r}"
    held_out = evaluation_indices(parsed, dataset)
    if held_out and (held_out[-1] >= dataset.slice_count or len(held_out) >= dataset.slice_count):
        return (
            f"evaluation slices {held_out} do not leave training slices in dataset {dataset.name!r} "
            f"({dataset.slice_count} slices)"
        )
    try:
        dataset_services.prepare_job(job, dataset.name, exclude=held_out)
    except DatasetError as error:
        return str(error)
    server_lease = job.leases.select_related("worker").get(role=PARAMETER_SERVER, status=Lease.Status.ACTIVE)
    task = _dispatch_server(job, server_lease, dataset=dataset, held_out=held_out)
    count = _dispatch_trainers(job, task)
    job.transition(
        Job.Status.RUNNING,
        reason=f"RUNNING: parameter server dispatched to {server_lease.worker.name} and {count} trainers; "
        "waiting for it to listen",
    )
    return None


def _dispatch_server(job: Job, lease: Lease, *, dataset: Dataset, held_out: list[int]) -> Task:
    """Create and dispatch a parameter-server task on ``lease``: it waits for the job's ACTIVE trainers and,
    when the job has a checkpoint (this server replaces a lost one), resumes from it."""
    parsed = plan(job).spec
    trainers = [
        str(worker_id)
        for worker_id in job.leases.filter(role=TRAINER, status=Lease.Status.ACTIVE).values_list(
            "worker_id", flat=True
        )
    ]
    evaluation = None
    if held_out:
        evaluation = {
            "dataset": dataset.name,
            "batch_size": parsed.evaluation.batch_size,
            # Signed anew with every dispatch: a replacement parameter server gets fresh tokens.
            "slices": [
                _slice_entry(
                    dataset,
                    slice_,
                    job_id=job.pk,
                    peer=dataset_services.PARAMETER_SERVER_PEER,
                    lifetime=dataset_services.EVAL_SLICE_TOKEN_LIFETIME,
                )
                for slice_ in dataset.slices.filter(index__in=held_out).order_by("index")
            ],
        }
    model_source = None
    if isinstance(parsed.model.source, job_spec.UploadSource):
        # A path, not a URL: the parameter server fetches it from the control plane it was told about,
        # with its transfer token (the control plane does not know the address daemons reach it at).
        model_source = {"type": "uri", "value": f"/api/uploads/{parsed.model.source.file}/content/"}
    task = Task.objects.create(job=job, lease=lease, role=PARAMETER_SERVER)
    envelope = job_spec.to_aggregate_job_json(
        parsed,
        job_id=str(job.pk),
        updates_reference=_peers_reference(trainers),
        results_reference=_peers_reference(trainers),
        model_source=model_source,
        evaluation=evaluation,
    )
    if job.checkpoint:
        envelope["executor"]["config"]["checkpoint"] = {
            "round": job.checkpoint["round"],
            "uri": f"/api/jobs/{job.pk}/checkpoint/",
            "files": job.checkpoint["files"],
        }
    _dispatch(
        task,
        protocol.DispatchJob(
            task_id=task.pk,
            lease_id=lease.pk,
            job_id=job.pk,
            role=PARAMETER_SERVER,
            spec=envelope,
            transfer_token=transfer_token(lease),
            transfer_key=transfer_key(job.pk),
        ),
    )
    return task


def _dispatch(task: Task, message: protocol.DispatchJob) -> None:
    task.dispatch_message = message.model_dump(mode="json", by_alias=True)
    Task.objects.filter(pk=task.pk).update(dispatch_message=task.dispatch_message)
    worker_services.send_to_worker(task.lease.worker_id, message)


def pending_dispatches(worker) -> list[protocol.DispatchJob]:
    """The ``dispatch_job`` frames of the live tasks on the worker's ACTIVE leases, to send again after it
    reconnected (it may have missed them; it answers a repeat without a second run)."""
    tasks = Task.objects.filter(
        lease__worker_id=worker.pk, lease__status=Lease.Status.ACTIVE, status__in=Task.LIVE
    ).exclude(dispatch_message={})
    return [
        protocol.DispatchJob.model_validate(task.dispatch_message) for task in tasks.order_by("dispatched_at")
    ]


def _dispatch_trainers(job: Job, server: Task) -> int:
    """Dispatch a trainer task for every ACTIVE trainer lease without one. They start (import, build their
    data loader) while the parameter server starts; their bridges wait for its address (``peers``), which
    :func:`_point_trainers` sends once it listens."""
    parsed = plan(job).spec
    server_peer = str(server.lease.worker_id)
    dispatched = 0
    # A replacement starts from the rounds done so far: the weights it fetches are the current ones.
    completed = job.rounds.filter(closed=True).count()
    for lease in job.leases.filter(role=TRAINER, status=Lease.Status.ACTIVE).select_related("worker"):
        if Task.objects.filter(lease=lease).exists():
            continue
        task = Task.objects.create(
            job=job, lease=lease, role=TRAINER, batch_size=parsed.batch_size, round=completed
        )
        envelope = job_spec.to_train_job_json(
            parsed,
            job_id=str(job.pk),
            data_reference={"type": "scheduler", "peer": CONTROL_PLANE_PEER, "dataset": parsed.dataset.name},
            updates_reference=_peers_reference([server_peer]),
            results_reference=_peers_reference([server_peer]),
            model_reference={"type": "parameter-server", "peer": server_peer, "filenames": list(MODEL_FILES)},
        )
        _dispatch(
            task,
            protocol.DispatchJob(
                task_id=task.pk,
                lease_id=lease.pk,
                job_id=job.pk,
                role=TRAINER,
                spec=envelope,
                peers={server_peer: server.url} if server.url else {},
                transfer_token=transfer_token(lease),
            ),
        )
        dispatched += 1
    return dispatched


#: A job fails rather than replace more trainers than this many times its trainer count (a trainer that dies
#: again and again is not a passing fault).
MAX_REPLACEMENTS_PER_TRAINER = 2


def trainer_lost(job: Job, lease: Lease, *, reason: str) -> str | None:
    """A trainer lease of the RUNNING training ``job`` ended: its task is over (CANCELLED). Returns ``None``
    when the job goes on (with a replacement if :func:`wants_replacements`), or why it cannot."""
    task = Task.objects.filter(lease=lease).first()
    if task is not None:
        task.finish(Task.Status.CANCELLED, reason=reason[:2000])
    lost = Task.objects.filter(job=job, role=TRAINER, status=Task.Status.CANCELLED).count()
    limit = MAX_REPLACEMENTS_PER_TRAINER * job.num_trainers
    if lost > limit:
        return f"{lost} trainers lost, more than the {limit} this job replaces"
    return None


def wants_replacements(job: Job) -> bool:
    """Whether a lost trainer of the RUNNING ``job`` is worth replacing: not once its last round is done."""
    return not job.rounds.filter(number=plan(job).update_rounds, closed=True).exists()


def replaces(job: Job, role: str) -> bool:
    """Whether a missing ``role`` of ``job`` is advertised: always while it allocates; while a training job
    runs, a trainer until its last round is done, a parameter server until the final model is stored."""
    if job.status != Job.Status.RUNNING or not is_training_job(job):
        return True
    return wants_replacements(job) if role == TRAINER else not model_stored(job)


def model_stored(job: Job) -> bool:
    """The last round is applied and the final model stored: nothing of the training is left to do."""
    return (
        "model.safetensors" in job.model_files
        and job.rounds.filter(number=plan(job).update_rounds, closed=True).exists()
    )


def dispatch_replacements(job: Job) -> int:
    """Dispatch a trainer task for each ACTIVE trainer lease of the RUNNING ``job`` that has none (a
    replacement): it fetches the current global weights from the parameter server and joins the open round.
    Nothing happens before the parameter server listens (its ``ready`` dispatches them). A parameter-server
    lease without a task (the lost one's replacement) gets a server that resumes from the checkpoint."""
    server = job.tasks.filter(role=PARAMETER_SERVER, status__in=Task.LIVE).first()
    if server is None:
        lease = (
            job.leases.select_related("worker")
            .filter(role=PARAMETER_SERVER, status=Lease.Status.ACTIVE, task__isnull=True)
            .first()
        )
        if lease is not None:
            _restart_server(job, lease)
        return 0
    if not server.url:
        return 0
    return _dispatch_trainers(job, server)


def _restart_server(job: Job, lease: Lease) -> Task:
    parsed = plan(job).spec
    dataset = Dataset.objects.get(name=parsed.dataset.name)
    task = _dispatch_server(job, lease, dataset=dataset, held_out=evaluation_indices(parsed, dataset))
    job.transition(
        Job.Status.RUNNING,
        reason=f"RUNNING: parameter server dispatched to {lease.worker.name}, resuming after round "
        f"{job.checkpoint.get('round', 0)}; waiting for it to listen",
    )
    return task


#: A job fails rather than restart its parameter server more often than this (one that dies again and again
#: is not a passing fault).
MAX_SERVER_RESTARTS = 3


def server_lost(job: Job, lease: Lease, *, reason: str) -> str | None:
    """The parameter-server lease of the RUNNING training ``job`` ended: its task is over (CANCELLED). Returns
    ``None`` when a new one is to resume from the job's checkpoint (advertised like any missing role), or why
    the job cannot go on."""
    task = Task.objects.filter(lease=lease).first()
    if task is not None:
        task.finish(Task.Status.CANCELLED, reason=reason[:2000])
    if not job.checkpoint:
        return "it had saved no round to restart from"
    lost = Task.objects.filter(job=job, role=PARAMETER_SERVER, status=Task.Status.CANCELLED).count()
    if lost > MAX_SERVER_RESTARTS:
        return f"{lost} parameter servers lost, more than the {MAX_SERVER_RESTARTS} restarts a job makes"
    return None


def current_server(job: Job) -> Task | None:
    """The job's latest parameter-server task (earlier ones were lost with their leases)."""
    return job.tasks.filter(role=PARAMETER_SERVER).order_by("-dispatched_at", "-id").first()


def _point_trainers(job: Job, server: Task) -> int:
    """Send every live trainer's dispatch again with the parameter server's address (its daemon takes the new
    ``peers`` of a running task); the stored dispatch carries it too, for a daemon that reconnects."""
    told = 0
    for task in job.tasks.filter(role=TRAINER, status__in=Task.LIVE).select_related("lease"):
        # The peer id the trainer's spec names for its parameter server: the first server's, also after a
        # restart elsewhere (the daemon maps it to whichever address it is given).
        peers = {_server_peer_of(task, default=str(server.lease.worker_id)): server.url}
        message = protocol.DispatchJob.model_validate({**task.dispatch_message, "peers": peers})
        _dispatch(task, message)
        told += 1
    return told


def _server_peer_of(task: Task, *, default: str) -> str:
    try:
        peers = task.dispatch_message["spec"]["executor"]["config"]["results"]["peers"]
    except (KeyError, TypeError):
        return default
    return str(peers[0]) if isinstance(peers, list) and peers else default


# --- what daemons report about their tasks ----------------------------------------------------------------------


def own_task(worker, task_id, *, lock: bool = False) -> Task:
    """The task ``task_id`` if it runs on ``worker``'s lease; :class:`TaskRefused` otherwise."""
    tasks = Task.objects.select_related("job", "lease")
    if lock:
        tasks = tasks.select_for_update(of=("self",))
    task = tasks.filter(pk=task_id, lease__worker_id=worker.pk).first()
    if task is None:
        raise TaskRefused(f"task {task_id} is not a task of this worker")
    return task


def task_role(worker, task_id) -> tuple[str, object]:
    """(role, job id) of the task ``task_id`` if it runs on ``worker``'s lease (one light query, no lock);
    :class:`TaskRefused` otherwise."""
    found = Task.objects.filter(pk=task_id, lease__worker_id=worker.pk).values_list("role", "job_id").first()
    if found is None:
        raise TaskRefused(f"task {task_id} is not a task of this worker")
    return found


def task_started(worker, task_id) -> None:
    task = own_task(worker, task_id)
    # The start is the trainer's first "round start": its first step report is timed from it.
    Task.objects.filter(pk=task.pk, status=Task.Status.DISPATCHED, started_at__isnull=True).update(
        started_at=timezone.now(), last_status_at=sync_clock()
    )


def record_exit(worker, message: protocol.JobExited) -> Task | None:
    """End the task as the daemon reports; returns it if this report ended it (``None`` for a repeat)."""
    task = own_task(worker, message.task_id)
    if message.cancelled:
        status = Task.Status.CANCELLED
    elif message.exit_code == 0:
        status = Task.Status.EXITED
    else:
        status = Task.Status.FAILED
    ended = task.finish(
        status,
        exit_code=message.exit_code,
        signal=message.signal,
        reason=message.reason[:2000],
        log_tail=message.log_tail,
    )
    return task if ended else None


#: Lines of a task's output the control plane keeps (``Task.log_tail``).
LOG_TAIL_LINES = 100


def append_output(worker, task_id, lines: list[str]) -> None:
    """Add a running task's new output lines to its log tail (the last :data:`LOG_TAIL_LINES` are kept)."""
    with transaction.atomic():
        task = own_task(worker, task_id, lock=True)
        if not task.is_live or not lines:
            return
        kept = (task.log_tail.splitlines() + list(lines))[-LOG_TAIL_LINES:]
        task.log_tail = "\n".join(kept)
        Task.objects.filter(pk=task.pk).update(log_tail=task.log_tail)
        observers.job_changed(task.job)


def describe_exit(task: Task) -> str:
    how = f"exit code {task.exit_code}" if task.exit_code is not None else f"signal {task.signal}"
    label = "parameter server" if task.role == PARAMETER_SERVER else "trainer"
    detail = f": {task.reason}" if task.reason else ""
    last_line = next((line for line in reversed(task.log_tail.splitlines()) if line.strip()), "")
    tail = f" — last output: {last_line[:200]}" if last_line else ""
    return f"the {label} on {task.lease.worker.name} failed with {how}{detail}{tail}"


def cancel_tasks(job: Job, *, reason: str) -> None:
    """Mark every live task of the job cancelled (their daemons stop them when their leases end)."""
    for task in job.tasks.filter(status__in=Task.LIVE):
        task.finish(Task.Status.CANCELLED, reason=reason[:2000])


# --- status: the sync protocol ------------------------------------------------------------------------------


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _kind(progress: dict | str) -> str:
    if isinstance(progress, str):
        return progress
    if len(progress) == 1:
        return next(iter(progress))
    return ""


def handle_status(worker, message: protocol.StatusReport) -> tuple[dict, int]:
    """The reply to one progress value a task's bridge forwarded (``{"type": "Error"}`` when refused), and how
    many of the trainer's next step reports its daemon may answer ``Continue`` itself (``continue_for``)."""
    with transaction.atomic():
        task = own_task(worker, message.task_id, lock=True)
        if task.last_status_request == message.request_id:
            return task.last_status_reply, 0  # a repeat after a reconnect: already counted
        job = task.job
        changes: dict[str, Any] = {}
        if not task.is_live or job.status != Job.Status.RUNNING:
            reply = ERROR
        elif task.role == PARAMETER_SERVER:
            reply = _server_status(task, message.progress)
        else:
            reply, changes = _trainer_status(task, message.progress)
        # One UPDATE per report: the trainer's progress and the reply kept for a repeat of this request.
        Task.objects.filter(pk=task.pk).update(
            **changes, last_status_request=message.request_id, last_status_reply=reply
        )
        if changes:
            for field, value in changes.items():
                setattr(task, field, value)
            observers.task_progress(task)
        return reply, changes.get("continue_granted", 0)


def _covered(body: dict, task: Task, batch_size: int) -> tuple[int, int]:
    """(steps, samples) a step report stands for: itself, plus the steps its daemon answered locally since
    the last report (``covered_steps``/``covered_samples``, at most what was granted; samples at most a
    full batch per step)."""
    steps = body.get("covered_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        return 1, batch_size
    steps = min(steps, task.continue_granted + 1)
    samples = body.get("covered_samples")
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
        samples = batch_size * steps
    return steps, min(samples, steps * max(batch_size, task.batch_size, 1))


def _trainer_status(task: Task, progress: dict | str) -> tuple[dict, dict[str, Any]]:
    """The reply to a trainer's progress value, and the changes to its task row (not yet written)."""
    kind = _kind(progress)
    current = plan(task.job)
    now = timezone.now()
    changes: dict[str, Any] = {}
    if task.status == Task.Status.DISPATCHED:
        changes["status"] = Task.Status.RUNNING
    if kind == "status":
        body = progress["status"] if isinstance(progress["status"], dict) else {}
        batch_size = body.get("batch_size")
        batch_size = batch_size if isinstance(batch_size, int) and not isinstance(batch_size, bool) else 0
        batch_size = max(0, min(batch_size, 10**9))
        if task.sync_state not in (Task.Sync.TRAINING, Task.Sync.SCHEDULED):
            return ERROR, {}
        covered, samples = _covered(body, task, batch_size)
        steps = task.steps_in_round + covered
        clock = sync_clock()
        interval = task.step_interval
        if task.last_status_at is not None:
            interval = sync.next_interval(
                interval, (clock - task.last_status_at) / covered, first_of_round=task.steps_in_round == 0
            )
        changes.update(
            steps_in_round=steps,
            samples_in_round=task.samples_in_round + samples,
            steps_total=task.steps_total + covered,
            samples_total=task.samples_total + samples,
            last_status_at=clock,
            step_interval=interval,
        )
        loss = _finite(body.get("loss"))
        if loss is not None:
            changes["last_loss"] = loss
        if task.first_step_at is None:
            changes["first_step_at"] = now
        reply = CONTINUE
        grant = 0
        if task.sync_state == Task.Sync.SCHEDULED:
            # Its remaining steps need no answer but the last: that report carries them all.
            grant = max(0, (task.update_due or 0) - steps - 1)
        elif current.sample_target is None:
            # Fixed H: ScheduleUpdate{0} ("stop after this batch") at the H-th step; until then the daemon
            # answers every step but the H-th itself.
            if steps >= current.steps_per_round:
                changes.update(sync_state=Task.Sync.SCHEDULED, update_due=steps)
                reply = {"type": "ScheduleUpdate", "counter": 0}
            else:
                grant = current.steps_per_round - steps - 1
        else:
            more, grant = _adaptive_step(task, current.sample_target, samples, interval, clock)
            if more is not None:
                changes.update(sync_state=Task.Sync.SCHEDULED, update_due=steps + more)
                reply = {"type": "ScheduleUpdate", "counter": more}
                grant = max(0, more - 1)
        changes["continue_granted"] = min(grant, MAX_CONTINUE_GRANT)
    elif kind == "update":
        if task.sync_state == Task.Sync.DONE:
            return ERROR, {}
        changes["sync_state"] = Task.Sync.UPDATING
        reply = OK
    elif kind == "update-received":
        if task.sync_state == Task.Sync.DONE:
            return DONE, {}
        completed = task.round + 1
        # Decided by this trainer's own round count, not by the parameter server's report: the trainer may
        # merge the last update before the control plane hears of the round (Hypha's end-of-training race).
        done = completed >= current.update_rounds
        changes.update(
            round=completed,
            steps_in_round=0,
            samples_in_round=0,
            update_due=None,
            continue_granted=0,
            last_status_at=sync_clock(),  # the next round starts now for this trainer
            sync_state=Task.Sync.DONE if done else Task.Sync.TRAINING,
        )
        reply = DONE if done else CONTINUE
    elif kind == "metrics":
        _record_trainer_metrics(task, progress["metrics"])
        reply = OK
    else:
        return ERROR, {}
    return reply, changes


def _trainers_in_round(job_id, round_number: int):
    """The job's live trainers still training in round ``round_number + 1`` (not yet sent their update)."""
    return Task.objects.filter(
        job_id=job_id,
        role=TRAINER,
        status__in=Task.LIVE,
        round=round_number,
        sync_state__in=(Task.Sync.TRAINING, Task.Sync.SCHEDULED),
    )


def _projected(rows: list[dict], *, now: float) -> list[sync.Trainer]:
    """Trainers for :func:`sync.project` from task rows (``pk``, ``batch_size``, ``last_status_at``,
    ``step_interval``, ``steps_in_round``, ``score``); unknown intervals seeded from the others' and the
    benchmark scores."""
    keys = [str(row["pk"]) for row in rows]
    intervals = sync.seed_intervals(
        {key: row["step_interval"] for key, row in zip(keys, rows, strict=True)},
        scores={key: row["score"] for key, row in zip(keys, rows, strict=True)},
        batch_sizes={key: max(1, row["batch_size"]) for key, row in zip(keys, rows, strict=True)},
    )
    return [
        sync.Trainer(
            key=key,
            batch_size=max(1, row["batch_size"]),
            # A trainer yet to report a step this round may still be starting or merging: its first step is
            # not expected before a whole step from now.
            last_report=now
            if row["last_status_at"] is None or row["steps_in_round"] == 0
            else row["last_status_at"],
            interval=intervals[key],
        )
        for key, row in zip(keys, rows, strict=True)
    ]


_ROW_FIELDS = (
    "pk",
    "batch_size",
    "last_status_at",
    "step_interval",
    "update_due",
    "steps_in_round",
    "samples_in_round",
    "continue_granted",
)


def _rows(tasks) -> list[dict]:
    """What the projection needs of ``tasks``, with their workers' benchmark scores as ``score``."""
    return list(tasks.values(*_ROW_FIELDS, score=F("lease__worker__benchmark_score")))


def _adaptive_step(
    task: Task, target: int, samples: int, interval: float | None, now: float
) -> tuple[int | None, int]:
    """Performance-aware sync at a report of ``task`` (still TRAINING): how many more steps it runs this round
    (``None``: not decided yet), and how many of its next reports its daemon may answer itself.

    The round's samples are those its trainers reported (this report included, and those of trainers that
    already sent their update); when they reach ``target`` every trainer stops after its current step (``0``). When the rest is within a few steps
    of every trainer, the coming steps are projected (:func:`sync.project`) and this trainer is told its
    share once the projection covers the rest within the caps. Further away, the trainer may run on without
    asking for as many steps as the whole fleet cannot bring the round near its end in (counting the steps
    other trainers were already allowed to run unreported), and at most :data:`MAX_CONTINUE_SECONDS`.
    """
    # The round's samples include those of trainers that have sent their update already (UPDATING): they
    # count until their update-received, which comes only once the round closed.
    sent = Task.objects.filter(
        job_id=task.job_id,
        role=TRAINER,
        status__in=Task.LIVE,
        round=task.round,
        sync_state=Task.Sync.UPDATING,
    ).aggregate(samples=Sum("samples_in_round"))["samples"]
    rows = _rows(_trainers_in_round(task.job_id, task.round).exclude(pk=task.pk))
    done = (sent or 0) + sum(row["samples_in_round"] for row in rows) + task.samples_in_round + samples
    to_go = max(0, target - done)
    if to_go == 0:
        return 0, 0
    own_batch = max(1, task.batch_size)
    rows.append(
        {
            "pk": task.pk,
            "batch_size": own_batch,
            "last_status_at": now,
            "step_interval": interval,
            "update_due": None,
            "steps_in_round": task.steps_in_round + 1,
            "samples_in_round": 0,
            "continue_granted": 0,
            "score": task.lease.worker.benchmark_score,
        }
    )
    trainers = _projected(rows, now=now)
    # A projection that succeeds has every trainer at most STEPS_CAP - 1 steps ahead.
    margin = (sync.STEPS_CAP - 1) * sum(trainer.batch_size for trainer in trainers)
    if to_go <= margin:
        projection = sync.project(trainers, to_go=to_go, now=now)
        return (projection.steps[str(task.pk)] if projection.reaches_target else None), 0
    unreported = sum(max(1, row["batch_size"]) * row["continue_granted"] for row in rows)
    return None, sync.steps_before(
        trainers, key=str(task.pk), slack=to_go - margin - unreported, limit=MAX_CONTINUE_SECONDS
    )


def _record_trainer_metrics(task: Task, body: Any) -> None:
    if not isinstance(body, dict):
        return
    number = body.get("round")
    metrics = body.get("metrics")
    if not isinstance(number, int) or isinstance(number, bool) or not isinstance(metrics, dict):
        return
    if not 1 <= number <= plan(task.job).update_rounds:
        return
    finite = {str(name)[:64]: _finite(value) for name, value in list(metrics.items())[:32]}
    clean = {name: value for name, value in finite.items() if value is not None}
    round_ = _locked_round(task.job, number)
    round_.trainer_metrics = {**round_.trainer_metrics, str(task.lease.worker_id): clean}
    losses = [entry["loss"] for entry in round_.trainer_metrics.values() if "loss" in entry]
    round_.mean_loss = sum(losses) / len(losses) if losses else None
    round_.save(update_fields=["trainer_metrics", "mean_loss"])
    observers.round_recorded(round_)
    observers.trainer_metrics(task, round_number=number, metrics=clean)


def _locked_round(job: Job, number: int) -> Round:
    Round.objects.get_or_create(job=job, number=number)
    return Round.objects.select_for_update().get(job=job, number=number)


def _server_status(task: Task, progress: dict | str) -> dict:
    kind = _kind(progress)
    job = task.job
    if kind == "ready":
        body = progress["ready"] if isinstance(progress["ready"], dict) else {}
        url = body.get("url")
        if not isinstance(url, str) or not re.match(r"^https?://\S+$", url) or len(url) > 500:
            return ERROR
        Task.objects.filter(pk=task.pk).update(url=url, status=Task.Status.RUNNING)
        task.url = url
        _dispatch_trainers(job, task)
        count = _point_trainers(job, task)
        job.transition(
            Job.Status.RUNNING,
            reason=f"RUNNING: parameter server listening at {url}; {count} trainers told",
        )
        return OK
    if kind == "round":
        return _record_round(task, progress["round"])
    if kind == "waiting":
        return _expectation(task, progress["waiting"])
    if kind in ("metrics", "updated"):
        return OK
    return ERROR


def _expectation(task: Task, body: Any) -> dict:
    """The parameter server's round ``body["round"]`` has its first update: whom should it wait for, and
    when are they due? ``{"type": "Expect", "peers": [worker ids], "due_in": seconds | None}`` — the job's
    live trainers that have not finished the job, and when the last of them is projected to finish its
    steps (``None`` when unknown; the parameter server then keeps its ``round_timeout``)."""
    job = task.job
    current = plan(job)
    number = body.get("round") if isinstance(body, dict) else None
    if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= current.update_rounds:
        return ERROR
    live = list(
        Task.objects.filter(job=job, role=TRAINER, status__in=Task.LIVE)
        .exclude(sync_state=Task.Sync.DONE)
        .values("lease__worker_id", "round")
    )
    peers = sorted({str(row["lease__worker_id"]) for row in live})
    now = sync_clock()
    rows = _rows(_trainers_in_round(job.pk, number - 1))
    due = None
    # Only trainers measured in this round are projected; one still starting, merging or a round behind
    # (left out of the last one) may need long: the parameter server keeps its round_timeout then.
    settled = all(row["round"] >= number - 1 for row in live) and all(
        row["steps_in_round"] > 0 and row["step_interval"] is not None for row in rows
    )
    if settled:
        remaining = {
            str(row["pk"]): (
                row["update_due"] - row["steps_in_round"]
                if row["update_due"] is not None
                else (current.steps_per_round - row["steps_in_round"] if current.steps_per_round else None)
            )
            for row in rows
        }
        due = sync.due_in(
            _projected(rows, now=now), remaining_steps=remaining, now=now, default=sync.STEPS_CAP - 1
        )
    return {"type": "Expect", "peers": peers, "due_in": None if due is None else round(due, 3)}


def _record_round(task: Task, body: Any) -> dict:
    job = task.job
    update_rounds = plan(job).update_rounds
    number = body.get("round") if isinstance(body, dict) else None
    if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= update_rounds:
        return ERROR

    def ids(value: Any) -> list[str]:
        return [str(item)[:64] for item in value[:1024]] if isinstance(value, list) else []

    round_ = _locked_round(job, number)
    round_.closed = True
    round_.closed_at = timezone.now()
    round_.participants = ids(body.get("participants"))
    round_.left_out = ids(body.get("left_out"))
    arrivals = body.get("arrivals")
    round_.arrivals = (
        {
            str(peer)[:64]: seconds
            for peer, seconds in ((peer, _finite(value)) for peer, value in list(arrivals.items())[:1024])
            if seconds is not None and seconds >= 0
        }
        if isinstance(arrivals, dict)
        else {}
    )
    refused = body.get("refused")
    round_.refused = (
        {str(key)[:64]: str(value)[:500] for key, value in list(refused.items())[:1024]}
        if isinstance(refused, dict)
        else {}
    )
    for field in ("samples", "bytes_in", "bytes_out"):
        value = body.get(field)
        setattr(
            round_,
            field,
            value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0,
        )
    round_.duration = _finite(body.get("duration"))
    round_.eval_loss = _finite(body.get("eval_loss"))
    round_.save()
    observers.round_recorded(round_)
    evaluation = f", eval loss {round_.eval_loss:.4f}" if round_.eval_loss is not None else ""
    left_out = f", {len(round_.left_out)} left out" if round_.left_out else ""
    job.transition(
        Job.Status.RUNNING,
        reason=f"RUNNING: round {number} of {update_rounds} applied "
        f"({len(round_.participants)} trainers{left_out}{evaluation})",
    )
    return DONE if number >= update_rounds else OK


# --- data slices -------------------------------------------------------------------------------------------------


def assign_slice(worker, message: protocol.FetchSlice) -> protocol.SliceAssigned:
    """Claim the next slice for the trainer task, or say when to ask again (never raises for a bad request)."""

    def refused(text: str) -> protocol.SliceAssigned:
        return protocol.SliceAssigned(request_id=message.request_id, dataset=message.dataset, error=text)

    with transaction.atomic():
        try:
            task = own_task(worker, message.task_id, lock=True)
        except TaskRefused as error:
            return refused(str(error))
        if task.last_slice_request == message.request_id and task.last_slice_reply:
            # A repeat after a reconnect: the same answer, not a second claim.
            return protocol.SliceAssigned.model_validate(task.last_slice_reply)
        reply = _assign_slice(task, message, refused)
        Task.objects.filter(pk=task.pk).update(
            last_slice_request=message.request_id, last_slice_reply=reply.model_dump(mode="json")
        )
        return reply


def _assign_slice(task: Task, message: protocol.FetchSlice, refused) -> protocol.SliceAssigned:
    if task.role != TRAINER or not task.is_live or task.job.status != Job.Status.RUNNING:
        return refused(f"task {task.pk} is not a running trainer")
    name = plan(task.job).spec.dataset.name
    if message.dataset != name:
        return refused(f"job {task.job_id} trains on dataset {name!r}, not {message.dataset!r}")
    try:
        job_slice = dataset_services.claim_next(task.job, task.lease)
    except DatasetError as error:
        return refused(str(error))
    if job_slice is None:
        return protocol.SliceAssigned(
            request_id=message.request_id, dataset=name, retry_in=SLICE_RETRY_SECONDS
        )
    dataset = job_slice.slice.dataset
    return protocol.SliceAssigned(
        request_id=message.request_id,
        dataset=name,
        index=job_slice.slice.index,
        size=job_slice.slice.size_bytes,
        sha256=job_slice.slice.sha256,
        urls=slice_urls(dataset, job_slice.slice.index, job_id=task.job_id, peer=str(task.lease.worker_id)),
    )


def acknowledge_slice(worker, message: protocol.SliceAck) -> None:
    """The trainer has slice ``index``: it is USED (raises TaskRefused/DatasetError when refused)."""
    task = own_task(worker, message.task_id)
    if task.role != TRAINER:
        raise TaskRefused(f"task {task.pk} is not a trainer")
    dataset_services.acknowledge(task.job, task.lease, message.index)


# --- the final model -------------------------------------------------------------------------------------------


def model_directory(job_id) -> Path:
    return Path(settings.HYPHA_DATA_DIR) / "models" / str(job_id)


def authorise_model_upload(job: Job, token: str | None) -> Task:
    """The parameter-server task whose transfer token ``token`` is; :class:`TransferRefused` otherwise."""
    return _server_task(job, token, action="uploads its model")


def _write_stream(path: Path, chunks, *, limit: int) -> dict:
    """Write ``chunks`` to ``path`` atomically (a partial file never appears there); ``{"size", "sha256"}``.
    :class:`TransferRefused` (413) past ``limit`` bytes, leaving nothing behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.part")
    digest = hashlib.sha256()
    size = 0
    try:
        with partial.open("wb") as handle:
            for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise TransferRefused(f"the file exceeds {limit} bytes", status=413)
                digest.update(chunk)
                handle.write(chunk)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return {"size": size, "sha256": digest.hexdigest()}


def store_model_file(job: Job, filename: str, chunks, *, limit: int) -> dict:
    """Write one uploaded model file atomically; returns ``{"size", "sha256"}`` (recorded on the job)."""
    if not MODEL_FILENAME.match(filename):
        raise TransferRefused(f"{filename!r} is not an allowed model file name", status=400)
    directory = model_directory(job.pk)
    entry = _write_stream(directory / filename, chunks, limit=limit)
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        locked.model_files = {**locked.model_files, filename: entry}
        locked.save(update_fields=["model_files", "updated_at"])
    (directory / "model.zip").unlink(missing_ok=True)
    return entry


# --- checkpoints: the parameter server's last round, kept to restart it elsewhere ---------------------------------

#: The files of a saved round (parameter_server.checkpoints); the manifest completes a copy.
CHECKPOINT_MANIFEST = "round.json"
CHECKPOINT_FILES = ("weights.safetensors", "momentum.safetensors", "result.safetensors", CHECKPOINT_MANIFEST)
MAX_MANIFEST_BYTES = 1 << 20


def checkpoint_directory(job_id) -> Path:
    return Path(settings.HYPHA_DATA_DIR) / "checkpoints" / str(job_id)


def _server_task(job: Job, token: str | None, *, action: str) -> Task:
    """The live parameter-server task of ``job`` whose transfer token ``token`` is; :class:`TransferRefused`
    (401 for a missing or bad token, 403 for another role or an ended server, 409 once the job ended)."""
    if not token:
        raise TransferRefused("a transfer token is required (Authorization: Bearer …)", status=401)
    try:
        claims = protocol.verify_transfer_token(transfer_key(job.pk), token, job_id=str(job.pk))
    except protocol.TransferTokenError as error:
        raise TransferRefused(str(error), status=401) from None
    task = (
        Task.objects.select_related("lease")
        .filter(job=job, role=PARAMETER_SERVER, lease_id=claims.get("lease"))
        .first()
    )
    if claims.get("role") != PARAMETER_SERVER or task is None:
        raise TransferRefused(f"only the job's parameter server {action}")
    if job.status != Job.Status.RUNNING:
        raise TransferRefused(f"job {job.pk} is {job.status}", status=409)
    if not task.is_live:
        raise TransferRefused(f"this parameter server's task is {task.status}; it {action} no more")
    return task


def store_checkpoint_file(
    job: Job, round_number: int, filename: str, token: str | None, chunks, *, limit: int
):
    """Store one file of round ``round_number``'s checkpoint, uploaded by the job's live parameter server.

    Files are kept aside until the manifest (``round.json``, sent last) arrives: it must name the round and
    the files it says the round has; the round then replaces the job's checkpoint in one step. A round older
    than the one kept is refused (409); the one kept again is answered with what is stored (a retry)."""
    task = _server_task(job, token, action="saves checkpoints")
    if filename not in CHECKPOINT_FILES:
        raise TransferRefused(
            f"{filename!r} is not a checkpoint file (one of {', '.join(CHECKPOINT_FILES)})", status=400
        )
    kept = job.checkpoint.get("round", -1) if job.checkpoint else -1
    if round_number < kept:
        raise TransferRefused(f"round {round_number} is older than the saved round {kept}", status=409)
    if round_number == kept:
        for _ in chunks:  # drain the body: the client is still sending it
            pass
        return job.checkpoint["files"].get(filename, {})
    directory = checkpoint_directory(job.pk)
    partial = directory / f".partial-round-{round_number}-{task.pk}"
    if filename != CHECKPOINT_MANIFEST:
        entry = _write_stream(partial / filename, chunks, limit=limit)
        (partial / f".{filename}.json").write_text(json.dumps(entry))
        return entry
    entry = _write_stream(partial / filename, chunks, limit=MAX_MANIFEST_BYTES)
    try:
        manifest = json.loads((partial / filename).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("round_number") != round_number:
        raise TransferRefused(f"round.json does not describe round {round_number}", status=400)
    wanted = ["weights.safetensors"]
    wanted += ["momentum.safetensors"] if manifest.get("has_momentum") else []
    wanted += ["result.safetensors"] if manifest.get("has_result") else []
    missing = [name for name in wanted if not (partial / f".{name}.json").is_file()]
    if missing:
        raise TransferRefused(f"round {round_number} is missing {', '.join(missing)}", status=409)
    files = {name: json.loads((partial / f".{name}.json").read_text()) for name in wanted}
    files[CHECKPOINT_MANIFEST] = entry
    final = directory / f"round-{round_number}"
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.checkpoint and locked.checkpoint.get("round", -1) >= round_number:
            return entry  # a concurrent upload of the same round won
        locked.checkpoint = {"round": round_number, "files": files}
        locked.save(update_fields=["checkpoint", "updated_at"])
        job.checkpoint = locked.checkpoint
        if round_number >= 1:
            # The round is applied once it is saved: its report follows with the details, unless the server
            # dies first — a server that resumes starts after it and never reports it.
            round_ = _locked_round(locked, round_number)
            if not round_.closed:
                participants = manifest.get("participants")
                round_.closed, round_.closed_at = True, timezone.now()
                if isinstance(participants, list):
                    round_.participants = [str(peer)[:64] for peer in participants[:1024]]
                round_.save()
    for stale in directory.iterdir():
        if stale != final and (stale.name.startswith("round-") or stale.name.startswith(".partial-round-")):
            number = stale.name.removeprefix(".partial-").removeprefix("round-").partition("-")[0]
            if not number.isdigit() or int(number) <= round_number:
                shutil.rmtree(stale, ignore_errors=True)
    logger.info("job %s: round %d checkpoint saved (%s)", job.pk, round_number, ", ".join(sorted(files)))
    return entry


def discard_checkpoint(job_id) -> None:
    """Remove an ended job's saved round (its files; the job keeps the record of what it was)."""
    shutil.rmtree(checkpoint_directory(job_id), ignore_errors=True)


def checkpoint_file(job: Job, filename: str, token: str | None) -> Path:
    """The path of a file of the job's saved round, for its live parameter server (a restarted one)."""
    _server_task(job, token, action="fetches checkpoints")
    if not job.checkpoint or filename not in job.checkpoint.get("files", {}):
        raise TransferRefused(f"job {job.pk} has no saved {filename!r}", status=404)
    return checkpoint_directory(job.pk) / f"round-{job.checkpoint['round']}" / filename


# --- uploads ------------------------------------------------------------------------------------------------


def store_upload(owner, name: str, chunks, *, limit: int) -> Upload:
    """Store a user's upload (e.g. a zip of a model directory); :class:`TransferRefused` when refused."""
    if not MODEL_FILENAME.match(name):
        raise TransferRefused(
            f"{name!r} is not an allowed file name (letters, digits, '.', '_', '-'; at most 100)", status=400
        )
    upload_id = uuid.uuid4()
    entry = _write_stream(Path(settings.HYPHA_DATA_DIR) / "uploads" / str(upload_id), chunks, limit=limit)
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


def model_archive(job: Job) -> Path | None:
    """A zip of the job's stored model files (built once), or ``None`` when no model is stored."""
    import zipfile

    if not job.model_files:
        return None
    directory = model_directory(job.pk)
    archive = directory / "model.zip"
    if not archive.exists():
        partial = directory / ".model.zip.part"
        # Stored, not deflated: safetensors barely compress and the archive is written once per job.
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_STORED) as bundle:
            for filename in sorted(job.model_files):
                bundle.write(directory / filename, arcname=filename)
        partial.replace(archive)
    return archive


#: Seconds a job whose parameter server finished waits for its trainers to exit by themselves (they were
#: told Done) before it completes anyway and their leases are released (which stops them).
TRAINER_EXIT_GRACE = 30.0


def training_finished(job: Job) -> bool:
    """The last round is applied, the final model stored, and the parameter server exited cleanly."""
    server = current_server(job)
    return server is not None and server.status == Task.Status.EXITED and model_stored(job)


def trainers_running(job: Job) -> bool:
    return job.tasks.filter(role=TRAINER, status__in=Task.LIVE).exists()


def completion_reason(job: Job) -> str:
    update_rounds = plan(job).update_rounds
    last = job.rounds.filter(number=update_rounds).first()
    evaluation = f"; eval loss {last.eval_loss:.4f}" if last and last.eval_loss is not None else ""
    loss = f"; training loss {last.mean_loss:.4f}" if last and last.mean_loss is not None else ""
    return f"COMPLETED: {update_rounds} rounds{loss}{evaluation}"


def jobs_waiting_for_trainers() -> list:
    """Ids of RUNNING jobs whose parameter server exited cleanly over :data:`TRAINER_EXIT_GRACE` s ago."""
    from datetime import timedelta

    cutoff = timezone.now() - timedelta(seconds=TRAINER_EXIT_GRACE)
    return list(
        Task.objects.filter(
            role=PARAMETER_SERVER,
            status=Task.Status.EXITED,
            ended_at__lt=cutoff,
            job__status=Job.Status.RUNNING,
        ).values_list("job_id", flat=True)[:100]
    )
