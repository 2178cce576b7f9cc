"""Whether a job can be allocated at all: the fleet check at submission and the allocation deadline.

A job asking for more workers than the fleet has was accepted, held the leases it could get and re-advertised
the rest for ever, keeping those workers from every other job. Two rules stop that:

* **At submission** (:func:`submission_warnings`) each role is compared with the connected workers that fit it
  (:func:`apps.market.targeting.could_serve`: its executor, its reachability policy, a price floor at most its
  bid, its resources within the worker's capacity, its reliability at least the role's ``min_reliability`` —
  whether the worker is busy now does not count, it may be free soon; the workers below the minimum are
  counted apart, :func:`reliability_note`). Fewer than the role needs, or fewer than the roles need together
  (a worker offering its whole capacity holds one lease at a time), is a warning: the job is still accepted,
  since workers may connect, but its submission says so (the 201 body's ``warnings``, a status event,
  ``hypha submit``).
* **The deadline** (:func:`due_for_timeout`): a job that has never been fully allocated
  ``allocation_timeout`` seconds after its submission (spec, default 600) gives back every lease it holds
  and fails with what it had (``apps.jobs.services.tick_market``). Once it was fully allocated the deadline
  no longer applies: a lease lost later is replaced as before (docs/architecture.md, "Job lifecycle").

While a job allocates, :func:`waiting_note` and :func:`loss_note` say in its status reason what its open
adverts wait for and why a role is short again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from django.utils import timezone

from apps.jobs.models import PARAMETER_SERVER, ROLE_LABELS, TRAINER, Job, RoleRequirement
from apps.leases.models import Lease
from apps.market import services as market
from apps.market import targeting
from apps.market.models import Advertisement

#: States a job waits for its first full allocation in (``allocated_at`` is still empty).
WAITING_STATES = (Job.Status.PENDING, Job.Status.ALLOCATING)


def fleet_warnings(
    requirements: Sequence[RoleRequirement], candidates: Sequence[targeting.Candidate]
) -> list[str]:
    """Why the connected workers ``candidates`` cannot serve the roles ``requirements`` now (empty: they can).

    Pure: one warning per role that fewer workers fit than it needs; else, when the roles together need more
    leases than the workers can hold at once, one for the job.
    """
    warnings = []
    fitting: dict[str, set] = {}
    for requirement in requirements:
        fitting[requirement.role] = {
            candidate.worker_id for candidate in candidates if _fits(requirement, candidate)
        }
        fit = len(fitting[requirement.role])
        if fit < requirement.count:
            warning = _role_warning(requirement, fit)
            below = reliability_note(requirement, candidates)
            warnings.append(f"{warning} ({below})" if below else warning)
    if warnings:
        return warnings
    needed = sum(requirement.count for requirement in requirements)
    # A worker offering its whole capacity holds one lease; a flexible one at most one lease of each role it
    # fits (an upper bound: its capacity may not hold them all at once, so no false warning comes of it).
    holdable = sum(
        1 if candidate.strategy == "whole" else roles
        for candidate in candidates
        if (roles := sum(candidate.worker_id in workers for workers in fitting.values()))
    )
    if holdable < needed:
        warnings.append(
            f"the job needs {needed} workers at once ({_roles_phrase(requirements)}) and the connected "
            f"workers that fit its roles can hold {holdable} of its leases (a worker offering its whole "
            "capacity holds one)"
        )
    return warnings


def reliability_note(requirement: RoleRequirement, candidates: Sequence[targeting.Candidate]) -> str:
    """How many of the connected workers ``candidates`` would fit the role but for its ``min_reliability``
    ("" when none): the owner learns why the role waits, not the other owners' workers' reliabilities."""
    if requirement.min_reliability <= 0:
        return ""
    loose = dataclasses.replace(requirement, min_reliability=0.0)
    below = sum(_fits(loose, candidate) and not _fits(requirement, candidate) for candidate in candidates)
    if not below:
        return ""
    singular = ROLE_LABELS.get(requirement.role, (requirement.role,))[0]
    workers = "1 connected worker that fits" if below == 1 else f"{below} connected workers that fit"
    return (
        f"{workers} the {singular} role {'is' if below == 1 else 'are'} below its min_reliability "
        f"{requirement.min_reliability:g} (docs/architecture.md, Reputation)"
    )


def waiting_for_reliability(job: Job, role: str) -> str:
    """:func:`reliability_note` for ``job``'s ``role`` and the workers connected now; no query when the role
    asks for no minimum."""
    requirement = job.requirement(role)
    if requirement.min_reliability <= 0:
        return ""
    return reliability_note(requirement, market.connected_candidates())


def submission_warnings(job: Job) -> list[str]:
    """:func:`fleet_warnings` for ``job`` and the workers connected now (two queries). An elastic pool is
    warned about only when the fleet cannot serve its ``min`` trainers: it starts with those."""
    requirements = [job.requirement(role) for role in job.roles]
    requirements = [
        dataclasses.replace(requirement, count=job.min_trainers)
        if requirement.role == TRAINER
        else requirement
        for requirement in requirements
    ]
    return fleet_warnings(requirements, market.connected_candidates())


def due_for_timeout(*, limit: int = 100) -> list:
    """Ids of jobs past their allocation deadline that were never fully allocated (a bounded batch)."""
    return list(
        Job.objects.filter(
            status__in=WAITING_STATES,
            allocated_at__isnull=True,
            allocation_deadline__lte=timezone.now(),
        )
        .order_by("allocation_deadline")
        .values_list("pk", flat=True)[:limit]
    )


def is_due(job: Job) -> bool:
    """Whether the (re-read, locked) ``job`` is still past its deadline without a full allocation."""
    return (
        job.status in WAITING_STATES
        and job.allocated_at is None
        and job.allocation_deadline is not None
        and job.allocation_deadline <= timezone.now()
    )


def timeout_reason(job: Job) -> str:
    """The FAILED reason of a job that missed its deadline: what it held, and why the fleet falls short now."""
    if job.kind == Job.Kind.INFERENCE:
        requirement = job.requirement(job.roles[0])
        leased = job.leases.filter(role=requirement.role, status=Lease.Status.ACTIVE).count()
        held = (
            f"{leased} of {requirement.count} {ROLE_LABELS[requirement.role][requirement.count != 1]} leased"
        )
        warnings = submission_warnings(job)
        suffix = f" ({'; '.join(warnings)})" if warnings else ""
        return f"FAILED: not fully allocated within {job.allocation_timeout:g} s: {held}{suffix}"
    have = {
        role: job.leases.filter(role=role, status=Lease.Status.ACTIVE).count()
        for role in (TRAINER, PARAMETER_SERVER)
    }
    # An elastic pool needed its min to start.
    needed = job.min_trainers
    trainers = f"{have[TRAINER]} of {needed} {ROLE_LABELS[TRAINER][needed != 1]}"
    if needed < job.num_trainers:
        trainers += f" (the pool's min; target {job.num_trainers})"
    held = (
        f"{trainers} and the parameter server leased"
        if have[PARAMETER_SERVER]
        else f"{trainers} leased, the parameter server not"
    )
    reason = f"FAILED: not fully allocated within {job.allocation_timeout:g} s: {held}"
    warnings = submission_warnings(job)
    if warnings:
        reason += f" ({'; '.join(warnings)})"
    return reason


def _fits(requirement: RoleRequirement, candidate: targeting.Candidate) -> bool:
    return targeting.could_serve(
        candidate,
        resources=requirement.resources,
        executors={requirement.executor.key()},
        bid=requirement.bid,
        reachable=requirement.reachable,
        devices=targeting.DeviceRequest(count=requirement.devices, memory=requirement.device_memory),
        min_reliability=requirement.min_reliability,
    )


def _role_warning(requirement: RoleRequirement, fit: int) -> str:
    singular, plural = ROLE_LABELS.get(requirement.role, (requirement.role, requirement.role))
    short = (
        f"the {singular} cannot"
        if requirement.count == 1
        else f"{requirement.count - fit} of the {requirement.count} {plural} cannot"
    )
    workers = (
        "no connected worker fits"
        if fit == 0
        else f"{fit} connected worker{'s' if fit != 1 else ''} fit{'s' if fit == 1 else ''}"
    )
    return f"{short} be served now: {workers} the {singular} role"


def _roles_phrase(requirements: Sequence[RoleRequirement]) -> str:
    parts = []
    for requirement in requirements:
        singular, plural = ROLE_LABELS.get(requirement.role, (requirement.role, requirement.role))
        parts.append(
            f"the {singular}"
            if requirement.count == 1 and requirement.role == PARAMETER_SERVER
            else f"{requirement.count} {plural if requirement.count != 1 else singular}"
        )
    return " and ".join(parts)


def waiting_note(job: Job) -> str:
    """What the job's open adverts wait for (offers, workers, reliability), for its ALLOCATING reason."""
    notes = []
    for ad in job.advertisements.filter(status=Advertisement.Status.OPEN).order_by("role"):
        label = ROLE_LABELS.get(ad.role, (ad.role, ad.role))[1 if ad.wanted != 1 else 0]
        if ad.next_attempt_at is not None:
            # An absolute time keeps the reason stable between refreshes (one JobEvent per attempt).
            nobody = " (no connected worker could take it)" if not ad.targets else ""
            notes.append(
                f"not enough offers for {ad.wanted} {label} after attempt {ad.attempt + 1}{nobody}; "
                f"re-advertising at {ad.next_attempt_at:%H:%M:%S} UTC"
            )
        else:
            # The attempt went to no daemon: none connected has the executor, a floor within the bid and the
            # free resources (apps.market.targeting) — the owner should know it waits for workers, not offers.
            nobody = "; no connected worker can take it" if not ad.targets else ""
            notes.append(f"advertising {ad.wanted} {label} (attempt {ad.attempt + 1}{nobody})")
        if len(ad.targets) < ad.wanted:
            # Workers below the role's min_reliability are not asked: say so, or the owner sees no reason.
            below = waiting_for_reliability(job, ad.role)
            if below:
                notes.append(below)
    return "; ".join(notes)


def loss_note(job: Job, short_roles: set[str]) -> str:
    """Why a role is short again: the last ACTIVE lease of a short role that ended, if any."""
    lost = (
        job.leases.filter(
            role__in=short_roles,
            activated_at__isnull=False,
            status__in=(Lease.Status.EXPIRED, Lease.Status.RELEASED),
        )
        .select_related("worker")
        .order_by("-ended_at")
        .first()
    )
    if lost is None:
        return ""
    label = ROLE_LABELS.get(lost.role, (lost.role,))[0]
    return f"{label} lease on {lost.worker.name} {lost.status} at {lost.ended_at:%H:%M:%S} UTC: {lost.status_reason}"
