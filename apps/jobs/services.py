"""Job workflows: the one place that knows every role of a DiLoCo job and drives the market and leases.

The gateway consumer, the REST API and the Celery tasks call these functions; they hold no logic of
their own. Messages to daemons and follow-up tasks are sent after commit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.accounting import services as accounting
from apps.datasets import services as dataset_services
from apps.jobs import allocation, budgets, inference, spec_checks, tasks, training
from apps.jobs.exceptions import JobNotCancellable, JobTransitionRefused
from apps.jobs.models import INFERENCE, PARAMETER_SERVER, ROLE_LABELS, TRAINER, Job, JobEvent, Task
from apps.jobs.spec import DEFAULT_ALLOCATION_TIMEOUT
from apps.jobs.training import problems as transfer_problems
from apps.leases import services as lease_services
from apps.leases.exceptions import LeaseTransitionRefused
from apps.leases.models import Lease
from apps.market import services as market
from apps.market.exceptions import OfferRefused
from apps.market.models import Advertisement
from apps.workers import reputation
from apps.workers import services as worker_services
from apps.workers.models import Worker
from hypha_site.runtime import enqueue_on_commit
from worker_daemon import protocol

logger = logging.getLogger(__name__)

ALLOCATING_STATES = (Job.Status.PENDING, Job.Status.ALLOCATING, Job.Status.ALLOCATED, Job.Status.RUNNING)


# --- jobs ---------------------------------------------------------------------------------------------------


def spec_for_storage(parsed, owner) -> dict:
    """The spec as stored on the job: an upload named by file name is pinned to its id, so a later upload
    of the same name cannot change what the job trains."""
    stored = parsed.model_dump(mode="json")
    if parsed.model.source.type == "upload":
        stored["model"]["source"]["file"] = str(training.resolve_upload(owner, parsed.model.source.file).pk)
    return stored


def create_job(
    *,
    owner,
    name: str,
    num_trainers: int,
    requirements: dict,
    spec: dict | None = None,
    allocation_timeout: float = DEFAULT_ALLOCATION_TIMEOUT,
    kind: str = Job.Kind.TRAINING,
) -> Job:
    """Create a job (PENDING) and queue its allocation. ``requirements`` must already be validated.

    The job must be fully allocated within ``allocation_timeout`` seconds or it fails (:func:`tick_market`).
    When the connected fleet cannot serve it now (:func:`apps.jobs.allocation.submission_warnings`) it is
    still created, with the warnings as its status reason and event; the returned job carries them as
    ``submission_warnings`` (not stored: the fleet changes).
    """
    with transaction.atomic():
        now = timezone.now()
        job = Job.objects.create(
            owner=owner,
            name=name,
            num_trainers=num_trainers,
            requirements=requirements,
            kind=kind,
            spec=spec or {},
            status=Job.Status.PENDING,
            status_reason="PENDING: waiting to be advertised",
            allocation_timeout=allocation_timeout,
            allocation_deadline=now + timedelta(seconds=allocation_timeout),
        )
        job.submission_warnings = allocation.submission_warnings(job)
        if job.submission_warnings:
            reason = f"PENDING: warning: {'; '.join(job.submission_warnings)}"[:500]
            Job.objects.filter(pk=job.pk).update(status_reason=reason)
            job.status_reason = reason
            JobEvent.objects.create(job=job, from_status=job.status, to_status=job.status, reason=reason)
        enqueue_on_commit(tasks.allocate_job, str(job.pk))
    return job


def training_problems(parsed, owner) -> dict[str, list[str]]:
    """What keeps a valid DiLoCo spec from training here, as 400 field errors (empty when it can run)."""
    from apps.datasets.models import Dataset

    problems: dict[str, list[str]] = {}
    if (
        parsed.model.source.type == "upload"
        and training.resolve_upload(owner, parsed.model.source.file) is None
    ):
        problems["model.source.file"] = [
            f"You have no upload {parsed.model.source.file!r} (POST the file to /api/uploads/ first)."
        ]
    if parsed.preprocessor is not None and parsed.preprocessor.source.type == "upload":
        problems["preprocessor.source.type"] = ["Uploaded preprocessor files are not supported yet."]
    # A model URL into the workers' own network (SSRF), a model too large for what the roles declare.
    problems.update(
        spec_checks.submission_problems(
            parsed,
            allow_private_urls=settings.HYPHA_ALLOW_PRIVATE_URLS,
            max_parameters=settings.HYPHA_MAX_MODEL_PARAMETERS,
        )
    )
    dataset = Dataset.objects.filter(name=parsed.dataset.name).first()
    if dataset is None:
        problems["dataset.name"] = [
            f"No data node has registered a dataset named {parsed.dataset.name!r}; start "
            "`hypha-data-node --dataset DIR` first (see GET /api/datasets/)."
        ]
    elif parsed.evaluation is not None:
        held_out = training.evaluation_indices(parsed, dataset)
        if any(index >= dataset.slice_count for index in held_out):
            problems["evaluation.slices"] = [
                f"Dataset {dataset.name!r} has slices 0..{dataset.slice_count - 1}."
            ]
        elif len(held_out) >= dataset.slice_count:
            problems["evaluation"] = [
                f"Holding out {len(held_out)} of {dataset.slice_count} slices leaves none to train on."
            ]
    return problems


def allocate(job_id) -> None:
    """Advertise every role that is short of ACTIVE leases; cancel adverts that are no longer needed."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        if job is None or job.status not in ALLOCATING_STATES:
            return
        for role in job.roles:
            requirement = job.requirement(role)
            missing = requirement.count - _active_count(job, role) if training.replaces(job, role) else 0
            ad = job.advertisements.filter(role=role, status=Advertisement.Status.OPEN).first()
            if ad is not None:
                if missing <= 0:
                    market.cancel(ad, reason="role no longer needs workers")
                else:
                    market.set_wanted(ad, missing)
            elif missing > 0:
                market.advertise(
                    job=job,
                    role=role,
                    wanted=missing,
                    resources=requirement.resources,
                    executor=requirement.executor,
                    bid=requirement.bid,
                    max_price=requirement.max_price,
                    reachable=requirement.reachable,
                    devices=requirement.devices,
                    device_memory=requirement.device_memory,
                )
        refresh_status(job)


def refresh_status(job: Job) -> None:
    """Recompute the job's allocation status and its visible reason from its leases and adverts."""
    if job.status not in ALLOCATING_STATES:
        return
    counts = {role: (_active_count(job, role), job.requirement(role).count) for role in job.roles}
    summary = ", ".join(
        f"{have} of {want} {ROLE_LABELS[role][1] if want != 1 else ROLE_LABELS[role][0]}"
        for role, (have, want) in counts.items()
    )
    # An elastic pool (docs/training.md, "Elastic pools") starts at its min trainers; the advert keeps asking
    # for the rest (allocate() counts toward the target) and a newcomer is dispatched like a replacement.
    enough = all(
        have >= (job.min_trainers if role == TRAINER else want) for role, (have, want) in counts.items()
    )
    if enough:
        total = sum(want for _, want in counts.values())
        target = Job.Status.RUNNING if job.status == Job.Status.RUNNING else Job.Status.ALLOCATED
        if all(have >= want for have, want in counts.values()):
            reason = f"{target.upper()}: all {total} leases active ({summary})"
        else:
            reason = (
                f"{target.upper()}: {summary} leased, at least the {job.min_trainers} trainers the job "
                "starts with; advertising for the rest"
            )
    else:
        target = Job.Status.ALLOCATING
        reason = f"ALLOCATING: {summary} leased"
        waiting = allocation.waiting_note(job)
        if waiting:
            reason += f"; {waiting}"
        loss = allocation.loss_note(job, {role for role, (have, want) in counts.items() if have < want})
        if loss:
            reason += f" — {loss}"
    if job.status == Job.Status.RUNNING and training.is_training_job(job):
        # A training job stays RUNNING while a lost trainer is replaced: the others train on. Once the
        # replacement's lease is active it is dispatched.
        if target == Job.Status.RUNNING:
            joined = training.dispatch_replacements(job)
            if joined:
                job.transition(Job.Status.RUNNING, reason=f"RUNNING: {joined} replacement trainer(s) joined")
        return
    if job.status == Job.Status.RUNNING and inference.is_inference_job(job):
        inference.dispatch_replacements(job)  # the others go on; a new lease's worker joins at once
        return
    if job.status == Job.Status.RUNNING and target == Job.Status.RUNNING:
        return  # a running job's reason tells its training progress; a lease refresh must not replace it
    try:
        job.transition(target, reason=reason)
    except JobTransitionRefused:
        logger.info("job %s: status not refreshed (%s)", job.pk, job.status)
        return
    if target == Job.Status.ALLOCATED:
        problem = (inference if inference.is_inference_job(job) else training).start(job)
        if problem is not None:
            _end_job(job, Job.Status.FAILED, reason=f"FAILED: cannot start {job.kind}: {problem}")


def cancel_job(job: Job, *, reason: str = "cancelled by its owner") -> Job:
    """Cancel a job: close its adverts, stop its tasks and release every lease it holds."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job.pk)
        if job.is_final:
            raise JobNotCancellable(f"job {job.pk} is already {job.status}")
        _end_job(job, Job.Status.CANCELLED, reason=f"CANCELLED: {reason}")
    return job


def _end_job(job: Job, status: str, *, reason: str) -> None:
    """Move the (locked) job to a final status, close its adverts, mark its tasks cancelled and release every
    lease (each daemon stops the tasks bound to its lease when it hears the lease ended)."""
    job.transition(status, reason=reason)
    ending = {Job.Status.CANCELLED: "job cancelled", Job.Status.COMPLETED: "job completed"}.get(
        status, "job failed"
    )
    for ad in job.advertisements.filter(status=Advertisement.Status.OPEN):
        market.cancel(ad, reason=ending)
    training.cancel_tasks(job, reason=ending)
    for lease in job.leases.filter(status__in=Lease.LIVE).select_related("worker"):
        _end_lease(lease, reason=ending, notify_job=False)
    # Nothing will resume from the saved round now: its files go once the job's end is committed.
    transaction.on_commit(lambda job_id=job.pk: training.discard_checkpoint(job_id))


# --- the gateway: what daemons say -------------------------------------------------------------------------


def worker_connected(
    *, worker: Worker, channel_name: str, hello: protocol.Hello, info: dict
) -> protocol.Welcome:
    """Record a (re)connection and reconcile leases: keep what both sides hold, end the rest.

    Lock order is job → advert → worker → lease everywhere (see ``_lock_job``), so the leases the daemon no
    longer holds are ended (locking their jobs) before the worker row is locked to mark it online. A stopped
    lease clock is resumed first, in a transaction of its own: the resume locks lease rows, which must not
    be held while the jobs of the leases ended below are locked.
    """
    lease_services.resume_clock_if_stopped()
    with transaction.atomic():
        claimed = set(hello.leases)
        now = timezone.now()
        for lease in lease_services.live_leases(worker.pk, now=now).select_related("worker"):
            if not (lease.status == Lease.Status.ACTIVE and lease.id in claimed):
                _end_unless_ended(
                    lease, reason="the worker's daemon no longer holds it (reconnected without it)"
                )
        worker = worker_services.record_connection(
            worker=worker, channel_name=channel_name, hello=hello, info=info
        )
        kept = [
            _lease_info(lease, now)
            for lease in lease_services.live_leases(worker.pk, now=now).filter(
                status=Lease.Status.ACTIVE, pk__in=claimed
            )
        ]
        return protocol.Welcome(
            worker_id=worker.pk,
            worker_name=worker.name,
            lease_ttl=lease_services.lease_ttl().total_seconds(),
            offer_ttl=lease_services.offer_ttl().total_seconds(),
            leases=kept,
            advertisements=market.open_advertisements(worker),
        )


def worker_disconnected(*, worker: Worker, channel_name: str) -> None:
    """The connection closed: the worker is offline; its open offers are void. ACTIVE leases run on to expiry."""
    with transaction.atomic():
        if not Worker.objects.filter(pk=worker.pk, channel_name=channel_name).exists():
            return  # a newer connection of this worker took over: leave its state alone
        # Offers first (they lock their jobs), the worker row last: the lock order of offer_made.
        for lease in Lease.objects.filter(worker=worker, status=Lease.Status.TEMPORARY).select_related(
            "worker"
        ):
            _end_unless_ended(
                lease, reason="the worker disconnected while its offer was open", tell_worker=False
            )
        worker_services.record_disconnection(worker=worker, channel_name=channel_name)


def offer_made(*, worker: Worker, message: protocol.Offer) -> protocol.OfferReceived | protocol.OfferDeclined:
    """A daemon offers on an advert: the reply to send back (raises OfferRefused when it is not considered)."""
    market.check_offer_window(message)
    with transaction.atomic():
        _lock_job_of_advertisement(message.advertisement_id)
        # Re-read: the consumer's copy predates the resources and executors its hello just reported.
        worker = Worker.objects.get(pk=worker.pk)
        if worker.is_revoked:  # a frame that raced the revocation wins no lease
            raise OfferRefused("the worker's token was revoked")
        outcome = market.record_offer(worker=worker, message=message)
        offer = outcome.offer
        if offer.lease_id is None:
            return protocol.OfferDeclined(advertisement_id=message.advertisement_id, reason=offer.reason)
        if outcome.ready:
            # Settle now, in this transaction: it holds the job and advert locks already, and a hop through
            # a task queue would wait behind the other offers of the same broadcast (docs/benchmarks.md).
            settle_advertisement(offer.advertisement_id, closing=False)
        return protocol.OfferReceived(
            advertisement_id=offer.advertisement_id,
            offer_id=offer.pk,
            lease_id=offer.lease_id,
            expires_in=(offer.expires_at - timezone.now()).total_seconds(),
        )


def settle_advertisement(advertisement_id, *, closing: bool) -> None:
    """Settle an advert (enough offers, or window closed) and update its job."""
    with transaction.atomic():
        _lock_job_of_advertisement(advertisement_id)
        result = market.settle(advertisement_id, closing=closing)
        ad = result.advertisement
        if ad is None or not (result.accepted or result.filled or result.readvertise_in is not None):
            return
        refresh_status(Job.objects.get(pk=ad.job_id))


def renewal_confirmed(*, worker: Worker, lease_id) -> bool:
    """The daemon confirmed it holds the lease: extend it, or tell the daemon how the lease ended.

    Returns False only when the lease is not this worker's (nothing changes then).
    """
    lease = Lease.objects.filter(pk=lease_id, worker=worker).first()
    if lease is None:
        return False
    try:
        lease.renew(ttl=lease_services.lease_ttl())
    except LeaseTransitionRefused:
        with transaction.atomic():
            lease.refresh_from_db()
            # Past expires_at: expire it now, unless the lease clock already did.
            _end_unless_ended(lease, reason="renewal confirmed after the lease ran out", expired=True)
    return True


def lease_given_back(*, worker: Worker, lease_id, reason: str) -> bool:
    """The daemon releases a lease (shutdown, or it does not hold it). False if it is not this worker's."""
    with transaction.atomic():
        lease = Lease.objects.select_related("worker").filter(pk=lease_id, worker=worker).first()
        if lease is None:
            return False
        _end_unless_ended(lease, reason=f"released by the worker: {reason or 'no reason given'}")
    return True


def revoke_worker(worker: Worker) -> None:
    """Revoke a worker's token: its connection is closed and its leases end now."""
    with transaction.atomic():
        # The close is registered first so that, after commit, the daemon hears of the revocation before
        # anything else this transaction sends (the re-advertisement of its roles). Then the leases (they
        # lock their jobs), and the worker row last: the lock order of offer_made.
        worker_services.close_revoked(worker)
        for lease in Lease.objects.filter(worker=worker, status__in=Lease.LIVE).select_related("worker"):
            _end_unless_ended(lease, reason="the worker's token was revoked", tell_worker=False)
        worker.revoke_token()


def rotate_token(worker: Worker) -> str:
    """Issue the worker a new token; a daemon connected with the old one is disconnected (it cannot return)."""
    with transaction.atomic():
        token = worker_services.rotate_token(worker)
    return token


# --- the gateway: what daemons say about their tasks ----------------------------------------------------------


def task_started(*, worker: Worker, message: protocol.JobStarted) -> None:
    """The daemon started the task's process (raises TaskRefused for another worker's task)."""
    training.task_started(worker, message.task_id)


def task_exited(*, worker: Worker, message: protocol.JobExited) -> None:
    """A task's process ended: a failure fails the job; a clean parameter-server exit may complete it."""
    with transaction.atomic():
        task = training.own_task(worker, message.task_id)
        _lock_job(task.job_id)
        ended = training.record_exit(worker, message)
        if ended is None:
            return
        job = Job.objects.get(pk=ended.job_id)
        if job.status != Job.Status.RUNNING:
            return
        if ended.status == Task.Status.FAILED:
            _end_job(job, Job.Status.FAILED, reason=f"FAILED: {training.describe_exit(ended)}")
        elif ended.status == Task.Status.EXITED:
            _complete_or_fail(job)
        elif training.lease_not_held(ended, message):
            # Its daemon does not hold the lease (restarted under churn): the task is lost with its lease,
            # which ends now (the role is advertised again), not at its expiry.
            lease = Lease.objects.select_related("worker").get(pk=ended.lease_id)
            _end_unless_ended(lease, reason=f"its daemon does not hold it: {ended.reason}")


def pending_dispatches(*, worker: Worker) -> list[protocol.DispatchJob]:
    """What to send a daemon again right after its welcome: the dispatches of its live tasks."""
    return training.pending_dispatches(worker)


def task_output(*, worker: Worker, message: protocol.TaskLog) -> None:
    """New output lines of a running task: kept as its log tail (shown live on the job page)."""
    training.append_output(worker, message.task_id, message.lines)


def transfer_problem_reported(*, worker: Worker, message: protocol.TransferProblem) -> bool:
    """A task of the worker cannot reach a peer: keep the report (shown on the job) while the task is live.
    Raises TaskRefused for another worker's task; False when the task has ended (nothing changes)."""
    with transaction.atomic():
        task = training.own_task(worker, message.task_id, lock=True)
        return transfer_problems.record(task, message)


def transfer_recovered(*, worker: Worker, message: protocol.TransferOk) -> bool:
    """A peer of an earlier transfer problem answers again: drop the problem (False when there was none)."""
    with transaction.atomic():
        task = training.own_task(worker, message.task_id, lock=True)
        return transfer_problems.clear(task, message.peer)


def status_reported(*, worker: Worker, message: protocol.StatusReport) -> protocol.StatusReply:
    """The reply to a progress value from a task's bridge (``{"type": "Error"}`` when it is refused)."""
    probed = None
    url = training.ready_url(message.progress)
    # Before any transaction: the check of a parameter server's URL may take seconds. Only the URL of a
    # parameter-server task of this worker's is tried (no one else makes the control plane call an address),
    # and what it answered is never shown beyond its status code.
    if (
        url is not None
        and training.transfers.wants_probe(worker)
        and training.task_role(worker, message.task_id)[0] == PARAMETER_SERVER
    ):
        probed = training.transfers.probe(url)
    with transaction.atomic():
        role, job_id = training.task_role(worker, message.task_id)
        if role == INFERENCE:  # informative only: counted on the task, nothing in the job moves
            return protocol.StatusReply(
                request_id=message.request_id, reply=inference.handle_status(worker, message)
            )
        if role == PARAMETER_SERVER:
            # Its reports dispatch trainers and move the job: lock order job → task. A trainer's per-step
            # report locks only its own task row, so trainers never queue behind one another on the job.
            _lock_job(job_id)
        reply, continue_for = training.handle_status(worker, message, probed=probed)
        if (
            role == PARAMETER_SERVER
            and reply != {"type": "Error"}
            and training.round_reported(message.progress)
        ):
            # A trainer whose updates the parameter server rejected round after round: its lease ends (the
            # role is advertised again, like any lost trainer's).
            for lease, reason in training.repeatedly_rejected(Job.objects.get(pk=job_id)):
                _end_unless_ended(lease, reason=reason)
    return protocol.StatusReply(request_id=message.request_id, reply=reply, continue_for=continue_for)


def slice_requested(*, worker: Worker, message: protocol.FetchSlice) -> protocol.SliceAssigned:
    if inference.is_inference_task(worker, message.task_id):
        return inference.assign_slice(worker, message)
    return training.assign_slice(worker, message)


def slice_acknowledged(*, worker: Worker, message: protocol.SliceAck) -> None:
    training.acknowledge_slice(worker, message)


def model_uploaded(*, job: Job, filename: str, token: str | None, chunks, limit: int) -> dict:
    """Store one file of the final model the job's parameter server uploads (TransferRefused when refused)."""
    training.authorise_model_upload(job, token)
    return training.store_model_file(job, filename, chunks, limit=limit)


def checkpoint_uploaded(
    *, job: Job, round_number: int, filename: str, token: str | None, chunks, limit: int
) -> dict:
    """Store one file of a round the job's parameter server saves (TransferRefused when refused)."""
    return training.store_checkpoint_file(job, round_number, filename, token, chunks, limit=limit)


def result_uploaded(*, job: Job, index: int, headers: dict, token: str | None, chunks, limit: int) -> tuple:
    """Store the result of slice ``index`` an inference worker uploads (``headers``: the ``sha256``,
    ``result_format`` and ``declared_size`` it declares); the job completes with its last slice. Returns
    ``(entry, created)``; TransferRefused when refused (:func:`apps.jobs.inference.receive`)."""
    received = inference.receive(job, index, token=token, chunks=chunks, limit=limit, **headers)
    with transaction.atomic():
        _lock_job(job.pk)
        entry, created = inference.accept(job, received)
        if created and inference.all_done(job):
            _end_job(
                Job.objects.get(pk=job.pk), Job.Status.COMPLETED, reason=inference.completion_reason(job)
            )
    return entry, created


def _complete_or_fail(job: Job, *, stragglers: bool = False) -> None:
    """A task exited cleanly. Once the parameter server has, the job completes when its trainers have exited
    too (they were told Done; ``stragglers`` completes it without waiting any longer), and fails if the
    parameter server left before the last round was applied and the model stored."""
    server = training.current_server(job)
    if server is None or server.status != Task.Status.EXITED:
        return
    if not training.training_finished(job):
        _end_job(
            job,
            Job.Status.FAILED,
            reason="FAILED: the parameter server exited before the last round was applied and its model stored",
        )
        return
    if training.trainers_running(job) and not stragglers:
        return
    _end_job(job, Job.Status.COMPLETED, reason=training.completion_reason(job))


# --- clocks ----------------------------------------------------------------------------------------------


@dataclass
class LeaseTick:
    expired: int = 0
    renewals_requested: int = 0


def tick_leases() -> LeaseTick:
    """Expire leases that ran out and ask daemons to confirm leases that are due for renewal."""
    result = LeaseTick()
    for lease in lease_services.due_for_expiry():
        reason = (
            "not renewed before it ran out"
            if lease.status == Lease.Status.ACTIVE
            else "the offer was not accepted before its temporary lease ran out"
        )
        with transaction.atomic():
            try:
                _end_lease(lease, reason=reason, expired=True)
                result.expired += 1
            except LeaseTransitionRefused:
                pass  # renewed or released concurrently: nothing to do
    expires_in = lease_services.lease_ttl().total_seconds()
    due = lease_services.claim_due_renewals()
    requests: list[tuple[object, protocol._Message]] = [
        (lease.worker_id, protocol.RenewLease(lease_id=lease.id, expires_in=expires_in)) for lease in due
    ]
    result.renewals_requested = len(requests)
    # Transfer tokens are short-lived: each live task gets a fresh one with its lease's renewal.
    workers = {lease.pk: lease.worker_id for lease in due}
    requests += [(workers[message.lease_id], message.token) for message in training.fresh_tokens(due)]
    # One batch: a tick may ask a large fleet for dozens of renewals at once (docs/benchmarks.md, "Fleet").
    worker_services.send_to_workers(requests)
    return result


def tick_accounting() -> None:
    """Accrue the ACTIVE leases that are due, and end the jobs whose running cost reached their max_cost."""
    accounting.accrue_due()
    for job_id in budgets.jobs_to_wind_down():
        with transaction.atomic():
            _lock_job(job_id)
            job = Job.objects.get(pk=job_id)
            decided = budgets.last_round(job)
            if decided is not None:
                job.stop_after_round, reason = decided
                job.save(update_fields=["stop_after_round"])
                job.transition(Job.Status.RUNNING, reason=reason)
    for job_id in budgets.jobs_over_budget():
        with transaction.atomic():
            _lock_job(job_id)
            job = Job.objects.get(pk=job_id)
            reason = budgets.stop_reason(job)  # re-checked under the lock: it may have ended meanwhile
            if reason is not None:
                _end_job(job, Job.Status.CANCELLED, reason=reason)


def tick_training() -> None:
    """Complete jobs whose parameter server finished a while ago but whose trainers never said they exited;
    pause, resume or fail elastic pools below their min (:mod:`apps.jobs.training.pools`)."""
    for job_id in training.jobs_waiting_for_trainers():
        with transaction.atomic():
            _lock_job(job_id)
            job = Job.objects.get(pk=job_id)
            if job.status == Job.Status.RUNNING:
                _complete_or_fail(job, stragglers=True)
    for job_id in training.pools.due():
        with transaction.atomic():
            _lock_job(job_id)
            job = Job.objects.get(pk=job_id)
            problem = training.pools.review(job)
            if problem is not None:
                _end_job(job, Job.Status.FAILED, reason=f"FAILED: {problem}")


def tick_market() -> None:
    """Settle adverts whose window closed, re-advertise those whose backoff passed, and fail the jobs that
    were not fully allocated by their deadline (:mod:`apps.jobs.allocation`)."""
    for advertisement_id in market.due_windows():
        settle_advertisement(advertisement_id, closing=True)
    for advertisement_id in market.due_readvertisements():
        with transaction.atomic():
            _lock_job_of_advertisement(advertisement_id)
            ad = market.readvertise(advertisement_id)
            if ad is not None:
                refresh_status(Job.objects.get(pk=ad.job_id))
    for job_id in allocation.due_for_timeout():
        with transaction.atomic():
            _lock_job(job_id)
            job = Job.objects.get(pk=job_id)
            # Re-checked under the lock: a settlement may have allocated it since the batch was read.
            if allocation.is_due(job):
                # As a cancel does: adverts closed, every lease released and its daemon told.
                _end_job(job, Job.Status.FAILED, reason=allocation.timeout_reason(job))


# --- helpers ---------------------------------------------------------------------------------------------


def _lock_job(job_id) -> None:
    """Lock the job's row. Lock order: a workflow that may touch a job locks the job FIRST, then its adverts,
    offers and leases — as ``allocate`` and ``cancel_job`` do. One that locked an advert or a lease first and
    the job second (to refresh its status) deadlocks with them on PostgreSQL (seen in the end-to-end test:
    ``cancel_job`` against ``settle_advertisement``). Re-locking a row this transaction holds is free."""
    Job.objects.select_for_update().filter(pk=job_id).values_list("pk", flat=True).first()


def _lock_job_of_advertisement(advertisement_id) -> None:
    job_id = Advertisement.objects.filter(pk=advertisement_id).values_list("job_id", flat=True).first()
    if job_id is not None:
        _lock_job(job_id)


def _active_count(job: Job, role: str) -> int:
    return job.leases.filter(role=role, status=Lease.Status.ACTIVE).count()


def _lease_info(lease: Lease, now) -> protocol.LeaseInfo:
    return protocol.LeaseInfo(
        lease_id=lease.id,
        job_id=lease.job_id,
        role=lease.role,
        status=lease.status,
        resources=lease.resources,
        devices=lease.devices,
        price=lease.price,
        expires_in=max(0.0, (lease.expires_at - now).total_seconds()),
    )


def _tell_lease_ended(lease: Lease) -> None:
    worker_services.send_to_worker(
        lease.worker_id,
        protocol.LeaseEnded(lease_id=lease.id, status=lease.status, reason=lease.status_reason),
    )


def _end_unless_ended(lease: Lease, *, reason: str, expired: bool = False, tell_worker: bool = True) -> None:
    """End a lease its daemon spoke about, unless it has ended already; either way the daemon hears how it ended.

    The lease was read without a lock, so the lease clock may end it between that read and this call (a
    daemon releasing or confirming a lease just as it runs out): the refused transition is that race, lost.
    """
    if lease.is_live:
        try:
            _end_lease(lease, reason=reason, expired=expired, tell_worker=tell_worker)
            return
        except LeaseTransitionRefused:
            pass  # ended concurrently; the refused transition re-read the lease
    if not lease.is_live and tell_worker:
        _tell_lease_ended(lease)


def _end_lease(
    lease: Lease, *, reason: str, expired: bool = False, tell_worker: bool = True, notify_job: bool = True
) -> None:
    """End a live lease (expire or release), tell its daemon, void its offer, return the data slices it held
    but had not acknowledged, and let the job react."""
    _lock_job(lease.job_id)
    was_active = lease.status == Lease.Status.ACTIVE
    if expired:
        lease.expire(reason=reason)
    else:
        lease.release(reason=reason)
    if was_active:  # its last accrual, in this transaction: an ended lease's cost is exact (apps/accounting)
        accounting.accrue(lease.pk)
        # Only _end_job ends a lease without notifying its job: the lease lasted as long as the job needed it.
        reputation.lease_ended(lease, with_its_job=not notify_job)
    if tell_worker:
        _tell_lease_ended(lease)
    if not was_active:  # a TEMPORARY lease: its offer was still open
        market.offer_lease_ended(lease)
        return
    dataset_services.release_for_lease(lease, reason=f"lease {lease.status} before the acknowledgement")
    if not notify_job:
        return
    job = Job.objects.get(pk=lease.job_id)
    if job.status not in ALLOCATING_STATES:
        return
    if job.status == Job.Status.RUNNING and training.is_training_job(job):
        label = ROLE_LABELS.get(lease.role, (lease.role,))[0]
        lost = (
            f"the {label} lease on {lease.worker.name} {lease.status} while training: {lease.status_reason}"
        )
        if lease.role == TRAINER:
            # The job goes on without it; a replacement is advertised and joins with the current weights.
            problem = training.trainer_lost(job, lease, reason=lost)
            if problem is None:
                if training.wants_replacements(job):
                    job.transition(Job.Status.RUNNING, reason=f"RUNNING: {lost}; a replacement is advertised")
                    enqueue_on_commit(tasks.allocate_job, str(job.pk))
                return
            lost = f"{lost}; {problem}"
        else:
            # A new parameter server is advertised; it resumes from the round the lost one saved last.
            problem = training.server_lost(job, lease, reason=lost)
            if problem is None and training.model_stored(job):
                # It had applied the last round and stored the model; it only waited for the last fetches.
                _end_job(job, Job.Status.COMPLETED, reason=training.completion_reason(job))
                return
            if problem is None:
                job.transition(
                    Job.Status.RUNNING,
                    reason=f"RUNNING: {lost}; a new one is advertised to resume after round "
                    f"{job.checkpoint['round']}",
                )
                enqueue_on_commit(tasks.allocate_job, str(job.pk))
                return
            lost = f"{lost}; {problem}"
        _end_job(job, Job.Status.FAILED, reason=f"FAILED: {lost}")
        return
    refresh_status(job)
    enqueue_on_commit(tasks.allocate_job, str(job.pk))


__all__ = [
    "PARAMETER_SERVER",
    "checkpoint_uploaded",
    "model_uploaded",
    "slice_acknowledged",
    "slice_requested",
    "status_reported",
    "task_exited",
    "task_output",
    "pending_dispatches",
    "task_started",
    "TRAINER",
    "allocate",
    "cancel_job",
    "create_job",
    "lease_given_back",
    "offer_made",
    "refresh_status",
    "renewal_confirmed",
    "revoke_worker",
    "rotate_token",
    "settle_advertisement",
    "tick_leases",
    "tick_accounting",
    "tick_training",
    "tick_market",
    "worker_connected",
    "worker_disconnected",
]
