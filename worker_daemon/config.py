"""The worker daemon's configuration: Hypha's worker TOML keys, layered with env vars and CLI flags.

Accepted keys (Hypha's worker keys, reference §7.3; the original's example files load unchanged)::

    work_dir = "/var/hypha/work"     # default: the system temp dir; relative paths are resolved against
                                     # the working directory at startup
    [resources]                      # numbers >= 0; absent ones are measured: cpu = os.cpu_count(),
    cpu = 16                         # memory = MemTotal of /proc/meminfo in GB, storage = free GB of
    memory = 64                      # work_dir's file system, gpu = 0 (GB of VRAM)
    storage = 500
    gpu = 24                         # Hypha's: total VRAM, GB; no device list (serves roles that ask for
                                     # no devices); with a device list it defaults to their sum
    gpus = 4                         # ours: 4 devices (indices 0-3) of gpu_memory GB each, or instead
    gpu_memory = 24                  # one [[resources.devices]] table per device:
    [[resources.devices]]            #   memory = 24 (GB, required), index = 0 (CUDA ordinal; default: its
    memory = 24                      #   position in the list), name = "A10" (optional)
    [offer]
    price = 100.0                    # under "whole": the counter-offer, price = max(price, bid)
    floor = 100.0                    # bids below it are ignored
    strategy = { type = "whole" }    # or "flexible"; the bare string strategy = "whole" works too
    [[executors]]                    # default: the built-in trainer, the parameter server, inference
    class = "train"
    name = "diloco-transformer"
    runtime = "process"              # or "parameter-server", "trainer" (ours: the built-in trainer), or
                                     # "inference" (ours: the built-in batch inference executor)
    cmd = "uv"                       # process only, required there
    args = ["..."]                   # process only, optional
    env = { HF_HOME = "/data/hf" }   # ours: added to the task's environment (see ExecutorConfig)

Our own keys (not Hypha's)::

    kill_grace = 5.0                 # seconds between SIGTERM and SIGKILL when a task is cancelled
    warm_start = true                # keep a warm spare interpreter for the built-in runtimes ("trainer",
                                     # "parameter-server") while idle (worker_daemon.spares); false: every
                                     # task starts a cold interpreter. "process" executors always do.
    benchmark = true                 # run the worker benchmark at start (worker_daemon.benchmark)
    slowdown = 1.0                   # >= 1: an experiment/test knob that makes this worker deliberately
                                     # slower (executors get HYPHA_SLOWDOWN and sleep (slowdown - 1) × each
                                     # step's time after it; the benchmark does the same)
    byzantine = ""                   # an experiment/test knob: "scale:K", "sign_flip", "random" or "zero"
                                     # makes the trainer send a corrupted pseudo-gradient (HYPHA_BYZANTINE)
    [parameter_server]               # where the built-in parameter server listens
    host = "127.0.0.1"
    port = 0                         # 0: any free port
    public_url = "http://gpu-01:8470"  # what trainers use; default: http://host:port once bound
    reachable = "auto"               # true: trainers can connect to public_url; false: they cannot (NAT,
                                     # firewall: the control plane's relay carries the transfers);
                                     # "auto" (default): not said, the control plane finds out

The original's libp2p and telemetry keys (``cert_pem``, ``gateway_addresses``, ``telemetry_*``, …) are
accepted and ignored with one info line; other unknown keys get a warning naming them, never an error.
``relay_circuit`` is among them: in Hypha it *adds* relayed listen addresses to the direct ones (its ``init``
writes ``true`` for every node), so it says nothing about whether this host is reachable — ``reachable`` does.

Layering, as in the original: the TOML file, then ``HYPHA_*`` env vars for top-level keys
(``HYPHA_WORK_DIR``), then CLI flags (``--work-dir``, ``--price``, ``--floor``, ``--ps-host``, ``--ps-port``,
``--ps-public-url``, ``--reachable``, ``--benchmark``/``--no-benchmark``, ``--slowdown``, ``--byzantine``). Any invalid value raises
:class:`~worker_daemon.exceptions.ConfigError` with a message naming the key.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import tomllib
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from worker_daemon import protocol
from worker_daemon.exceptions import ConfigError
from worker_daemon.executors.byzantine import ByzantineModeError, parse_mode

logger = logging.getLogger(__name__)

#: Top-level keys of the original's libp2p transport and OpenTelemetry export. We talk to the control plane
#: over a websocket instead, so they mean nothing here; users may still bring their old files.
ORIGINAL_ONLY_KEYS = frozenset(
    {
        "cert_pem",
        "key_pem",
        "trust_pem",
        "crls_pem",
        "gateway_addresses",
        "listen_addresses",
        "external_addresses",
        "exclude_cidr",
        "relay_circuit",
    }
)
_ORIGINAL_ONLY_PREFIX = "telemetry_"

#: Top-level keys that ``HYPHA_<KEY>`` env vars may set (tables cannot come from the environment).
ENV_KEYS = ("work_dir",)

WEBSOCKET_PATH = "/ws/worker/"

#: The worker's own credentials: they never reach a task (the daemon drops them from every task's environment).
PRIVATE_ENVIRONMENT = ("HYPHA_WORKER_TOKEN", "HYPHA_WORKER_TOKEN_FILE", "HYPHA_TOKEN", "HYPHA_TOKEN_FILE")
#: Variables an ``[[executors]]`` ``env`` table may not set: what the daemon sets for each task (the bridge's
#: socket, the work dir, the job, the slowdown knob, the parameter server's control-plane URL and transfer
#: credentials) and the worker's own credentials (:data:`PRIVATE_ENVIRONMENT`).
RESERVED_ENVIRONMENT = (
    "SOCKET_PATH",
    "WORK_DIR",
    "JOB_JSON",
    "HYPHA_SLOWDOWN",
    "HYPHA_SERVER_URL",
    "HYPHA_TRANSFER_KEY",
    "HYPHA_TRANSFER_TOKEN",
    "HYPHA_TRANSFER_TOKEN_FILE",
    "HYPHA_BYZANTINE",
    *PRIVATE_ENVIRONMENT,
)
#: What a task with leased devices is told about them (per lease; see ``WorkerConfig.devices``).
DEVICE_VARIABLE = "CUDA_VISIBLE_DEVICES"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,254}$")
MAX_EXECUTOR_ENV = 256
MAX_ENV_VALUE = 32768

# A number in the config: strict so that `cpu = "16"` or `cpu = true` is reported instead of guessed at,
# finite because TOML can spell `inf` and `nan`.
_NUMBER = {"ge": 0, "allow_inf_nan": False, "strict": True}


class _ConfigModel(BaseModel):
    # extra="allow" keeps unknown keys in `model_extra`, so that load_config can name them in one warning
    # instead of failing: a worker owner's old file should start, not crash.
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class DeviceConfig(_ConfigModel):
    """One ``[[resources.devices]]`` entry: a GPU of ``memory`` GB at CUDA ordinal ``index``."""

    model_config = ConfigDict(extra="allow", frozen=True)

    index: int | None = Field(default=None, ge=0, le=protocol.MAX_DEVICE_INDEX, strict=True)
    memory: float = Field(**_NUMBER, le=protocol.MAX_DEVICE_MEMORY, description="GB")
    name: str = Field(default="", max_length=200)


class ResourcesConfig(_ConfigModel):
    """The capacity this worker offers. ``None`` means "measure it" and is only seen before validation
    of the enclosing :class:`WorkerConfig` finishes."""

    model_config = ConfigDict(extra="allow", frozen=True)

    cpu: float | None = Field(
        default=None,
        **_NUMBER,
        le=protocol.MAX_DECLARED["cpu"],
        description="CPU cores. At most what a hello may declare.",
    )
    memory: float | None = Field(
        default=None,
        **_NUMBER,
        le=protocol.MAX_DECLARED["memory"],
        description="Memory, GB. At most what a hello may declare.",
    )
    storage: float | None = Field(
        default=None,
        **_NUMBER,
        le=protocol.MAX_DECLARED["storage"],
        description="Storage, GB. At most what a hello may declare.",
    )
    gpu: float | None = Field(
        default=None,
        **_NUMBER,
        le=protocol.MAX_DECLARED["gpu"],
        description="GPU memory (VRAM), GB. At most what a hello may declare.",
    )
    devices: list[DeviceConfig] | None = Field(default=None, max_length=protocol.MAX_DEVICES)
    gpus: int | None = Field(default=None, ge=0, le=protocol.MAX_DEVICES, strict=True)
    gpu_memory: float | None = Field(default=None, **_NUMBER, le=protocol.MAX_DEVICE_MEMORY)

    @model_validator(mode="after")
    def _one_device_list(self) -> ResourcesConfig:
        if self.gpus is not None and self.devices is not None:
            raise ValueError("give either gpus (+ gpu_memory) or [[resources.devices]], not both")
        if self.gpu_memory is not None and self.gpus is None:
            raise ValueError("gpu_memory needs gpus (the number of devices of that memory)")
        if self.gpus and self.gpu_memory is None:
            raise ValueError("gpus needs gpu_memory (GB of each device)")
        self.device_list()  # duplicate indices are an error here, not at the first offer
        return self

    def device_list(self) -> list[protocol.Device]:
        """The configured devices (none without ``gpus`` or ``[[resources.devices]]``)."""
        if self.gpus:
            return [protocol.Device(index=index, memory=self.gpu_memory or 0.0) for index in range(self.gpus)]
        devices = []
        seen: set[int] = set()
        for position, entry in enumerate(self.devices or []):
            index = position if entry.index is None else entry.index
            if index in seen:
                raise ValueError(f"devices[{position}]: device index {index} is listed twice")
            seen.add(index)
            devices.append(protocol.Device(index=index, memory=entry.memory, name=entry.name))
        return devices


class StrategyConfig(_ConfigModel):
    """How offers are shaped: ``whole`` offers all resources, ``flexible`` only what an advert asks."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["whole", "flexible"] = "whole"


class OfferConfig(_ConfigModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    price: float = Field(default=100.0, **_NUMBER)
    floor: float = Field(default=100.0, **_NUMBER)
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)

    @field_validator("strategy", mode="before")
    @classmethod
    def _accept_bare_string(cls, value: Any) -> Any:
        # The original's docs show `strategy = "whole"`, which its internally tagged enum rejects; we take
        # the obvious meaning instead of failing.
        if isinstance(value, str):
            return {"type": value}
        return value


class ExecutorConfig(_ConfigModel):
    """One ``[[executors]]`` entry. ``cmd`` and ``args`` apply to the ``process`` runtime only; the args
    may contain the templates ``{SOCKET_PATH}``, ``{WORK_DIR}`` and ``{JOB_JSON}``.

    Runtimes: ``process`` runs ``cmd`` + ``args`` as configured (Hypha's; e.g. ``accelerate launch`` of an
    executor); ``parameter-server`` the built-in parameter server (Hypha's); ``trainer`` (ours) the built-in
    DiLoCo trainer, ``python -m worker_daemon.executors.training``, in one process without a launcher;
    ``inference`` (ours) the batch inference executor, ``python -m worker_daemon.executors.inference``
    (class ``inference``, name ``batch-inference``: docs/inference.md). The trainer and the parameter server
    start from a warm spare when the daemon has one (``warm_start``); inference always starts cold.

    ``env`` (ours, not Hypha's): string variables added to the task's environment, over the daemon's own; the
    names of :data:`RESERVED_ENVIRONMENT` are refused. A task of an executor with an ``env`` always starts a
    cold interpreter: a warm spare imported its libraries without those variables, and some are read at
    import time (``PYTORCH_CUDA_ALLOC_CONF``, ``HF_HUB_OFFLINE``, …)."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    executor_class: str = Field(alias="class", min_length=1, max_length=64)
    name: str = Field(min_length=1, max_length=128)
    runtime: Literal["process", "parameter-server", "trainer", "inference"]
    cmd: str | None = Field(default=None, min_length=1)
    args: list[str] = Field(default_factory=list)
    #: Ours: variables added to the task's environment (any runtime), over the daemon's own.
    env: dict[str, str] = Field(default_factory=dict, max_length=MAX_EXECUTOR_ENV)

    @field_validator("env", mode="before")
    @classmethod
    def _environment(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            raise ValueError('must be a table of strings, e.g. env = { HF_HOME = "/data/hf" }')
        for key, item in value.items():
            if not isinstance(key, str) or not ENV_NAME.match(key):
                raise ValueError(
                    f"{key!r} is not an environment variable name (letters, digits and '_', not starting "
                    "with a digit)"
                )
            if key in RESERVED_ENVIRONMENT:
                raise ValueError(
                    f"{key} is reserved: the daemon sets it for the bridge and the task "
                    f"(reserved: {', '.join(RESERVED_ENVIRONMENT)})"
                )
            if not isinstance(item, str):
                raise ValueError(f'{key} must be a string (quote it: {key} = "{item}")')
            if "\0" in item or len(item) > MAX_ENV_VALUE:
                raise ValueError(f"{key} must hold no NUL character and at most {MAX_ENV_VALUE} characters")
        return value

    @model_validator(mode="after")
    def _process_needs_cmd(self) -> ExecutorConfig:
        if self.runtime == "process" and self.cmd is None:
            raise ValueError("cmd is required when runtime = 'process'")
        return self

    def descriptor(self) -> protocol.ExecutorDescriptor:
        """This executor as the control plane names it (class + name)."""
        return protocol.ExecutorDescriptor(executor_class=self.executor_class, name=self.name)


class ParameterServerConfig(_ConfigModel):
    """``[parameter_server]``: where the built-in parameter server (runtime ``parameter-server``) listens.

    ``public_url`` is the base URL trainers use to reach it; without it the parameter server reports
    ``http://<host>:<bound port>``, which only works when ``host`` is reachable from the trainers."""

    model_config = ConfigDict(extra="allow", frozen=True)

    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=0, ge=0, le=65535, strict=True)
    public_url: str | None = Field(default=None, min_length=1)
    reachable: protocol.Reachable = Field(
        default="auto",
        description="Whether trainers can connect to public_url (true), cannot (false: NAT, a firewall), or "
        '"auto": not said.',
    )

    @field_validator("reachable", mode="before")
    @classmethod
    def _reachable_word(cls, value: Any) -> Any:
        # Strictly true, false or "auto" ("true"/"false" as strings too: a CLI flag or a quoted TOML value);
        # pydantic's lax bool would also take 1, "yes" or "on", which are more likely a mistake here.
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "auto"):
            word = value.strip().lower()
            return word if word == "auto" else word == "true"
        if isinstance(value, bool):
            return value
        raise ValueError('must be true, false or "auto"')

    @field_validator("public_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urllib.parse.urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("must be an http:// or https:// URL with a host")
            return value.rstrip("/")
        return value


#: ``accelerate launch`` options for one process on one machine that name every value it would otherwise take a
#: default for with a warning ("The following values were not passed to `accelerate launch` and had defaults
#: used instead: …"), which would open every task's log: the args of a ``process`` executor under the launcher
#: start with them (docs/configuration.md).
ACCELERATE_LAUNCH_OPTIONS = (
    "--num_processes",
    "1",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
    "--num_cpu_threads_per_process",
    "1",
)


def default_executors() -> list[ExecutorConfig]:
    """The executors of a daemon that configures none: the built-in trainer (runtime ``trainer``: one process,
    no ``accelerate launch``, which would import torch and accelerate only to start a second interpreter),
    the parameter server, and the batch inference executor (runtime ``inference``, docs/inference.md). The trainer reads its job from ``$JOB_JSON``, not from a command line, which is
    visible to every user in ``ps``. A multi-process trainer is a ``process`` executor running
    ``accelerate launch --num_processes N -m worker_daemon.executors.training …``."""
    return [
        ExecutorConfig(executor_class="train", name="diloco-transformer", runtime="trainer"),
        ExecutorConfig(executor_class="aggregate", name="parameter-server", runtime="parameter-server"),
        ExecutorConfig(executor_class="inference", name="batch-inference", runtime="inference"),
    ]


class WorkerConfig(_ConfigModel):
    """A validated worker configuration. After validation every resource is a number (measured when it
    was absent), ``work_dir`` is absolute and ``executors`` is never empty."""

    work_dir: Path = Field(default_factory=lambda: Path(tempfile.gettempdir()))
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    offer: OfferConfig = Field(default_factory=OfferConfig)
    # 64 is what hello may carry (protocol.Hello.executors).
    executors: list[ExecutorConfig] = Field(default_factory=list, max_length=64)
    parameter_server: ParameterServerConfig = Field(default_factory=ParameterServerConfig)
    kill_grace: float = Field(
        default=5.0,
        **_NUMBER,
        description="Seconds between SIGTERM and SIGKILL when a task is cancelled.",
    )
    benchmark: bool = Field(
        default=True,
        strict=True,
        description="Run the worker benchmark when the daemon starts (it also runs on demand).",
    )
    warm_start: bool = Field(
        default=True,
        strict=True,
        description="Keep a warm spare interpreter for the built-in runtimes while idle (worker_daemon.spares).",
    )
    slowdown: float = Field(
        default=1.0,
        ge=1.0,
        le=protocol.MAX_SLOWDOWN,
        allow_inf_nan=False,
        strict=True,
        description="Experiments and tests only: make this worker deliberately slower by this factor.",
    )
    byzantine: str = Field(
        default="",
        max_length=64,
        strict=True,
        description="Experiments and tests only: the trainer sends a corrupted pseudo-gradient "
        "(scale:K, sign_flip, random, zero; empty: honest).",
    )

    @field_validator("byzantine")
    @classmethod
    def _byzantine_mode(cls, value: str) -> str:
        value = value.strip()
        if value:
            try:
                parse_mode(value)
            except ByzantineModeError as error:
                raise ValueError(str(error)) from None
        return value

    @field_validator("work_dir", mode="before")
    @classmethod
    def _absolute_work_dir(cls, value: Any) -> Any:
        if isinstance(value, str | Path):
            if not str(value):
                raise ValueError("must not be empty")
            # abspath resolves against the working directory now, at startup, and normalises `..`.
            path = Path(os.path.abspath(os.path.expanduser(value)))
            if path.exists() and not path.is_dir():
                raise ValueError(f"{str(path)!r} exists and is not a directory")
            return path
        return value

    @model_validator(mode="after")
    def _fill_defaults(self) -> WorkerConfig:
        seen: dict[tuple[str, str], int] = {}
        for index, executor in enumerate(self.executors):
            key = (executor.executor_class, executor.name)
            if key in seen:
                raise ValueError(
                    f"executors[{index}] repeats class={key[0]!r} name={key[1]!r} "
                    f"of executors[{seen[key]}]; each class+name may be configured once"
                )
            seen[key] = index
            if self.resources.device_list() and DEVICE_VARIABLE in executor.env:
                # With a device list the daemon sets it per lease (the lease's devices only).
                raise ValueError(
                    f"executors[{index}].env: {DEVICE_VARIABLE} is set by the daemon from each lease's devices "
                    "when [resources] lists devices"
                )
        if not self.executors:
            self.executors = default_executors()
        resources = self.resources
        self.resources = resources.model_copy(
            update={
                "cpu": resources.cpu if resources.cpu is not None else float(os.cpu_count() or 1),
                "memory": resources.memory if resources.memory is not None else total_memory_gb(),
                # Measured free disk may exceed what a hello may declare: offer at most that.
                "storage": resources.storage
                if resources.storage is not None
                else min(free_disk_gb(self.work_dir), protocol.MAX_DECLARED["storage"]),
                "gpu": resources.gpu
                if resources.gpu is not None
                else min(
                    sum(device.memory for device in resources.device_list()), protocol.MAX_DECLARED["gpu"]
                ),
            }
        )
        return self

    @property
    def devices(self) -> list[protocol.Device]:
        """The configured devices (GPUs); empty when none are listed (``gpu = N`` alone lists none)."""
        return self.resources.device_list()

    @property
    def capacity(self) -> protocol.Resources:
        """The configured resources as a protocol vector."""
        resources = self.resources
        return protocol.Resources(
            cpu=resources.cpu or 0.0,
            memory=resources.memory or 0.0,
            storage=resources.storage or 0.0,
            gpu=resources.gpu or 0.0,
        )

    @property
    def strategy(self) -> Literal["whole", "flexible"]:
        return self.offer.strategy.type

    def descriptors(self) -> list[protocol.ExecutorDescriptor]:
        """The executors this daemon offers, as sent in ``hello``."""
        return [executor.descriptor() for executor in self.executors]

    def find_executor(self, executor_class: str, name: str) -> ExecutorConfig | None:
        """The configured executor of this class and name, if any."""
        for executor in self.executors:
            if (executor.executor_class, executor.name) == (executor_class, name):
                return executor
        return None

    def summary(self) -> str:
        """One log line describing the effective configuration."""
        capacity = self.capacity
        executors = ", ".join(f"{e.executor_class}/{e.name}" for e in self.executors)
        slowed = f" slowdown={self.slowdown:g}" if self.slowdown != 1.0 else ""
        slowed += f" BYZANTINE={self.byzantine}" if self.byzantine else ""
        cold = "" if self.warm_start else " warm_start=false"
        reachable = self.parameter_server.reachable
        said = f" reachable={str(reachable).lower()}" if reachable != "auto" else ""
        return (
            f"work_dir={self.work_dir} resources=cpu:{capacity.cpu:g} memory:{capacity.memory:g}GB "
            f"storage:{capacity.storage:g}GB gpu:{capacity.gpu:g}GB price={self.offer.price:g} "
            f"floor={self.offer.floor:g} strategy={self.strategy} executors=[{executors}]"
            f"{slowed}{cold}{said}"
        )


def total_memory_gb(*, meminfo: Path = Path("/proc/meminfo")) -> float:
    """Total memory in GB (GiB) from ``/proc/meminfo``; 1.0 when it cannot be read (not Linux)."""
    try:
        with meminfo.open() as lines:
            for line in lines:
                if line.startswith("MemTotal:"):
                    kilobytes = int(line.split()[1])
                    return round(kilobytes / 1024**2, 1)
    except (OSError, ValueError, IndexError):
        pass
    return 1.0


def free_disk_gb(path: Path) -> float:
    """Free space in GB (GiB) of the file system holding ``path`` or, if it does not exist yet, its nearest
    existing parent; 0.0 if even that cannot be measured."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return round(shutil.disk_usage(candidate).free / 1024**3, 1)
            except OSError:
                return 0.0
    return 0.0


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    work_dir: str | None = None,
    price: float | None = None,
    floor: float | None = None,
    ps_host: str | None = None,
    ps_port: int | None = None,
    ps_public_url: str | None = None,
    reachable: str | bool | None = None,
    benchmark: bool | None = None,
    slowdown: float | None = None,
    byzantine: str | None = None,
) -> WorkerConfig:
    """Read the TOML file at ``path`` (none: defaults only), apply ``HYPHA_*`` env vars from ``environ``
    (default ``os.environ``) and then the CLI overrides that are not ``None``; validate and return.

    Raises :class:`ConfigError` naming the file and key for an unreadable file, invalid TOML or any invalid
    value. Logs one info line for ignored keys of the original's libp2p transport and one warning for
    other unknown keys.
    """
    environ = os.environ if environ is None else environ
    source = str(path) if path is not None else "config"
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as file:
                data = tomllib.load(file)
        except FileNotFoundError:
            raise ConfigError(f"config file {source} not found") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {source} is a directory") from None
        except OSError as error:
            raise ConfigError(f"config file {source} cannot be read: {error.strerror}") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {source} is not valid TOML: {error}") from None

    for key in ENV_KEYS:
        variable = f"HYPHA_{key.upper()}"
        if environ.get(variable):
            data[key] = environ[variable]
    overridden = {"work_dir": work_dir, "benchmark": benchmark, "slowdown": slowdown, "byzantine": byzantine}
    for key, value in overridden.items():
        if value is not None:
            data[key] = value
    if price is not None or floor is not None:
        offer = data.get("offer")
        # Only merge into a table; anything else is left for validation to report as offer's error.
        if offer is None or isinstance(offer, dict):
            offer = dict(offer or {})
            if price is not None:
                offer["price"] = price
            if floor is not None:
                offer["floor"] = floor
            data["offer"] = offer
    overrides = {"host": ps_host, "port": ps_port, "public_url": ps_public_url, "reachable": reachable}
    if any(value is not None for value in overrides.values()):
        table = data.get("parameter_server")
        if table is None or isinstance(table, dict):
            table = dict(table or {})
            table.update({key: value for key, value in overrides.items() if value is not None})
            data["parameter_server"] = table

    try:
        config = WorkerConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(f"{source}: {_describe(error)}") from None

    original, unknown = _ignored_keys(config)
    if original:
        logger.info(
            "%s: ignoring keys of the original's libp2p/telemetry transport (not used here): %s",
            source,
            ", ".join(original),
        )
    if unknown:
        logger.warning("%s: ignoring unknown config keys: %s", source, ", ".join(unknown))
    return config


def websocket_url(server: str) -> str:
    """The worker gateway URL for a control plane address.

    ``http://host:port[/prefix]`` becomes ``ws://host:port[/prefix]/ws/worker/`` and https becomes wss. A
    ``ws://`` or ``wss://`` URL is used as is when its path already ends with ``/ws/worker/``; otherwise
    ``/ws/worker/`` is appended. Raises :class:`ConfigError` for any other scheme or a missing host.
    """
    parts = urllib.parse.urlsplit(server.strip())
    schemes = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
    scheme = parts.scheme.lower()
    if scheme not in schemes:
        raise ConfigError(f"--server {server!r}: the URL must start with http://, https://, ws:// or wss://")
    if not parts.hostname:
        raise ConfigError(f"--server {server!r}: the URL has no host")
    path = parts.path
    if not path.endswith(WEBSOCKET_PATH):
        path = path.rstrip("/") + WEBSOCKET_PATH
    return urllib.parse.urlunsplit((schemes[scheme], parts.netloc, path, parts.query, ""))


def http_base_url(server: str) -> str:
    """The control plane's HTTP(S) base URL for an address given as ``--server``: the inverse of
    :func:`websocket_url` (``ws://h:p/prefix/ws/worker/`` becomes ``http://h:p/prefix``), no trailing slash."""
    parts = urllib.parse.urlsplit(websocket_url(server))
    scheme = "https" if parts.scheme == "wss" else "http"
    path = parts.path.removesuffix(WEBSOCKET_PATH).rstrip("/")
    return urllib.parse.urlunsplit((scheme, parts.netloc, path, "", ""))


def _describe(error: ValidationError) -> str:
    """Turn pydantic's errors into ``key.path: problem (got value)`` sentences."""
    messages = []
    for item in error.errors():
        location = _dotted(item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        # Echo scalar inputs only: a whole table or list in the message would bury the point.
        if "input" in item and not isinstance(item["input"], dict | list) and item["type"] != "missing":
            got = f" (got {item['input']!r})"
        else:
            got = ""
        messages.append(f"{location}: {message}{got}" if location else f"{message}{got}")
    return "; ".join(messages)


def _dotted(location: tuple[int | str, ...]) -> str:
    text = ""
    for part in location:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part.startswith("function-") or part in {"str", "dict[str,any]"}:
            # pydantic adds validator names to locations of union/function errors; they are not keys.
            continue
        else:
            text += f".{part}" if text else part
    return text


def _ignored_keys(config: WorkerConfig) -> tuple[list[str], list[str]]:
    """(keys of the original's transport, other unknown keys), each as a dotted path."""
    original: list[str] = []
    unknown: list[str] = []
    for location, key in _extra_keys(config, ""):
        is_original = key in ORIGINAL_ONLY_KEYS or key.startswith(_ORIGINAL_ONLY_PREFIX)
        if location != key and (is_original or key in WorkerConfig.model_fields):
            # A top-level key written after a [table] header belongs to that table in TOML; say so, because
            # the original's own example puts work_dir under [resources] that way.
            location += " (a top-level key: move it above the first [table] header)"
        (original if is_original else unknown).append(location)
    for index, executor in enumerate(config.executors):
        if executor.runtime != "process":
            for key in ("cmd", "args"):
                if key in executor.model_fields_set:
                    unknown.append(f"executors[{index}].{key} (only used by runtime = 'process')")
    return original, unknown


def _extra_keys(model: BaseModel, prefix: str) -> Iterator[tuple[str, str]]:
    for key in model.model_extra or {}:
        yield (f"{prefix}.{key}" if prefix else key), key
    for name in type(model).model_fields:
        value = getattr(model, name)
        field_key = type(model).model_fields[name].alias or name
        path = f"{prefix}.{field_key}" if prefix else field_key
        if isinstance(value, BaseModel):
            yield from _extra_keys(value, path)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from _extra_keys(item, f"{path}[{index}]")
