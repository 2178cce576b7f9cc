"""The batch inference job specification (docs/inference.md): a model, a registered dataset, a task and the
workers that run it, validated as strictly as the DiLoCo spec, and what it becomes.

A valid :class:`InferenceSpec` becomes:

* :func:`to_requirements` — the ``Job.requirements`` JSON of its one role, ``inference``;
* :func:`to_job_json` — the envelope handed to the ``inference`` executor, in the shape of the training
  envelopes (``{"job_id", "executor": {"class", "descriptor", "config"}}``).

Like the rest of the package it needs neither Django nor a database.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from apps.jobs.exceptions import SpecError
from apps.jobs.spec.base import (
    DEFAULT_ALLOCATION_TIMEOUT,
    MAX_ALLOCATION_TIMEOUT,
    MIN_ALLOCATION_TIMEOUT,
    Float,
    Integer,
    NonEmptyString,
    _Spec,
)
from apps.jobs.spec.conversions import _requirement, field_path
from apps.jobs.spec.models import DatasetSpec, ModelSource, RoleSpec

INFERENCE_EXECUTOR = {"class": "inference", "name": "batch-inference"}
MAX_INFERENCE_WORKERS = 64
MAX_NEW_TOKENS = 1024
#: The model task (a ModelType, as the trainer's ``model.task``) each inference task loads its model as.
MODEL_TASKS = {"generate": "causal-lm", "classify": "sequence-classification", "embed": "feature-extraction"}


class GenerateTask(_Spec):
    """Generate up to ``max_new_tokens`` tokens after each row (a causal LM): greedy at temperature 0, else
    sampled with a generator seeded by ``seed`` + the slice's index (so a slice's result is reproducible)."""

    type: Literal["generate"]
    max_new_tokens: Integer = Field(default=16, ge=1, le=MAX_NEW_TOKENS)
    temperature: Float = Field(default=0.0, ge=0, le=100)
    seed: Integer = Field(default=0, ge=0, le=2**31 - 1)


class ClassifyTask(_Spec):
    """Classify each row (a sequence-classification model): every logit (``top_k`` null) or the ``top_k``
    largest with their class indices."""

    type: Literal["classify"]
    top_k: Integer | None = Field(default=None, ge=1, le=100_000)


class EmbedTask(_Spec):
    """Embed each row: the mean of the model's last hidden state over the attention mask."""

    type: Literal["embed"]


InferenceTask = Annotated[GenerateTask | ClassifyTask | EmbedTask, Field(discriminator="type")]


class InferenceModelSpec(_Spec):
    """The model to run: where it comes from (the training spec's sources) and the slice tensors it takes."""

    source: ModelSource
    input_names: list[NonEmptyString] = Field(
        default_factory=lambda: ["input_ids"], min_length=1, max_length=64
    )


class VerificationSpec(_Spec):
    """Golem's verification (docs/inference.md, "Verification"): ``fraction`` of the slices, chosen from the
    job's id and the slice's index, are computed by two different workers and compared — generated tokens
    exactly, tensors within ``tolerance`` — and a disagreement is settled by a third."""

    fraction: Float = Field(default=0.0, ge=0, le=1, description="Share of slices computed twice (0–1).")
    tolerance: Float = Field(
        default=1e-4,
        ge=0,
        le=1e6,
        description="Largest difference |a − b| ≤ tolerance + tolerance·|b| between two workers' tensors "
        "that still agree (JSON Lines results must be equal).",
    )


class InferenceSpec(_Spec):
    """A batch inference job: the model, the dataset whose slices are the units of work, the task, and the
    ``workers`` that process slices in parallel, each with what ``worker`` asks of it and pays."""

    model: InferenceModelSpec
    dataset: DatasetSpec
    task: InferenceTask
    batch_size: Integer = Field(default=8, ge=1, le=100_000, description="Rows per forward pass.")
    workers: Integer = Field(default=1, ge=1, le=MAX_INFERENCE_WORKERS)
    worker: RoleSpec = Field(default_factory=RoleSpec)
    allocation_timeout: Float = Field(
        default=DEFAULT_ALLOCATION_TIMEOUT,
        ge=MIN_ALLOCATION_TIMEOUT,
        le=MAX_ALLOCATION_TIMEOUT,
        description="Seconds after submission by which every worker must have been leased once, or the job "
        "gives back the leases it holds and fails.",
    )
    verification: VerificationSpec = Field(default_factory=VerificationSpec)


# --- parsing ----------------------------------------------------------------------------------------------

#: Fields whose next error location element is a discriminated union's tag, dropped from reported paths.
_TAGGED_FIELDS = {"source", "task"}


def parse_json(data: Any) -> InferenceSpec:
    """Validate a JSON inference specification; raise :class:`SpecError` with every error at once."""
    if not isinstance(data, dict):
        raise SpecError([{"field": "", "message": "A specification must be a JSON object."}])
    try:
        parsed = InferenceSpec.model_validate(data)
    except ValidationError as error:
        errors = []
        for line in error.errors(include_url=False):
            message = "Unknown key." if line["type"] == "extra_forbidden" else line["msg"]
            errors.append({"field": field_path(tuple(line["loc"]), _TAGGED_FIELDS), "message": message})
        raise SpecError(errors) from None
    # A verified slice needs a second worker to compute it (and a third to settle a disagreement).
    if parsed.verification.fraction > 0 and parsed.workers < 2:
        raise SpecError(
            [
                {
                    "field": "verification.fraction",
                    "message": "Verification needs at least 2 workers (3 to settle a disagreement).",
                }
            ]
        )
    return parsed


# --- what a spec becomes ----------------------------------------------------------------------------------


def to_requirements(spec: InferenceSpec) -> dict:
    """The ``Job.requirements`` JSON: the ``inference`` role's resources, executor, bid and max."""
    return {"inference": _requirement(spec.worker, INFERENCE_EXECUTOR)}


def task_json(spec: InferenceSpec) -> dict:
    return spec.task.model_dump(mode="json")


def to_job_json(
    spec: InferenceSpec, *, job_id: str, model_artifact: dict, data_reference: dict, results_reference: dict
) -> dict:
    """The envelope of an inference task (docs/inference.md, "The job JSON"). ``model_artifact`` is the Fetch
    reference of the model, ``data_reference`` the ``scheduler`` Fetch of the slices and ``results_reference``
    the Send of the results; they are inserted as given."""
    config = {
        "model": {"task": MODEL_TASKS[spec.task.type], "artifact": model_artifact},
        "data": data_reference,
        "results": results_reference,
        "task": task_json(spec),
        "batch_size": spec.batch_size,
        "input_names": list(spec.model.input_names),
    }
    return {
        "job_id": str(job_id),
        "executor": {
            "class": INFERENCE_EXECUTOR["class"],
            "descriptor": {"name": INFERENCE_EXECUTOR["name"]},
            "config": config,
        },
    }
