"""The DiLoCo job specification: what a user submits, validated, and what it becomes.

A :class:`DiLoCoSpec` comes from a JSON body (:func:`parse_json`) or from Hypha's scheduler TOML
(:func:`parse_toml`, reading ``[scheduler.job]`` with the keys the original reads plus the unambiguous spellings
of its docs). Both report every mistake at once as one :class:`SpecError`, each with a dotted field path.

A valid spec becomes:

* :func:`to_requirements` — the ``Job.requirements`` JSON (per role: resources, executor, bid, max);
* :func:`to_train_job_json` / :func:`to_aggregate_job_json` — the job envelope handed to executors, in exactly
  the shape of Hypha's ``{JOB_JSON}`` (reference §2): key order, kebab/snake case, lowercase reference tags.

The module needs neither Django nor a database; it imports only pydantic and the standard library.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from apps.jobs.exceptions import SpecError
from hypha_tensors.formats import (
    DEFAULT_BLOCK_SIZE,
    ENCODINGS,
    FLOAT32,
    INT8,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
)
from hypha_tensors.fragments import DEFAULT_FRAGMENTS, MAX_FRAGMENTS, MIN_FRAGMENTS

MAX_TRAINERS = 256
#: Rounds between two full-weight uploads of the checkpoint copy (``rounds.checkpoint_every``).
DEFAULT_CHECKPOINT_EVERY = 10
DEFAULT_BID = 100.0
DEFAULT_MAX_PRICE = 100.0
#: Seconds a job may wait for its first full allocation before it fails and gives back its leases
#: (``allocation_timeout``; apps.jobs.allocation), and the bounds of the value.
DEFAULT_ALLOCATION_TIMEOUT = 600.0
MIN_ALLOCATION_TIMEOUT = 10
MAX_ALLOCATION_TIMEOUT = 86_400
#: The largest value of the executor's i32 schedule fields.
MAX_STEPS = 2**31 - 1

TRAINER_EXECUTOR = {"class": "train", "name": "diloco-transformer"}
PARAMETER_SERVER_EXECUTOR = {"class": "aggregate", "name": "parameter-server"}

#: ModelType strings as executors expect them (reference §2.2, with the Python executor's spelling of the three
#: that Rust spells differently, §9 item 12).
MODEL_TYPES = (
    "auto",
    "pretraining",
    "causal-lm",
    "masked-lm",
    "mask-generation",
    "seq-2-seq-lm",
    "sequence-classification",
    "multiple-choice",
    "next-sentence-prediction",
    "token-classification",
    "question-answering",
    "text-encoding",
    "depth-estimation",
    "image-classification",
    "video-classification",
    "keypoint-detection",
    "keypoint-matching",
    "object-detection",
    "image-segmentation",
    "image-to-image",
    "semantic-segmentation",
    "instance-segmentation",
    "universal-segmentation",
    "zero-shot-image-classification",
    "zero-shot-object-detection",
    "audio-classification",
    "audio-frame-classification",
    "ctc",
    "speech-seq-2-seq",
    "audio-x-vector",
    "text-to-spectrogram",
    "text-to-waveform",
    "audio-tokenization",
    "table-question-answering",
    "document-question-answering",
    "vision-2-seq",
    "image-text-to-text",
    "time-series-prediction",
)
#: Rust's serde spelling (and one obvious fix of its typo) → the executor's spelling.
MODEL_TYPE_ALIASES = {
    "seq2-seq-lm": "seq-2-seq-lm",
    "speech-seq2-seq": "speech-seq-2-seq",
    "vison2-seq": "vision-2-seq",
    "vision2-seq": "vision-2-seq",
}
#: Spellings Hypha's docs use that no executor knows (§9 item 8), and what to write instead.
MODEL_TYPE_REFUSED = {
    "vision-classification": "use 'image-classification' (AutoModelForImageClassification)",
    "torch": "use 'auto', or a task such as 'image-classification' or 'causal-lm'",
}

#: How a trainer overlaps a round's communication with computation (``rounds.overlap``): ``none`` waits for
#: each round's result; ``eager`` sends round r's update and trains round r + 1 at once from a proxy of the
#: global weights, merging round r's result when it arrives (docs/training.md, "Overlap: eager updates");
#: ``streaming`` syncs one of ``rounds.fragments`` fragments of the model a round and trains on while it
#: travels, mixing the result in when it arrives (docs/training.md, "Overlap: streaming").
OVERLAP_NONE = "none"
OVERLAP_EAGER = "eager"
OVERLAP_STREAMING = "streaming"
OVERLAPS = (OVERLAP_NONE, OVERLAP_EAGER, OVERLAP_STREAMING)
#: The modes whose trainers train the next round while a round's update is out (the control plane counts
#: those steps ahead, apps.jobs.training.status).
OVERLAPS_TRAINING_AHEAD = (OVERLAP_EAGER, OVERLAP_STREAMING)
#: Modes a user may know from the literature that are not built yet, and why they are refused.
OVERLAP_NOT_AVAILABLE: dict[str, str] = {}
#: Streaming's mixing factor α by default: a fragment's weights become α·local + (1 − α)·global when its
#: round's result arrives (the Streaming DiLoCo paper's best value).
DEFAULT_STREAMING_MIX = 0.5

#: The schedule types of the spec → the ``scheduler`` variant tag of the train job JSON.
SCHEDULE_TAGS = {"cosine": "cosine-with-warmup", "linear": "linear-with-warmup", "wsd": "wsd"}


# --- the specification ------------------------------------------------------------------------------------


class _Spec(BaseModel):
    # Unknown keys are refused: a misspelt optional key (``learning_rate`` for ``learning-rate``) would otherwise
    # be silently dropped. Infinite or NaN numbers would poison prices and JSON.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


NonEmptyString = Annotated[str, Field(min_length=1, max_length=500)]
# Numbers are strict: ``true`` or ``"0.1"`` is a mistake in a spec, not a number (an int is a valid float).
Float = Annotated[float, Strict()]
Integer = Annotated[int, Strict()]


class HuggingFaceSource(_Spec):
    """Files of a Hugging Face model repository."""

    type: Literal["huggingface"]
    repository: str = Field(min_length=1, max_length=200, pattern=r"\S")
    revision: str = Field(default="main", min_length=1, max_length=200)
    filenames: list[NonEmptyString] = Field(min_length=1, max_length=1000)
    token: str | None = None


class UrlSource(_Spec):
    """One file fetched with an HTTP(S) GET."""

    type: Literal["url"]
    url: str = Field(max_length=2000, pattern=r"^https?://\S+$")


class UploadSource(_Spec):
    """A file uploaded to the control plane beforehand, named by its id or name."""

    type: Literal["upload"]
    file: NonEmptyString


class ConfigSource(_Spec):
    """A transformers model config (``config.json`` as a dict): the model is trained from scratch."""

    type: Literal["config"]
    config: dict[str, Any]

    @field_validator("config")
    @classmethod
    def _has_model_type(cls, config: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(config.get("model_type"), str) or not config["model_type"]:
            raise PydanticCustomError(
                "model_type_missing", "A transformers config needs a 'model_type' string, e.g. 'gpt2'."
            )
        return config


ModelSource = Annotated[
    HuggingFaceSource | UrlSource | UploadSource | ConfigSource, Field(discriminator="type")
]
PreprocessorSource = Annotated[HuggingFaceSource | UploadSource, Field(discriminator="type")]


class ModelSpec(_Spec):
    """The model to train: where it comes from, its task (a ModelType) and the batch keys it takes."""

    source: ModelSource
    type: str
    input_names: list[NonEmptyString] = Field(min_length=1, max_length=64)

    @field_validator("type")
    @classmethod
    def _model_type(cls, value: str) -> str:
        """Normalise Rust's spellings to the executor's; refuse the docs' invalid ones with a suggestion."""
        value = value.strip().lower()
        if value in MODEL_TYPE_REFUSED:
            raise PydanticCustomError(
                "model_type",
                "'{value}' is not a model type: {hint}.",
                {"value": value, "hint": MODEL_TYPE_REFUSED[value]},
            )
        value = MODEL_TYPE_ALIASES.get(value, value)
        if value not in MODEL_TYPES:
            raise PydanticCustomError(
                "model_type",
                "'{value}' is not a model type; expected one of {expected}.",
                {"value": value, "expected": ", ".join(MODEL_TYPES)},
            )
        return value


class PreprocessorSpec(_Spec):
    """The preprocessor applied to the slice tensors named by ``input_names`` before they reach the model.

    The executor loads ``artifacts/<first filename>``, so it must come from a repository or an upload.
    """

    source: PreprocessorSource
    type: Literal["tokenizer", "feature", "image", "video", "auto"]
    input_names: list[NonEmptyString] = Field(min_length=1, max_length=64)


class DatasetSpec(_Spec):
    """The dataset, by the name data nodes publish it under."""

    name: str = Field(min_length=1, max_length=200)


class WarmupSchedule(_Spec):
    """Cosine or linear decay after a linear warm-up, stepped once per batch."""

    type: Literal["cosine", "linear"]
    warmup_steps: Integer = Field(ge=0, le=MAX_STEPS)
    training_steps: Integer = Field(ge=1, le=MAX_STEPS)

    @field_validator("training_steps")
    @classmethod
    def _after_warmup(cls, value: int, info: ValidationInfo) -> int:
        warmup = info.data.get("warmup_steps")
        if warmup is not None and value < warmup:
            raise PydanticCustomError(
                "schedule", "Must be at least warmup_steps ({warmup}).", {"warmup": warmup}
            )
        return value


class WarmupStableDecaySchedule(_Spec):
    """Warm-up, stable, decay (WSD)."""

    type: Literal["wsd"]
    warmup_steps: Integer = Field(ge=0, le=MAX_STEPS)
    decay_steps: Integer = Field(ge=1, le=MAX_STEPS)


Schedule = Annotated[WarmupSchedule | WarmupStableDecaySchedule, Field(discriminator="type")]


class InnerOptimizerSpec(_Spec):
    """The trainers' optimizer: AdamW, with an optional LR schedule (constant lr when absent)."""

    type: Literal["adamw"] = "adamw"
    learning_rate: Float = Field(gt=0)
    betas: tuple[Annotated[Float, Field(ge=0, lt=1)], Annotated[Float, Field(ge=0, lt=1)]] | None = None
    epsilon: Float | None = Field(default=None, gt=0)
    schedule: Schedule | None = None


class OuterOptimizerSpec(_Spec):
    """The parameter server's optimizer: Nesterov momentum on the averaged pseudo-gradients."""

    type: Literal["nesterov"] = "nesterov"
    learning_rate: Float = Field(gt=0)
    momentum: Float = Field(ge=0, le=1)


class RoundsSpec(_Spec):
    """How many outer rounds, and how much local work between them: a fixed number of inner steps (H) per
    trainer, or performance-aware sync after about ``avg_samples_between_updates`` samples over all trainers
    (fast trainers run more steps than slow ones so that all finish together; ``apps.jobs.sync``)."""

    update_rounds: Integer = Field(ge=1, le=1_000_000)
    inner_steps: Integer | None = Field(default=None, ge=1, le=MAX_STEPS)
    avg_samples_between_updates: Integer | None = Field(default=None, ge=1, le=MAX_STEPS)
    max_batch_size: Integer | None = Field(default=None, ge=1, le=1_000_000)
    round_timeout: Float = Field(
        default=120.0,
        gt=0,
        le=86_400,
        description="Seconds the parameter server waits, after a round's first update, for the others.",
    )
    weighted: bool = Field(default=True, description="Weight each trainer's update by its samples.")
    encoding: Literal[ENCODINGS] = Field(  # type: ignore[valid-type]
        default=FLOAT32,
        description="How pseudo-gradients and results travel: float32 (exact), float16, bfloat16 or int8 "
        "(per-block absmax scales), the lossy ones with error feedback (docs/training.md, Encodings).",
    )
    encoding_block_size: Integer | None = Field(
        default=None,
        ge=MIN_BLOCK_SIZE,
        le=MAX_BLOCK_SIZE,
        description=f"int8 only: values per scale (default {DEFAULT_BLOCK_SIZE}).",
    )
    overlap: Literal[OVERLAPS] = Field(  # type: ignore[valid-type]
        default=OVERLAP_NONE,
        description="How trainers overlap a round's communication with computation: none (wait for each "
        "round's result), eager (send round r's update and train round r + 1 at once from a proxy of the "
        "global weights; docs/training.md, Overlap: eager updates) or streaming (each round syncs one of "
        "`fragments` fragments of the model, in turn, while the trainers train on; docs/training.md, "
        "Overlap: streaming).",
    )
    fragments: Integer | None = Field(
        default=None,
        ge=MIN_FRAGMENTS,
        le=MAX_FRAGMENTS,
        description=f"streaming only: fragments of the model (default {DEFAULT_FRAGMENTS}); round r syncs "
        "fragment (r − 1) mod fragments, so each tensor is synced every `fragments` rounds.",
    )
    mix: Float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description=f"streaming only: when a fragment's result arrives its weights become mix × local + "
        f"(1 − mix) × global (default {DEFAULT_STREAMING_MIX}; 0 replaces them with the global ones).",
    )
    checkpoint_every: Integer = Field(
        default=DEFAULT_CHECKPOINT_EVERY,
        ge=1,
        le=1000,
        description="The parameter server uploads the full weights to the control plane's checkpoint copy "
        "every this many rounds; the rounds between upload their momentum and result only "
        "(docs/training.md, A parameter server lost).",
    )

    @model_validator(mode="after")
    def _one_sync_rule(self) -> RoundsSpec:
        given = (self.inner_steps is not None) + (self.avg_samples_between_updates is not None)
        if given != 1:
            raise PydanticCustomError(
                "sync_rule",
                "Give exactly one of inner_steps and avg_samples_between_updates ({given} given).",
                {"given": "both" if given == 2 else "neither"},
            )
        return self

    @field_validator("encoding_block_size")
    @classmethod
    def _blocks_of_int8(cls, value: int | None, info: ValidationInfo) -> int | None:
        encoding = info.data.get("encoding")
        if value is not None and encoding is not None and encoding != INT8:
            raise PydanticCustomError(
                "encoding_block_size",
                "Only the int8 encoding has blocks (this job's is {encoding}).",
                {"encoding": encoding},
            )
        return value

    @field_validator("fragments", "mix")
    @classmethod
    def _streaming_options(cls, value: Any, info: ValidationInfo) -> Any:
        # A field validator (``overlap`` is declared before them), so that the error is at the option's own
        # field — next to it in the dashboard, under its key in a TOML — and both are reported.
        overlap = info.data.get("overlap")
        if value is not None and overlap is not None and overlap != OVERLAP_STREAMING:
            raise PydanticCustomError(
                "streaming_only",
                "{name} is an option of overlap = 'streaming' (this job's is {overlap}).",
                {"name": info.field_name, "overlap": overlap},
            )
        return value

    @property
    def fragment_count(self) -> int:
        """F of a streaming job (its ``fragments`` or the default); 1 otherwise."""
        if self.overlap != OVERLAP_STREAMING:
            return 1
        return self.fragments if self.fragments is not None else DEFAULT_FRAGMENTS

    @property
    def streaming_mix(self) -> float:
        return self.mix if self.mix is not None else DEFAULT_STREAMING_MIX

    @field_validator("overlap", mode="before")
    @classmethod
    def _overlap_available(cls, value: Any) -> Any:
        if isinstance(value, str) and value in OVERLAP_NOT_AVAILABLE:
            raise PydanticCustomError("overlap_not_available", OVERLAP_NOT_AVAILABLE[value])
        return value

    def encoding_json(self) -> dict[str, Any]:
        """The job JSON's ``encoding`` and (int8) ``encoding_block_size`` for executors; nothing for float32,
        the executors' default, so that a float32 job's JSON stays exactly Hypha's."""
        if self.encoding == FLOAT32:
            return {}
        if self.encoding != INT8:
            return {"encoding": self.encoding}
        size = self.encoding_block_size if self.encoding_block_size is not None else DEFAULT_BLOCK_SIZE
        return {"encoding": INT8, "encoding_block_size": size}


class EvaluationSpec(_Spec):
    """Held-out slices of the dataset: never trained on; the global model's loss on them is computed after
    every round. Name them by index (``slices``) or hold out the last ``holdout`` slices."""

    slices: list[Annotated[int, Strict(), Field(ge=0)]] | None = Field(
        default=None, min_length=1, max_length=1000
    )
    holdout: Integer | None = Field(default=None, ge=1, le=1000)
    batch_size: Integer = Field(default=16, ge=1, le=100_000)

    @model_validator(mode="after")
    def _one_way(self) -> EvaluationSpec:
        if (self.slices is None) == (self.holdout is None):
            raise PydanticCustomError("evaluation", "Give exactly one of slices and holdout.")
        return self


class ResourcesSpec(_Spec):
    """Minimum resources per worker: CPU cores, memory GB, storage GB, GPU GB of VRAM."""

    cpu: Float = Field(default=1.0, ge=0)
    memory: Float = Field(default=1.0, ge=0)
    storage: Float = Field(default=0.0, ge=0)
    gpu: Float = Field(default=0.0, ge=0)


class PriceSpec(_Spec):
    """Price per worker: ``bid`` is broadcast to daemons; ``max`` is private, offers above it are declined."""

    bid: Float = Field(default=DEFAULT_BID, ge=0)
    max: Float = Field(default=DEFAULT_MAX_PRICE, ge=0)

    @field_validator("max")
    @classmethod
    def _at_least_bid(cls, value: float, info: ValidationInfo) -> float:
        bid = info.data.get("bid")
        if bid is not None and value < bid:
            raise PydanticCustomError(
                "max_below_bid", "Must be at least the bid ({bid}).", {"bid": f"{bid:g}"}
            )
        return value


class RoleSpec(_Spec):
    """What each worker of a role must have, and what the job pays it."""

    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    price: PriceSpec = Field(default_factory=PriceSpec)


class ParameterServerSpec(RoleSpec):
    """The parameter server's role, and whether its worker must accept inbound connections (``reachable``):
    ``prefer`` (default) ranks workers that declare ``reachable = true`` first (a worker that does not is
    ranked 5 % dearer, and only reachable offers settle the advert before its window closes); ``require`` takes
    only those; ``any`` ignores it. An unreachable parameter server is served through the relay (slower)."""

    reachable: Literal["prefer", "require", "any"] = "prefer"


class DiLoCoSpec(_Spec):
    """A DiLoCo training job: the model, data, both optimizers, the rounds, and what each role needs and pays.

    ``batch_size`` is the per-trainer batch size used when dispatch does not allocate one (reference §6.5).
    """

    model: ModelSpec
    preprocessor: PreprocessorSpec | None = None
    dataset: DatasetSpec
    inner_optimizer: InnerOptimizerSpec
    outer_optimizer: OuterOptimizerSpec
    rounds: RoundsSpec
    batch_size: Integer = Field(default=1, ge=1, le=1_000_000)
    num_trainers: Integer = Field(default=2, ge=1, le=MAX_TRAINERS)
    trainer: RoleSpec = Field(default_factory=RoleSpec)
    parameter_server: ParameterServerSpec = Field(default_factory=ParameterServerSpec)
    evaluation: EvaluationSpec | None = None
    seed: Integer = Field(default=0, ge=0, le=2**31 - 1, description="Seeds a model built from a config.")
    allocation_timeout: Float = Field(
        default=DEFAULT_ALLOCATION_TIMEOUT,
        ge=MIN_ALLOCATION_TIMEOUT,
        le=MAX_ALLOCATION_TIMEOUT,
        description="Seconds after submission by which every role must have been leased once; a job not fully "
        "allocated by then gives back the leases it holds and fails (docs/architecture.md, Job lifecycle).",
    )


# --- parsing ----------------------------------------------------------------------------------------------

# A discriminated union puts its tag into the error location (``model.source.huggingface.filenames``); these
# are the fields whose next location element is such a tag and is dropped from the reported path.
_TAGGED_FIELDS = {"source", "schedule"}


def _field_path(location: tuple[str | int, ...]) -> str:
    parts: list[str] = []
    skip_next = False
    for element in location:
        if skip_next:
            skip_next = False
            continue
        parts.append(str(element))
        skip_next = element in _TAGGED_FIELDS
    return ".".join(parts)


def field_errors(error: ValidationError, rename: dict[str, str] | None = None) -> list[dict[str, str]]:
    """Every error of ``error`` as ``{"field", "message"}``; ``rename`` maps spec paths to source paths."""
    found = []
    for line in error.errors(include_url=False):
        path = _field_path(tuple(line["loc"]))
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
        },
        "batch_size": size,
        # Ours, for lossy encodings only (Hypha's executors ignore it: they can take part in float32 jobs only).
        **spec.rounds.encoding_json(),
        # Ours, for eager jobs only (Hypha's executors ignore it and wait for each round's result).
        **_overlap_json(spec),
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
from apps.jobs.spec_toml import parse_toml  # noqa: E402

__all__ = [
    "DiLoCoSpec",
    "SpecError",
    "parse_json",
    "parse_toml",
    "source_reference",
    "to_aggregate_job_json",
    "to_requirements",
    "to_train_job_json",
]
