"""Hypha's scheduler TOML (``[scheduler.job]``) translated into a :class:`~apps.jobs.spec.DiLoCoSpec`.

Accepts the keys the original reads (reference §7.2) and the unambiguous spellings of its docs (§9 item 8),
and keys of ours marked so below (``model.config``: a model built from a transformers config, as the JSON spec's
``config`` source; ``model.upload``: a file the user uploaded, as its ``upload`` source); error paths name the
TOML keys as the user wrote them. ``examples/`` has a TOML of each kind of job.

A batch inference job (docs/inference.md) is the same job table with ``type = "inference"`` (the table's
``type`` is Hypha's job kind, ``diloco`` by default): :func:`parse_inference_toml` reads it into an
:class:`~apps.jobs.spec.inference.InferenceSpec`, with the training form's model sources, dataset spellings and
``[resources]`` keys (``num_workers``, ``worker``, ``worker_price``), and its own ``[task]`` table.
"""

from __future__ import annotations

import datetime
import tomllib
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from pydantic import ValidationError

from apps.jobs.exceptions import SpecError, SpecUnreadable
from apps.jobs.spec import (
    PARAMETER_SERVER_EXECUTOR,
    TRAINER_EXECUTOR,
    DiLoCoSpec,
    ResourcesSpec,
    TrainingSpec,
    field_errors,
)
from apps.jobs.spec import inference as inference_spec
from apps.jobs.spec.conversions import _renamed
from apps.jobs.spec.inference import INFERENCE_EXECUTOR, MODEL_TASKS, InferenceSpec
from hypha_site.parsers import document_depth, toml_nesting
from worker_daemon.bounded_json import escape_hostile, hostile_strings

_JOB_KEYS = {
    "model", "dataset", "dataset_name", "rounds", "inner_optimizer", "outer_optimizer", "resources", "task"
}  # fmt: skip


def parse_toml(text: str) -> DiLoCoSpec:
    """Validate Hypha's scheduler TOML: its ``[scheduler.job]`` table, or a ``[job]`` or top-level job table.

    Accepts the keys the original reads (reference §7.2) and the unambiguous spellings of its docs
    (``learning_rate``, ``dataset_name``, ``schedule``/``warmup_steps``/``total_steps``, ``[[…worker]]``
    requirement arrays). Error paths name the TOML keys as written. Raises :class:`SpecError`.
    """
    prefix, table = _job_table(_bounded_document(text))
    if table.get("type") == "inference":
        raise SpecError(
            [
                {
                    "field": ".".join(filter(None, [prefix, "type"])),
                    "message": "An inference job: submit it to POST /api/jobs/inference/ (`hypha submit` does).",
                }
            ]
        )
    translation = _TomlTranslation(prefix)
    data = translation.job(table)
    try:
        spec = DiLoCoSpec.model_validate(data)
    except ValidationError as error:
        errors = translation.errors + field_errors(error, translation.rename)
        raise SpecError(errors) from None
    if translation.errors:
        raise SpecError(translation.errors)
    return spec


def parse_inference_toml(text: str) -> InferenceSpec:
    """Validate a batch inference job's TOML: the job table of :func:`parse_toml` with ``type = "inference"``.

    The table holds ``[model]`` (the training form's sources; no ``type``: the task decides how the model is
    loaded), ``dataset``, ``[task]`` (``type`` generate, classify or embed and that task's keys, snake or kebab
    case), ``batch_size``, ``allocation_timeout`` and ``[resources]`` (``num_workers`` the spec's ``workers``,
    ``worker``, ``worker_price``, ``worker_min_reliability``) and ``[verification]``. Raises :class:`SpecError`, paths as written.
    """
    prefix, table = _job_table(_bounded_document(text))
    if table.get("type") != "inference":
        raise SpecError(
            [
                {
                    "field": ".".join(filter(None, [prefix, "type"])),
                    "message": 'An inference job needs type = "inference" in its job table.',
                }
            ]
        )
    translation = _InferenceTranslation(prefix)
    data = translation.inference_job(table)
    try:
        spec = inference_spec.parse_json(data)
    except SpecError as error:
        renamed = [
            {"field": _renamed(item["field"], translation.rename), "message": item["message"]}
            for item in error.errors
        ]
        raise SpecError(translation.errors + renamed) from None
    if translation.errors:
        raise SpecError(translation.errors)
    return spec


def _job_table(document: dict[str, Any]) -> tuple[str, dict]:
    """The job table (``[scheduler.job]``, ``[job]`` or the document itself) and its TOML path."""
    candidates = []
    scheduler = document.get("scheduler")
    if isinstance(scheduler, dict) and isinstance(scheduler.get("job"), dict):
        candidates.append(("scheduler.job", scheduler["job"]))
    if isinstance(document.get("job"), dict):
        candidates.append(("job", document["job"]))
    if not candidates and _JOB_KEYS & document.keys():
        candidates.append(("", document))
    if not candidates:
        raise SpecError([{"field": "scheduler.job", "message": "Missing: no [scheduler.job] table."}])
    if len(candidates) > 1:
        raise SpecError(
            [{"field": "", "message": "Ambiguous: both [scheduler.job] and [job] are present; keep one."}]
        )
    return candidates[0]


def _bounded_document(text: str) -> dict[str, Any]:
    """``tomllib.loads(text)`` within the size and nesting bounds (checked before: tomllib's cost grows with the
    square of a dotted key's length, and it recurses per bracket), its strings storable; else SpecUnreadable (a
    document that cannot be read) or SpecError (strings that cannot be stored, by key)."""
    limit, depth = settings.HYPHA_MAX_TOML_BYTES, settings.HYPHA_MAX_INPUT_DEPTH
    too_deep = f"TOML nested more than {depth} levels deep (tables, arrays and dotted keys)."
    if len(text.encode("utf-8", "surrogatepass")) > limit:
        raise SpecUnreadable(f"The TOML is larger than {limit} bytes.")
    if toml_nesting(text, limit=depth):
        raise SpecUnreadable(too_deep)
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise SpecUnreadable(f"TOML syntax error: {error}") from None
    # Dotted keys inside nested inline tables add up beyond what the scan of one key or one bracket sees.
    if document_depth(document) > depth:
        raise SpecUnreadable(too_deep)
    problems = [
        {"field": ".".join(escape_hostile(str(part)) for part in path), "message": message}
        for path, message in hostile_strings(document)
    ]
    if problems:
        raise SpecError(problems)
    return document


class _TomlTranslation:
    """Rewrites a Hypha job table into the JSON shape of :class:`DiLoCoSpec`.

    Records, for every spec path it produces, the TOML path it came from (``rename``), and collects mistakes
    only the TOML can have (unknown keys, two spellings of one key) in ``errors``.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.rename: dict[str, str] = {"": prefix}
        self.errors: list[dict[str, str]] = []

    def path(self, *keys: str) -> str:
        return ".".join(filter(None, [self.prefix, *keys]))

    def error(self, toml_path: str, message: str) -> None:
        self.errors.append({"field": toml_path, "message": message})

    def take(self, table: dict, toml_keys: tuple[str, ...], spelling: tuple[str, ...], spec_path: str) -> Any:
        """Pop the one of ``spelling`` present in ``table``; remember where ``spec_path`` came from."""
        present = [key for key in spelling if key in table]
        if len(present) > 1:
            self.error(self.path(*toml_keys, present[1]), f"Duplicate of '{present[0]}'; give one.")
        if not present:
            return None
        for key in present[1:]:
            table.pop(key)
        self.rename[spec_path] = self.path(*toml_keys, present[0])
        return table.pop(present[0])

    def unknown(self, table: dict, toml_keys: tuple[str, ...]) -> None:
        for key in table:
            self.error(self.path(*toml_keys, key), "Unknown key.")

    def subtable(self, table: dict, key: str, toml_keys: tuple[str, ...]) -> dict | None:
        value = table.pop(key, None)
        if value is None:
            return None
        if not isinstance(value, dict):
            self.error(self.path(*toml_keys, key), "Must be a table.")
            return None
        return dict(value)

    def job(self, table: dict) -> dict:
        table = dict(table)
        data: dict[str, Any] = {}
        kind = table.pop("type", "diloco")
        if kind != "diloco":
            self.error(self.path("type"), "The only job type is 'diloco'.")
        model = self.subtable(table, "model", ())
        self.rename["model"] = self.path("model")
        data["model"] = self.artifact(model, "model") if model is not None else None
        if data["model"] is None:
            data.pop("model")
        preprocessor = self.subtable(table, "preprocessor", ())
        if preprocessor is not None:
            self.rename["preprocessor"] = self.path("preprocessor")
            data["preprocessor"] = self.artifact(preprocessor, "preprocessor")
        self.dataset(table, data)
        for name in ("inner_optimizer", "outer_optimizer"):
            optimizer = self.subtable(table, name, ())
            if optimizer is not None:
                data[name] = self.optimizer(optimizer, name)
        rounds = self.subtable(table, "rounds", ())
        if rounds is not None:
            self.rename["rounds"] = self.path("rounds")
            data["rounds"] = {}
            for key in (
                "update_rounds",
                "inner_steps",
                "avg_samples_between_updates",
                "max_batch_size",
                "round_timeout",
                "weighted",
                # Ours: how pseudo-gradients and results travel (float32, float16, bfloat16, int8).
                "encoding",
                "encoding_block_size",
                # Ours: the parameter server uploads its full weights every this many rounds.
                "checkpoint_every",
                # Ours: how trainers overlap a round's communication with computation (none, eager,
                # streaming), and streaming's fragments of the model and mixing factor.
                "overlap",
                "fragments",
                "mix",
                # Ours: how the parameter server combines a round's updates, and its verification of each.
                "aggregation",
                "clip_factor",
                "trim_fraction",
                "verification",
                # Ours: roll a round back when its held-out loss rises by more than this factor.
                "discard_if_loss_rises",
            ):
                # One spelling for a key without "_" (``weighted``): two equal ones read as a duplicate.
                spellings = tuple(dict.fromkeys((key, key.replace("_", "-"))))
                value = self.take(rounds, ("rounds",), spellings, f"rounds.{key}")
                if value is not None:
                    data["rounds"][key] = value
            self.unknown(rounds, ("rounds",))
        for key in ("batch_size", "seed", "allocation_timeout", "max_cost"):
            if key in table:
                data[key] = self.take(table, (), (key,), key)
        evaluation = self.subtable(table, "evaluation", ())
        if evaluation is not None:
            # Ours, not Hypha's: held-out slices whose loss the parameter server reports every round.
            self.rename["evaluation"] = self.path("evaluation")
            data["evaluation"] = evaluation
        training = self.subtable(table, "training", ())
        if training is not None:
            self.training(training, data)
        resources = self.subtable(table, "resources", ())
        if resources is not None:
            self.resources(resources, data)
        self.unknown(table, ())
        return data

    def artifact(self, table: dict, name: str) -> dict:
        """A ``[model]``/``[preprocessor]`` table: ``repository``…, ``url`` or (ours) ``config`` or ``upload``, plus
        ``type`` and input names."""
        keys = (name,)
        result: dict[str, Any] = {}
        if "config" in table:
            result["source"] = self.config_source(table, name)
        elif "upload" in table:
            result["source"] = self.upload_source(table, name)
        elif "url" in table and "repository" not in table:
            result["source"] = {"type": "url", "url": self.take(table, keys, ("url",), f"{name}.source.url")}
        else:
            source: dict[str, Any] = {"type": "huggingface"}
            self.rename[f"{name}.source"] = self.path(name)
            for key in ("repository", "revision", "filenames", "token"):
                value = self.take(table, keys, (key,), f"{name}.source.{key}")
                if value is not None:
                    source[key] = value
            result["source"] = source
        for key, spellings in (("type", ("type",)), ("input_names", ("input_names", "input-names"))):
            value = self.take(table, keys, spellings, f"{name}.{key}")
            if value is not None:
                result[key] = value
        self.unknown(table, keys)
        return result

    def config_source(self, table: dict, name: str) -> dict:
        """Ours: ``config``, a transformers ``config.json`` as a table (inline or ``[….model.config]``), for the
        JSON spec's ``{"type": "config", "config": {...}}``: the model is built from it and trained from scratch.
        """
        where = self.path(name, "config")
        others = [key for key in ("repository", "url", "upload") if key in table]
        if others:
            self.error(where, "Give one of repository, url, upload and config.")
            for key in others:
                table.pop(key)
        # Errors of the source (a wrong tag for a preprocessor) and of the config are reported at ``config``.
        self.rename[f"{name}.source"] = where
        config = self.take(table, (name,), ("config",), f"{name}.source.config")
        if isinstance(config, dict):
            for path in _dates_and_times(config):
                self.error(
                    ".".join([where, *path]),
                    "A TOML date or time has no JSON equivalent; write it as a string.",
                )
        return {"type": "config", "config": config}

    def upload_source(self, table: dict, name: str) -> dict:
        """Ours: ``upload = "<id or file name>"``, a file the user uploaded (``POST /api/uploads/``), for the
        JSON spec's ``{"type": "upload", "file": ...}``."""
        where = self.path(name, "upload")
        others = [key for key in ("repository", "url", "revision", "filenames", "token") if key in table]
        if others:
            self.error(
                where, f"Give one of repository, url, upload and config ('{others[0]}' is not for an upload)."
            )
            for key in others:
                table.pop(key)
        self.rename[f"{name}.source"] = where
        return {"type": "upload", "file": self.take(table, (name,), ("upload",), f"{name}.source.file")}

    def dataset(self, table: dict, data: dict) -> None:
        """``dataset.dataset`` (the original), ``dataset.name``, or the docs' ``dataset_name``."""
        name = None
        if "dataset_name" in table:
            name = self.take(table, (), ("dataset_name",), "dataset.name")
        value = table.pop("dataset", None)
        if isinstance(value, str):
            if name is not None:
                self.error(self.path("dataset"), "Duplicate of 'dataset_name'; give one.")
            self.rename["dataset.name"] = self.path("dataset")
            name = value
        elif isinstance(value, dict):
            value = dict(value)
            self.rename["dataset"] = self.path("dataset")
            spellings = ("dataset", "name", "dataset_name")
            inner = self.take(value, ("dataset",), spellings, "dataset.name")
            if inner is not None and name is not None:
                self.error(self.path("dataset"), "Duplicate of 'dataset_name'; give one.")
            name = inner if inner is not None else name
            self.unknown(value, ("dataset",))
        elif value is not None:
            self.error(self.path("dataset"), "Must be a table or a string.")
        if name is not None or value is not None:
            data["dataset"] = {"name": name} if name is not None else {}

    def optimizer(self, table: dict, name: str) -> dict:
        keys = (name,)
        self.rename[name] = self.path(name)
        result: dict[str, Any] = {}
        # ``weight_decay``: ours (AdamW's decoupled weight decay; the inner optimizer only).
        for key in ("learning_rate", "betas", "epsilon", "momentum", "weight_decay"):
            spellings = (key.replace("_", "-"), key) if "_" in key else (key,)
            value = self.take(table, keys, spellings, f"{name}.{key}")
            if value is not None:
                result[key] = value
        if name == "inner_optimizer":
            schedule = self.schedule(table, keys)
            if schedule is not None:
                result["schedule"] = schedule
        self.unknown(table, keys)
        return result

    def schedule(self, table: dict, keys: tuple[str, ...]) -> dict | None:
        """A ``schedule`` table, or the docs' ``schedule = "cosine"`` with ``warmup_steps``/``total_steps``."""
        value = table.pop("schedule", None)
        flat = {key: table.pop(key) for key in ("warmup_steps", "total_steps", "decay_steps") if key in table}
        if value is None:
            if flat:
                self.error(self.path(*keys, next(iter(flat))), "Needs 'schedule' (cosine, linear or wsd).")
            return None
        if isinstance(value, str):
            self.rename["inner_optimizer.schedule.type"] = self.path(*keys, "schedule")
            # The flat form's keys sit beside ``schedule``; a missing one is reported there too.
            for key in ("warmup_steps", "total_steps", "decay_steps"):
                target = "training_steps" if key == "total_steps" else key
                self.rename[f"inner_optimizer.schedule.{target}"] = self.path(*keys, key)
            value = {"type": value, **flat}
        elif isinstance(value, dict):
            self.rename["inner_optimizer.schedule"] = self.path(*keys, "schedule")
            value = dict(value)
            for key in flat:
                self.error(self.path(*keys, key), "Give it inside the 'schedule' table.")
        else:
            self.error(self.path(*keys, "schedule"), "Must be a string or a table.")
            return None
        if "total_steps" in value:
            if "training_steps" in value:
                self.error(self.path(*keys, "total_steps"), "Duplicate of 'training_steps'; give one.")
            value["training_steps"] = value.pop("total_steps")
        # The executor's own tags are accepted too.
        if isinstance(value.get("type"), str):
            value["type"] = value["type"].removesuffix("-with-warmup")
        return value

    def training(self, table: dict, data: dict) -> None:
        """Ours, not Hypha's: the ``[….training]`` knobs (docs/configuration.md, "Training knobs"), in snake or
        kebab case."""
        self.rename["training"] = self.path("training")
        data["training"] = {}
        for key in TrainingSpec.model_fields:
            value = self.take(table, ("training",), (key, key.replace("_", "-")), f"training.{key}")
            if value is not None:
                data["training"][key] = value
        self.unknown(table, ("training",))

    def resources(self, table: dict, data: dict) -> None:
        keys = ("resources",)
        count = self.take(table, keys, ("num_workers",), "num_trainers")
        if count is not None:
            data["num_trainers"] = count
        self.pools(table, data)
        for toml_role, role in (("worker", "trainer"), ("parameter_server", "parameter_server")):
            block: dict[str, Any] = {}
            value = table.pop(toml_role, None)
            if isinstance(value, dict):
                self.rename[f"{role}.resources"] = self.path(*keys, toml_role)
                block["resources"] = dict(value)
            elif isinstance(value, list):
                block["resources"] = self.requirement_list(value, (*keys, toml_role), role)
            elif value is not None:
                self.error(self.path(*keys, toml_role), "Must be a table.")
            price = table.pop(f"{toml_role}_price", None)
            if isinstance(price, dict):
                self.rename[f"{role}.price"] = self.path(*keys, f"{toml_role}_price")
                block["price"] = dict(price)
            elif price is not None:
                self.error(self.path(*keys, f"{toml_role}_price"), "Must be a table.")
            # Ours (Hypha has no reputation): the role's minimum reliability (docs/architecture.md, Reputation).
            reliability = table.pop(f"{toml_role}_min_reliability", None)
            if reliability is not None:
                self.rename[f"{role}.min_reliability"] = self.path(*keys, f"{toml_role}_min_reliability")
                block["min_reliability"] = reliability
            if block:
                data[role] = block
        self.unknown(table, keys)

    def pools(self, table: dict, data: dict) -> None:
        """Hypha's ``worker_pool`` (``min``, ``target``, ``grace_ms``) as the spec's ``trainers`` pool; its
        ``parameter_server_pool`` is accepted with one parameter server (``min = target = 1``) only."""
        keys = ("resources", "worker_pool")
        pool = self.subtable(table, "worker_pool", ("resources",))
        if pool is not None:
            trainers: dict[str, Any] = {}
            for key in ("min", "target"):
                if key in pool:
                    self.rename[f"trainers.{key}"] = self.path(*keys, key)
                    trainers[key] = pool.pop(key)
            if "grace_ms" in pool:
                self.rename["trainers.grace"] = self.path(*keys, "grace_ms")
                grace = pool.pop("grace_ms")
                trainers["grace"] = grace / 1000 if isinstance(grace, int | float) else grace
            self.unknown(pool, keys)
            self.rename["trainers"] = self.path(*keys)
            data["trainers"] = trainers
        keys = ("resources", "parameter_server_pool")
        server_pool = self.subtable(table, "parameter_server_pool", ("resources",))
        if server_pool is not None:
            for key in ("min", "target"):
                if key in server_pool and server_pool.pop(key) != 1:
                    self.error(self.path(*keys, key), "A job has exactly one parameter server: must be 1.")
            server_pool.pop("grace_ms", None)
            self.unknown(server_pool, keys)

    def requirement_list(self, entries: list, keys: tuple[str, ...], role: str) -> dict:
        """The docs' ``[[resources.worker]]`` arrays: ``{type = "GPU", min = 10.0}`` or ``{kind = <executor>}``."""
        resources: dict[str, Any] = {}
        executor = {"trainer": TRAINER_EXECUTOR, "worker": INFERENCE_EXECUTOR}.get(
            role, PARAMETER_SERVER_EXECUTOR
        )
        for index, entry in enumerate(entries):
            where = self.path(*keys) + f".{index}"
            if not isinstance(entry, dict):
                self.error(where, "Must be a table.")
            elif set(entry) == {"kind"}:
                if entry["kind"] != executor["name"]:
                    self.error(f"{where}.kind", f"The {role} executor is '{executor['name']}'.")
            elif set(entry) == {"type", "min"} and str(entry["type"]).lower() in ResourcesSpec.model_fields:
                name = str(entry["type"]).lower()
                self.rename[f"{role}.resources.{name}"] = f"{where}.min"
                resources[name] = entry["min"]
            else:
                self.error(where, "Expected {type = GPU|CPU|Memory|Storage, min = number} or {kind = ...}.")
        return resources


class _InferenceTranslation(_TomlTranslation):
    """Rewrites an inference job table (``type = "inference"``) into the JSON shape of :class:`InferenceSpec`."""

    def inference_job(self, table: dict) -> dict:
        table = dict(table)
        table.pop("type")
        data: dict[str, Any] = {}
        model = self.subtable(table, "model", ())
        if model is not None:
            self.rename["model"] = self.path("model")
            if "type" in model:
                model.pop("type")
                tasks = ", ".join(f"{task}: {loaded}" for task, loaded in MODEL_TASKS.items())
                self.error(self.path("model", "type"), f"The task decides how the model is loaded ({tasks}).")
            data["model"] = self.artifact(model, "model")
        self.dataset(table, data)
        task = self.subtable(table, "task", ())
        if task is not None:
            self.rename["task"] = self.path("task")
            data["task"] = {}
            for key in ("type", "max_new_tokens", "temperature", "seed", "top_k"):
                spellings = tuple(dict.fromkeys((key, key.replace("_", "-"))))
                value = self.take(task, ("task",), spellings, f"task.{key}")
                if value is not None:
                    data["task"][key] = value
            data["task"].update(task)  # unknown keys: the spec names them
        for key in ("batch_size", "allocation_timeout"):
            if key in table:
                data[key] = self.take(table, (), (key,), key)
        verification = self.subtable(table, "verification", ())
        if verification is not None:
            # A share of the slices computed twice and compared (docs/inference.md, "Verification").
            self.rename["verification"] = self.path("verification")
            data["verification"] = verification
        resources = self.subtable(table, "resources", ())
        if resources is not None:
            self.inference_resources(resources, data)
        self.unknown(table, ())
        return data

    def inference_resources(self, table: dict, data: dict) -> None:
        keys = ("resources",)
        count = self.take(table, keys, ("num_workers",), "workers")
        if count is not None:
            data["workers"] = count
        block: dict[str, Any] = {}
        value = table.pop("worker", None)
        if isinstance(value, dict):
            self.rename["worker.resources"] = self.path(*keys, "worker")
            block["resources"] = dict(value)
        elif isinstance(value, list):
            block["resources"] = self.requirement_list(value, (*keys, "worker"), "worker")
        elif value is not None:
            self.error(self.path(*keys, "worker"), "Must be a table.")
        price = table.pop("worker_price", None)
        if isinstance(price, dict):
            self.rename["worker.price"] = self.path(*keys, "worker_price")
            block["price"] = dict(price)
        elif price is not None:
            self.error(self.path(*keys, "worker_price"), "Must be a table.")
        reliability = table.pop("worker_min_reliability", None)
        if reliability is not None:
            self.rename["worker.min_reliability"] = self.path(*keys, "worker_min_reliability")
            block["min_reliability"] = reliability
        if block:
            data["worker"] = block
        for key in list(table):
            if key.startswith("parameter_server"):
                table.pop(key)
                self.error(self.path(*keys, key), "An inference job has no parameter server.")
        self.unknown(table, keys)


def _dates_and_times(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The paths of TOML's dates and times in ``value`` (tables and arrays walked): JSON has no such values."""
    if isinstance(value, datetime.date | datetime.time):
        yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _dates_and_times(item, (*path, str(key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _dates_and_times(item, (*path, str(index)))
