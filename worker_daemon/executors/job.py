"""The ``train`` job JSON an executor is started with (hypha-protocols.md §2.1–2.2), parsed and checked.

Keys are Hypha's: kebab-case for ``input-names`` and ``learning-rate``, snake_case elsewhere; unknown keys
are ignored, as Hypha's serde does. References (``model.artifact``, ``data``, ``updates``, ``results``,
``preprocessor.artifact``) are kept as the JSON objects they are and handed to the bridge verbatim: the bridge,
not the executor, knows how to fetch or send them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from hypha_tensors.formats import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_ENCODING,
    ENCODINGS,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
)
from hypha_tensors.fragments import MAX_FRAGMENTS, MIN_FRAGMENTS
from worker_daemon.executors.exceptions import JobConfigError

# Rust's kebab-case ModelType → candidate transformers Auto classes, the first that exists wins. Hypha's Python
# executor spells three of them differently from what Rust sends (§9.12); both spellings are accepted.
MODEL_CLASSES: dict[str, tuple[str, ...]] = {
    "auto": ("AutoModel",),
    "pretraining": ("AutoModelForPreTraining",),
    "causal-lm": ("AutoModelForCausalLM",),
    "masked-lm": ("AutoModelForMaskedLM",),
    "mask-generation": ("AutoModelForMaskGeneration",),
    "seq2-seq-lm": ("AutoModelForSeq2SeqLM",),
    "seq-2-seq-lm": ("AutoModelForSeq2SeqLM",),
    "sequence-classification": ("AutoModelForSequenceClassification",),
    "multiple-choice": ("AutoModelForMultipleChoice",),
    "next-sentence-prediction": ("AutoModelForNextSentencePrediction",),
    "token-classification": ("AutoModelForTokenClassification",),
    "question-answering": ("AutoModelForQuestionAnswering",),
    "text-encoding": ("AutoModelForTextEncoding",),
    "depth-estimation": ("AutoModelForDepthEstimation",),
    "image-classification": ("AutoModelForImageClassification",),
    "video-classification": ("AutoModelForVideoClassification",),
    "keypoint-detection": ("AutoModelForKeypointDetection",),
    "keypoint-matching": ("AutoModelForKeypointMatching",),
    "object-detection": ("AutoModelForObjectDetection",),
    "image-segmentation": ("AutoModelForImageSegmentation",),
    "image-to-image": ("AutoModelForImageToImage",),
    "semantic-segmentation": ("AutoModelForSemanticSegmentation",),
    "instance-segmentation": ("AutoModelForInstanceSegmentation",),
    "universal-segmentation": ("AutoModelForUniversalSegmentation",),
    "zero-shot-image-classification": ("AutoModelForZeroShotImageClassification",),
    "zero-shot-object-detection": ("AutoModelForZeroShotObjectDetection",),
    "audio-classification": ("AutoModelForAudioClassification",),
    "audio-frame-classification": ("AutoModelForAudioFrameClassification",),
    "ctc": ("AutoModelForCTC",),
    "speech-seq2-seq": ("AutoModelForSpeechSeq2Seq",),
    "speech-seq-2-seq": ("AutoModelForSpeechSeq2Seq",),
    "audio-x-vector": ("AutoModelForAudioXVector",),
    "text-to-spectrogram": ("AutoModelForTextToSpectrogram",),
    "text-to-waveform": ("AutoModelForTextToWaveform",),
    "audio-tokenization": ("AutoModelForAudioTokenization",),
    # Hypha's executor maps table QA to the plain QA head; kept for compatibility.
    "table-question-answering": ("AutoModelForQuestionAnswering",),
    "document-question-answering": ("AutoModelForDocumentQuestionAnswering",),
    # transformers 5 folded Vision2Seq into ImageTextToText.
    "vison2-seq": ("AutoModelForVision2Seq", "AutoModelForImageTextToText"),
    "vision-2-seq": ("AutoModelForVision2Seq", "AutoModelForImageTextToText"),
    "image-text-to-text": ("AutoModelForImageTextToText",),
    "time-series-prediction": ("AutoModelForTimeSeriesPrediction",),
}


def set_loss_type(model: Any, auto_class_name: str) -> None:
    """Name the model's loss after its task when transformers cannot tell it from the class name (GPT-2's
    ``GPT2LMHeadModel`` matches none of its loss names): otherwise every forward with labels warns
    "`loss_type=None` was set in the config but it is unrecognized" into the task's log, and then uses
    ``ForCausalLM`` whatever the task. ``AutoModelForCausalLM`` gives ``ForCausalLM``; a task without a
    loss of its own in transformers is left as it is."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:  # a transformers without loss registry has no such warning either
        return
    if getattr(model, "loss_type", None) in LOSS_MAPPING:
        return
    wanted = auto_class_name.removeprefix("AutoModel")
    if wanted in LOSS_MAPPING:
        model.loss_type = wanted


PREPROCESSOR_CLASSES: dict[str, str] = {
    "tokenizer": "AutoTokenizer",
    "feature": "AutoFeatureExtractor",
    "image": "AutoImageProcessor",
    "video": "AutoVideoProcessor",
    "auto": "AutoProcessor",
}

Reference = dict[str, Any]


class _Shape(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


class ModelSpec(_Shape):
    task: str
    artifact: Reference
    input_names: Annotated[list[str], Field(alias="input-names", min_length=1)]


class OptimizerSpec(_Shape):
    learning_rate: Annotated[float, Field(alias="learning-rate", gt=0)]
    betas: tuple[float, float] | None = None
    epsilon: Annotated[float, Field(gt=0)] | None = None
    #: Ours, not Hypha's: AdamW's decoupled weight decay; absent: AdamW's default (0.01).
    weight_decay: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = Field(
        default=None, alias="weight-decay"
    )


class TrainingKnobs(_Shape):
    """Ours, not Hypha's (its executors ignore it): how the inner steps run (docs/configuration.md, "Training
    knobs"); the key absent means these defaults. Applied by :mod:`worker_daemon.executors.knobs`."""

    max_grad_norm: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    gradient_accumulation_steps: Annotated[StrictInt, Field(ge=1, le=1024)] = 1
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    gradient_checkpointing: StrictBool = False
    #: DataLoader worker processes that read the data slices (worker_daemon/executors/slice_workers.py).
    dataloader_workers: Annotated[StrictInt, Field(ge=0, le=32)] = 0
    #: Processes of one trainer (DDP; docs/training.md, "One trainer, several processes"): 0 is one per CUDA
    #: device the lease shows (one on a CPU); the job's batch is split between them.
    processes: Annotated[StrictInt, Field(ge=0, le=64)] = 1
    #: Seconds a process of a several-process trainer waits for a peer before it gives up (the process
    #: group's timeout).
    process_timeout: Annotated[float, Field(ge=1, le=86_400, allow_inf_nan=False)] = 300.0


class PreprocessorSpec(_Shape):
    task: Literal["tokenizer", "feature", "image", "video", "auto"]
    artifact: Reference
    input_names: Annotated[list[str], Field(alias="input-names", min_length=1)]


class WarmupSchedule(_Shape):
    type: Literal["cosine-with-warmup", "linear-with-warmup"]
    warmup_steps: Annotated[int, Field(ge=0)]
    training_steps: Annotated[int, Field(gt=0)]


class WsdSchedule(_Shape):
    type: Literal["wsd"]
    warmup_steps: Annotated[int, Field(ge=0)]
    # Rust sends decay_steps, Hypha's Python executor reads decay_step (§9.12): accept both.
    decay_steps: Annotated[int, Field(ge=0, validation_alias=AliasChoices("decay_steps", "decay_step"))]
    # Neither Hypha side has these; without them the stable phase lasts for the whole job (see training.py).
    stable_steps: Annotated[int, Field(ge=0)] | None = None
    training_steps: Annotated[int, Field(gt=0)] | None = None


class ProgressSpec(_Shape):
    """Ours, not Hypha's (its executors ignore it): where the job was when the control plane dispatched this
    trainer — ``rounds`` closed, the job's step (``steps``: the optimizer steps a trainer that took part in
    every closed round has run) and the ``steps_per_round`` a trainer runs from there (docs/training.md)."""

    rounds: Annotated[int, Field(ge=0)]
    steps: Annotated[int, Field(ge=0)]
    steps_per_round: Annotated[float, Field(ge=0, allow_inf_nan=False)]


class OverlapSpec(_Shape):
    """Ours, not Hypha's: how a trainer overlaps a round's communication with the next round's steps
    (docs/training.md, "Overlap: eager updates" and "Overlap: streaming"). ``none`` (also: the key absent) waits
    for each round's result; ``eager`` sends round r's update and trains on at once from a proxy of the
    parameter server's step, which needs the job's outer optimizer: ``outer_learning_rate`` (> 0) and
    ``outer_momentum`` (0 ≤ μ < 1); ``streaming`` sends one of ``fragments`` (F, 2–64) fragments of the model
    a round and trains on, mixing the fragment's global weights in with the weight ``mix`` (α, 0 ≤ α < 1) on
    the local ones when they arrive."""

    mode: Literal["none", "eager", "streaming"]
    outer_learning_rate: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    outer_momentum: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] | None = None
    # Strict: a JSON true or 2.5 is not a fragment count.
    fragments: Annotated[StrictInt, Field(ge=MIN_FRAGMENTS, le=MAX_FRAGMENTS)] | None = None
    #: Streaming: the job's rounds (its last one syncs every fragment); absent: every round one fragment.
    rounds: Annotated[StrictInt, Field(ge=1)] | None = None
    mix: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _each_mode_has_its_settings(self) -> OverlapSpec:
        if self.mode == "eager" and (self.outer_learning_rate is None or self.outer_momentum is None):
            raise ValueError("eager overlap needs outer_learning_rate and outer_momentum")
        if self.mode == "streaming" and (self.fragments is None or self.mix is None):
            raise ValueError(
                f"streaming overlap needs fragments ({MIN_FRAGMENTS} to {MAX_FRAGMENTS}) and mix (0 ≤ mix < 1)"
            )
        return self

    @property
    def eager(self) -> bool:
        return self.mode == "eager"

    @property
    def streaming(self) -> bool:
        return self.mode == "streaming"


class TrainConfig(_Shape):
    model: ModelSpec
    data: Reference
    updates: Reference
    results: Reference
    optimizer: OptimizerSpec
    batch_size: Annotated[int, Field(gt=0)]
    preprocessor: PreprocessorSpec | None = None
    scheduler: Annotated[WarmupSchedule | WsdSchedule, Field(discriminator="type")] | None = None
    progress: ProgressSpec | None = None
    #: Ours, not Hypha's: how the pseudo-gradients travel and the results come (docs/training.md, "Encodings").
    encoding: str = DEFAULT_ENCODING
    encoding_block_size: Annotated[int, Field(ge=MIN_BLOCK_SIZE, le=MAX_BLOCK_SIZE)] = DEFAULT_BLOCK_SIZE
    #: Ours, not Hypha's: only eager and streaming jobs carry it (docs/training.md, "Overlap: …").
    overlap: OverlapSpec | None = None
    #: Ours, not Hypha's: the training knobs (docs/configuration.md, "Training knobs").
    training: TrainingKnobs = Field(default_factory=TrainingKnobs)

    @model_validator(mode="after")
    def _batches_split_into_micro_batches(self) -> TrainConfig:
        steps = self.training.gradient_accumulation_steps
        if self.batch_size % steps:
            raise ValueError(
                f"training.gradient_accumulation_steps ({steps}) must divide batch_size ({self.batch_size})"
            )
        processes = self.training.processes
        if processes > 1 and self.batch_size % (processes * steps):
            raise ValueError(
                f"training.processes × gradient_accumulation_steps ({processes} × {steps}) must divide "
                f"batch_size ({self.batch_size})"
            )
        return self

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, value: str) -> str:
        if value not in ENCODINGS:
            raise ValueError(f"unknown encoding {value!r}; expected one of {', '.join(ENCODINGS)}")
        return value


class TrainJob(_Shape):
    job_id: str | None = None
    config: TrainConfig


def parse_job(text: str) -> TrainJob:
    """The train job in JOB_JSON ``text`` (the whole envelope). Raises :class:`JobConfigError`: not JSON,
    not a ``train`` envelope, a missing or mistyped key, an unknown model task."""
    try:
        envelope = json.loads(text)
    except ValueError as error:
        raise JobConfigError(f"the job is not JSON: {error}") from error
    if not isinstance(envelope, dict) or not isinstance(envelope.get("executor"), dict):
        raise JobConfigError("the job has no executor object")
    executor = envelope["executor"]
    if executor.get("class") != "train":
        raise JobConfigError(f"this executor runs train jobs, not {executor.get('class')!r}")
    try:
        job = TrainJob.model_validate({"job_id": envelope.get("job_id"), "config": executor.get("config")})
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        location = ".".join(str(part) for part in first["loc"])
        raise JobConfigError(f"executor.{location}: {first['msg']}") from error
    if job.config.model.task not in MODEL_CLASSES:
        raise JobConfigError(f"unknown model task {job.config.model.task!r}")
    return job
