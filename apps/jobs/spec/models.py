"""The DiLoCo job specification's models: every field a user submits, with its bounds and checks (see the
package docstring)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    Strict,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from apps.jobs.spec.base import (
    DEFAULT_ALLOCATION_TIMEOUT,
    DEFAULT_BID,
    DEFAULT_MAX_PRICE,
    MAX_ACCUMULATION_STEPS,
    MAX_ALLOCATION_TIMEOUT,
    MAX_DATALOADER_WORKERS,
    MAX_PROCESS_TIMEOUT,
    MAX_STEPS,
    MAX_TRAINER_PROCESSES,
    MAX_TRAINERS,
    MAX_WEIGHT_DECAY,
    MIN_ALLOCATION_TIMEOUT,
    MIN_PROCESS_TIMEOUT,
    MIXED_PRECISIONS,
    MODEL_TYPE_ALIASES,
    MODEL_TYPE_REFUSED,
    MODEL_TYPES,
    Float,
    Integer,
    NonEmptyString,
    _Spec,
)
from apps.jobs.spec.rounds import RoundsSpec
from worker_daemon.protocol import MAX_DEVICE_MEMORY, MAX_DEVICES


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
    min_reliability: Float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Offers from workers whose reliability is below this are declined (0 to 1; a new worker is "
        "at 0.5; docs/architecture.md, Reputation). 0: any worker.",
    )


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
    evaluation: EvaluationSpec | None = Field(default=None, validate_default=True)
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

    @field_validator("evaluation")
    @classmethod
    def _loss_checks_have_data(
        cls, value: EvaluationSpec | None, info: ValidationInfo
    ) -> EvaluationSpec | None:
        # The validation step and the discard rule measure the held-out loss: at the parameter server, on the
        # evaluation data (docs/training.md, Robust aggregation and verification).
        rounds = info.data.get("rounds")
        if value is not None or rounds is None:
            return value
        verification = rounds.verification
        wanted = [
            name
            for name, given in (
                (
                    "rounds.verification.validation_every",
                    verification is not None and verification.validation_every,
                ),
                ("rounds.discard_if_loss_rises", rounds.discard_if_loss_rises is not None),
            )
            if given
        ]
        if wanted:
            raise PydanticCustomError(
                "evaluation_needed",
                "Evaluation data is needed for {names} (the held-out loss is measured on it): give "
                "evaluation.slices or evaluation.holdout.",
                {"names": " and ".join(wanted)},
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
