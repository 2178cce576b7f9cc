"""The worker gateway protocol, shared by the control plane and the worker daemon.

Every frame on ``/ws/worker/`` is one JSON object with a ``"type"`` field naming the message. The daemon
connects outbound, authenticates with ``Authorization: Bearer <token>`` on the websocket handshake, and
then speaks first with :class:`Hello`.

Conversation (``→`` daemon to control plane, ``←`` control plane to daemon)::

    → hello                      resources, executors, price floor, leases it still holds
    ← welcome                    worker id, timing constants, open adverts, and the leases the daemon may keep:
                                 those it claimed that the control plane still has ACTIVE (others are ended)
    ← advertisement              a job role wants workers: minimum resources, executors, public bid
    → offer                      price and offered resources for one advertisement
    ← offer_received             the control plane holds a TEMPORARY lease for the offer
    ← offer_declined             the offer lost, was refused, or its window closed
    ← lease_granted              the offer won: the lease is ACTIVE
    ← renew_lease                please confirm you still hold this lease
    → lease_renewed              confirmed; the control plane extends the lease by its TTL
    → renew_refused              the daemon does not hold it (the control plane releases it)
    → release_lease              the daemon gives a lease back (shutdown, cannot serve it)
    ← lease_ended                the lease is EXPIRED or RELEASED; the daemon frees its resources
    ← advertisement_closed       the advertisement is filled or cancelled; stop offering on it
    ← error                      the last frame was malformed, unknown, or refused; nothing changed

Renewal is a round trip on purpose: a lease is only extended when its daemon answers, so a daemon that
died (``kill -9``) loses its leases within one TTL without any extra failure detection.

Versioning: :data:`PROTOCOL_VERSION` is sent in :class:`Hello`. The control plane accepts the versions in
:data:`SUPPORTED_VERSIONS` and closes with :data:`CloseCode.UNSUPPORTED_VERSION` otherwise. Unknown fields are
ignored (forward compatible); unknown message types get an :class:`Error` frame.

This module must stay importable without Django: the daemon runs on GPU hosts without it.
"""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})

#: Weights of the capacity score, from the original's resource evaluator (reference §3.3, §3.4):
#: a GB of VRAM is worth 25 cores, a GB of memory 0.1 cores, a GB of storage 0.01 cores.
RESOURCE_WEIGHTS = {"gpu": 25.0, "cpu": 1.0, "memory": 0.1, "storage": 0.01}


class CloseCode(enum.IntEnum):
    """Websocket close codes the control plane uses (4000–4999 is the application range)."""

    MISSING_TOKEN = 4000
    INVALID_TOKEN = 4001
    UNSUPPORTED_VERSION = 4002
    TOKEN_REVOKED = 4003
    HELLO_EXPECTED = 4004
    SUPERSEDED = 4009
    SERVER_SHUTDOWN = 4010

    @property
    def is_fatal(self) -> bool:
        """True when reconnecting with the same token and version cannot succeed."""
        return self in {
            CloseCode.MISSING_TOKEN,
            CloseCode.INVALID_TOKEN,
            CloseCode.TOKEN_REVOKED,
            CloseCode.UNSUPPORTED_VERSION,
        }


class ErrorCode(enum.StrEnum):
    MALFORMED = "malformed"
    UNKNOWN_TYPE = "unknown_type"
    UNKNOWN_ADVERTISEMENT = "unknown_advertisement"
    UNKNOWN_LEASE = "unknown_lease"
    REFUSED = "refused"
    TOO_LARGE = "too_large"
    INTERNAL = "internal"


class _Message(BaseModel):
    # No NaN or infinity anywhere: an infinite price or capacity would poison rankings and JSON responses.
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True, allow_inf_nan=False)


class Resources(_Message):
    """A resource vector. Units: CPU cores, memory GB, storage GB, GPU GB of VRAM."""

    cpu: float = Field(default=0.0, ge=0)
    memory: float = Field(default=0.0, ge=0)
    storage: float = Field(default=0.0, ge=0)
    gpu: float = Field(default=0.0, ge=0)

    def fits_within(self, capacity: Resources) -> bool:
        """Component-wise ``self <= capacity`` (a product order, as in the original)."""
        return all(getattr(self, name) <= getattr(capacity, name) + 1e-9 for name in RESOURCE_WEIGHTS)

    def __add__(self, other: Resources) -> Resources:
        return Resources(**{name: getattr(self, name) + getattr(other, name) for name in RESOURCE_WEIGHTS})

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            **{name: max(0.0, getattr(self, name) - getattr(other, name)) for name in RESOURCE_WEIGHTS}
        )

    def weighted(self) -> float:
        """The weighted capacity used to compare prices: ``25·gpu + cpu + 0.1·memory + 0.01·storage``."""
        return sum(weight * getattr(self, name) for name, weight in RESOURCE_WEIGHTS.items())


ZERO = Resources()


class ExecutorDescriptor(_Message):
    """An executor a worker offers or a job requires: its class (``train``, ``aggregate``) and name."""

    executor_class: str = Field(alias="class", min_length=1, max_length=64)
    name: str = Field(min_length=1, max_length=128)

    def key(self) -> tuple[str, str]:
        return (self.executor_class, self.name)


class LeaseInfo(_Message):
    lease_id: uuid.UUID
    job_id: uuid.UUID
    role: str
    status: Literal["temporary", "active"]
    resources: Resources
    price: float = Field(default=0.0, ge=0)
    expires_in: float = Field(description="Seconds until the lease expires unless renewed.")


# --- daemon → control plane ----------------------------------------------------------------------------


class Hello(_Message):
    type: Literal["hello"] = "hello"
    protocol_version: int
    daemon_version: str = Field(default="", max_length=64)
    resources: Resources
    executors: list[ExecutorDescriptor] = Field(max_length=64)
    price_floor: float = Field(default=0.0, ge=0)
    strategy: Literal["whole", "flexible"] = "whole"
    leases: list[uuid.UUID] = Field(default_factory=list, max_length=1024)


class Offer(_Message):
    type: Literal["offer"] = "offer"
    advertisement_id: uuid.UUID
    attempt: int = Field(ge=0)
    price: float = Field(ge=0)
    resources: Resources


class LeaseRenewed(_Message):
    type: Literal["lease_renewed"] = "lease_renewed"
    lease_id: uuid.UUID


class RenewRefused(_Message):
    type: Literal["renew_refused"] = "renew_refused"
    lease_id: uuid.UUID
    reason: str = Field(default="", max_length=500)


class ReleaseLease(_Message):
    type: Literal["release_lease"] = "release_lease"
    lease_id: uuid.UUID
    reason: str = Field(default="", max_length=500)


DaemonMessage = Annotated[
    Hello | Offer | LeaseRenewed | RenewRefused | ReleaseLease,
    Field(discriminator="type"),
]

# --- control plane → daemon ----------------------------------------------------------------------------


class Advertisement(_Message):
    type: Literal["advertisement"] = "advertisement"
    advertisement_id: uuid.UUID
    attempt: int = Field(ge=0)
    job_id: uuid.UUID
    role: str
    resources: Resources = Field(description="Minimum resources per worker for this role.")
    executors: list[ExecutorDescriptor] = Field(description="Every one of these must be offered.")
    bid: float
    wanted: int = Field(description="How many workers the role still needs.")
    window_closes_in: float | None = Field(
        default=None,
        ge=0,
        description="Seconds until this attempt stops taking offers; an offer sent later is declined. "
        "If the window closes short, advertisement_closed follows and a later attempt is advertised anew.",
    )


class AdvertisementClosed(_Message):
    type: Literal["advertisement_closed"] = "advertisement_closed"
    advertisement_id: uuid.UUID
    reason: str = ""


class Welcome(_Message):
    type: Literal["welcome"] = "welcome"
    worker_id: uuid.UUID
    worker_name: str
    protocol_version: int = PROTOCOL_VERSION
    lease_ttl: float
    offer_ttl: float
    leases: list[LeaseInfo]
    advertisements: list[Advertisement]


class OfferReceived(_Message):
    type: Literal["offer_received"] = "offer_received"
    advertisement_id: uuid.UUID
    offer_id: uuid.UUID
    lease_id: uuid.UUID
    expires_in: float


class OfferDeclined(_Message):
    type: Literal["offer_declined"] = "offer_declined"
    advertisement_id: uuid.UUID
    lease_id: uuid.UUID | None = None
    reason: str


class LeaseGranted(_Message):
    type: Literal["lease_granted"] = "lease_granted"
    lease_id: uuid.UUID
    advertisement_id: uuid.UUID
    job_id: uuid.UUID
    role: str
    resources: Resources
    price: float
    expires_in: float


class RenewLease(_Message):
    type: Literal["renew_lease"] = "renew_lease"
    lease_id: uuid.UUID
    expires_in: float = Field(description="The lease's TTL once the renewal is confirmed.")


class LeaseEnded(_Message):
    type: Literal["lease_ended"] = "lease_ended"
    lease_id: uuid.UUID
    status: Literal["expired", "released"]
    reason: str = ""


class Error(_Message):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: str
    ref: str | None = Field(default=None, description="The type of the frame this error answers, if known.")
    lease_id: uuid.UUID | None = Field(default=None, description="The lease the refused frame named, if any.")
    at: datetime | None = None


ServerMessage = Annotated[
    Welcome
    | Advertisement
    | AdvertisementClosed
    | OfferReceived
    | OfferDeclined
    | LeaseGranted
    | RenewLease
    | LeaseEnded
    | Error,
    Field(discriminator="type"),
]

_daemon_adapter: TypeAdapter[DaemonMessage] = TypeAdapter(DaemonMessage)
_server_adapter: TypeAdapter[ServerMessage] = TypeAdapter(ServerMessage)

DAEMON_MESSAGE_TYPES = frozenset({"hello", "offer", "lease_renewed", "renew_refused", "release_lease"})
SERVER_MESSAGE_TYPES = frozenset(
    {
        "welcome",
        "advertisement",
        "advertisement_closed",
        "offer_received",
        "offer_declined",
        "lease_granted",
        "renew_lease",
        "lease_ended",
        "error",
    }
)


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol. ``code`` says why; ``ref`` is its type, if any."""

    def __init__(self, code: ErrorCode, message: str, ref: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.ref = ref

    def to_frame(self) -> Error:
        return Error(code=self.code, message=self.message, ref=self.ref)


def _parse(text: str | bytes, adapter: TypeAdapter, known: frozenset[str]):
    import json

    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise ProtocolError(ErrorCode.MALFORMED, f"frame is not JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "frame must be a JSON object with a 'type' field")
    message_type = raw.get("type")
    if not isinstance(message_type, str):
        raise ProtocolError(ErrorCode.MALFORMED, "frame has no string 'type' field")
    if message_type not in known:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE,
            f"unknown message type {message_type!r}; expected one of {sorted(known)}",
            ref=message_type[:64],
        )
    try:
        return adapter.validate_python(raw)
    except ValidationError as error:
        details = "; ".join(
            f"{'.'.join(str(part) for part in item['loc'][1:]) or '(frame)'}: {item['msg']}"
            for item in error.errors()
        )
        raise ProtocolError(
            ErrorCode.MALFORMED, f"invalid {message_type!r}: {details}", ref=message_type
        ) from None


def parse_daemon_message(text: str | bytes) -> DaemonMessage:
    """Parse a frame sent by a daemon; raise :class:`ProtocolError` with a reason otherwise."""
    return _parse(text, _daemon_adapter, DAEMON_MESSAGE_TYPES)


def parse_server_message(text: str | bytes) -> ServerMessage:
    """Parse a frame sent by the control plane; raise :class:`ProtocolError` with a reason otherwise."""
    return _parse(text, _server_adapter, SERVER_MESSAGE_TYPES)


def encode(message: _Message) -> str:
    """Serialise a message to its JSON frame (field aliases such as ``class`` applied)."""
    return message.model_dump_json(by_alias=True)
