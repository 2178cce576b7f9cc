"""A deliberately dishonest trainer: **an experiment and test knob** (``hypha-worker-daemon --byzantine MODE``).

Like ``--slowdown``, it exists to build a hostile fleet on purpose (to test the parameter server's robust
aggregation and the control plane's verdicts), never for production. The daemon validates the mode at start
(:func:`parse_mode`, a ``ConfigError`` on a bad value) and exports it to every task as ``HYPHA_BYZANTINE``
(always set, from the config, never inherited; ``""`` when honest). The trainer computes its honest
pseudo-gradient ``delta`` as always and then sends :func:`corrupt` of it instead:

* ``scale:K``    ``K × delta`` (e.g. ``scale:100``; ``K`` finite, ``0 < |K| ≤ 1e6``)
* ``sign_flip``  ``−delta``
* ``random``     Gaussian noise scaled to the honest update's L2 norm (over all tensors)
* ``zero``       zeros

Tied names stay tied (one corrupted tensor per group). Importing this module is cheap: torch only when
:func:`corrupt` runs.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

BYZANTINE_ENV = "HYPHA_BYZANTINE"
MODES = ("scale:K", "sign_flip", "random", "zero")
MAX_SCALE = 1e6

_warned = False


class ByzantineModeError(ValueError):
    """A ``--byzantine`` value that is not one of :data:`MODES`."""


def parse_mode(value: str) -> tuple[str, float]:
    """``(kind, scale)`` of a mode string; raises :class:`ByzantineModeError` with a message saying what is
    accepted. ``scale`` is 1.0 except for ``scale:K``."""
    if not isinstance(value, str):
        raise ByzantineModeError(f"must be a string, one of {', '.join(MODES)}")
    text = value.strip()
    if text in ("sign_flip", "random", "zero"):
        return text, 1.0
    if text.startswith("scale:"):
        try:
            factor = float(text.removeprefix("scale:"))
        except ValueError:
            factor = math.nan
        if not math.isfinite(factor) or factor == 0 or abs(factor) > MAX_SCALE:
            raise ByzantineModeError(
                f"{value[:64]!r}: scale:K needs a finite number K with 0 < |K| <= {MAX_SCALE:g} (e.g. scale:100)"
            )
        return "scale", factor
    raise ByzantineModeError(f"{value[:64]!r} is not one of {', '.join(MODES)} (e.g. scale:100)")


def mode_from_environment(environ: Mapping[str, str] | None = None) -> str | None:
    """The task's mode from ``HYPHA_BYZANTINE`` (None when unset, empty, or invalid: an executor started
    outside the daemon is honest), logging a loud warning the first time a mode is found."""
    global _warned
    value = (os.environ if environ is None else environ).get(BYZANTINE_ENV, "").strip()
    if not value:
        return None
    try:
        parse_mode(value)
    except ByzantineModeError as error:
        logger.warning("ignoring %s: %s", BYZANTINE_ENV, error)
        return None
    if not _warned:
        _warned = True
        logger.warning(
            "BYZANTINE TRAINER (%s=%s): every pseudo-gradient this trainer sends is deliberately corrupted; "
            "an experiment and test knob, never for production",
            BYZANTINE_ENV,
            value,
        )
    return value


def corrupt(delta: Mapping[str, torch.Tensor], mode: str, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """``delta`` corrupted by ``mode`` (see the module docstring) as new tensors, tied like ``delta`` (names
    sharing one tensor object share one corrupted tensor). ``delta`` is never modified. ``seed`` makes
    ``random`` reproducible (the trainer passes the round number)."""
    import torch

    kind, factor = parse_mode(mode)
    unique: dict[int, torch.Tensor] = {}
    for tensor in delta.values():
        unique.setdefault(id(tensor), tensor)
    replaced: dict[int, torch.Tensor] = {}
    if kind == "random":
        generator = torch.Generator().manual_seed(seed)
        noise = {
            key: torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
            for key, tensor in unique.items()
        }
        honest = math.sqrt(sum(float(tensor.double().pow(2).sum()) for tensor in unique.values()))
        drawn = math.sqrt(sum(float(value.pow(2).sum()) for value in noise.values()))
        ratio = honest / drawn if drawn > 0 else 0.0
        replaced = {key: (value * ratio).to(unique[key].dtype) for key, value in noise.items()}
    else:
        for key, tensor in unique.items():
            if kind == "scale":
                replaced[key] = tensor * factor
            elif kind == "sign_flip":
                replaced[key] = -tensor
            else:
                replaced[key] = torch.zeros_like(tensor)
    return {name: replaced[id(tensor)] for name, tensor in delta.items()}
