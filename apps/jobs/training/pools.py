"""An elastic pool below its ``min`` while it trains (docs/training.md, "Elastic pools"): grace, pause, resume,
failure.

A RUNNING job with a trainer pool (``trainers = {min, target, grace}``) trains on while at least ``min`` of its
trainers hold ACTIVE leases. When fewer do, ``Job.below_min_since`` is set (:func:`review`, called when a
trainer is lost, when newcomers are dispatched, and by the lease clock's tick). Once the job has been below
``min`` for longer than the pool's ``grace`` it **pauses** (``Job.paused_at``; it stays RUNNING, its reason and
events say so):

* the leases it holds are kept, and replacements are advertised as for any lost trainer;
* the round in progress is **held**: the parameter server's ``Expect`` keeps naming the lost trainers
  (:func:`held_peers`), so the round does not close with the few left (it closes at the latest at the job's
  ``round_timeout``, which the control plane cannot extend); trainers that sent their update wait for its
  result, as they do for any round;
* trainers get no new data slices ("none yet", asked again), so one still training stops once the slices it
  holds are used up. Step reports are answered as usual: a trainer told to run past its round's steps would
  claim more samples than the parameter server accepts (``max_samples_per_update``).

When trainers are back to ``min`` the job resumes (the newcomers are named in the held round's ``Expect``
and join it). If they are not back within ``allocation_timeout`` seconds of the pause, the job fails with the
reason. A job without a pool (a fixed ``num_trainers``) never pauses: it trains on with the trainers it has.
"""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from apps.jobs.models import TRAINER, Job, Task
from apps.jobs.training.plans import plan
from apps.leases.models import Lease

#: Jobs examined per tick.
BATCH = 100


def has_pool(job: Job) -> bool:
    """Whether the job gave its trainers as an elastic pool (only those pause below ``min``)."""
    return bool((job.spec or {}).get("trainers"))


def grace(job: Job) -> float:
    """The pool's ``grace``: seconds below ``min`` before the job pauses."""
    return float(((job.spec or {}).get("trainers") or {}).get("grace") or 0.0)


def live_trainers(job: Job) -> int:
    """The job's trainers holding ACTIVE leases (a newcomer counts from its lease's activation)."""
    return job.leases.filter(role=TRAINER, status=Lease.Status.ACTIVE).count()


def is_paused(job: Job) -> bool:
    return job.paused_at is not None


def _finishing(job: Job) -> bool:
    """The last round is closed: nothing is left to pause (the trainers are told Done)."""
    return job.rounds.filter(number=plan(job).update_rounds, closed=True).exists()


def due() -> list:
    """Ids of RUNNING jobs below their pool's ``min`` (paused or in their grace): the tick reviews them."""
    return list(
        Job.objects.filter(status=Job.Status.RUNNING, below_min_since__isnull=False).values_list(
            "pk", flat=True
        )[:BATCH]
    )


def review(job: Job, *, now=None) -> str | None:
    """Bring the (locked, RUNNING) job's pause up to date with its live trainers: note when it went below
    ``min``, pause it past the grace, resume it once back to ``min``. Returns why the job fails (paused for
    ``allocation_timeout`` s), else ``None``."""
    if job.status != Job.Status.RUNNING or not has_pool(job):
        return None
    now = now or timezone.now()
    # Re-read: the caller's instance may have been loaded before the tick paused the job (the row is locked).
    job.below_min_since, job.paused_at = Job.objects.values_list("below_min_since", "paused_at").get(
        pk=job.pk
    )
    live = live_trainers(job)
    minimum = job.min_trainers
    if live >= minimum or _finishing(job):
        if job.below_min_since is not None:
            _resume(job, live=live, minimum=minimum, now=now)
        return None
    if job.below_min_since is None:
        _set(job, below_min_since=now)
    if job.paused_at is None:
        # Strictly longer: with a grace of 0 the loss itself does not pause; the next tick does.
        if (now - job.below_min_since).total_seconds() > grace(job):
            _pause(job, live=live, minimum=minimum, now=now)
        return None
    paused_for = (now - job.paused_at).total_seconds()
    if paused_for >= job.allocation_timeout:
        return (
            f"paused below the pool's min for {paused_for:.0f} s, more than its allocation_timeout "
            f"({job.allocation_timeout:g} s): {live} of the {minimum} trainers it needs hold leases"
        )
    return None


def _set(job: Job, **fields) -> None:
    Job.objects.filter(pk=job.pk).update(**fields)
    for name, value in fields.items():
        setattr(job, name, value)


def _pause(job: Job, *, live: int, minimum: int, now) -> None:
    _set(job, paused_at=now)
    fails_at = now + timedelta(seconds=job.allocation_timeout)
    job.transition(
        Job.Status.RUNNING,
        reason=f"RUNNING: paused: {live} of the pool's min {minimum} trainers for over {grace(job):g} s; the "
        f"round in progress is held and the leases kept while replacements are advertised; fails at "
        f"{fails_at:%H:%M:%S} UTC (allocation_timeout {job.allocation_timeout:g} s) unless "
        f"{minimum - live} more join",
    )


def _resume(job: Job, *, live: int, minimum: int, now) -> None:
    paused_at = job.paused_at
    _set(job, below_min_since=None, paused_at=None)
    if paused_at is not None:
        job.transition(
            Job.Status.RUNNING,
            reason=f"RUNNING: resumed after {(now - paused_at).total_seconds():.0f} s paused: {live} trainers "
            f"again (the pool's min is {minimum})",
        )


def held_peers(job: Job, live: list[str]) -> list[str]:
    """Peers a paused job's open round keeps waiting for besides its ``live`` trainers: the most recently lost
    trainers, as many as the pool is short of its ``min`` (so the round cannot close with the few left)."""
    short = job.min_trainers - len(live)
    if short <= 0:
        return []
    held: list[str] = []
    lost = (
        Task.objects.filter(job=job, role=TRAINER, status=Task.Status.CANCELLED)
        .order_by("-ended_at")
        .values_list("lease__worker_id", flat=True)
    )
    for worker_id in lost[:BATCH]:
        peer = str(worker_id)
        if peer not in live and peer not in held:
            held.append(peer)
            if len(held) == short:
                break
    return held
