"""What the dashboard shows, read from the database: who may see what, and the JSON the job page draws.

The job page is rendered with :func:`job_snapshot` embedded in it, its websocket starts with the same snapshot,
and the live events of :mod:`apps.dashboard.live` carry parts of it in the same shapes, so the page's script has
one data model. Rounds, tasks and leases use the REST serializers' shapes (``apps/jobs/api/serializers.py``), so
what the page shows is what ``GET /api/jobs/<id>/`` says.

Visibility is the REST API's: a user sees their own jobs, the market activity of their jobs (offers on them, and
offers their workers made), and the pool: every worker's public facts, with the leases of their own jobs only.
The workers a user owns they see in full (owner, token state, presence log, every lease); staff see everything.
"""

from __future__ import annotations

import json
from datetime import datetime

from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import Count, Prefetch, Q, QuerySet
from django.utils import timezone

from apps.accounting import services as accounting
from apps.dashboard.inference import section as inference_section
from apps.dashboard.progress import run_progress
from apps.datasets import services as dataset_services
from apps.jobs import budgets
from apps.jobs.api.serializers import JobEventSerializer, JobLeaseSerializer, RoundSerializer, TaskSerializer
from apps.jobs.models import PARAMETER_SERVER, ROLE_LABELS, TRAINER, Job, Task
from apps.leases.models import Lease
from apps.market.models import Advertisement, Offer
from apps.workers.models import Worker
from apps.workers.services import manages

#: How many rows of market activity and lease history the pages show.
RECENT_ADVERTISEMENTS = 15
RECENT_OFFERS = 25
LEASE_HISTORY = 50
#: How many status transitions the job page's history shows (the newest).
HISTORY = 30


def to_json(value) -> str:
    """``value`` as JSON text (datetimes, UUIDs and decimals as strings), the one encoding of every event."""
    return json.dumps(value, cls=DjangoJSONEncoder, separators=(",", ":"))


# --- visibility -------------------------------------------------------------------------------------------


def visible_jobs(user) -> QuerySet[Job]:
    jobs = Job.objects.select_related("owner")
    return jobs if user.is_staff else jobs.filter(owner=user)


def visible_workers(user) -> QuerySet[Worker]:
    """The pool: every signed-in user sees every worker, in full only those they manage (``manages``)."""
    return Worker.objects.select_related("owner")


def can_see_job(user, job_id) -> bool:
    return bool(user.is_authenticated and user.is_active and visible_jobs(user).filter(pk=job_id).exists())


# --- the job page -----------------------------------------------------------------------------------------


def job_state(job: Job) -> dict:
    """The job's header: status, why, and whether its model can be downloaded."""
    return {
        "id": str(job.pk),
        "name": job.name,
        "status": job.status,
        "status_reason": job.status_reason,
        "final": job.is_final,
        "created_at": job.created_at,
        "ended_at": job.ended_at,
        "model_ready": job.status == Job.Status.COMPLETED and bool(job.model_files),
        "kind": job.kind,
        "update_rounds": _update_rounds(job),
    }


def _update_rounds(job: Job) -> int | None:
    rounds = job.spec.get("rounds") if isinstance(job.spec, dict) else None
    return rounds.get("update_rounds") if isinstance(rounds, dict) else None


def job_leases(job: Job) -> list[dict]:
    leases = Lease.objects.filter(job=job).select_related("worker").order_by("role", "created_at")
    return [JobLeaseSerializer(lease).data for lease in leases]  # each with its worker_id, for the links


def job_tasks(job: Job) -> list[dict]:
    tasks = Task.objects.filter(job=job).select_related("lease__worker")
    return [TaskSerializer(task).data for task in tasks]


def samples_per_second(task: Task, *, now: datetime | None = None) -> float | None:
    """A trainer's throughput since its first step (until it ended): samples over wall time, sync waits
    included, so it is what the job actually got from the worker.

    The clock starts when the first step is reported, at that step's end, so the first step's samples are
    not counted (a step's mean of them: the first report is of one step): counting them divided a step's
    samples by the milliseconds since, and a trainer once showed 15,533 samples/s after its first step. None
    until a second step is reported."""
    if task.first_step_at is None or task.steps_total < 2 or not task.samples_total:
        return None
    until = task.ended_at or now or timezone.now()
    seconds = (until - task.first_step_at).total_seconds()
    after_first = task.samples_total * (task.steps_total - 1) / task.steps_total
    return round(after_first / seconds, 2) if seconds > 0 else None


def trainer_progress(job_id) -> list[dict]:
    """Each trainer's place in the run: the numbers the job page's trainer table shows."""
    now = timezone.now()
    tasks = Task.objects.filter(job_id=job_id, role=TRAINER).select_related("lease__worker")
    return [
        {
            "id": str(task.pk),
            "worker": task.lease.worker.name,
            "worker_id": str(task.lease.worker_id),
            "status": task.status,
            "sync_state": task.sync_state,
            "round": task.round,
            "steps_in_round": task.steps_in_round,
            "ahead_steps": task.ahead_steps,
            "steps_total": task.steps_total,
            "samples_total": task.samples_total,
            "last_loss": task.last_loss,
            "samples_per_second": samples_per_second(task, now=now),
        }
        for task in tasks
    ]


def worker_names(job: Job) -> dict[str, str]:
    """Worker id → name of every worker that held a lease of the job (the chart's trainer lines)."""
    rows = Lease.objects.filter(job=job).values_list("worker_id", "worker__name").distinct()
    return {str(worker_id): name for worker_id, name in rows}


def job_events(job: Job) -> list[dict]:
    """The job's status history, the newest first (the last :data:`HISTORY` transitions)."""
    return JobEventSerializer(job.events.order_by("-at", "-id")[:HISTORY], many=True).data


def job_rounds(job: Job) -> list[dict]:
    return [RoundSerializer(round_).data for round_ in job.rounds.order_by("number")]


def job_snapshot(job: Job) -> dict:
    """Everything the job page's script draws; the first message of the job's websocket."""
    return {
        "type": "snapshot",
        "job": job_state(job),
        "leases": job_leases(job),
        "tasks": job_tasks(job),
        "trainers": trainer_progress(job.pk),
        "rounds": job_rounds(job),
        "workers": worker_names(job),
        "data": dataset_services.progress(job),
        "progress": run_progress(job),
        "events": job_events(job),
        "cost": job_cost(job),
        # An inference job's task, workers and stored results (None for training: apps/dashboard/inference.py).
        "inference": inference_section(job),
    }


def job_cost(job: Job) -> dict:
    """What the job has cost so far and its ``max_cost`` (credits, as the pages show them), and when that was
    read: the job page's #job-cost, in its snapshot and in every live event, since a running job's cost grows
    with its leases' ACTIVE time. Two small queries by the job's id (the sum of its ended leases' accruals, its
    ACTIVE leases' prices), on every push — at most a few a second per job (apps.dashboard.live)."""
    now = timezone.now()
    return {
        "credits": credits_text(accounting.job_cost(job.pk, now=now)),
        "max_cost": credits_text(budgets.max_cost_of(job)),
        "as_of": now,
    }


def job_page(job: Job) -> dict:
    """The job page's template context (besides the snapshot, which holds the status history): roles, tasks,
    transfer problems, the spec."""
    leases = job_leases(job)
    roles = []
    for role in job.roles:  # an inference job's one role, inference
        singular, plural = ROLE_LABELS[role]
        wanted = 1 if role == PARAMETER_SERVER else job.num_trainers  # trainers, or inference workers
        requirement = job.requirements.get(role) or {}
        roles.append(
            {
                "role": role,
                "label": plural if wanted != 1 else singular,
                "wanted": wanted,
                "bid": requirement.get("bid"),
                "max": requirement.get("max"),
                "resources": requirement.get("resources") or {},
                "leases": [lease for lease in leases if lease["role"] == role],
            }
        )
    tasks = job_tasks(job)
    return {
        "roles": roles,
        "tasks": tasks,
        "transfer_problems": transfer_problems(tasks),
        "spec": job.spec,
        # What the job cost up to the page's load, and its limit (apps/accounting; apps/jobs/budgets.py).
        "cost": credits_text(accounting.job_cost(job.pk)),
        "max_cost": credits_text(budgets.max_cost_of(job)),
    }


def credits_text(amount) -> str | None:
    """An amount of credits as the pages show it: ``19.635417``, ``30`` (None stays None)."""
    return None if amount is None else f"{amount.normalize():f}"


def transfer_problems(tasks: list[dict]) -> list[dict]:
    """The transfer problems of the serialized ``tasks`` (``job_tasks``), each with its task's worker, the
    oldest first: what ``GET /api/jobs/<id>/`` lists as ``transfer_problems`` (the page's script builds the
    same rows from the tasks of each live event)."""
    found = [
        {**problem, "worker": task["worker"], "worker_id": task["worker_id"]}
        for task in tasks
        for problem in task["transfer_problems"]
    ]
    return sorted(found, key=lambda problem: (problem["since"], problem["peer"]))


# --- the overview -----------------------------------------------------------------------------------------


def overview(user) -> dict:
    """Workers with their current leases, jobs by status, and the market's recent activity, as ``user`` may
    see them."""
    live_leases = Lease.objects.filter(status__in=Lease.LIVE).select_related("job").order_by("created_at")
    workers = list(
        visible_workers(user).prefetch_related(
            Prefetch("leases", queryset=live_leases, to_attr="live_leases")
        )
    )
    jobs = visible_jobs(user)
    counts = dict(jobs.order_by().values_list("status").annotate(count=Count("pk")))
    visible_job_ids = set()
    if not user.is_staff:
        visible_job_ids = set(jobs.values_list("pk", flat=True))
    for worker in workers:
        # A worker of the pool shows the leases of the user's own jobs only: another user's job on it, even
        # unnamed, would tell when and at what price that user trains.
        worker.managed = manages(user, worker)
        worker.mine = worker.owner_id is not None and worker.owner_id == user.pk
        worker.shown_leases = [
            lease for lease in worker.live_leases if worker.managed or lease.job_id in visible_job_ids
        ]
    advertisements = Advertisement.objects.select_related("job").order_by("-created_at")
    offers = Offer.objects.select_related("advertisement__job", "worker").order_by("-created_at")
    if not user.is_staff:
        advertisements = advertisements.filter(job__owner=user)
        offers = offers.filter(Q(advertisement__job__owner=user) | Q(worker__owner=user))
    return {
        "workers": workers,
        "online": sum(worker.status == Worker.Status.ONLINE for worker in workers),
        "job_counts": [
            {"status": status, "label": label, "count": counts.get(status, 0)}
            for status, label in Job.Status.choices
        ],
        # The list itself, filtered and a page at a time, is apps/dashboard/job_list.py's.
        "job_total": sum(counts.values()),
        "advertisements": list(advertisements[:RECENT_ADVERTISEMENTS]),
        "offers": list(offers[:RECENT_OFFERS]),
        "all_jobs_visible": user.is_staff,
        "visible_job_ids": visible_job_ids,
    }


# --- the worker page --------------------------------------------------------------------------------------


def worker_page(worker: Worker, user) -> dict:
    """A worker's lease history, the jobs it served and its trainers' throughput.

    Its owner and staff see all of it (other users' jobs unnamed); anyone else sees only what concerns their own
    jobs, so that the page tells them nothing of another user's work (``managed`` is False then, and the
    template leaves out the private facts: owner, presence log, token state, the benchmark's details)."""
    managed = manages(user, worker)
    visible = set(visible_jobs(user).filter(leases__worker=worker).values_list("pk", flat=True).distinct())
    history = Lease.objects.filter(worker=worker)
    task_history = Task.objects.filter(lease__worker=worker)
    if not managed:
        history = history.filter(job_id__in=visible)
        task_history = task_history.filter(job_id__in=visible)
    leases = list(history.select_related("job").order_by("-created_at")[:LEASE_HISTORY])
    served: dict = {}
    for lease in history.filter(activated_at__isnull=False).select_related("job"):
        entry = served.setdefault(
            lease.job_id,
            {"job": lease.job, "roles": set(), "visible": lease.job_id in visible, "price": lease.price},
        )
        entry["roles"].add(ROLE_LABELS.get(lease.role, (lease.role,))[0])
    now = timezone.now()
    tasks = list(task_history.select_related("job").order_by("-dispatched_at")[:LEASE_HISTORY])
    throughput = []
    for task in tasks:
        measured = samples_per_second(task, now=now) if task.role == TRAINER else None
        throughput.append(
            {
                "task": task,
                "visible": task.job_id in visible,
                "samples_per_second": measured,
                # Measured ÷ benchmark: how much of the benchmark's speed the job got (its model, batch and
                # sync waits differ from the benchmark's, so this compares workers, not absolute speed).
                "benchmark_ratio": measured / worker.benchmark_score
                if measured is not None and worker.benchmark_score
                else None,
            }
        )
    trained = [task for task in tasks if task.role == TRAINER]
    return {
        "managed": managed,
        "leases": [{"lease": lease, "visible": lease.job_id in visible} for lease in leases],
        "served": sorted(served.values(), key=lambda entry: entry["job"].created_at, reverse=True),
        "throughput": throughput,
        "totals": {
            "steps": sum(task.steps_total for task in trained),
            "samples": sum(task.samples_total for task in trained),
            "rounds": sum(task.round for task in trained),
            "parameter_servers": sum(task.role == PARAMETER_SERVER for task in tasks),
        },
        "live_leases": [lease for lease in leases if lease.is_live],
        # A worker's earnings are its owner's business (and staff's): never on another user's page.
        "earnings": credits_text(accounting.worker_earnings(worker.pk)) if managed else None,
        # So is its reputation (docs/architecture.md, "Reputation"); None: no record yet, at the prior.
        "record": getattr(worker, "record", None) if managed else None,
        "reliability": worker.reliability if managed else None,
    }
