"""Submitting an inference job: what keeps a valid spec from running here, and the job with its slices.

Not imported by the package's ``__init__`` (it builds on :mod:`apps.jobs.services`, which imports the package).
"""

from __future__ import annotations

from django.conf import settings
from django.db import transaction

from apps.datasets import services as dataset_services
from apps.datasets.models import Dataset
from apps.jobs import services, spec_checks
from apps.jobs.models import Job
from apps.jobs.spec import inference as inference_spec
from apps.jobs.training.uploads import resolve_upload


def problems(parsed: inference_spec.InferenceSpec, owner) -> dict[str, list[str]]:
    """What keeps a valid inference spec from running here, as 400 field errors (empty when it can run)."""
    found: dict[str, list[str]] = {}
    source = parsed.model.source
    if source.type == "upload" and resolve_upload(owner, source.file) is None:
        found["model.source.file"] = [
            f"You have no upload {source.file!r} (POST the file to /api/uploads/ first)."
        ]
    if source.type == "url":
        # A worker would fetch it from inside its own network (SSRF): refused at once, as for training.
        problem = spec_checks.url_problem(source.url, settings.HYPHA_ALLOW_PRIVATE_URLS)
        if problem:
            found["model.source.url"] = [problem]
    dataset = Dataset.objects.filter(name=parsed.dataset.name).first()
    if dataset is None:
        found["dataset.name"] = [
            f"No data node has registered a dataset named {parsed.dataset.name!r}; start "
            "`hypha-data-node --dataset DIR` first (see GET /api/datasets/)."
        ]
    elif dataset.slice_count < 1:
        found["dataset.name"] = [f"Dataset {dataset.name!r} has no slices."]
    return found


def spec_for_storage(parsed: inference_spec.InferenceSpec, owner) -> dict:
    """The spec as stored on the job: an upload named by file name is pinned to its id."""
    stored = parsed.model_dump(mode="json")
    if parsed.model.source.type == "upload":
        stored["model"]["source"]["file"] = str(resolve_upload(owner, parsed.model.source.file).pk)
    return stored


def submit(*, owner, name: str, parsed: inference_spec.InferenceSpec) -> Job:
    """Create the inference job (PENDING, its allocation queued) and its slices, one epoch, all AVAILABLE.
    The spec must be valid and have no :func:`problems`."""
    with transaction.atomic():
        job = services.create_job(
            owner=owner,
            name=name,
            num_trainers=parsed.workers,
            requirements=inference_spec.to_requirements(parsed),
            spec=spec_for_storage(parsed, owner),
            allocation_timeout=parsed.allocation_timeout,
            kind=Job.Kind.INFERENCE,
        )
        dataset_services.prepare_job(job, parsed.dataset.name)
    return job
