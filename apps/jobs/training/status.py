"""The sync protocol: trainers' and the parameter server's status reports and their replies."""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Any

from django.db import transaction
from django.db.models import F, Sum
from django.utils import timezone

from apps.jobs import metrics, observers, sync, throughput
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job, Round, Task
from apps.jobs.spec import OVERLAPS_TRAINING_AHEAD
from apps.jobs.training import pools, transfers
from apps.jobs.training.discard import OWNER_DISCARD, pending_discard
from apps.jobs.training.dispatch import dispatch_trainers, point_trainers
from apps.jobs.training.plans import Plan, plan
from apps.jobs.training.reports import own_task
from hypha_tensors.formats import ENCODINGS
from worker_daemon import protocol

logger = logging.getLogger(__name__)

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


def task_started(worker, task_id) -> None:
    task = own_task(worker, task_id)
    # The start is the trainer's first "round start": its first step report is timed from it.
    Task.objects.filter(pk=task.pk, status=Task.Status.DISPATCHED, started_at__isnull=True).update(
        started_at=timezone.now(), last_status_at=sync_clock()
    )


# --- status: the sync protocol ------------------------------------------------------------------------------


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        value = float(value)
    except OverflowError:  # an int beyond any float (JSON allows any length)
        return None
    return value if math.isfinite(value) else None


def _kind(progress: dict | str) -> str:
    if isinstance(progress, str):
        return progress
    if len(progress) == 1:
        return next(iter(progress))
    return ""


def round_reported(progress: Any) -> bool:
    """Whether ``progress`` is a parameter server's ``{"round": {...}}`` report."""
    return isinstance(progress, dict) and _kind(progress) == "round"


def handle_status(
    worker, message: protocol.StatusReport, *, probed: tuple[bool, str] | None = None
) -> tuple[dict, int]:
    """The reply to one progress value a task's bridge forwarded (``{"type": "Error"}`` when refused), and how
    many of the trainer's next step reports its daemon may answer ``Continue`` itself (``continue_for``).
    ``probed``: for a parameter server's ``ready``, whether the control plane reached its URL
    (:func:`apps.jobs.training.transfers.probe`, run before the transaction)."""
    with transaction.atomic():
        task = own_task(worker, message.task_id, lock=True)
        if task.last_status_request == message.request_id:
            return task.last_status_reply, 0  # a repeat after a reconnect: already counted
        job = task.job
        changes: dict[str, Any] = {}
        if not task.is_live or job.status != Job.Status.RUNNING:
            reply = ERROR
        elif task.role == PARAMETER_SERVER:
            reply = _server_status(task, message.progress, probed=probed, worker=worker)
        else:
            reply, changes = _trainer_status(task, message.progress)
        # One UPDATE per report: the trainer's progress and the reply kept for a repeat of this request.
        Task.objects.filter(pk=task.pk).update(
            **changes, last_status_request=message.request_id, last_status_reply=reply
        )
        if "steps_total" in changes:
            # The steps this report counted, with what it (and its daemon's summary) says of them.
            metrics.record_step_report(
                task,
                message.progress["status"] if isinstance(message.progress["status"], dict) else {},
                first_step=task.steps_total + 1,
                last_step=changes["steps_total"],
                now=changes["last_status_at"],
            )
        if changes:
            state_changed = any(
                field in changes and changes[field] != getattr(task, field)
                for field in ("status", "sync_state")
            )
            for field, value in changes.items():
                setattr(task, field, value)
            observers.task_progress(task, state_changed=state_changed)
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
        if task.sync_state == Task.Sync.UPDATING and current.spec.rounds.overlap in OVERLAPS_TRAINING_AHEAD:
            reply, ahead = _ahead_step(task, current, body, batch_size, now=now)
            return reply, {**changes, **ahead}
        if task.sync_state not in (Task.Sync.TRAINING, Task.Sync.SCHEDULED):
            return ERROR, {}
        covered, samples = _covered(body, task, batch_size)
        steps = task.steps_in_round + covered
        changes.update(
            steps_in_round=steps,
            samples_in_round=task.samples_in_round + samples,
            **_step_changes(task, body, covered, samples, first_of_round=task.steps_in_round == 0, now=now),
        )
        clock, interval = changes["last_status_at"], changes["step_interval"]
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
            more, grant = _adaptive_step(
                task,
                current.sample_target,
                samples,
                interval,
                clock,
                eager=current.spec.rounds.overlap in OVERLAPS_TRAINING_AHEAD,
            )
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
        # The round it merged: the one after its last, or a later one it took part in (a replacement may
        # have fetched weights newer than the rounds it was dispatched with). The parameter server saves a
        # round with the control plane, participants included, before it publishes the result: it is known
        # here even when the round's report comes after this (Hypha's end-of-training race).
        completed = max(task.round + 1, _last_round_taken_part(task))
        # A trainer behind the job (left out of rounds, or one that skipped rounds by fetching the full global
        # weights after a drift) has nothing left to train once the job's last round is closed.
        done = (
            completed >= current.update_rounds
            or Round.objects.filter(job_id=task.job_id, number=current.update_rounds, closed=True).exists()
        )
        changes.update(
            round=completed,
            steps_in_round=0,
            samples_in_round=0,
            update_due=None,
            continue_granted=0,
            last_status_at=sync_clock(),  # the next round starts now for this trainer
            sync_state=Task.Sync.DONE if done else Task.Sync.TRAINING,
            ahead_steps=0,
            ahead_samples=0,
            ahead_due=None,
        )
        if not done and current.spec.rounds.overlap in OVERLAPS_TRAINING_AHEAD:
            del changes["continue_granted"]  # its daemon may hold a grant still: see _carried_over
            changes.update(_carried_over(task))
        reply = DONE if done else CONTINUE
    elif kind == "metrics":
        _record_trainer_metrics(task, progress["metrics"])
        reply = OK
    else:
        return ERROR, {}
    return reply, changes


def _step_changes(
    task: Task, body: dict, covered: int, samples: int, *, first_of_round: bool, now
) -> dict[str, Any]:
    """What every counted step report changes, whichever round it is of: the trainer's totals, its last loss,
    when it last reported and its step-time estimate (``first_of_round``: the time since its last report
    includes a merge or a start, and counts only while there is no estimate)."""
    clock = sync_clock()
    interval = task.step_interval
    if task.last_status_at is not None:
        interval = sync.next_interval(
            interval, (clock - task.last_status_at) / covered, first_of_round=first_of_round
        )
    changes: dict[str, Any] = {
        "steps_total": task.steps_total + covered,
        "samples_total": task.samples_total + samples,
        "last_status_at": clock,
        "step_interval": interval,
    }
    loss = _finite(body.get("loss"))
    if loss is not None:
        changes["last_loss"] = loss
    if task.first_step_at is None:
        changes["first_step_at"] = now
    return changes


def _ahead_step(
    task: Task, current: Plan, body: dict, batch_size: int, *, now
) -> tuple[dict, dict[str, Any]]:
    """The reply to an eager trainer's step report while UPDATING — a step of the round after the one whose
    update it sent, trained before that round's result came — and the changes to its task row.

    The step (with the steps its daemon answered locally, ``covered_steps``) counts as ``ahead_steps``, not
    in ``steps_in_round``: those are the sent round's until its "update-received", and performance-aware
    sync counts that round's samples until then. The reply is ``Continue``, or ``ScheduleUpdate{0}`` ("stop
    after this step and send the next update once merged"; ``ahead_due``) when the next round is done
    already: H ahead steps, the sample target reached, or no next round at all (its update was for the
    job's last round). The daemon may answer the steps that need no decision itself: fixed H, all but the
    H-th; with a sample target, as many as the fleet cannot bring the round near its end in; the rest of
    the round's count is decided once the trainer is back in TRAINING."""
    covered, samples = _covered(body, task, batch_size)
    ahead = task.ahead_steps + covered
    changes = _step_changes(task, body, covered, samples, first_of_round=task.ahead_steps == 0, now=now)
    changes.update(ahead_steps=ahead, ahead_samples=task.ahead_samples + samples)
    stop = False
    grant = 0
    if task.ahead_due is not None:
        pass  # told to stop already: a step that was in flight
    elif task.round + 1 >= current.update_rounds:
        stop = True
    elif current.sample_target is None:
        stop = ahead >= current.steps_per_round
        grant = 0 if stop else current.steps_per_round - ahead - 1
    else:
        more, grant = _adaptive_step(
            task,
            current.sample_target,
            samples,
            changes["step_interval"],
            changes["last_status_at"],
            eager=True,
            ahead=True,
        )
        stop = more == 0
        grant = 0 if more is not None else grant
    changes["continue_granted"] = min(grant, MAX_CONTINUE_GRANT)
    if stop:
        changes["ahead_due"] = ahead
        return {"type": "ScheduleUpdate", "counter": 0}, changes
    return CONTINUE, changes


def _carried_over(task: Task) -> dict[str, Any]:
    """An eager trainer's "update-received" (not the job's end): the steps it trained ahead are its new
    round's so far. Told to stop while ahead, it is SCHEDULED (its update is due after them); else TRAINING.
    The grant its daemon still holds stays (the merge came between two steps of a granted run; the next step
    report carries the steps answered meanwhile). After steps ahead, its last report time is forgotten: the
    time to its next report spans the merge, not a step."""
    changes: dict[str, Any] = {"steps_in_round": task.ahead_steps, "samples_in_round": task.ahead_samples}
    if task.ahead_steps:
        changes["last_status_at"] = None
    if task.ahead_due is not None:
        changes.update(sync_state=Task.Sync.SCHEDULED, update_due=task.ahead_due)
    return changes


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


def _ahead_rows(job_id, merged: int, *, exclude) -> list[dict]:
    """Rows as :func:`_rows` gives them of the eager trainers that sent round ``merged + 1``'s update and
    train the round after it while they wait for its result (those that reported a step of it), with
    their steps and samples ahead as that round's."""
    tasks = Task.objects.filter(
        job_id=job_id,
        role=TRAINER,
        status__in=Task.LIVE,
        round=merged,
        sync_state=Task.Sync.UPDATING,
        ahead_steps__gt=0,
    ).exclude(pk=exclude)
    rows = list(
        tasks.values(*_ROW_FIELDS, "ahead_steps", "ahead_samples", score=F("lease__worker__benchmark_score"))
    )
    for row in rows:
        row.update(
            steps_in_round=row.pop("ahead_steps"), samples_in_round=row.pop("ahead_samples"), update_due=None
        )
    return rows


def _adaptive_step(
    task: Task,
    target: int,
    samples: int,
    interval: float | None,
    now: float,
    *,
    eager: bool = False,
    ahead: bool = False,
) -> tuple[int | None, int]:
    """Performance-aware sync at a report of ``task`` (still TRAINING): how many more steps it runs this round
    (``None``: not decided yet), and how many of its next reports its daemon may answer itself.

    The round's samples are those its trainers reported (this report included, and those of trainers that
    already sent their update); when they reach ``target`` every trainer stops after its current step (``0``). When the rest is within a few steps
    of every trainer, the coming steps are projected (:func:`sync.project`) and this trainer is told its
    share once the projection covers the rest within the caps. Further away, the trainer may run on without
    asking for as many steps as the whole fleet cannot bring the round near its end in (counting the steps
    other trainers were already allowed to run unreported), and at most :data:`MAX_CONTINUE_SECONDS`.

    ``eager``: the job's trainers train ahead while UPDATING; those that do are the next round's trainers
    too (:func:`_ahead_rows`). ``ahead``: ``task`` is one of them, reporting a step ahead (its round is the
    one after the round whose update it sent).
    """
    merged = task.round + 1 if ahead else task.round
    own_steps, own_samples = (
        (task.ahead_steps, task.ahead_samples) if ahead else (task.steps_in_round, task.samples_in_round)
    )
    # The round's samples include those of trainers that have sent their update already (UPDATING): they
    # count until their update-received, which comes only once the round closed.
    sent = Task.objects.filter(
        job_id=task.job_id,
        role=TRAINER,
        status__in=Task.LIVE,
        round=merged,
        sync_state=Task.Sync.UPDATING,
    ).aggregate(samples=Sum("samples_in_round"))["samples"]
    rows = _rows(_trainers_in_round(task.job_id, merged).exclude(pk=task.pk))
    if eager and merged > 0:
        rows += _ahead_rows(task.job_id, merged - 1, exclude=task.pk)
    done = (sent or 0) + sum(row["samples_in_round"] for row in rows) + own_samples + samples
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
            "steps_in_round": own_steps + 1,
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


def _last_round_taken_part(task: Task) -> int:
    """The last closed round after ``task.round`` whose participants name the trainer's worker (0: none)."""
    peer = str(task.lease.worker_id)
    rounds = Round.objects.filter(job_id=task.job_id, closed=True, number__gt=task.round)
    return max(
        (number for number, names in rounds.values_list("number", "participants") if peer in names), default=0
    )


def _metrics_round(task: Task, claimed: int) -> int | None:
    """The round a trainer's metrics report belongs to, decided by the control plane (``None``: none).

    The executor's round number (``claimed``) is not trusted to name it: Hypha's executor counts from 1, so a
    replacement's would land in rounds it never trained. The round is the one the trainer is in by its own
    count (``task.round + 1``), or a later one it took part in. If that round closed without it (it was left
    out, or it fetched weights newer than the rounds it was dispatched with), it is the claimed one only when
    that is the open round (the one after the last closed), else the report is ignored: a closed round's mean
    loss is its participants'."""
    taken_part = _last_round_taken_part(task)
    if taken_part:
        return taken_part
    number = task.round + 1
    closed = Round.objects.filter(job_id=task.job_id, number=number, closed=True).exists()
    if not closed:
        return number
    last_closed = max(
        Round.objects.filter(job_id=task.job_id, closed=True).values_list("number", flat=True), default=0
    )
    return claimed if claimed > number and claimed == last_closed + 1 else None


def _record_trainer_metrics(task: Task, body: Any) -> None:
    if not isinstance(body, dict):
        return
    claimed = body.get("round")
    metrics = body.get("metrics")
    if not isinstance(claimed, int) or isinstance(claimed, bool) or not isinstance(metrics, dict):
        return
    number = _metrics_round(task, claimed)
    if number is None or not 1 <= number <= plan(task.job).update_rounds:
        logger.info(
            "job %s: metrics of trainer task %s for its round %d ignored: round %d closed without it",
            task.job_id,
            task.pk,
            claimed,
            task.round + 1,
        )
        return
    if number != claimed:
        logger.info(
            "job %s: metrics of trainer task %s for its round %d recorded in round %d (the round it trained)",
            task.job_id,
            task.pk,
            claimed,
            number,
        )
    finite = {str(name)[:64]: _finite(value) for name, value in list(metrics.items())[:32]}
    clean = throughput.cleaned({name: value for name, value in finite.items() if value is not None})
    round_ = locked_round(task.job, number)
    round_.trainer_metrics = {**round_.trainer_metrics, str(task.lease.worker_id): clean}
    losses = [entry["loss"] for entry in round_.trainer_metrics.values() if "loss" in entry]
    round_.mean_loss = sum(losses) / len(losses) if losses else None
    round_.save(update_fields=["trainer_metrics", "mean_loss"])
    observers.round_recorded(round_)
    observers.trainer_metrics(task, round_number=number, metrics=clean)


def _transfers(value: Any) -> dict:
    """A round report's ``transfers`` (bytes by path and direction), keeping only well-formed counts."""
    if not isinstance(value, dict):
        return {}
    kept: dict[str, dict[str, int]] = {}
    for path in (transfers.DIRECT, transfers.RELAY):
        counts = value.get(path)
        if isinstance(counts, dict):
            kept[path] = {
                direction: count
                for direction in ("in", "out")
                if isinstance(count := counts.get(direction), int)
                and not isinstance(count, bool)
                and count >= 0
            }
    return kept


#: What the parameter server may say of an update (parameter_server.aggregation); any other verdict is dropped.
VERDICTS = ("accepted", "down-weighted", "rejected")
MAX_VERDICTS = 1024


def _verdicts(value: Any) -> dict:
    """A round report's ``verdicts`` (peer → ``{"verdict", "reason", "norm_ratio", "cosine"}``), bounded: at
    most :data:`MAX_VERDICTS` peers, ids cut to 64 and reasons to 500 characters, only finite numbers (else
    null), entries with an unknown verdict or not an object dropped."""
    if not isinstance(value, dict):
        return {}
    kept: dict[str, dict] = {}
    for peer, body in list(value.items())[:MAX_VERDICTS]:
        if not isinstance(body, dict):
            continue
        verdict = body.get("verdict")
        if not isinstance(verdict, str) or verdict not in VERDICTS:
            continue
        reason = body.get("reason")
        kept[str(peer)[:64]] = {
            "verdict": verdict,
            "reason": reason[:500] if isinstance(reason, str) else "",
            "norm_ratio": _finite(body.get("norm_ratio")),
            "cosine": _finite(body.get("cosine")),
        }
        if "validation_loss" in body:  # a round that validated its updates (the validation step)
            kept[str(peer)[:64]]["validation_loss"] = _finite(body.get("validation_loss"))
            kept[str(peer)[:64]]["loss_ratio"] = _finite(body.get("loss_ratio"))
    return kept


def locked_round(job: Job, number: int) -> Round:
    Round.objects.get_or_create(job=job, number=number)
    return Round.objects.select_for_update().get(job=job, number=number)


def ready_url(progress: dict | str) -> str | None:
    """The URL of a parameter server's ``{"ready": {"url": …}}`` report, None for anything else or a bad URL."""
    if _kind(progress) != "ready" or not isinstance(progress, dict):
        return None
    body = progress["ready"] if isinstance(progress["ready"], dict) else {}
    url = body.get("url")
    if not isinstance(url, str) or not re.match(r"^https?://\S+$", url) or len(url) > 500:
        return None
    return url


def _server_status(
    task: Task, progress: dict | str, *, probed: tuple[bool, str] | None = None, worker=None
) -> dict:
    kind = _kind(progress)
    job = task.job
    if kind == "ready":
        url = ready_url(progress)
        if url is None:
            return ERROR
        Task.objects.filter(pk=task.pk).update(url=url, status=Task.Status.RUNNING)
        task.url = url
        # The worker as the caller knew it when it chose to probe (its own hello said how it is reached).
        path, why = transfers.choose_path(worker or task.lease.worker, url, probed)
        transfers.set_path(task, path)
        dispatch_trainers(job, task)
        count = point_trainers(job, task)
        reason = f"RUNNING: parameter server listening at {url}; {count} trainers told"
        if path == transfers.RELAY:
            reason += f"; they reach it through the relay: {why}"
        job.transition(Job.Status.RUNNING, reason=reason)
        return {**OK, "path": path}
    if kind == "round":
        return _record_round(task, progress["round"])
    if kind == "waiting":
        return _expectation(task, progress["waiting"])
    if kind in ("metrics", "updated"):
        return OK
    return ERROR


def _expectation(task: Task, body: Any) -> dict:
    """The parameter server's round ``body["round"]`` has its first update: whom should it wait for, and
    when are they due? ``{"type": "Expect", "peers": [worker ids], "due_in": seconds | None}`` (and
    ``"discard": n`` while the owner's discard of round n waits to be taken: docs/training.md) — the job's
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
    paused = pools.is_paused(job)
    if paused:
        # Held: the round keeps waiting for trainers it lost, so it does not close with the few left.
        peers += pools.held_peers(job, peers)
    # What the control plane counted for each trainer in this round: the most its update's X-Samples may
    # claim (the parameter server refuses more, after asking again once).
    counted = {
        str(worker_id): samples
        for worker_id, samples in Task.objects.filter(
            job=job,
            role=TRAINER,
            status__in=Task.LIVE,
            round=number - 1,
            sync_state__in=(Task.Sync.TRAINING, Task.Sync.SCHEDULED, Task.Sync.UPDATING),
        ).values_list("lease__worker_id", "samples_in_round")
    }
    now = sync_clock()
    rows = _rows(_trainers_in_round(job.pk, number - 1))
    due = None
    # Only trainers measured in this round are projected; one still starting, merging or a round behind
    # (left out of the last one) may need long: the parameter server keeps its round_timeout then.
    settled = all(row["round"] >= number - 1 for row in live) and all(
        row["steps_in_round"] > 0 and row["step_interval"] is not None for row in rows
    )
    if settled and not paused:
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
    reply: dict[str, Any] = {
        "type": "Expect",
        "peers": peers,
        "due_in": None if due is None else round(due, 3),
        "samples": counted,
    }
    discard = pending_discard(job, number)
    if discard is not None:  # the owner discards the last closed round (apps/jobs/training/discard.py)
        reply["discard"] = discard
    return reply


def _record_round(task: Task, body: Any) -> dict:
    job = task.job
    update_rounds = plan(job).update_rounds
    number = body.get("round") if isinstance(body, dict) else None
    if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= update_rounds:
        return ERROR

    def ids(value: Any) -> list[str]:
        return [str(item)[:64] for item in value[:1024]] if isinstance(value, list) else []

    round_ = locked_round(job, number)
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
    round_.transfers = _transfers(body.get("transfers"))
    round_.verdicts = _verdicts(body.get("verdicts"))
    encoding = body.get("encoding")
    # The encoding the round's bytes travelled in (bytes_in/bytes_out count them encoded); "" when not said.
    round_.encoding = encoding if isinstance(encoding, str) and encoding in ENCODINGS else ""
    round_.duration = _finite(body.get("duration"))
    round_.eval_loss = _finite(body.get("eval_loss"))
    eval_error = body.get("eval_error")
    # Why there is no eval loss (a NaN model, no eval data): shown, not a silent null.
    round_.eval_error = eval_error[:500] if isinstance(eval_error, str) and round_.eval_loss is None else ""
    discarded = body.get("discarded")
    # The step thrown away (its held-out loss rose, or it was not finite): the weights stayed as they were.
    round_.discarded = isinstance(discarded, str) and bool(discarded)
    round_.discard_reason = discarded[:500] if isinstance(discarded, str) else ""
    round_.save()
    observers.round_recorded(round_)
    observers.round_reported(round_)
    evaluation = f", eval loss {round_.eval_loss:.4f}" if round_.eval_loss is not None else ""
    if round_.eval_error:
        evaluation = f", no eval loss: {round_.eval_error[:300]}"
    left_out = f", {len(round_.left_out)} left out" if round_.left_out else ""
    # A discarded round is said on the job page, not hidden behind "applied".
    outcome = f"discarded, weights kept ({round_.discard_reason[:300]})" if round_.discarded else "applied"
    if round_.discarded and round_.discard_reason.startswith(OWNER_DISCARD):  # gone back, not kept
        outcome = f"discarded ({round_.discard_reason[:300]})"
    job.transition(
        Job.Status.RUNNING,
        reason=f"RUNNING: round {number} of {update_rounds} {outcome} "
        f"({len(round_.participants)} trainers{left_out}{evaluation})",
    )
    return DONE if number >= update_rounds else OK
