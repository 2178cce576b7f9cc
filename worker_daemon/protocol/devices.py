"""Devices (GPUs) as countable resources: what a worker has, what a role asks for, which ones a lease holds.

Part of :mod:`worker_daemon.protocol`, which re-exports every public name here. Importable without Django.

A worker declares its devices in ``hello.devices`` (index, memory in GB, name). An advertisement asks for
``devices`` of at least ``device_memory`` GB each (0 devices: no device requirement, as before devices
existed). An offer names the device indices it offers; a granted lease carries them back, and the daemon starts
the lease's tasks with ``CUDA_VISIBLE_DEVICES`` set to exactly those. The indices are the host's CUDA ordinals.

A daemon that sends no device list (older daemons, or a ``[resources] gpu = N`` config without devices) has
no devices: it can only serve roles that ask for none. ``Resources.gpu`` stays the total VRAM of the host and
keeps its meaning for scoring.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Annotated, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

_Vector = TypeVar("_Vector", bound=BaseModel)

#: The most devices a worker may declare or a role may ask for (far above any one host).
MAX_DEVICES = 64
#: The largest device index (CUDA ordinal) taken.
MAX_DEVICE_INDEX = 1023
#: The most memory one device may declare, GB (``MAX_DECLARED["gpu"]`` is 64 devices of this).
MAX_DEVICE_MEMORY = 1024.0


class Device(BaseModel):
    """One device of a worker: its index (CUDA ordinal), its memory in GB, and a name for people."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    index: int = Field(ge=0, le=MAX_DEVICE_INDEX)
    memory: float = Field(ge=0, le=MAX_DEVICE_MEMORY, description="GB")
    name: str = Field(default="", max_length=200)


def _distinct(indices: Iterable[int]) -> None:
    seen: set[int] = set()
    for index in indices:
        if index in seen:
            raise PydanticCustomError(
                "duplicate_device", "device index {index} is listed twice", {"index": index}
            )
        seen.add(index)


def _distinct_devices(devices: list[Device]) -> list[Device]:
    _distinct(device.index for device in devices)
    return devices


def _distinct_indices(indices: list[int]) -> list[int]:
    _distinct(indices)
    return indices


#: A worker's device list: at most :data:`MAX_DEVICES`, each index once.
DeviceList = Annotated[list[Device], Field(max_length=MAX_DEVICES), AfterValidator(_distinct_devices)]
#: The device indices an offer or a lease holds: at most :data:`MAX_DEVICES`, each once.
DeviceIndices = Annotated[
    list[Annotated[int, Field(ge=0, le=MAX_DEVICE_INDEX)]],
    Field(max_length=MAX_DEVICES),
    AfterValidator(_distinct_indices),
]


def choose_devices(free: Sequence[Device], *, count: int, memory: float) -> list[int] | None:
    """The indices of ``count`` devices of ``free`` with at least ``memory`` GB each, or ``None`` if there are
    not that many. The smallest devices that fit are taken first (ties by index), so that the large ones stay
    free for roles that need them. ``count <= 0`` takes none."""
    if count <= 0:
        return []
    fitting = sorted(
        (device for device in free if device.memory + 1e-9 >= memory), key=lambda d: (d.memory, d.index)
    )
    if len(fitting) < count:
        return None
    return sorted(device.index for device in fitting[:count])


def device_share(capacity: _Vector, *, devices: Sequence[Device], chosen: Iterable[int]) -> _Vector:
    """What a ``whole`` offer of the devices ``chosen`` (indices of ``devices``) offers of ``capacity`` (a
    :class:`~worker_daemon.protocol.Resources`): the chosen devices' memory as ``gpu`` (at most the declared
    total), and ``len(chosen) / len(devices)`` of the cores, memory and storage."""
    chosen = set(chosen)
    share = len(chosen) / len(devices) if devices else 1.0
    return capacity.model_copy(
        update={
            "cpu": capacity.cpu * share,
            "memory": capacity.memory * share,
            "storage": capacity.storage * share,
            "gpu": min(capacity.gpu, sum(device.memory for device in devices if device.index in chosen)),
        }
    )


def devices_fit(
    devices: Sequence[Device], indices: Sequence[int], *, count: int, memory: float
) -> str | None:
    """Why ``indices`` do not satisfy a request of ``count`` devices of ``memory`` GB on a worker with
    ``devices``, or ``None`` when they do (exactly ``count`` distinct indices, each a device of the worker with
    enough memory). The control plane's check of an offer."""
    if count <= 0:
        return None if not indices else "offers devices to a role that asks for none"
    if len(indices) != count or len(set(indices)) != count:
        return f"offers {len(indices)} devices, the role asks for {count}"
    by_index = {device.index: device for device in devices}
    for index in indices:
        device = by_index.get(index)
        if device is None:
            return f"device {index} is not one of the worker's devices"
        if device.memory + 1e-9 < memory:
            return f"device {index} has {device.memory:g} GB, the role asks for {memory:g} GB per device"
    return None


def cuda_visible_devices(indices: Sequence[int]) -> str:
    """The value of ``CUDA_VISIBLE_DEVICES`` for a task holding ``indices`` (``""``: no device visible)."""
    return ",".join(str(index) for index in sorted(indices))
