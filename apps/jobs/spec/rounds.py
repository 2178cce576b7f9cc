"""The DiLoCo job specification's ``rounds`` section: how often trainers sync, how updates travel, and how the
parameter server combines and verifies them (see the package docstring)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from apps.jobs.spec.base import (
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_STREAMING_MIX,
    MAX_STEPS,
    OVERLAP_NONE,
    OVERLAP_NOT_AVAILABLE,
    OVERLAP_STREAMING,
    OVERLAPS,
    Float,
    Integer,
    _Spec,
)
from hypha_tensors.formats import (
    DEFAULT_BLOCK_SIZE,
    ENCODINGS,
    FLOAT32,
    INT8,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
)
from hypha_tensors.fragments import DEFAULT_FRAGMENTS, MAX_FRAGMENTS, MIN_FRAGMENTS

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
    validation_every: Integer | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="The validation step: in every round whose number is a multiple of this, each update is "
        "applied alone to the global weights and its held-out loss measured (needs evaluation data; one eval "
        "per update). Absent or 0: off.",
    )
    max_validation_rise: Float = Field(
        default=1.5,
        gt=1,
        le=1e6,
        description="With validation_every: reject an update that, applied alone, raises the held-out loss "
        "above this many times the global weights' loss.",
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
    discard_if_loss_rises: Float | None = Field(
        default=None,
        gt=1,
        le=1e6,
        description="Discard a round whose held-out loss rises above this many times the previous round's: the "
        "parameter server keeps the previous weights and momentum and trainers continue from them (needs "
        "evaluation data). Absent: never.",
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
        for name in ("aggregation", "clip_factor", "trim_fraction", "verification", "discard_if_loss_rises"):
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
            verification = self.verification.model_dump(exclude={"max_rejections"})
            if not self.verification.validation_every:  # no validation step: the keys of before
                del verification["validation_every"], verification["max_validation_rise"]
            keys["verification"] = verification
        if self.discard_if_loss_rises is not None:
            keys["discard_if_loss_rises"] = self.discard_if_loss_rises
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
