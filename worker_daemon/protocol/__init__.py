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
    ← dispatch_job               run a task of a job under an ACTIVE lease (the JOB_JSON and how to reach peers)
    → job_started                the task's process runs (and the parameter server's URL, once it listens)
    → task_log                   new output lines of a running task (every few seconds)
    → job_exited                 the task's process ended: exit code, signal, last log lines
    ← cancel_job                 stop a task (SIGTERM, then SIGKILL after a grace period)
    → status                     a progress value from an executor's bridge (verbatim), with a request id
    ← status_reply               the control plane's reply to it (``{"type": "Continue"}``, …)
    → fetch_slice                a trainer's bridge wants the next data slice of the job
    ← slice_assigned             which slice, its size and digest, and the data nodes that serve it
    → slice_ack                  the executor has the slice: it becomes USED
    → transfer_problem           a task cannot reach a peer (parameter server, data node): where, why, since when
    → transfer_ok                that peer answers again: the problem is over
    ← run_benchmark              measure this worker's speed now (an operator asked)
    → benchmark_result           a benchmark finished (or failed): its score and details
    ← error                      the last frame was malformed, unknown, or refused; nothing changed

Renewal is a round trip on purpose: a lease is only extended when its daemon answers, so a daemon that
died (``kill -9``) loses its leases within one TTL without any extra failure detection.

Versioning: :data:`PROTOCOL_VERSION` is sent in :class:`Hello`. The control plane accepts the versions in
:data:`SUPPORTED_VERSIONS` and closes with :data:`CloseCode.UNSUPPORTED_VERSION` otherwise. Unknown fields are
ignored (forward compatible); unknown message types get an :class:`Error` frame.

This package must stay importable without Django: the daemon runs on GPU hosts without it. It is split by
concern — the messages here, devices as resources in :mod:`worker_daemon.protocol.devices`, transfer tokens and
the public-address rule in :mod:`worker_daemon.protocol.tokens` — and every public name is importable from
``worker_daemon.protocol``.
"""

from __future__ import annotations

import enum
import typing
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from worker_daemon.protocol.devices import (  # noqa: F401 (re-exported)
    MAX_DEVICE_INDEX,
    MAX_DEVICE_MEMORY,
    MAX_DEVICES,
    Device,
    DeviceIndices,
    DeviceList,
    choose_devices,
    cuda_visible_devices,
    device_share,
    devices_fit,
)

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})

#: The largest benchmark score (training samples per second) taken: far above any real device on the
#: standard workload, so that a larger number can only be a bug or a lie.
MAX_BENCHMARK_SCORE = 1e7
#: The largest ``--slowdown`` factor (an experiment knob; beyond it a step would outlast any round).
MAX_SLOWDOWN = 100.0

#: Weights of the capacity score, from the original's resource evaluator (reference §3.3, §3.4):
#: a GB of VRAM is worth 25 cores, a GB of memory 0.1 cores, a GB of storage 0.01 cores.
RESOURCE_WEIGHTS = {"gpu": 25.0, "cpu": 1.0, "memory": 0.1, "storage": 0.01}

#: What every price is — a job's bid and private maximum, an offer's price, a lease's agreed price, a worker's
#: floor: credits per hour of a lease, per worker. The control plane bills nothing itself (prices rank and cap
#: offers); a deployment's accounting bills in this unit (docs/architecture.md, "Prices").
PRICE_UNIT = "credits/h"
PRICE_MEANING = "credits per hour of a lease, per worker"

#: Files of a model's directory, besides ``config.json`` and ``model.safetensors``, that the final model carries
#: when the initial model had them (saved by ``save_pretrained`` or brought with the source): the parameter
#: server uploads them and the control plane keeps them in the zip users download. Data only, by exact name:
#: no code (``*.py`` would run with ``trust_remote_code``), nothing else a worker could slip into the archive.
MODEL_EXTRA_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
    "processor_config.json", "video_preprocessor_config.json",
)  # fmt: skip

#: Whether a worker or data node accepts inbound connections at its public URL: ``true``, ``false``, or
#: ``"auto"`` (not said: to be found out). The config files, ``--reachable`` and ``hello`` spell it the same way.
Reachable = bool | Literal["auto"]


class CloseCode(enum.IntEnum):
    """Websocket close codes the control plane uses (4000–4999 is the application range)."""

    MISSING_TOKEN = 4000
    INVALID_TOKEN = 4001
    UNSUPPORTED_VERSION = 4002
    TOKEN_REVOKED = 4003
    HELLO_EXPECTED = 4004
    #: The connection kept sending over the gateway's rate limit after being told (``rate_limited``).
    FLOODING = 4008
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
    RATE_LIMITED = "rate_limited"
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

    def capped(self, **caps: float | None) -> Resources:
        """Component-wise ``min(self, cap)`` for each resource given a cap (``None``: no cap on that one)."""
        return Resources(
            **{
                name: getattr(self, name) if caps.get(name) is None else min(getattr(self, name), caps[name])
                for name in RESOURCE_WEIGHTS
            }
        )

    def weighted(self) -> float:
        """The weighted capacity used to compare prices: ``25·gpu + cpu + 0.1·memory + 0.01·storage``."""
        return sum(weight * getattr(self, name) for name, weight in RESOURCE_WEIGHTS.items())


ZERO = Resources()

#: The most a worker may declare of each resource (``hello``, ``offer``): far above any one host (4096 cores,
#: 16 TiB of memory, 10 PB of storage, 64 GPUs of 1 TB of VRAM), so that more can only be a bug or a lie. A
#: ``hello`` of 1e300 cores was welcomed once, and would win every ranking by price per capacity.
MAX_DECLARED = {"cpu": 4096.0, "memory": 16384.0, "storage": 10_000_000.0, "gpu": 65536.0}


def _declarable(resources: Resources) -> Resources:
    for name, maximum in MAX_DECLARED.items():
        if getattr(resources, name) > maximum:
            raise PydanticCustomError(
                "declared_too_large",
                "{name} of {value} is more than a worker may declare ({maximum})",
                {"name": name, "value": f"{getattr(resources, name):.15g}", "maximum": f"{maximum:.15g}"},
            )
    return resources


#: Resources a daemon declares: each at most :data:`MAX_DECLARED` (a plain :class:`Resources` once parsed;
#: sums and stored rows are not bounded, only what a daemon says).
DeclaredResources = Annotated[Resources, AfterValidator(_declarable)]


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
    devices: DeviceIndices = Field(default_factory=list, description="The device indices the lease holds.")
    price: float = Field(default=0.0, ge=0)
    expires_in: float = Field(description="Seconds until the lease expires unless renewed.")


class BenchmarkResult(_Message):
    """A worker benchmark's outcome (:mod:`worker_daemon.benchmark`): AdamW training steps of a fixed small
    model on a fixed batch, on the daemon's real device. ``score`` is training samples per second on that
    workload (higher is faster), measured with the daemon's ``slowdown`` applied."""

    score: float = Field(gt=0, le=MAX_BENCHMARK_SCORE, description="Training samples per second.")
    device: str = Field(min_length=1, max_length=64, description="cpu, cuda, cuda:0, …")
    device_name: str = Field(default="", max_length=200)
    model: str = Field(min_length=1, max_length=128, description="The standard workload's model.")
    parameters: int = Field(ge=0)
    batch_size: int = Field(ge=1)
    sequence_length: int = Field(default=0, ge=0)
    threads: int = Field(default=0, ge=0, description="torch threads (CPU), 0 when not set")
    warmup_steps: int = Field(default=0, ge=0)
    steps: int = Field(ge=1, description="Timed steps.")
    step_seconds: float = Field(gt=0, description="Median seconds of a timed step (slowdown included).")
    duration_seconds: float = Field(default=0.0, ge=0, description="Wall time of the whole benchmark.")
    slowdown: float = Field(default=1.0, ge=1, le=MAX_SLOWDOWN)
    torch_version: str = Field(default="", max_length=64)
    measured_at: datetime


# --- daemon → control plane ----------------------------------------------------------------------------


class Hello(_Message):
    type: Literal["hello"] = "hello"
    protocol_version: int
    daemon_version: str = Field(default="", max_length=64)
    resources: DeclaredResources
    devices: DeviceList = Field(
        default_factory=list, description="The worker's devices (GPUs); none from older daemons."
    )
    executors: list[ExecutorDescriptor] = Field(max_length=64)
    price_floor: float = Field(default=0.0, ge=0)
    strategy: Literal["whole", "flexible"] = "whole"
    leases: list[uuid.UUID] = Field(default_factory=list, max_length=1024)
    benchmark: BenchmarkResult | None = Field(
        default=None, description="The daemon's last benchmark, if one finished before this hello."
    )
    reachable: Reachable = Field(
        default="auto",
        description="Whether the worker accepts inbound connections at its parameter server's public URL: "
        'true, false, or "auto" (not said; also what an older daemon that sends nothing means).',
    )


class Offer(_Message):
    type: Literal["offer"] = "offer"
    advertisement_id: uuid.UUID
    attempt: int = Field(ge=0)
    price: float = Field(ge=0)
    resources: DeclaredResources
    devices: DeviceIndices = Field(
        default_factory=list, description="The device indices offered: as many as the advertisement asks."
    )
    benchmark_score: float | None = Field(
        default=None, gt=0, le=MAX_BENCHMARK_SCORE, description="The worker's benchmark score, if known."
    )


class BenchmarkReport(_Message):
    """A benchmark ended: at start after ``hello`` went out, or after ``run_benchmark``. Either ``benchmark``
    (it ran) or ``error`` (why it did not: failed, timed out, busy with a task)."""

    type: Literal["benchmark_result"] = "benchmark_result"
    request_id: uuid.UUID | None = Field(default=None, description="The run_benchmark it answers, if any.")
    benchmark: BenchmarkResult | None = None
    error: str = Field(default="", max_length=2000)

    @model_validator(mode="after")
    def _result_or_error(self) -> BenchmarkReport:
        if (self.benchmark is None) == (not self.error):
            raise ValueError("exactly one of 'benchmark' and 'error' must be given")
        return self


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


class JobStarted(_Message):
    """The task's process runs. A parameter server reports its URL later, in a ``ready`` status."""

    type: Literal["job_started"] = "job_started"
    task_id: uuid.UUID


class JobExited(_Message):
    """The task's process ended by itself, or after ``cancel_job``/lease loss (``cancelled``)."""

    type: Literal["job_exited"] = "job_exited"
    task_id: uuid.UUID
    exit_code: int | None = Field(default=None, description="The exit status; None when killed by a signal.")
    signal: int | None = None
    cancelled: bool = False
    reason: str = Field(default="", max_length=2000)
    log_tail: str = Field(default="", max_length=8000, description="The last lines of its output.")


class TaskLog(_Message):
    """New output lines of a running task, sent every few seconds (the job page shows them)."""

    type: Literal["task_log"] = "task_log"
    task_id: uuid.UUID
    lines: list[Annotated[str, Field(max_length=1000)]] = Field(max_length=200)


class StatusReport(_Message):
    """A progress value exactly as the task's bridge received it (Hypha's ``Progress``: ``{"status": …}``,
    ``{"metrics": …}``, ``"update"``, ``"update-received"``; a parameter server also sends ``{"ready": …}``,
    ``{"round": …}`` and ``{"waiting": …}``). The control plane answers with :class:`StatusReply` of the same ``request_id``."""

    type: Literal["status"] = "status"
    request_id: uuid.UUID
    task_id: uuid.UUID
    progress: dict[str, Any] | str


class FetchSlice(_Message):
    type: Literal["fetch_slice"] = "fetch_slice"
    request_id: uuid.UUID
    task_id: uuid.UUID
    dataset: str = Field(max_length=200)


class SliceAck(_Message):
    type: Literal["slice_ack"] = "slice_ack"
    task_id: uuid.UUID
    index: int = Field(ge=0)


class TransferProblem(_Message):
    """A task's transfer cannot reach a peer: sent once a call has failed more times in a row than the bridge
    retries quietly (3), then again with each further failure (at most one every few seconds: the retries back
    off), until a :class:`TransferOk` for the same peer. The control plane keeps the latest per (task, peer)
    and shows it on the job (``transfer_problems``); a task that then fails is said to have failed of it."""

    type: Literal["transfer_problem"] = "transfer_problem"
    task_id: uuid.UUID
    peer: str = Field(
        min_length=1, max_length=200, description="The parameter server's peer id, or the data node's host."
    )
    role: Literal["parameter_server", "data_node"]
    url: str = Field(max_length=500, description="What was called, without its query (tokens live there).")
    operation: str = Field(
        min_length=1, max_length=200, description="e.g. 'round 3 update', 'slice download'"
    )
    cause: str = Field(
        min_length=1, max_length=1000, description="The last failure, e.g. 'Connect call failed'"
    )
    attempts: int = Field(ge=1, description="Failed attempts in a row so far.")
    since: AwareDatetime = Field(description="When the first of those attempts failed (with its time zone).")


class TransferOk(_Message):
    """The peer of an earlier :class:`TransferProblem` of the task answered again (even with an HTTP error:
    it is reachable); the control plane drops the problem."""

    type: Literal["transfer_ok"] = "transfer_ok"
    task_id: uuid.UUID
    peer: str = Field(min_length=1, max_length=200)


DaemonMessage = Annotated[
    Hello
    | Offer
    | LeaseRenewed
    | RenewRefused
    | ReleaseLease
    | JobStarted
    | JobExited
    | TaskLog
    | StatusReport
    | FetchSlice
    | SliceAck
    | TransferProblem
    | TransferOk
    | BenchmarkReport,
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
    devices: int = Field(default=0, ge=0, le=MAX_DEVICES, description="Devices per worker (0: none needed).")
    device_memory: float = Field(default=0.0, ge=0, le=MAX_DEVICE_MEMORY, description="GB per device.")
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
    devices: DeviceIndices = Field(default_factory=list, description="The device indices the lease holds.")
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


class DispatchJob(_Message):
    """Run a task of a job under the ACTIVE lease ``lease_id``.

    ``spec`` is the JOB_JSON envelope handed to the executor unchanged (reference §2). ``peers`` maps the peer
    ids its references name to base URLs (the parameter server's, ``http://host:port``). ``transfer_token``
    authorises this task's uploads and downloads at those peers. A parameter server also gets
    ``transfer_key`` (to verify the trainers' tokens) and ``server_url`` (where to upload the final model).
    """

    type: Literal["dispatch_job"] = "dispatch_job"
    task_id: uuid.UUID
    lease_id: uuid.UUID
    job_id: uuid.UUID
    role: str
    spec: dict[str, Any]
    peers: dict[str, str] = Field(default_factory=dict)
    #: Peer ids (of ``peers``) this task reaches through the control plane's relay instead of their URL:
    #: they accept no inbound connections (docs/transfers.md). Older daemons ignore it.
    relay: list[str] = Field(default_factory=list, max_length=64)
    transfer_token: str | None = None
    transfer_key: str | None = None


class TransferToken(_Message):
    """A fresh transfer token for the running task ``task_id`` (sent with each renewal of its lease: tokens
    are short-lived); it replaces the dispatch's ``transfer_token`` from now on."""

    type: Literal["transfer_token"] = "transfer_token"
    task_id: uuid.UUID
    transfer_token: str = Field(min_length=1, max_length=4096)


class CancelJob(_Message):
    type: Literal["cancel_job"] = "cancel_job"
    task_id: uuid.UUID
    reason: str = ""


class StatusReply(_Message):
    type: Literal["status_reply"] = "status_reply"
    request_id: uuid.UUID
    reply: dict[str, Any] = Field(description='Passed to the executor as is, e.g. {"type": "Continue"}.')
    continue_for: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description='How many of the task\'s next step reports ({"status": …}) the daemon may answer '
        '{"type": "Continue"} itself; the report after them carries covered_steps and covered_samples.',
    )


class SliceAssigned(_Message):
    """The answer to :class:`FetchSlice`: a slice (``index`` with its size, digest and the URLs that serve it),
    or none for now (``index`` is None; ask again after ``retry_in`` seconds), or an ``error``. ``done``
    (inference tasks): no slice is left for this task, for good: every slice is USED or its own (the bridge
    answers the executor's fetch with ``[]``); slices another live lease holds are a ``retry_in``."""

    type: Literal["slice_assigned"] = "slice_assigned"
    request_id: uuid.UUID
    dataset: str
    index: int | None = Field(default=None, ge=0)
    size: int = Field(default=0, ge=0)
    sha256: str = ""
    urls: list[str] = Field(default_factory=list)
    retry_in: float | None = Field(default=None, ge=0)
    error: str | None = None
    done: bool = False


class RunBenchmark(_Message):
    """Measure the worker's speed now; answered by ``benchmark_result`` with the same ``request_id``."""

    type: Literal["run_benchmark"] = "run_benchmark"
    request_id: uuid.UUID = Field(default_factory=uuid.uuid4)


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
    | DispatchJob
    | TransferToken
    | CancelJob
    | StatusReply
    | SliceAssigned
    | RunBenchmark
    | Error,
    Field(discriminator="type"),
]

_daemon_adapter: TypeAdapter[DaemonMessage] = TypeAdapter(DaemonMessage)
_server_adapter: TypeAdapter[ServerMessage] = TypeAdapter(ServerMessage)


def _message_types(union: Any) -> frozenset[str]:
    """The ``type`` values of a discriminated union's classes: the parse gate knows exactly what the schemas
    define (a hand-kept list once left out ``transfer_token``, and daemons dropped every fresh token)."""
    members = typing.get_args(typing.get_args(union)[0])
    return frozenset(member.model_fields["type"].default for member in members)


DAEMON_MESSAGE_TYPES = _message_types(DaemonMessage)
SERVER_MESSAGE_TYPES = _message_types(ServerMessage)


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


# Split by concern; every public name stays importable from ``worker_daemon.protocol``.
from worker_daemon.protocol.tokens import (  # noqa: E402, F401
    TransferTokenError,
    is_public_address,
    sign_transfer_token,
    verify_transfer_token,
)
