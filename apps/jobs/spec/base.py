"""The DiLoCo job specification's shared parts: its bounds and defaults, the strict base model and the strict
number types (see the package docstring)."""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
)

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
