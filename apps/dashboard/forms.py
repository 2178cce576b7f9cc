"""The submit-a-job forms: the DiLoCo specification as fields with defaults, or a Hypha scheduler TOML.

The fields only parse types (a number is a number); every rule of the specification is checked by
:func:`apps.jobs.spec.parse_json` / :func:`~apps.jobs.spec.parse_toml` and
:func:`apps.jobs.services.training_problems` — the same checks as ``POST /api/jobs/diloco/`` — and each error
is put next to the field it is about (:data:`FIELD_OF_PATH` maps the spec's dotted paths to fields).
"""

from __future__ import annotations

import json
from collections import defaultdict

from django import forms

from apps.jobs import services as job_services
from apps.jobs import spec as job_spec
from apps.jobs.exceptions import SpecError
from apps.jobs.spec.base import MAX_TRAINER_PROCESSES
from apps.jobs.spec.rounds import AGGREGATION_MEAN, AGGREGATIONS
from hypha_tensors.fragments import DEFAULT_FRAGMENTS, MAX_FRAGMENTS, MIN_FRAGMENTS

#: A tiny GPT-2 trained from scratch on bytes (bench/cluster.py's TINY_GPT2): trains on a CPU.
TINY_GPT2 = {
    "model_type": "gpt2",
    "vocab_size": 256,
    "n_positions": 128,
    "n_embd": 128,
    "n_layer": 2,
    "n_head": 4,
    "bos_token_id": 0,
    "eos_token_id": 0,
}

#: The spec's dotted paths (their longest matching prefix) → the form field an error is shown next to.
FIELD_OF_PATH = {
    "name": "name",
    "model": "model_config",
    "model.source": "model_config",
    "model.type": "model_type",
    "model.input_names": "input_names",
    "dataset": "dataset",
    "inner_optimizer": "inner_learning_rate",
    "inner_optimizer.learning_rate": "inner_learning_rate",
    "outer_optimizer": "outer_learning_rate",
    "outer_optimizer.learning_rate": "outer_learning_rate",
    "outer_optimizer.momentum": "outer_momentum",
    "rounds": "inner_steps",
    "rounds.update_rounds": "update_rounds",
    "rounds.inner_steps": "inner_steps",
    "rounds.round_timeout": "round_timeout",
    "rounds.encoding": "encoding",
    "rounds.encoding_block_size": "encoding_block_size",
    "rounds.overlap": "overlap",
    "rounds.fragments": "fragments",
    "rounds.mix": "mix",
    "rounds.aggregation": "aggregation",
    "rounds.clip_factor": "clip_factor",
    "rounds.trim_fraction": "trim_fraction",
    "rounds.verification": "verification",
    "max_cost": "max_cost",
    "batch_size": "batch_size",
    "num_trainers": "num_trainers",
    "trainers": "trainers_min",
    "trainers.min": "trainers_min",
    "trainers.target": "num_trainers",
    "trainers.grace": "trainers_grace",
    "inner_optimizer.weight_decay": "weight_decay",
    "training": "gradient_accumulation_steps",
    "training.max_grad_norm": "max_grad_norm",
    "training.gradient_accumulation_steps": "gradient_accumulation_steps",
    "training.mixed_precision": "mixed_precision",
    "training.gradient_checkpointing": "gradient_checkpointing",
    "training.dataloader_workers": "dataloader_workers",
    "training.processes": "processes",
    "evaluation": "holdout",
    "evaluation.holdout": "holdout",
    "evaluation.batch_size": "eval_batch_size",
    "seed": "seed",
    **{
        f"{role}.{group}.{key}": f"{prefix}_{key}"
        for role, prefix in (("trainer", "trainer"), ("parameter_server", "ps"))
        for group, keys in (("resources", ("cpu", "memory", "storage", "gpu")), ("price", ("bid", "max")))
        for key in keys
    },
}


def field_for(path: str, fields) -> str | None:
    """The form field of a spec error's dotted ``path`` (``None``: a non-field error)."""
    parts = path.split(".") if path else []
    for length in range(len(parts), 0, -1):
        field = FIELD_OF_PATH.get(".".join(parts[:length]))
        if field is not None and field in fields:
            return field
    return None


def _number(label: str, initial: float, help_text: str = "", *, integer: bool = False, required=True):
    field_class = forms.IntegerField if integer else forms.FloatField
    widget = forms.NumberInput(attrs={"step": "1" if integer else "any"})
    return field_class(label=label, initial=initial, help_text=help_text, required=required, widget=widget)


class _SpecForm(forms.Form):
    """A form whose valid data becomes a :class:`~apps.jobs.spec.DiLoCoSpec`, checked like the REST API."""

    name = forms.CharField(
        label="Name", max_length=200, required=False, help_text="a label for you (optional)"
    )

    def __init__(self, *args, owner, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.owner = owner
        self.parsed: job_spec.DiLoCoSpec | None = None

    def parse(self) -> job_spec.DiLoCoSpec:
        raise NotImplementedError

    def clean(self):
        cleaned = super().clean()
        # Every mistake at once, as the API reports them: the spec is checked without the fields whose value
        # could not be read (not JSON, not a number), and what it then says about those fields is left out —
        # each already shows its own error.
        unreadable = set(self.errors)
        try:
            parsed = self.parse()
        except SpecError as error:
            for item in error.errors:
                if field_for(item["field"], self.fields) not in unreadable:
                    self._spec_error(item["field"], item["message"])
            return cleaned
        problems = job_services.training_problems(parsed, self.owner)
        for path, messages in problems.items():
            for message in messages:
                if field_for(path, self.fields) not in unreadable:
                    self._spec_error(path, message)
        if not problems and not unreadable:
            self.parsed = parsed
        return cleaned

    def _spec_error(self, path: str, message: str) -> None:
        self.add_error(field_for(path, self.fields), message)


class DiLoCoJobForm(_SpecForm):
    """The DiLoCo specification as fields; the defaults train a tiny GPT-2 on a CPU in minutes."""

    model_config = forms.CharField(
        label="Model config (transformers config.json)",
        initial=json.dumps(TINY_GPT2, indent=2),
        widget=forms.Textarea(attrs={"rows": 10, "spellcheck": "false", "class": "code"}),
        help_text="trained from scratch; the default is a 0.45 M-parameter GPT-2 over bytes",
    )
    model_type = forms.ChoiceField(
        label="Model type", choices=[(value, value) for value in job_spec.MODEL_TYPES], initial="causal-lm"
    )
    input_names = forms.CharField(
        label="Input names",
        initial="input_ids, labels",
        help_text="batch keys the model takes, comma-separated",
    )
    dataset = forms.ChoiceField(label="Dataset", choices=(), help_text="registered by a data node")
    num_trainers = _number("Trainers", 2, "with a minimum below: the pool's target", integer=True)
    # An elastic pool (docs/training.md, "Elastic pools"): empty, every trainer must be leased before training
    # starts; the target is "Trainers" (one field: the spec refuses a target that differs from num_trainers).
    trainers_min = _number(
        "Minimum trainers",
        None,
        "elastic pool: training starts once this many trainers hold leases, grows toward the target and goes "
        "on while at least this many remain (empty: no pool, all of them)",
        integer=True,
        required=False,
    )
    trainers_grace = _number(
        "Grace",
        None,
        "elastic pool: seconds the pool may stay below its minimum before the job pauses (empty: 0)",
        required=False,
    )
    batch_size = _number("Batch size", 16, "per trainer", integer=True)
    update_rounds = _number("Rounds", 10, "outer rounds", integer=True)
    inner_steps = _number("Inner steps (H)", 50, "optimizer steps per trainer per round", integer=True)
    round_timeout = _number("Round timeout", 120.0, "seconds the parameter server waits for stragglers")
    encoding = forms.ChoiceField(
        label="Encoding",
        choices=[
            ("float32", "float32 (exact)"),
            ("float16", "float16 (½ the bytes)"),
            ("bfloat16", "bfloat16 (½ the bytes)"),
            ("int8", "int8 (¼ the bytes)"),
        ],
        initial="float32",
        help_text="how pseudo-gradients and results travel; the lossy ones carry their rounding over "
        "(error feedback)",
    )
    encoding_block_size = _number(
        "int8 block size",
        None,
        "int8 only: values per scale (empty: 256)",
        integer=True,
        required=False,
    )
    overlap = forms.ChoiceField(
        label="Overlap",
        choices=[
            ("none", "none (wait for each round's result)"),
            ("eager", "eager (train on while the round's result travels)"),
            ("streaming", "streaming (sync one fragment of the model a round, training on)"),
        ],
        initial="none",
        help_text="eager: each trainer sends its update and starts the next round at once from a proxy of "
        "the global weights, merging the real result when it arrives; streaming: each round syncs one of "
        "the model's fragments in turn while the trainers train on, mixing its result in when it arrives",
    )
    # Empty by default, and sent only when filled: the server's defaults apply, and a value given with another
    # overlap than streaming is refused next to its field rather than dropped unseen.
    fragments = _number(
        "Fragments",
        None,
        f"streaming only: fragments of the model, each synced every this many rounds "
        f"({MIN_FRAGMENTS}–{MAX_FRAGMENTS}; empty: {DEFAULT_FRAGMENTS})",
        integer=True,
        required=False,
    )
    mix = _number(
        "Mix",
        None,
        "streaming only: a fragment's weights become mix × local + (1 − mix) × global when its result "
        f"arrives (0 ≤ mix < 1; empty: {job_spec.DEFAULT_STREAMING_MIX})",
        required=False,
    )
    aggregation = forms.ChoiceField(
        label="Aggregation",
        choices=[(value, value) for value in AGGREGATIONS],
        initial=AGGREGATION_MEAN,
        help_text=job_spec.RoundsSpec.model_fields["aggregation"].description,
    )
    # Like fragments and mix: empty by default and sent only when filled, so that the rule's default applies,
    # and an option given with another rule is refused next to its field (the spec's rule) rather than dropped.
    clip_factor = _number(
        "Clip factor",
        None,
        job_spec.RoundsSpec.model_fields["clip_factor"].description + " (1–1000)",
        required=False,
    )
    trim_fraction = _number(
        "Trim fraction",
        None,
        job_spec.RoundsSpec.model_fields["trim_fraction"].description + " (0 ≤ f < 0.5)",
        required=False,
    )
    verification = forms.ChoiceField(
        label="Verification",
        choices=[
            ("", "the rule's default (on for the robust rules, off for mean)"),
            ("on", "on"),
            ("off", "off"),
        ],
        initial="",
        required=False,
        help_text="score each update and leave outliers out of the round's aggregate (default thresholds)",
    )
    inner_learning_rate = _number("Inner learning rate", 3e-3, "AdamW on the trainers")
    outer_learning_rate = _number("Outer learning rate", 0.7, "Nesterov on the parameter server")
    outer_momentum = _number("Outer momentum", 0.9)
    # Advanced: the training knobs (docs/configuration.md, "Training knobs"); empty numbers are left out.
    weight_decay = _number(
        "Weight decay", None, "AdamW's decoupled weight decay (empty: 0.01)", required=False
    )
    max_grad_norm = _number(
        "Gradient clipping", None, "max global L2 norm of the gradients (empty: no clipping)", required=False
    )
    gradient_accumulation_steps = _number(
        "Gradient accumulation",
        1,
        "micro-batches per step (1–1024; must divide the batch size)",
        integer=True,
    )
    mixed_precision = forms.ChoiceField(
        label="Mixed precision",
        choices=[("no", "no (float32)"), ("bf16", "bf16 (CPU or GPU)"), ("fp16", "fp16 (CUDA GPU only)")],
        initial="no",
        help_text="autocast the forward pass; fp16 needs trainers with a GPU",
    )
    gradient_checkpointing = forms.BooleanField(
        label="Gradient checkpointing", required=False, help_text="less memory, more compute"
    )
    dataloader_workers = _number(
        "Data-loader workers",
        0,
        "processes reading the data slices (0: in the trainer's process)",
        integer=True,
    )
    processes = _number(
        "Trainer processes",
        1,
        "processes per trainer, kept in step by DDP (gloo on a CPU, one device each on CUDA); 0: one per device "
        f"the lease holds (0–{MAX_TRAINER_PROCESSES}; × the gradient accumulation, must divide the batch size)",
        integer=True,
    )
    holdout = _number(
        "Held-out slices",
        2,
        "the last slices, for the eval loss; empty for none",
        integer=True,
        required=False,
    )
    eval_batch_size = _number("Eval batch size", 32, integer=True)
    seed = _number("Seed", 0, "seeds the model's initial weights", integer=True)
    max_cost = _number(
        "Maximum cost",
        None,
        "credits the job may spend at most (its leases' price × active hours); the job ends when its cost "
        "reaches this (empty: no limit)",
        required=False,
    )
    trainer_cpu = _number("CPU cores", 1.0)
    trainer_memory = _number("Memory (GB)", 1.0)
    trainer_storage = _number("Storage (GB)", 0.0)
    trainer_gpu = _number("GPU memory (GB)", 0.0)
    trainer_bid = _number("Bid", job_spec.DEFAULT_BID, "public price per trainer")
    trainer_max = _number("Maximum price", job_spec.DEFAULT_MAX_PRICE, "private; at least the bid")
    ps_cpu = _number("CPU cores", 1.0)
    ps_memory = _number("Memory (GB)", 1.0)
    ps_storage = _number("Storage (GB)", 0.0)
    ps_gpu = _number("GPU memory (GB)", 0.0)
    ps_bid = _number("Bid", job_spec.DEFAULT_BID, "public price")
    ps_max = _number("Maximum price", job_spec.DEFAULT_MAX_PRICE, "private; at least the bid")

    #: The template's fieldsets: (legend, field names).
    SECTIONS = (
        ("Job", ("name", "max_cost")),
        ("Model", ("model_config", "model_type", "input_names", "seed")),
        ("Data", ("dataset", "holdout", "eval_batch_size")),
        (
            "Training",
            (
                "num_trainers",
                "trainers_min",
                "trainers_grace",
                "batch_size",
                "update_rounds",
                "inner_steps",
                "round_timeout",
                "encoding",
                "encoding_block_size",
                "overlap",
                "fragments",
                "mix",
                "aggregation",
                "clip_factor",
                "trim_fraction",
                "verification",
                "inner_learning_rate",
                "outer_learning_rate",
                "outer_momentum",
            ),
        ),
        (
            "Advanced training",
            (
                "weight_decay",
                "max_grad_norm",
                "gradient_accumulation_steps",
                "mixed_precision",
                "gradient_checkpointing",
                "dataloader_workers",
                "processes",
            ),
        ),
        (
            "Each trainer",
            ("trainer_cpu", "trainer_memory", "trainer_storage", "trainer_gpu", "trainer_bid", "trainer_max"),
        ),
        ("The parameter server", ("ps_cpu", "ps_memory", "ps_storage", "ps_gpu", "ps_bid", "ps_max")),
    )

    def __init__(self, *args, owner, **kwargs) -> None:
        super().__init__(*args, owner=owner, **kwargs)
        from apps.datasets.models import Dataset

        names = list(Dataset.objects.order_by("name").values_list("name", "slice_count"))
        self.fields["dataset"].choices = [(name, f"{name} ({count} slices)") for name, count in names]
        if not names:
            self.fields["dataset"].help_text = "no data node has registered a dataset yet"

    def sections(self):
        return [(legend, [self[name] for name in names]) for legend, names in self.SECTIONS]

    def clean_model_config(self) -> dict:
        text = self.cleaned_data["model_config"]
        try:
            config = json.loads(text)
        except json.JSONDecodeError as error:
            raise forms.ValidationError(f"Not JSON: {error}") from None
        if not isinstance(config, dict):
            raise forms.ValidationError('A JSON object, e.g. {"model_type": "gpt2", …}.')
        return config

    def clean_input_names(self) -> list[str]:
        return [name.strip() for name in self.cleaned_data["input_names"].split(",") if name.strip()]

    def specification(self) -> dict:
        """The JSON specification the fields describe (``POST /api/jobs/diloco/``'s body, without the name);
        a field whose value could not be read is left out (the spec then reports it missing)."""
        data = defaultdict(lambda: _UNREAD, self.cleaned_data)
        spec = {
            "model": {
                "source": {"type": "config", "config": data["model_config"]},
                "type": data["model_type"],
                "input_names": data["input_names"],
            },
            "dataset": {"name": data["dataset"]},
            "inner_optimizer": {"learning_rate": data["inner_learning_rate"]},
            "outer_optimizer": {
                "learning_rate": data["outer_learning_rate"],
                "momentum": data["outer_momentum"],
            },
            "rounds": {
                "update_rounds": data["update_rounds"],
                "inner_steps": data["inner_steps"],
                "round_timeout": data["round_timeout"],
                "encoding": data["encoding"],
                "overlap": data["overlap"],
                "aggregation": data["aggregation"],
            },
            "batch_size": data["batch_size"],
            "num_trainers": data["num_trainers"],
            "seed": data["seed"],
            "trainer": _role(data, "trainer"),
            "parameter_server": _role(data, "ps"),
        }
        pool = {
            key: data[f"trainers_{key}"]
            for key in ("min", "grace")
            if data.get(f"trainers_{key}") is not None
        }
        # Either given makes a pool, its target the trainers (a missing min is then said next to its field).
        if pool:
            spec["trainers"] = {**pool, "target": data["num_trainers"]}
        for key in ("encoding_block_size", "fragments", "mix", "clip_factor", "trim_fraction"):
            if data.get(key) is not None:
                spec["rounds"][key] = data[key]
        if data.get("verification"):
            spec["rounds"]["verification"] = {"enabled": data["verification"] == "on"}
        if data.get("max_cost") is not None:
            spec["max_cost"] = data["max_cost"]
        if data.get("weight_decay") is not None:
            spec["inner_optimizer"]["weight_decay"] = data["weight_decay"]
        spec["training"] = {
            "gradient_accumulation_steps": data["gradient_accumulation_steps"],
            "mixed_precision": data["mixed_precision"],
            "gradient_checkpointing": data["gradient_checkpointing"],
            "dataloader_workers": data["dataloader_workers"],
            "processes": data["processes"],
        }
        if data.get("max_grad_norm") is not None:
            spec["training"]["max_grad_norm"] = data["max_grad_norm"]
        if data.get("holdout"):
            spec["evaluation"] = {"holdout": data["holdout"], "batch_size": data["eval_batch_size"]}
        return _without_unread(spec)

    def parse(self) -> job_spec.DiLoCoSpec:
        return job_spec.parse_json(self.specification())


#: The value of a field that could not be read, in :meth:`DiLoCoJobForm.specification` until it is left out.
_UNREAD = object()


def _without_unread(value):
    if isinstance(value, dict):
        return {key: _without_unread(item) for key, item in value.items() if item is not _UNREAD}
    return value


def _role(data: dict, prefix: str) -> dict:
    return {
        "resources": {key: data[f"{prefix}_{key}"] for key in ("cpu", "memory", "storage", "gpu")},
        "price": {"bid": data[f"{prefix}_bid"], "max": data[f"{prefix}_max"]},
    }


class TomlJobForm(_SpecForm):
    """A Hypha scheduler TOML (its ``[scheduler.job]`` table), uploaded as a file or pasted."""

    toml_file = forms.FileField(label="TOML file", required=False)
    toml_text = forms.CharField(
        label="…or paste it",
        required=False,
        widget=forms.Textarea(attrs={"rows": 12, "spellcheck": "false", "class": "code"}),
    )

    #: The largest TOML accepted (a job description, not a data file).
    MAX_BYTES = 256 * 1024

    def clean(self):
        upload = self.cleaned_data.get("toml_file")
        if upload is not None:
            if upload.size > self.MAX_BYTES:
                self.add_error("toml_file", f"At most {self.MAX_BYTES // 1024} KiB.")
                return self.cleaned_data
            try:
                self.cleaned_data["toml_text"] = upload.read().decode("utf-8")
            except UnicodeDecodeError:
                self.add_error("toml_file", "The file must be UTF-8 text.")
                return self.cleaned_data
        if not (self.cleaned_data.get("toml_text") or "").strip():
            self.add_error("toml_file", "Choose a TOML file or paste one.")
            return self.cleaned_data
        if self.errors:
            return self.cleaned_data
        return super().clean()

    def parse(self) -> job_spec.DiLoCoSpec:
        return job_spec.parse_toml(self.cleaned_data["toml_text"])

    def _spec_error(self, path: str, message: str) -> None:
        # The paths name the TOML's own keys: shown with the key, next to the TOML.
        field = "toml_file" if self.cleaned_data.get("toml_file") is not None else "toml_text"
        self.add_error(field, f"{path}: {message}" if path else message)
