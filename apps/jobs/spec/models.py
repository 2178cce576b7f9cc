"""The DiLoCo job specification's models: every field a user submits, with its bounds and checks (see the
package docstring)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    Strict,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from hypha_tensors.formats import (
    DEFAULT_BLOCK_SIZE,
    ENCODINGS,
    FLOAT32,
    INT8,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
)
from hypha_tensors.fragments import DEFAULT_FRAGMENTS, MAX_FRAGMENTS, MIN_FRAGMENTS
from worker_daemon.protocol import MAX_DEVICE_MEMORY, MAX_DEVICES

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

#: Training knobs (``training``): their bounds, and the mixed precisions (accelerate's names).
MAX_WEIGHT_DECAY = 10.0
MAX_ACCUMULATION_STEPS = 1024
MAX_DATALOADER_WORKERS = 32
MAX_TRAINER_PROCESSES = 64
MIN_PROCESS_TIMEOUT = 10.0
MAX_PROCESS_TIMEOUT = 86_400.0
MIXED_PRECISIONS = ("no", "bf16", "fp16")


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
    weight_decay: Float | None = Field(
        default=None,
        ge=0,
        le=MAX_WEIGHT_DECAY,
        description="AdamW's decoupled weight decay; absent: AdamW's default (0.01), as Hypha's executor.",
    )
    schedule: Schedule | None = None


class OuterOptimizerSpec(_Spec):
    """The parameter server's optimizer: Nesterov momentum on the averaged pseudo-gradients."""

    type: Literal["nesterov"] = "nesterov"
    learning_rate: Float = Field(gt=0)
    momentum: Float = Field(ge=0, le=1)


#: ``rounds.aggregation``: how the parameter server combines a round's updates (parameter_server/aggregation.py;
#: docs/training.md, "Robust aggregation and verification").
AGGREGATION_MEAN = "mean"
AGGREGATIONS = (AGGREGATION_MEAN, "clipped_mean", "trimmed_mean", "median")


class VerificationSpec(_Spec):
    """``rounds.verification``: the parameter server scores each update and rejects outliers (left out of the
    round's aggregate). On by default for the robust rules, off for ``mean``."""

    enabled: bool | None = Field(
        default=None, description="Verify each update (default: on for the robust rules, off for mean)."
    )
    max_norm_ratio: Float = Field(
        default=10.0,
        gt=1,
        le=1e6,
        description="Reject an update whose norm is more than this many times the round's median norm.",
    )
    min_cosine: Float = Field(
        default=-0.5,
        ge=-1,
        le=1,
        description="With 3 updates or more, reject one whose cosine similarity to the mean of the others is "
        "under this.",
    )
    max_rejections: Integer | None = Field(
        default=None,
        ge=1,
        le=1000,
        description="The control plane ends a trainer's lease after this many consecutive rejected rounds "
        "(default HYPHA_MAX_REJECTIONS, 3).",
    )


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
    aggregation: Literal[AGGREGATIONS] = Field(  # type: ignore[valid-type]
        default=AGGREGATION_MEAN,
        description="How the parameter server combines a round's updates: mean (sample-weighted), clipped_mean "
        "(each update's norm clipped to clip_factor × the round's median norm), trimmed_mean (per coordinate, "
        "the trim_fraction largest and smallest values dropped) or median (coordinate-wise); docs/training.md, "
        "Robust aggregation and verification.",
    )
    clip_factor: Float | None = Field(
        default=None,
        ge=1,
        le=1000,
        description="clipped_mean only: an update's norm is clipped to this × the round's median norm "
        "(default 2).",
    )
    trim_fraction: Float | None = Field(
        default=None,
        ge=0,
        lt=0.5,
        description="trimmed_mean only: the fraction of values dropped on each side of each coordinate "
        "(default 0.25; at least one each side with 3 updates or more).",
    )
    verification: VerificationSpec | None = Field(
        default=None,
        description="Score each update and reject outliers (thresholds; on for the robust rules).",
    )

    @field_validator("clip_factor", "trim_fraction")
    @classmethod
    def _aggregation_options(cls, value: Any, info: ValidationInfo) -> Any:
        # A field validator (``aggregation`` is declared before them): the error is at the option's own field.
        wanted = {"clip_factor": "clipped_mean", "trim_fraction": "trimmed_mean"}[info.field_name]
        aggregation = info.data.get("aggregation")
        if value is not None and aggregation is not None and aggregation != wanted:
            raise PydanticCustomError(
                "aggregation_only",
                "{name} is an option of aggregation = '{wanted}' (this job's is {aggregation}).",
                {"name": info.field_name, "wanted": wanted, "aggregation": aggregation},
            )
        return value

    @model_serializer(mode="wrap")
    def _newer_keys_only_when_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # The aggregation rule and its options came later: at their defaults they are left out, so that the
        # stored spec of a job that does not set them stays what it was.
        data = handler(self)
        for name in ("aggregation", "clip_factor", "trim_fraction", "verification"):
            if name in data and data[name] == type(self).model_fields[name].default:
                del data[name]
        return data

    def aggregation_json(self) -> dict[str, Any]:
        """The parameter server's ``rounds`` keys of the aggregation rule: nothing for an unverified mean (the
        default), so that such a job's JSON is unchanged."""
        keys: dict[str, Any] = {}
        if self.aggregation != AGGREGATION_MEAN:
            keys["aggregation"] = self.aggregation
        if self.clip_factor is not None:
            keys["clip_factor"] = self.clip_factor
        if self.trim_fraction is not None:
            keys["trim_fraction"] = self.trim_fraction
        if self.verification is not None:
            # max_rejections is the control plane's (apps.jobs.training.dispatch), not the parameter server's.
            keys["verification"] = self.verification.model_dump(exclude={"max_rejections"})
        return keys

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


class TrainingSpec(_Spec):
    """Ours, not Hypha's: how each trainer runs its inner steps (docs/configuration.md, "Training knobs"), applied
    the way accelerate documents them. The defaults are what a job without this table gets."""

    max_grad_norm: Float | None = Field(
        default=None,
        gt=0,
        description="Clip the gradients' global L2 norm to this before each optimizer step; null: no clipping.",
    )
    gradient_accumulation_steps: Integer = Field(
        default=1,
        ge=1,
        le=MAX_ACCUMULATION_STEPS,
        description="Micro-batches of batch_size / k samples each whose gradients add up to one step's "
        "(batch_size must be a multiple of it).",
    )
    mixed_precision: Literal[MIXED_PRECISIONS] = Field(
        default="no",
        description="Autocast the forward pass: no, bf16 (CPU or a CUDA GPU that supports it) or fp16 (a CUDA "
        "GPU only; the job must ask for trainer.resources.gpu).",
    )
    gradient_checkpointing: Annotated[bool, Strict()] = Field(
        default=False, description="Recompute activations in the backward pass (less memory, more compute)."
    )
    dataloader_workers: Integer = Field(
        default=0,
        ge=0,
        le=MAX_DATALOADER_WORKERS,
        description="DataLoader worker processes that read and preprocess the data slices (0: in the trainer's "
        "process); the trainer still fetches every slice itself, and the batches are the same whatever the number.",
    )
    processes: Integer = Field(
        default=1,
        ge=0,
        le=MAX_TRAINER_PROCESSES,
        description="Processes per trainer, kept in step by DDP, each on one of the lease's devices (CUDA) and "
        "each training batch_size / processes of every batch; 0: one per device the lease holds.",
    )
    process_timeout: Float = Field(
        default=300.0,
        ge=MIN_PROCESS_TIMEOUT,
        le=MAX_PROCESS_TIMEOUT,
        description="Seconds a process of a several-process trainer waits for a peer before the trainer fails.",
    )

    @model_serializer(mode="wrap")
    def _newer_keys_only_when_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # processes and process_timeout came later: at their defaults they are left out, so that the stored
        # spec and the trainer's job JSON of a job that does not set them stay what they were.
        data = handler(self)
        for name in ("processes", "process_timeout"):
            if name in data and data[name] == type(self).model_fields[name].default:
                del data[name]
        return data

    @property
    def is_default(self) -> bool:
        return self == TrainingSpec()


class ResourcesSpec(_Spec):
    """Minimum resources per worker: CPU cores, memory GB, storage GB, GPU GB of VRAM; and ``devices`` (GPUs,
    each of at least ``device_memory`` GB) the worker gives this role alone (0: no device requirement)."""

    cpu: Float = Field(default=1.0, ge=0)
    memory: Float = Field(default=1.0, ge=0)
    storage: Float = Field(default=0.0, ge=0)
    gpu: Float = Field(default=0.0, ge=0)
    devices: Integer = Field(default=0, ge=0, le=MAX_DEVICES)
    device_memory: Float = Field(default=0.0, ge=0, le=MAX_DEVICE_MEMORY)


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


class TrainerPoolSpec(_Spec):
    """An elastic trainer pool (Hypha's ``worker_pool``): training starts once ``min`` trainers hold leases,
    grows toward ``target`` as fitting offers arrive (a newcomer joins at a round boundary), and goes on while
    at least ``min`` remain (docs/training.md, "Elastic pools"). Below ``min`` for longer than ``grace``
    (seconds; Hypha's ``grace_ms``) the job pauses, keeping its leases, and fails if trainers are not back to
    ``min`` within its ``allocation_timeout``."""

    min: Integer = Field(ge=1, le=MAX_TRAINERS)
    target: Integer = Field(ge=1, le=MAX_TRAINERS)
    grace: Float = Field(default=0.0, ge=0, le=86_400)

    @model_validator(mode="after")
    def _min_within_target(self) -> TrainerPoolSpec:
        if self.min > self.target:
            raise PydanticCustomError(
                "trainer_pool",
                "min ({min}) must be at most target ({target}).",
                {"min": self.min, "target": self.target},
            )
        return self


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
    trainers: TrainerPoolSpec | None = Field(
        default=None,
        description="An elastic pool {min, target, grace}; absent: min = target = num_trainers. Given, "
        "num_trainers is its target.",
    )
    trainer: RoleSpec = Field(default_factory=RoleSpec)
    parameter_server: ParameterServerSpec = Field(default_factory=ParameterServerSpec)
    evaluation: EvaluationSpec | None = None
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    seed: Integer = Field(default=0, ge=0, le=2**31 - 1, description="Seeds a model built from a config.")
    allocation_timeout: Float = Field(
        default=DEFAULT_ALLOCATION_TIMEOUT,
        ge=MIN_ALLOCATION_TIMEOUT,
        le=MAX_ALLOCATION_TIMEOUT,
        description="Seconds after submission by which every role must have been leased once; a job not fully "
        "allocated by then gives back the leases it holds and fails (docs/architecture.md, Job lifecycle).",
    )
    max_cost: Float | None = Field(
        default=None,
        gt=0,
        le=1e12,
        description="Credits the job may spend at most (its leases' price × ACTIVE hours, docs/architecture.md, "
        "Accounting); when its running cost reaches this the job ends, its status reason says so. Absent: no limit.",
    )

    @field_validator("training")
    @classmethod
    def _training_fits_the_job(cls, value: TrainingSpec, info: ValidationInfo) -> TrainingSpec:
        steps, batch_size = value.gradient_accumulation_steps, info.data.get("batch_size")
        if batch_size is not None and batch_size % steps:
            raise PydanticCustomError(
                "training",
                "gradient_accumulation_steps ({steps}) must divide batch_size ({batch_size}).",
                {"steps": steps, "batch_size": batch_size},
            )
        rounds = info.data.get("rounds")
        if rounds is not None and rounds.max_batch_size is not None and rounds.max_batch_size < steps:
            raise PydanticCustomError(
                "training",
                "gradient_accumulation_steps ({steps}) exceeds rounds.max_batch_size ({limit}).",
                {"steps": steps, "limit": rounds.max_batch_size},
            )
        processes = value.processes
        if processes > 1 and batch_size is not None and batch_size % (processes * steps):
            raise PydanticCustomError(
                "training",
                "processes × gradient_accumulation_steps ({processes} × {steps}) must divide batch_size "
                "({batch_size}): each process trains an equal share of every batch.",
                {"processes": processes, "steps": steps, "batch_size": batch_size},
            )
        overlap = getattr(rounds, "overlap", "none") if rounds is not None else "none"
        if processes != 1 and overlap != "none":
            raise PydanticCustomError(
                "training",
                "processes other than 1 cannot be combined with rounds.overlap {overlap} yet.",
                {"overlap": overlap},
            )
        trainer = info.data.get("trainer")
        resources = trainer.resources if trainer is not None else None
        if processes > 1 and resources is not None and resources.devices and processes > resources.devices:
            raise PydanticCustomError(
                "training",
                "processes ({processes}) exceeds trainer.resources.devices ({devices}): one process a device.",
                {"processes": processes, "devices": resources.devices},
            )
        no_gpu = resources is not None and not resources.gpu and not resources.devices
        if value.mixed_precision == "fp16" and no_gpu:
            raise PydanticCustomError(
                "training",
                "mixed_precision fp16 needs a CUDA GPU: ask for one (trainer.resources.gpu or devices above 0), "
                "or use bf16.",
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _pool_sets_trainers(cls, data: Any) -> Any:
        # num_trainers is what the job stores and advertises toward: the pool's target (the spec is frozen, so
        # it is filled in before validation; both given must agree, checked after).
        if isinstance(data, dict) and isinstance(data.get("trainers"), dict) and "num_trainers" not in data:
            target = data["trainers"].get("target")
            # A bad target is reported once, at trainers.target.
            if isinstance(target, int) and not isinstance(target, bool) and 1 <= target <= MAX_TRAINERS:
                data = {**data, "num_trainers": target}
        return data

    @model_validator(mode="after")
    def _pool_agrees(self) -> DiLoCoSpec:
        if self.trainers is not None and self.num_trainers != self.trainers.target:
            raise PydanticCustomError(
                "trainer_pool",
                "num_trainers ({count}) differs from trainers.target ({target}); give one.",
                {"count": self.num_trainers, "target": self.trainers.target},
            )
        return self

    @property
    def min_trainers(self) -> int:
        """The trainers the job starts with and needs to go on: the pool's ``min``, else ``num_trainers``."""
        return self.trainers.min if self.trainers is not None else self.num_trainers


# --- parsing ----------------------------------------------------------------------------------------------

# A discriminated union puts its tag into the error location (``model.source.huggingface.filenames``); these
# are the fields whose next location element is such a tag and is dropped from the reported path.
