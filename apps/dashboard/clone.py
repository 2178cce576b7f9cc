"""Clone a job: the submit form's fields filled in from a job's stored spec (``/jobs/new/?clone=<id>``).

:func:`initial_for` is the inverse of :meth:`apps.dashboard.forms.DiLoCoJobForm.specification`; what the fields
cannot say (a Hugging Face or uploaded model, an optimizer's betas, a schedule, …) :func:`lost_settings` names,
so the page can warn that resubmitting the form would give those their defaults.
"""

from __future__ import annotations

import json

from apps.dashboard.forms import DiLoCoJobForm
from apps.jobs import services as job_services
from apps.jobs.models import Job

#: Form field → the path of its value in the stored spec.
SPEC_PATH_OF_FIELD = {
    "model_type": ("model", "type"),
    "dataset": ("dataset", "name"),
    "num_trainers": ("num_trainers",),
    "trainers_min": ("trainers", "min"),
    "trainers_grace": ("trainers", "grace"),
    "batch_size": ("batch_size",),
    "update_rounds": ("rounds", "update_rounds"),
    "inner_steps": ("rounds", "inner_steps"),
    "round_timeout": ("rounds", "round_timeout"),
    "encoding": ("rounds", "encoding"),
    "encoding_block_size": ("rounds", "encoding_block_size"),
    "overlap": ("rounds", "overlap"),
    "fragments": ("rounds", "fragments"),
    "mix": ("rounds", "mix"),
    "aggregation": ("rounds", "aggregation"),
    "clip_factor": ("rounds", "clip_factor"),
    "trim_fraction": ("rounds", "trim_fraction"),
    "max_cost": ("max_cost",),
    "inner_learning_rate": ("inner_optimizer", "learning_rate"),
    "outer_learning_rate": ("outer_optimizer", "learning_rate"),
    "outer_momentum": ("outer_optimizer", "momentum"),
    "seed": ("seed",),
    "weight_decay": ("inner_optimizer", "weight_decay"),
    **{key: ("training", key) for key in ("max_grad_norm", "gradient_accumulation_steps", "mixed_precision")},
    **{key: ("training", key) for key in ("gradient_checkpointing", "dataloader_workers", "processes")},
    **{
        f"{prefix}_{key}": (role, group, key)
        for role, prefix in (("trainer", "trainer"), ("parameter_server", "ps"))
        for group, keys in (("resources", ("cpu", "memory", "storage", "gpu")), ("price", ("bid", "max")))
        for key in keys
    },
}

_MISSING = object()


def _at(spec, path):
    for key in path:
        if not isinstance(spec, dict) or key not in spec:
            return _MISSING
        spec = spec[key]
    return spec


def initial_for(job: Job) -> dict:
    """The fields' initial values that describe ``job``'s spec (fields it does not mention keep the form's
    defaults); the name is the job's, marked as a copy."""
    spec = job.spec if isinstance(job.spec, dict) else {}
    initial: dict = {"name": f"{job.name or 'job'} (copy)"[:200]}
    for field, path in SPEC_PATH_OF_FIELD.items():
        value = _at(spec, path)
        if value is not _MISSING:
            initial[field] = value
    source = _at(spec, ("model", "source"))
    if isinstance(source, dict) and source.get("type") == "config" and isinstance(source.get("config"), dict):
        initial["model_config"] = json.dumps(source["config"], indent=2)
    input_names = _at(spec, ("model", "input_names"))
    if isinstance(input_names, list):
        initial["input_names"] = ", ".join(str(name) for name in input_names)
    # The select says only on, off or the rule's default; other thresholds are named by lost_settings.
    enabled = _at(spec, ("rounds", "verification", "enabled"))
    if enabled is True or enabled is False:
        initial["verification"] = "on" if enabled else "off"
    evaluation = spec.get("evaluation")
    if isinstance(evaluation, dict) and evaluation.get("holdout"):
        initial["holdout"] = evaluation["holdout"]
        if evaluation.get("batch_size") is not None:
            initial["eval_batch_size"] = evaluation["batch_size"]
    elif "evaluation" in spec:
        initial["holdout"] = None
    return initial


def form_data(initial: dict, *, prefix: str = "job") -> dict:
    """``initial`` as a browser would post the fields form (the form's own defaults for the rest)."""
    form = DiLoCoJobForm(owner=None, prefix=prefix, initial=initial)
    data = {"source": "fields"}
    for name, field in form.fields.items():
        value = form.get_initial_for_field(field, name)
        data[f"{prefix}-{name}"] = "" if value is None else value
    return data


def _differences(stored, produced, path: str = "") -> list[str]:
    if isinstance(stored, dict) and isinstance(produced, dict):
        found = []
        for key in sorted(set(stored) | set(produced)):
            found += _differences(stored.get(key), produced.get(key), f"{path}.{key}" if path else key)
        return found
    return [] if stored == produced else [path]


def lost_settings(job: Job, initial: dict, owner) -> list[str]:
    """The spec's dotted paths that resubmitting the pre-filled form unchanged would not reproduce (empty when
    the form says all of it, or when the form would not validate as it is, e.g. its dataset is gone)."""
    form = DiLoCoJobForm(form_data(initial), owner=owner, prefix="job")
    if not form.is_valid():
        return []
    produced = job_services.spec_for_storage(form.parsed, owner)
    return _differences(job.spec if isinstance(job.spec, dict) else {}, produced)
