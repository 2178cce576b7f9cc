"""The spec of a running job and what follows from it, parsed once per job and process."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

from apps.jobs import spec as job_spec
from apps.jobs.models import Job

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
    stop = getattr(job, "stop_after_round", None)
    if stop is not None and stop < found.update_rounds:
        # Stopped early by its max_cost (apps.jobs.budgets): the round in progress then was its last.
        return dataclasses.replace(found, update_rounds=stop)
    return found


def is_training_job(job: Job) -> bool:
    return bool(job.spec) and job.kind != Job.Kind.INFERENCE
