"""Checks of a valid DiLoCo spec against what its workers can safely do, made once, when it is submitted.

* :func:`url_problem` — a model URL whose host is (or resolves to) a loopback, private, link-local,
  multicast, reserved or unspecified address is refused: the worker running the parameter server would fetch
  it from inside its own network (SSRF). The parameter server checks again when it downloads, on every
  redirect and against the address it connects to (``parameter_server/safe_fetch.py``); this check only
  gives the user the error at once. A host that does not resolve here is left to that check.
* :func:`size_problem` — a model built from a config is counted (on PyTorch's ``meta`` device: no memory is
  allocated) and refused when it is larger than ``max_parameters`` or than the memory its roles declare.

Not part of :func:`apps.jobs.spec.parse_json`: a stored spec is parsed again at every dispatch, and neither a
DNS lookup nor building a model belongs there. The module needs no Django; the caller passes the settings.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import urllib.parse
from typing import Any

from apps.jobs.spec import OVERLAP_EAGER, ConfigSource, DiLoCoSpec, RoleSpec, UrlSource
from worker_daemon import protocol

logger = logging.getLogger(__name__)

ALLOW_SETTING = "HYPHA_ALLOW_PRIVATE_URLS"
MAX_PARAMETERS_SETTING = "HYPHA_MAX_MODEL_PARAMETERS"

#: Bytes per parameter: the models are trained in float32.
BYTES_PER_PARAMETER = 4
#: Copies of the parameters a trainer holds: weights, gradients, AdamW's two moments, and the weights at the
#: round's start (the pseudo-gradient is their difference).
TRAINER_COPIES = 5
#: Copies the parameter server holds: the model, the global weights, the Nesterov momentum and the round's sum.
PARAMETER_SERVER_COPIES = 4
#: A lossy encoding (float16, bfloat16, int8) adds one copy to each role: its error-feedback residual
#: (docs/training.md, "Encodings").
RESIDUAL_COPIES = 1
#: An eager trainer (``rounds.overlap = "eager"``) adds two: the last result it merged and the proxy weights it
#: trains from while its update is out (``worker_daemon/executors/overlap.py``; the weights at the round's
#: start are counted already). A streaming trainer (``rounds.overlap = "streaming"``) adds none: the global
#: weights it mixes a fragment's result into are the weights at the round's start, counted already, and what it
#: sends and receives is one fragment, a 1/fragments share of a copy.
EAGER_COPIES = 2
#: Above this many layers the count is extrapolated from models of one and two layers, which a config of a
#: million layers would otherwise take minutes to build even on the meta device.
EXACT_LAYER_LIMIT = 64
#: Config keys that count repeated layers, by the names transformers' configs use.
LAYER_KEYS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "num_decoder_layers",
    "encoder_layers",
    "decoder_layers",
)

Networks = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]


def submission_problems(
    spec: DiLoCoSpec, *, allow_private_urls: bool | Networks, max_parameters: int
) -> dict[str, list[str]]:
    """Field errors (``{"model.source.url": [...]}``), empty when the spec passes both checks.

    ``allow_private_urls`` is True (every address allowed), or the networks allowed (empty: none)."""
    source = spec.model.source
    problems: dict[str, list[str]] = {}
    if isinstance(source, UrlSource):
        problem = url_problem(source.url, allow_private_urls)
        if problem:
            problems["model.source.url"] = [problem]
    if isinstance(source, ConfigSource):
        problem = size_problem(spec, max_parameters=max_parameters)
        if problem:
            problems["model.source.config"] = [problem]
    return problems


# --- URLs -------------------------------------------------------------------------------------------------


def url_problem(url: str, allow: bool | Networks) -> str | None:
    """Why ``url`` may not be fetched by a worker, or None."""
    if allow is True:
        return None
    networks: Networks = () if allow is False else allow
    host = urllib.parse.urlsplit(url).hostname
    if not host:
        return "The URL has no host."
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            return None  # unknown here; the parameter server checks what it resolves when it downloads
        addresses = [ipaddress.ip_address(str(entry[4][0]).split("%", 1)[0]) for entry in found]
    for address in addresses:
        if not protocol.is_public_address(address) and not any(address in network for network in networks):
            return (
                f"{address} is not a public address (host {host!r}): workers do not fetch from loopback, "
                f"private, link-local, multicast or reserved addresses unless the operator allows it "
                f"({ALLOW_SETTING})."
            )
    return None


# --- model size -------------------------------------------------------------------------------------------


class UnbuildableConfig(Exception):
    """transformers cannot build a model of the config (the message is its reason)."""


def count_parameters(config: dict[str, Any]) -> int:
    """The parameters of the transformers model ``config`` describes (its base model, ``AutoModel``), counted
    without allocating them. Raises :class:`UnbuildableConfig` when transformers cannot build it (the parameter
    server could not either; a dimension so large that a tensor's size overflows is one such case)."""
    layers = max((value for key in LAYER_KEYS if isinstance(value := config.get(key), int)), default=0)
    if layers <= EXACT_LAYER_LIMIT:
        return _count(config)
    one = _count({**config, **{key: 1 for key in LAYER_KEYS if isinstance(config.get(key), int)}})
    two = _count({**config, **{key: 2 for key in LAYER_KEYS if isinstance(config.get(key), int)}})
    return one + (two - one) * (layers - 1)


def _count(config: dict[str, Any]) -> int:
    import torch
    import transformers

    settings = dict(config)
    model_type = settings.pop("model_type")
    try:
        model_config = transformers.AutoConfig.for_model(model_type, **settings)
        with torch.device("meta"):
            model = transformers.AutoModel.from_config(model_config)
    except Exception as error:  # transformers (and torch) raise many kinds for configs they cannot build
        raise UnbuildableConfig(str(error) or type(error).__name__) from None
    return sum(parameter.numel() for parameter in model.parameters())


def size_problem(spec: DiLoCoSpec, *, max_parameters: int) -> str | None:
    """Why the config-built model of ``spec`` is too large for its workers, or None."""
    assert isinstance(spec.model.source, ConfigSource)
    try:
        count = count_parameters(spec.model.source.config)
    except UnbuildableConfig as error:
        return f"transformers cannot build a model of this config: {str(error)[:500]}"
    if count > max_parameters:
        return (
            f"The model has {count:,} parameters, more than this control plane accepts "
            f"({max_parameters:,}, {MAX_PARAMETERS_SETTING})."
        )
    residual = RESIDUAL_COPIES if spec.rounds.encoding != "float32" else 0
    eager = EAGER_COPIES if spec.rounds.overlap == OVERLAP_EAGER else 0
    short = [
        _shortfall("trainer", spec.trainer, count, TRAINER_COPIES + residual + eager, gpu_counts=True),
        _shortfall(
            "parameter_server",
            spec.parameter_server,
            count,
            PARAMETER_SERVER_COPIES + residual,
            gpu_counts=False,
        ),
    ]
    short = [line for line in short if line]
    if not short:
        return None
    return f"The model has {count:,} parameters: " + "; ".join(short) + "."


def _shortfall(role: str, spec: RoleSpec, count: int, copies: int, *, gpu_counts: bool) -> str | None:
    needed = count * BYTES_PER_PARAMETER * copies / 1e9
    resources = spec.resources
    # A trainer trains on its GPU when it has one, else in memory; the parameter server works in memory.
    declared = max(resources.memory, resources.gpu) if gpu_counts else resources.memory
    if needed <= declared:
        return None
    field = f"{role}.resources.memory" + (" (or .gpu)" if gpu_counts else "")
    return (
        f"a {role.replace('_', ' ')} needs about {needed:.3g} GB ({copies} float32 copies of them) but "
        f"{role}.resources declares {declared:g} GB: raise {field} to at least {needed:.3g}"
    )
