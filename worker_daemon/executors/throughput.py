"""A trainer's throughput and device facts for one round: tokens, tokens/s, peak CUDA memory, MFU.

Sent with the round's metrics (docs/observability.md, "Throughput and device facts"):

* ``tokens`` and ``tokens_per_second`` (over the round's train time), when the model's inputs are tokens;
* ``peak_memory_bytes``: ``torch.cuda.max_memory_allocated(device)`` since the round began (its peak statistics
  are reset by :meth:`RoundDevice.begin`); only on a CUDA device — absent on CPU, never a made-up zero;
* ``mfu``: ``6 × parameters × tokens/s ÷ peak FLOPS`` (the usual estimate of a transformer's training FLOPs:
  forward and backward, embeddings included), with the device's peak from ``HYPHA_PEAK_FLOPS`` or
  :data:`PEAK_FLOPS`; absent when neither knows the device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

#: Dense (no sparsity) BF16/FP16 tensor-core peak FLOPS per GPU, as NVIDIA's data sheets list them, by a part
#: of the name ``torch.cuda.get_device_name()`` gives; the longest part that matches wins ("H100 PCIe" before
#: "H100"). An estimate's denominator, not a promise: a card's clocks and power limit move it.
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,
    "T4": 65e12,
    "RTX 4090": 165.2e12,
    "RTX 3090": 71e12,
}
#: The environment variable that overrides the table: the device's peak FLOPS (e.g. ``989e12``).
PEAK_FLOPS_ENV = "HYPHA_PEAK_FLOPS"


def peak_flops(device_name: str | None, environ: Mapping[str, str] | None = None) -> float | None:
    """The peak FLOPS of a device: ``HYPHA_PEAK_FLOPS`` when it is a positive number, else the table's entry
    for ``device_name``, else None."""
    environ = os.environ if environ is None else environ
    override = environ.get(PEAK_FLOPS_ENV, "").strip()
    if override:
        try:
            value = float(override)
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value > 0:
            return value
    if not device_name:
        return None
    name = device_name.upper()
    for part in sorted(PEAK_FLOPS, key=len, reverse=True):
        if part.upper() in name:
            return PEAK_FLOPS[part]
    return None


def mfu(parameters: int, tokens_per_second: float, peak: float | None) -> float | None:
    """``6 × parameters × tokens/s ÷ peak``, None when the peak is unknown or the inputs say nothing."""
    if not peak or parameters <= 0 or tokens_per_second <= 0:
        return None
    return 6.0 * parameters * tokens_per_second / peak


class RoundDevice:
    """The device facts of a trainer's rounds on ``device`` (a ``torch.device``): call :meth:`begin` when a round
    starts and :meth:`facts` when it ends."""

    def __init__(self, device: Any, *, environ: Mapping[str, str] | None = None) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.cuda = getattr(device, "type", None) == "cuda" and torch.cuda.is_available()
        self.peak = peak_flops(torch.cuda.get_device_name(device) if self.cuda else None, environ)

    def begin(self) -> None:
        """Start the round: reset CUDA's peak memory statistics (nothing on CPU)."""
        if self.cuda:
            self._torch.cuda.reset_peak_memory_stats(self.device)

    def facts(self, *, tokens: int, seconds: float, parameters: int, devices: int = 1) -> dict[str, float]:
        """The round's facts to send (see the module docstring): only those known. ``devices``: the trainer's
        processes, each on a device like this one (a trainer of several processes: its MFU is over all of
        them; its peak memory is this device's, rank 0's)."""
        found: dict[str, float] = {}
        if tokens > 0:
            found["tokens"] = float(tokens)
            if seconds > 0:
                found["tokens_per_second"] = tokens / seconds
                peak = self.peak * devices if self.peak else None
                utilisation = mfu(parameters, found["tokens_per_second"], peak)
                if utilisation is not None:
                    found["mfu"] = utilisation
        if self.cuda:
            found["peak_memory_bytes"] = float(self._torch.cuda.max_memory_allocated(self.device))
        return found
