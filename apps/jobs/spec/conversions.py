"""What a valid :class:`~apps.jobs.spec.models.DiLoCoSpec` becomes, and how its errors are reported: field
paths, ``Job.requirements``, and the job envelopes handed to executors (see the package docstring)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from apps.jobs.exceptions import SpecError
from apps.jobs.spec.base import (
    DEFAULT_CHECKPOINT_EVERY,
    OVERLAP_NONE,
    OVERLAP_STREAMING,
    PARAMETER_SERVER_EXECUTOR,
    SCHEDULE_TAGS,
    TRAINER_EXECUTOR,
)
from apps.jobs.spec.models import (
    ConfigSource,
    DiLoCoSpec,
    HuggingFaceSource,
    RoleSpec,
    UploadSource,
    UrlSource,
    WarmupSchedule,
    WarmupStableDecaySchedule,
)

_TAGGED_FIELDS = {"source", "schedule"}


def field_path(location: tuple[str | int, ...], tagged: set[str] = _TAGGED_FIELDS) -> str:
    """``location`` as a dotted path, without the tag element that follows a field in ``tagged`` (a
    discriminated union's)."""
    parts: list[str] = []
    skip_next = False
    for element in location:
        if skip_next:
            skip_next = False
            continue
        parts.append(str(element))
        skip_next = element in tagged
    return ".".join(parts)


def field_errors(error: ValidationError, rename: dict[str, str] | None = None) -> list[dict[str, str]]:
    """Every error of ``error`` as ``{"field", "message"}``; ``rename`` maps spec paths to source paths."""
    found = []
    for line in error.errors(include_url=False):
        path = field_path(tuple(line["loc"]))
        if rename:
            path = _renamed(path, rename)
        message = line["msg"]
        if line["type"] == "extra_forbidden":
            message = "Unknown key."
        found.append({"field": path, "message": message})
    return found


def _renamed(path: str, rename: dict[str, str]) -> str:
    parts = path.split(".") if path else []
    for length in range(len(parts), -1, -1):
        prefix = ".".join(parts[:length])
        if prefix in rename:
            return ".".join(filter(None, [rename[prefix], *parts[length:]]))
    return path


def parse_json(data: dict) -> DiLoCoSpec:
    """Validate a JSON specification (the shape of :class:`DiLoCoSpec`); raise :class:`SpecError` with all errors."""
    if not isinstance(data, dict):
        raise SpecError([{"field": "", "message": "A specification must be a JSON object."}])
    try:
        return DiLoCoSpec.model_validate(data)
    except ValidationError as error:
        raise SpecError(field_errors(error)) from None


# --- what a spec becomes ----------------------------------------------------------------------------------


def to_requirements(spec: DiLoCoSpec) -> dict:
    """The ``Job.requirements`` JSON: per role its minimum resources, executor, public bid and private max."""
    return {
        "trainer": _requirement(spec.trainer, TRAINER_EXECUTOR),
        "parameter_server": {
            **_requirement(spec.parameter_server, PARAMETER_SERVER_EXECUTOR),
            "reachable": spec.parameter_server.reachable,
        },
    }


def _requirement(role: RoleSpec, executor: dict[str, str]) -> dict:
    return {
        "resources": role.resources.model_dump(),
        "executor": dict(executor),
        "bid": role.price.bid,
        "max": role.price.max,
        # Stored only when set: the requirements of jobs that set none stay as they were.
        **({"min_reliability": role.min_reliability} if role.min_reliability else {}),
    }


def source_reference(source: HuggingFaceSource | UrlSource | UploadSource | ConfigSource) -> dict:
    """The bridge Fetch reference of a model or preprocessor source (reference §1.2).

    Uploads and configs have no Hypha reference of their own: the caller must pass one (e.g. a ``uri`` to the
    control plane's file endpoint), so they raise :class:`ValueError` here.
    """
    if isinstance(source, HuggingFaceSource):
        # Hypha writes ``null`` for the default revision; the bridge reads null as "main".
        return {
            "type": "huggingface",
            "repository": source.repository,
            "revision": None if source.revision == "main" else source.revision,
            "filenames": list(source.filenames),
            "token": source.token,
        }
    if isinstance(source, UrlSource):
        return {"type": "uri", "value": source.url}
    raise ValueError(f"a {source.type!r} source needs a reference from the caller")


def _schedule_json(schedule: WarmupSchedule | WarmupStableDecaySchedule) -> dict:
    if isinstance(schedule, WarmupSchedule):
        return {
            "type": SCHEDULE_TAGS[schedule.type],
            "warmup_steps": schedule.warmup_steps,
            "training_steps": schedule.training_steps,
        }
    # Rust emits ``decay_steps`` but Hypha's Python executor reads ``decay_step`` (§9 item 12); both are
    # written so either executor works (unknown keys are ignored by both).
    return {
        "type": "wsd",
        "warmup_steps": schedule.warmup_steps,
        "decay_steps": schedule.decay_steps,
        "decay_step": schedule.decay_steps,
    }


def to_train_job_json(
    spec: DiLoCoSpec,
    *,
    job_id: str,
    data_reference: dict,
    updates_reference: dict,
    results_reference: dict,
    batch_size: int | None = None,
    model_reference: dict | None = None,
    preprocessor_reference: dict | None = None,
) -> dict:
    """The ``{JOB_JSON}`` envelope of a trainer (reference §2.1–2.2), in the original's key order.

    ``data_reference`` is a Fetch (``scheduler``), ``updates_reference`` a Send and ``results_reference`` a
    Receive (``peers``, strategy All); they are inserted as given. ``batch_size`` is the one dispatch allocated
    to this trainer (§6.5), ``spec.batch_size`` when omitted. ``model_reference``/``preprocessor_reference``
    override the reference built from the source; they are required for ``upload`` and ``config`` sources.
    """
    size = spec.batch_size if batch_size is None else batch_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"batch_size must be a positive integer, not {size!r}")
    optimizer = spec.inner_optimizer
    config: dict[str, Any] = {
        "model": {
            "task": spec.model.type,
            "artifact": model_reference
            if model_reference is not None
            else source_reference(spec.model.source),
            "input-names": list(spec.model.input_names),
        },
        "data": data_reference,
        "updates": updates_reference,
        "results": results_reference,
        "optimizer": {
            "learning-rate": optimizer.learning_rate,
            "betas": list(optimizer.betas) if optimizer.betas is not None else None,
            "epsilon": optimizer.epsilon,
            # Ours (only when given, so that a default job's JSON stays exactly Hypha's).
            **({"weight-decay": optimizer.weight_decay} if optimizer.weight_decay is not None else {}),
        },
        "batch_size": size,
        # Ours, for lossy encodings only (Hypha's executors ignore it: they can take part in float32 jobs only).
        **spec.rounds.encoding_json(),
        # Ours, for eager jobs only (Hypha's executors ignore it and wait for each round's result).
        **_overlap_json(spec),
        # Ours, only when not the defaults (Hypha's executors ignore it).
        **({"training": spec.training.model_dump()} if not spec.training.is_default else {}),
    }
    if spec.preprocessor is not None:
        artifact = preprocessor_reference
        if artifact is None:
            artifact = source_reference(spec.preprocessor.source)
        config["preprocessor"] = {
            "task": spec.preprocessor.type,
            "artifact": artifact,
            "input-names": list(spec.preprocessor.input_names),
        }
    if optimizer.schedule is not None:
        config["scheduler"] = _schedule_json(optimizer.schedule)
    return _envelope(job_id, "train", TRAINER_EXECUTOR["name"], config)


def _overlap_json(spec: DiLoCoSpec) -> dict[str, Any]:
    """A trainer's ``overlap`` key: the mode and the outer optimizer an eager trainer's proxy of the
    parameter server's step needs; nothing for ``none``, so that a default job's JSON stays exactly Hypha's."""
    if spec.rounds.overlap == OVERLAP_NONE:
        return {}
    if spec.rounds.overlap == OVERLAP_STREAMING:
        return {
            "overlap": {
                "mode": OVERLAP_STREAMING,
                "fragments": spec.rounds.fragment_count,
                "mix": spec.rounds.streaming_mix,
                # The job's last round syncs every fragment (docs/training.md, "Overlap: streaming").
                "rounds": spec.rounds.update_rounds,
            }
        }
    return {
        "overlap": {
            "mode": spec.rounds.overlap,
            "outer_learning_rate": spec.outer_optimizer.learning_rate,
            "outer_momentum": spec.outer_optimizer.momentum,
        }
    }


def to_aggregate_job_json(
    spec: DiLoCoSpec,
    *,
    job_id: str,
    updates_reference: dict,
    results_reference: dict,
    model_source: dict | None = None,
    evaluation: dict | None = None,
) -> dict:
    """The parameter server's envelope (reference §2.3): receive ``updates``, send ``results``, Nesterov.

    Our parameter server also builds the initial model and evaluates it (docs/training.md), so the envelope
    carries ``model`` (task, source, input names, seed), ``rounds`` and ``eval`` as well; Hypha's keys come
    first and keep their shape. ``model_source`` defaults to the spec's source (a ``config`` source as is).
    """
    source = spec.model.source
    if model_source is None:
        model_source = (
            {"type": "config", "config": dict(source.config)}
            if isinstance(source, ConfigSource)
            else source_reference(source)
        )
    config = {
        "updates": updates_reference,
        "results": results_reference,
        "optimizer": {
            "learning-rate": spec.outer_optimizer.learning_rate,
            "momentum": spec.outer_optimizer.momentum,
        },
        "model": {
            "task": spec.model.type,
            "source": model_source,
            "input-names": list(spec.model.input_names),
            "seed": spec.seed,
        },
        "rounds": {
            "update_rounds": spec.rounds.update_rounds,
            "round_timeout": spec.rounds.round_timeout,
            "weighted": spec.rounds.weighted,
            **spec.rounds.encoding_json(),
            # Ours, for streaming jobs only: round r steps fragment (r − 1) mod fragments alone.
            **(
                {"overlap": OVERLAP_STREAMING, "fragments": spec.rounds.fragment_count}
                if spec.rounds.overlap == OVERLAP_STREAMING
                else {}
            ),
            # Ours (only when not the parameter server's default, so that a default job's JSON stays Hypha's).
            **(
                {"checkpoint_every": spec.rounds.checkpoint_every}
                if spec.rounds.checkpoint_every != DEFAULT_CHECKPOINT_EVERY
                else {}
            ),
            # Ours, only when not the unverified mean: the aggregation rule and its verification.
            **spec.rounds.aggregation_json(),
        },
        "eval": evaluation,
    }
    return _envelope(job_id, "aggregate", PARAMETER_SERVER_EXECUTOR["name"], config)


def _envelope(job_id: str, executor_class: str, name: str, config: dict) -> dict:
    return {
        "job_id": str(job_id),
        "executor": {"class": executor_class, "descriptor": {"name": name}, "config": config},
    }


# Hypha's scheduler TOML is translated in its own module; it builds on the models above.
