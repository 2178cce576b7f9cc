"""JSON shapes of Hypha's job bridge (§1.2, §1.3): references, data slices, request bodies, progress.

References are internally tagged by a lowercase ``"type"``; a peers reference's ``strategy`` is itself
tagged (``{"type": "All"}``, never a bare string). As in Hypha (serde without ``deny_unknown_fields``),
unknown fields are ignored and optional fields may be missing (then ``null``). ``model_dump(mode="json")``
gives exactly the JSON Hypha writes, ``null`` fields included.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator


class _Shape(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class SelectionStrategy(_Shape):
    type: Literal["All", "One", "Random"]


class DataSlice(_Shape):
    dataset: str
    index: Annotated[int, Field(ge=0)]


class UriReference(_Shape):
    type: Literal["uri"] = "uri"
    value: str


class HuggingFaceReference(_Shape):
    type: Literal["huggingface"] = "huggingface"
    repository: str
    revision: str | None = None
    """``None`` means ``"main"``."""
    filenames: list[str]
    token: str | None = None


class PeersReference(_Shape):
    type: Literal["peers"] = "peers"
    peers: list[str]
    strategy: SelectionStrategy
    resource: DataSlice | None = None


class SchedulerReference(_Shape):
    type: Literal["scheduler"] = "scheduler"
    peer: str
    dataset: str


class ParameterServerReference(_Shape):
    """Our extension (not Hypha's): the current global model of a job's parameter server, named by its peer
    id; the bridge downloads ``GET <peer URL>/jobs/<job>/model/<filename>`` for each of ``filenames``."""

    type: Literal["parameter-server"] = "parameter-server"
    peer: str
    filenames: list[str]


Reference = Annotated[
    UriReference | HuggingFaceReference | PeersReference | SchedulerReference | ParameterServerReference,
    Field(discriminator="type"),
]
"""Any resource reference; what ``/resources/fetch`` deserialises."""

FetchReference = UriReference | HuggingFaceReference | SchedulerReference | ParameterServerReference
"""The references a fetch accepts after the bridge's own checks."""

reference_adapter: TypeAdapter[Any] = TypeAdapter(Reference)


class SendRequest(_Shape):
    """Body of ``/resources/send``: a peers reference (any strategy) and a file relative to the work dir."""

    resource: PeersReference
    path: str


class ReceiveRequest(_Shape):
    """Body of ``/resources/receive``: a peers reference with strategy ``All`` (an empty ``peers`` list
    means "from anyone") and a directory relative to the work dir."""

    resource: PeersReference
    path: str = "incoming"

    @model_validator(mode="after")
    def _strategy_all(self) -> ReceiveRequest:
        if self.resource.strategy.type != "All":
            raise ValueError("receive needs a peers reference with strategy All")
        return self


# --- Progress (/status/send): externally tagged, kebab-case tags -------------------------------------------


class StatusBody(BaseModel):
    """``{"batch_size": n}``; other fields (the executor's ``round_time``) are kept."""

    model_config = ConfigDict(extra="allow", frozen=True)
    batch_size: Annotated[int, Field(ge=0)]


class MetricsBody(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    round: Annotated[int, Field(ge=0)]
    metrics: dict[str, float]


class StatusProgress(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    status: StatusBody


class MetricsProgress(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    metrics: MetricsBody


UNIT_PROGRESS = ("update", "update-received", "updated")


class UnitProgress(BaseModel):
    """A unit variant, given as a bare string (``"update"``) or as ``{"update": null}``."""

    model_config = ConfigDict(frozen=True)
    kind: Literal["update", "update-received", "updated"]

    @model_validator(mode="before")
    @classmethod
    def _from_wire(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"kind": value}
        if isinstance(value, dict) and len(value) == 1:
            ((key, inner),) = value.items()
            if key in UNIT_PROGRESS and inner is None:
                return {"kind": key}
        raise ValueError(f"expected one of {', '.join(UNIT_PROGRESS)} (or {{tag: null}}), got {value!r}")


class ReadyProgress(BaseModel):
    """Our parameter server's extension: ``{"ready": {"url": …, "round": n}}`` once it listens."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ready: dict[str, Any]


class RoundProgress(BaseModel):
    """Our parameter server's extension: ``{"round": {"round": r, "participants": [...], …}}`` per round."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    round: dict[str, Any]


class WaitingProgress(BaseModel):
    """Our parameter server's extension: ``{"waiting": {"round": r}}`` when a round has its first update (the
    control plane answers whom to expect: ``{"type": "Expect", "peers": [...], "due_in": s}``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    waiting: dict[str, Any]


Progress = StatusProgress | MetricsProgress | ReadyProgress | RoundProgress | WaitingProgress | UnitProgress


def parse_progress(value: Any) -> Progress:
    """The Progress variant ``value`` is; raises ``ValueError`` (pydantic's ``ValidationError``) otherwise.

    The bridge only checks the shape: it forwards the original JSON value, unknown fields included.
    """
    if isinstance(value, dict) and "status" in value:
        return StatusProgress.model_validate(value)
    if isinstance(value, dict) and "metrics" in value:
        return MetricsProgress.model_validate(value)
    if isinstance(value, dict) and "ready" in value:
        return ReadyProgress.model_validate(value)
    if isinstance(value, dict) and "round" in value:
        return RoundProgress.model_validate(value)
    if isinstance(value, dict) and "waiting" in value:
        return WaitingProgress.model_validate(value)
    return UnitProgress.model_validate(value)
