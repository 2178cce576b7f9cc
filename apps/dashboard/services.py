"""The dashboard's two workflows: submit a validated DiLoCo job, and cancel one. Both are the jobs service's,
called exactly as the REST API calls them (``apps/jobs/api/views.py``)."""

from __future__ import annotations

from apps.jobs import services as job_services
from apps.jobs import spec as job_spec
from apps.jobs.models import Job


def submit(*, owner, name: str, parsed: job_spec.DiLoCoSpec) -> Job:
    """Create the job of a spec that passed :func:`~apps.jobs.services.training_problems`, as
    ``POST /api/jobs/diloco/`` does; its allocation is queued on commit."""
    return job_services.create_job(
        owner=owner,
        name=name,
        num_trainers=parsed.num_trainers,
        requirements=job_spec.to_requirements(parsed),
        spec=job_services.spec_for_storage(parsed, owner),
        allocation_timeout=parsed.allocation_timeout,
    )


def submit_inference(*, owner, name: str, parsed) -> Job:
    """Create the inference job of a spec that passed ``apps.jobs.inference.submission.problems``, as
    ``POST /api/jobs/inference/`` does (its slices made, its allocation queued on commit)."""
    from apps.jobs.inference import submission

    return submission.submit(owner=owner, name=name, parsed=parsed)


def cancel(job: Job, *, by) -> Job:
    """Cancel ``job`` on behalf of ``by`` (its owner or staff); raises ``JobNotCancellable`` once it ended."""
    reason = "cancelled by its owner" if job.owner_id == by.pk else f"cancelled by {by}"
    return job_services.cancel_job(job, reason=reason)
