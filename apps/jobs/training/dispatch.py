"""Dispatch of a training job's tasks, replacements of lost ones, and the end of the training."""

from __future__ import annotations

from django.conf import settings
from django.utils import timezone

from apps.datasets import services as dataset_services
from apps.datasets.exceptions import DatasetError
from apps.datasets.models import Dataset, Slice
from apps.jobs import spec as job_spec
from apps.jobs import sync
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job, Task
from apps.jobs.training import pools
from apps.jobs.training.plans import is_training_job, plan
from apps.jobs.training.tokens import transfer_key, transfer_token
from apps.leases.models import Lease
from apps.workers import services as worker_services
from worker_daemon import protocol

#: The peer id trainers' ``scheduler`` references name: the control plane answers their slice requests.
CONTROL_PLANE_PEER = "control-plane"
#: Files of the global model trainers fetch from the parameter server, and the parameter server uploads.
MODEL_FILES = ("config.json", "model.safetensors")

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
    lifetime: float | None = None,
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
    count = dispatch_trainers(job, task)
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
                    lifetime=settings.HYPHA_EVAL_SLICE_TOKEN_LIFETIME,
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
    # The most samples one trainer's update may claim (its X-Samples): a round's worth of its steps; the
    # parameter server refuses more (a hostile count would outweigh every honest update in the mean).
    envelope["executor"]["config"]["rounds"]["max_samples_per_update"] = max_samples_per_update(parsed)
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


def max_samples_per_update(parsed: job_spec.DiLoCoSpec) -> int:
    """H full batches with fixed-H sync; with a sample target, the target plus the most steps a trainer may
    be told to run past it (:data:`apps.jobs.sync.STEPS_CAP`) in full batches."""
    batch = max(1, parsed.batch_size)
    if parsed.rounds.inner_steps is not None:
        return parsed.rounds.inner_steps * batch
    return parsed.rounds.avg_samples_between_updates + sync.STEPS_CAP * batch


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


def dispatch_trainers(job: Job, server: Task) -> int:
    """Dispatch a trainer task for every ACTIVE trainer lease without one. They start (import, build their
    data loader) while the parameter server starts; their bridges wait for its address (``peers``), which
    :func:`point_trainers` sends once it listens."""
    parsed = plan(job).spec
    server_peer = str(server.lease.worker_id)
    dispatched = 0
    # A replacement starts from the rounds done so far: the weights it fetches are the current ones. The count
    # is a lower bound of the rounds in the weights it fetches (a round is closed here before the parameter
    # server serves its weights); a round closed meanwhile is counted when the trainer merges its first
    # result (status.py).
    progress = job_progress(job)
    completed = progress["rounds"]
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
        # Ours: where the job is, so that the trainer's LR schedule starts at the job's step (an extra key,
        # ignored by executors that do not know it).
        envelope["executor"]["config"]["progress"] = progress
        _dispatch(
            task,
            protocol.DispatchJob(
                task_id=task.pk,
                lease_id=lease.pk,
                job_id=job.pk,
                role=TRAINER,
                spec=envelope,
                peers={server_peer: server.url} if server.url else {},
                relay=[server_peer] if server.transfer_path == "relay" else [],
                transfer_token=transfer_token(lease),
            ),
        )
        dispatched += 1
    return dispatched


def job_progress(job: Job) -> dict:
    """The job's progress, as a trainer is dispatched with it (``progress`` in its job JSON):

    * ``rounds``: the rounds closed;
    * ``steps``: **the job's step** — the optimizer steps a trainer that took part in every closed round has
      run: the sum over the closed rounds of the mean steps per participating trainer (fixed H: ``rounds × H``;
      with a sample target: the round's samples over its participants and the batch size, or the target over
      the job's trainers and the batch size for a round reported without samples);
    * ``steps_per_round``: the steps a trainer runs per round from here on (H; with a sample target the mean of
      the closed rounds, the target over the trainers' batches before any), for a trainer whose fetched weights
      are from a later round than ``rounds``: its schedule starts at ``steps + (later − rounds) ×
      steps_per_round``.
    """
    current = plan(job)
    closed = list(job.rounds.filter(closed=True).values_list("participants", "samples"))
    if current.steps_per_round is not None:
        per_round = float(current.steps_per_round)
        return {
            "rounds": len(closed),
            "steps": len(closed) * current.steps_per_round,
            "steps_per_round": per_round,
        }
    batch = max(1, current.spec.batch_size)
    nominal = current.sample_target / (max(1, job.num_trainers) * batch)
    means = [
        samples / (len(participants) * batch) if samples and participants else nominal
        for participants, samples in closed
    ]
    return {
        "rounds": len(closed),
        "steps": round(sum(means)),
        "steps_per_round": round(sum(means) / len(means), 3) if means else round(nominal, 3),
    }


#: A job fails rather than lose more trainers than this many times its trainer count (its pool's target)
#: **without a round closing in between**: a trainer that dies again and again before the job gets anywhere is
#: not a passing fault, but a fleet that churns while rounds still close is (docs/training.md, "Elastic
#: pools", "The replacement limit").
MAX_REPLACEMENTS_PER_TRAINER = 2


def trainer_lost(job: Job, lease: Lease, *, reason: str) -> str | None:
    """A trainer lease of the RUNNING training ``job`` ended: its task is over (CANCELLED). Returns ``None``
    when the job goes on (with a replacement if :func:`wants_replacements`; an elastic pool left below its
    ``min`` starts its grace, :mod:`.pools`), or why it cannot."""
    task = Task.objects.filter(lease=lease).first()
    if task is not None:
        task.finish(Task.Status.CANCELLED, reason=reason[:2000])
    lost, since = losses_since_progress(job)
    limit = MAX_REPLACEMENTS_PER_TRAINER * job.num_trainers
    if lost > limit:
        return f"{lost} trainers lost {since}, more than the {limit} this job replaces without progress"
    return pools.review(job)


def max_rejections(job: Job) -> int:
    """How many consecutive rejected rounds end a trainer's lease: the job's
    ``rounds.verification.max_rejections`` when its spec has one, else ``settings.HYPHA_MAX_REJECTIONS``."""
    verification = getattr(plan(job).spec.rounds, "verification", None)
    limit = getattr(verification, "max_rejections", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
        return limit
    return settings.HYPHA_MAX_REJECTIONS


def repeatedly_rejected(job: Job) -> list[tuple[Lease, str]]:
    """The ACTIVE trainer leases of ``job`` whose updates the parameter server rejected in each of the last
    :func:`max_rejections` closed rounds (consecutive numbers, all closed after the lease began: a new lease
    on the same worker starts with a clean record), each with the reason its lease ends for. The caller ends
    them (``apps.jobs.services``), which advertises the role again like any lost trainer."""
    limit = max_rejections(job)
    rounds = list(
        job.rounds.filter(closed=True, closed_at__isnull=False)
        .order_by("-number")
        .values("number", "verdicts", "refused", "closed_at")[:limit]
    )
    if len(rounds) < limit or rounds[0]["number"] - rounds[-1]["number"] != limit - 1:
        return []
    ended: list[tuple[Lease, str]] = []
    tasks = Task.objects.filter(
        job=job, role=TRAINER, status__in=Task.LIVE, lease__status=Lease.Status.ACTIVE
    ).select_related("lease", "lease__worker")
    for task in tasks:
        lease = task.lease
        reasons = []
        for round_ in reversed(rounds):
            verdicts = round_["verdicts"] if isinstance(round_["verdicts"], dict) else {}
            refused = round_["refused"] if isinstance(round_["refused"], dict) else {}
            verdict = verdicts.get(str(lease.worker_id))
            if round_["closed_at"] < lease.created_at:
                break
            # Refused on arrival (the parameter server's bounds on updates: a 422) counts as rejected too.
            if isinstance(verdict, dict) and verdict.get("verdict") == "rejected":
                reason = verdict.get("reason")
            elif str(lease.worker_id) in refused:
                reason = f"refused: {refused[str(lease.worker_id)]}"
            else:
                break
            reasons.append(f"round {round_['number']}: {str(reason or 'no reason given')[:80]}")
        if len(reasons) == limit:
            ended.append((lease, f"rejected in {limit} rounds in a row: {'; '.join(reasons)}"))
    return ended


def losses_since_progress(job: Job) -> tuple[int, str]:
    """The job's trainers lost (leases ended while training) since its last round closed, and since when in
    words. A round that closes shows the job moves: losses before it no longer count toward the limit."""
    last = job.rounds.filter(closed=True, closed_at__isnull=False).order_by("-closed_at").first()
    lost = Task.objects.filter(job=job, role=TRAINER, status=Task.Status.CANCELLED)
    if last is None:
        return lost.count(), "before any round closed"
    return lost.filter(ended_at__gt=last.closed_at).count(), f"since round {last.number} closed"


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
    lease without a task (the lost one's replacement) gets a server that resumes from the checkpoint. An
    elastic pool paused below its ``min`` resumes once newcomers bring it back (:func:`.pools.review`)."""
    # A failure reason cannot come from here: a newcomer only adds trainers (the tick fails a paused job).
    pools.review(job)
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
    return dispatch_trainers(job, server)


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


def point_trainers(job: Job, server: Task) -> int:
    """Send every live trainer's dispatch again with the parameter server's address (its daemon takes the new
    ``peers`` of a running task); the stored dispatch carries it too, for a daemon that reconnects."""
    told = 0
    for task in job.tasks.filter(role=TRAINER, status__in=Task.LIVE).select_related("lease"):
        # The peer id the trainer's spec names for its parameter server: the first server's, also after a
        # restart elsewhere (the daemon maps it to whichever address it is given).
        peer = _server_peer_of(task, default=str(server.lease.worker_id))
        relay = [peer] if server.transfer_path == "relay" else []
        message = protocol.DispatchJob.model_validate(
            {**task.dispatch_message, "peers": {peer: server.url}, "relay": relay}
        )
        _dispatch(task, message)
        told += 1
    return told


def _server_peer_of(task: Task, *, default: str) -> str:
    try:
        peers = task.dispatch_message["spec"]["executor"]["config"]["results"]["peers"]
    except (KeyError, TypeError):
        return default
    return str(peers[0]) if isinstance(peers, list) and peers else default


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
    planned = plan(job).spec.rounds.update_rounds
    if update_rounds < planned:
        return f"COMPLETED: {update_rounds} of {planned} rounds (stopped by max_cost){loss}{evaluation}"
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
