"""The parameter server's job JSON: the ``aggregate`` envelope (reference §2.3) plus ``model``, ``rounds`` and
``eval`` (docs/training.md, "The parameter server's job JSON"), parsed into frozen dataclasses.

Contract of :func:`parse_job`: it accepts the envelope as a JSON string or an already decoded object and
either returns a :class:`JobConfig` or raises :class:`~parameter_server.exceptions.JobConfigError` naming
the first bad key (the process then exits with code 2). Unknown keys are ignored (Hypha's rule). Defaults:
``rounds.update_rounds`` 1, ``rounds.round_timeout`` 120 s, ``rounds.weighted`` true,
``rounds.max_samples_per_update`` absent (no cap), ``rounds.update_norm_ratio`` 10, ``rounds.encoding``
``float32`` (``rounds.encoding_block_size`` 256, for int8), ``rounds.checkpoint_every`` 10, ``model.seed`` 0,
``model.input-names`` ``[]``, ``eval`` absent, ``rounds.overlap`` absent (every round syncs every tensor),
``rounds.aggregation`` ``mean`` (``clip_factor`` 2, ``trim_fraction`` 0.25, ``verification``: see
:mod:`parameter_server.aggregation`).
``rounds.overlap = "streaming"`` makes round r sync fragment ``(r − 1) mod rounds.fragments`` of the model
alone (``hypha_tensors.fragments``; ``fragments`` an integer 2 to 64, default 4); another ``overlap`` string
(``none``, ``eager``: how trainers overlap, nothing the parameter server does differently) is ignored, a value
that is not a string is refused. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from hypha_tensors.formats import DEFAULT_BLOCK_SIZE, DEFAULT_ENCODING, Encoding, EncodingError
from hypha_tensors.fragments import DEFAULT_FRAGMENTS, MAX_FRAGMENTS, MIN_FRAGMENTS
from parameter_server.aggregation import (
    AGGREGATIONS,
    DEFAULT_CLIP_FACTOR,
    DEFAULT_MAX_NORM_RATIO,
    DEFAULT_MAX_VALIDATION_RISE,
    DEFAULT_MIN_COSINE,
    DEFAULT_TRIM_FRACTION,
    AggregationRule,
    Verification,
)
from parameter_server.exceptions import JobConfigError

SOURCE_TYPES = ("config", "huggingface", "uri")


@dataclass(frozen=True)
class ModelSource:
    """Where the initial model comes from: ``config`` (build from ``config``), ``huggingface``
    (``repository``/``revision``/``filenames``/``token``) or ``uri`` (one file at ``value``)."""

    type: str
    config: dict[str, Any] | None = None
    repository: str | None = None
    revision: str | None = None
    filenames: tuple[str, ...] = ()
    token: str | None = None
    value: str | None = None


@dataclass(frozen=True)
class EvalSlice:
    index: int
    size: int
    sha256: str
    urls: tuple[str, ...]


@dataclass(frozen=True)
class EvalConfig:
    dataset: str
    batch_size: int
    slices: tuple[EvalSlice, ...]


@dataclass(frozen=True)
class CheckpointFile:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ResumeConfig:
    """``checkpoint``: the last round the job's previous parameter server saved with the control plane, to
    resume from: its files are fetched from ``uri`` + name (a control-plane path) with the transfer token:
    ``round.json``, ``weights.safetensors`` (the base round's), ``momentum.safetensors`` and
    ``result-<round>.safetensors`` for each round since the base (``result.safetensors``: an older copy's)."""

    round_number: int
    uri: str
    files: tuple[CheckpointFile, ...]


@dataclass(frozen=True)
class JobConfig:
    job_id: str
    expected_peers: tuple[str, ...]
    """``updates.peers``: the trainers whose updates each round waits for (in the JSON's order)."""
    result_peers: tuple[str, ...]
    learning_rate: float
    momentum: float
    task: str
    source: ModelSource
    input_names: tuple[str, ...]
    seed: int
    update_rounds: int
    round_timeout: float
    weighted: bool
    eval: EvalConfig | None
    resume: ResumeConfig | None = None
    #: ``rounds.max_samples_per_update``: the most X-Samples one trainer may claim for a round (None: no cap).
    max_samples_per_update: int | None = None
    #: ``rounds.update_norm_ratio``: an update's norm may be at most this times the round's reference norm.
    update_norm_ratio: float = 10.0
    #: ``rounds.encoding`` and ``rounds.encoding_block_size``: how updates and results travel.
    encoding: Encoding = Encoding()
    #: ``rounds.checkpoint_every``: the checkpoint copy on the control plane gets the full weights every this
    #: many rounds (a base); the rounds between send their momentum and result only.
    checkpoint_every: int = 10
    #: ``rounds.fragments`` of a job with ``rounds.overlap = "streaming"``: round r syncs fragment
    #: ``(r − 1) mod fragments`` of the model alone. 1: every round syncs every tensor.
    fragments: int = 1
    #: ``rounds.aggregation`` (``clip_factor``, ``trim_fraction``) and ``rounds.verification``: how a round's
    #: updates become its mean (parameter_server/aggregation.py). The default: the mean, unverified.
    aggregation: AggregationRule = AggregationRule()


#: The ``rounds.overlap`` whose rounds sync one fragment of the model each.
OVERLAP_STREAMING = "streaming"


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise JobConfigError(f"{where} must be an object, got {type(value).__name__}")
    return value


def _string(value: Any, where: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise JobConfigError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _number(value: Any, where: str, *, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise JobConfigError(f"{where} must be a finite number, got {value!r}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise JobConfigError(f"{where} must be {'>' if strict else '>='} {minimum}, got {value!r}")
    return float(value)


def _integer(value: Any, where: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise JobConfigError(f"{where} must be an integer >= {minimum}, got {value!r}")
    return value


def _peers(value: Any, where: str) -> tuple[str, ...]:
    reference = _object(value, where)
    if reference.get("type") != "peers":
        raise JobConfigError(f"{where}.type must be 'peers', got {reference.get('type')!r}")
    peers = reference.get("peers")
    if not isinstance(peers, list) or not all(isinstance(peer, str) and peer for peer in peers):
        raise JobConfigError(f"{where}.peers must be a list of peer ids")
    if len(set(peers)) != len(peers):
        raise JobConfigError(f"{where}.peers lists a peer twice")
    return tuple(peers)


_CHECKPOINT_FILES = ("round.json", "weights.safetensors", "momentum.safetensors", "result.safetensors")
#: The results of the rounds since the base round (parameter_server.checkpoints.CHAIN_RESULT).
_CHAIN_FILE = re.compile(r"result-\d{1,9}\.safetensors")
#: The most rounds between two bases of the checkpoint copy (the manifest lists every round between).
MAX_CHECKPOINT_EVERY = 1000


def _fragments(rounds: dict[str, Any]) -> int:
    """F of ``rounds`` (see the module docstring): 1 unless ``overlap`` is ``streaming``."""
    overlap = rounds.get("overlap")
    if overlap is not None and not isinstance(overlap, str):
        raise JobConfigError(f"rounds.overlap must be a string, got {overlap!r}")
    if overlap != OVERLAP_STREAMING:
        return 1
    fragments = rounds.get("fragments", DEFAULT_FRAGMENTS)
    if (
        isinstance(fragments, bool)
        or not isinstance(fragments, int)
        or not MIN_FRAGMENTS <= fragments <= MAX_FRAGMENTS
    ):
        raise JobConfigError(
            f"rounds.fragments must be an integer from {MIN_FRAGMENTS} to {MAX_FRAGMENTS} "
            f"(rounds.overlap is streaming), got {fragments!r}"
        )
    return fragments


def _aggregation(rounds: dict[str, Any]) -> AggregationRule:
    """``rounds.aggregation`` with ``clip_factor``, ``trim_fraction`` and ``verification`` (an object of
    ``enabled`` (true, false or null: the rule's default), ``max_norm_ratio`` (> 1) and ``min_cosine``
    (-1 to 1)); absent: the mean, unverified."""
    name = rounds.get("aggregation", AGGREGATIONS[0])
    if name not in AGGREGATIONS:
        raise JobConfigError(f"rounds.aggregation must be one of {', '.join(AGGREGATIONS)}, got {name!r}")
    clip_factor = _number(rounds.get("clip_factor", DEFAULT_CLIP_FACTOR), "rounds.clip_factor", minimum=1)
    trim_fraction = _number(
        rounds.get("trim_fraction", DEFAULT_TRIM_FRACTION), "rounds.trim_fraction", minimum=0
    )
    if trim_fraction >= 0.5:
        raise JobConfigError(f"rounds.trim_fraction must be < 0.5, got {trim_fraction!r}")
    verification = rounds.get("verification")
    verification = _object({} if verification is None else verification, "rounds.verification")
    enabled = verification.get("enabled")
    if enabled is not None and not isinstance(enabled, bool):
        raise JobConfigError(f"rounds.verification.enabled must be true, false or null, got {enabled!r}")
    min_cosine = _number(
        verification.get("min_cosine", DEFAULT_MIN_COSINE), "rounds.verification.min_cosine", minimum=-1
    )
    if min_cosine > 1:
        raise JobConfigError(f"rounds.verification.min_cosine must be <= 1, got {min_cosine!r}")
    # validation_every null or 0: no validation step.
    every = verification.get("validation_every")
    every = None if every in (None, 0) else _integer(every, "rounds.verification.validation_every", minimum=1)
    discard = rounds.get("discard_if_loss_rises")
    if discard is not None:
        discard = _number(discard, "rounds.discard_if_loss_rises", minimum=1, strict=True)
    return AggregationRule(
        name=name,
        clip_factor=clip_factor,
        trim_fraction=trim_fraction,
        verification=Verification(
            enabled=enabled,
            max_norm_ratio=_number(
                verification.get("max_norm_ratio", DEFAULT_MAX_NORM_RATIO),
                "rounds.verification.max_norm_ratio",
                minimum=1,
                strict=True,
            ),
            min_cosine=min_cosine,
            validation_every=every,
            max_validation_rise=_number(
                verification.get("max_validation_rise", DEFAULT_MAX_VALIDATION_RISE),
                "rounds.verification.max_validation_rise",
                minimum=1,
                strict=True,
            ),
        ),
        discard_if_loss_rises=discard,
    )


def _resume(value: Any) -> ResumeConfig | None:
    if value is None:
        return None
    checkpoint = _object(value, "checkpoint")
    uri = _string(checkpoint.get("uri"), "checkpoint.uri")
    if not uri.startswith("/") or not uri.endswith("/"):
        raise JobConfigError(f"checkpoint.uri must be a control-plane path ending in '/', got {uri!r}")
    files = _object(checkpoint.get("files"), "checkpoint.files")
    if "round.json" not in files or "weights.safetensors" not in files:
        raise JobConfigError("checkpoint.files must name round.json and weights.safetensors")
    entries = []
    for name, entry in files.items():
        if name not in _CHECKPOINT_FILES and not _CHAIN_FILE.fullmatch(name):
            raise JobConfigError(f"checkpoint.files: unknown file {name!r}")
        entry = _object(entry, f"checkpoint.files.{name}")
        digest = _string(entry.get("sha256"), f"checkpoint.files.{name}.sha256")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise JobConfigError(f"checkpoint.files.{name}.sha256 must be 64 lowercase hex digits")
        entries.append(
            CheckpointFile(
                name=name,
                size=_integer(entry.get("size"), f"checkpoint.files.{name}.size", minimum=0),
                sha256=digest,
            )
        )
    return ResumeConfig(
        round_number=_integer(checkpoint.get("round"), "checkpoint.round", minimum=0),
        uri=uri,
        files=tuple(entries),
    )


def _source(value: Any) -> ModelSource:
    source = _object(value, "model.source")
    kind = source.get("type")
    if kind == "config":
        return ModelSource(type="config", config=dict(_object(source.get("config"), "model.source.config")))
    if kind == "huggingface":
        filenames = source.get("filenames")
        if not isinstance(filenames, list) or not filenames or not all(isinstance(n, str) for n in filenames):
            raise JobConfigError("model.source.filenames must be a non-empty list of file names")
        revision = source.get("revision")
        token = source.get("token")
        return ModelSource(
            type="huggingface",
            repository=_string(source.get("repository"), "model.source.repository"),
            revision=None if revision is None else _string(revision, "model.source.revision"),
            filenames=tuple(filenames),
            token=None if token is None else _string(token, "model.source.token"),
        )
    if kind == "uri":
        url = _string(source.get("value"), "model.source.value")
        # A path (no scheme, no "//") is a file uploaded to the control plane: /api/uploads/<id>/content/.
        if not url.startswith(("http://", "https://", "/api/")) or url.startswith("//"):
            raise JobConfigError(
                f"model.source.value must be an http(s) URL or a control-plane path, got {url!r}"
            )
        return ModelSource(type="uri", value=url)
    raise JobConfigError(f"model.source.type must be one of {', '.join(SOURCE_TYPES)}, got {kind!r}")


def _eval(value: Any) -> EvalConfig | None:
    if value is None:
        return None
    config = _object(value, "eval")
    slices_value = config.get("slices")
    if not isinstance(slices_value, list) or not slices_value:
        raise JobConfigError("eval.slices must be a non-empty list")
    slices = []
    for position, item in enumerate(slices_value):
        where = f"eval.slices[{position}]"
        item = _object(item, where)
        urls = item.get("urls")
        if not isinstance(urls, list) or not urls or not all(isinstance(url, str) for url in urls):
            raise JobConfigError(f"{where}.urls must be a non-empty list of URLs")
        digest = _string(item.get("sha256"), f"{where}.sha256").lower()
        if len(digest) != 64 or any(character not in "0123456789abcdef" for character in digest):
            raise JobConfigError(f"{where}.sha256 must be 64 hex digits")
        slices.append(
            EvalSlice(
                index=_integer(item.get("index"), f"{where}.index", minimum=0),
                size=_integer(item.get("size"), f"{where}.size", minimum=0),
                sha256=digest,
                urls=tuple(urls),
            )
        )
    return EvalConfig(
        dataset=_string(config.get("dataset", ""), "eval.dataset", allow_empty=True),
        batch_size=_integer(config.get("batch_size", 16), "eval.batch_size", minimum=1),
        slices=tuple(slices),
    )


def parse_job(document: str | bytes | dict[str, Any]) -> JobConfig:
    """Parse the parameter server's JOB_JSON (see the module docstring for the contract)."""
    if isinstance(document, str | bytes):
        try:
            document = json.loads(document)
        except ValueError as error:
            raise JobConfigError(f"the job is not JSON: {error}") from None
    envelope = _object(document, "the job")
    job_id = _string(envelope.get("job_id"), "job_id")
    executor = _object(envelope.get("executor"), "executor")
    if executor.get("class") != "aggregate":
        raise JobConfigError(f"executor.class must be 'aggregate', got {executor.get('class')!r}")
    config = _object(executor.get("config"), "executor.config")

    expected = _peers(config.get("updates"), "updates")
    if not expected:
        raise JobConfigError("updates.peers must name at least one trainer")
    results = _peers(config.get("results"), "results") if config.get("results") is not None else expected
    optimizer = _object(config.get("optimizer"), "optimizer")
    learning_rate = _number(optimizer.get("learning-rate"), "optimizer.learning-rate", minimum=0, strict=True)
    momentum = _number(optimizer.get("momentum", 0.9), "optimizer.momentum", minimum=0)
    if momentum >= 1:
        raise JobConfigError(f"optimizer.momentum must be < 1, got {momentum!r}")

    # ``model``, ``rounds`` and ``eval`` extend the config; also found at the envelope's top level for callers
    # that put them next to ``executor``.
    for key in ("model", "rounds", "eval", "checkpoint"):
        if key not in config and key in envelope:
            config = {**config, key: envelope[key]}
    model = _object(config.get("model"), "model")
    input_names = model.get("input-names", [])
    if not isinstance(input_names, list) or not all(isinstance(name, str) for name in input_names):
        raise JobConfigError("model.input-names must be a list of strings")
    seed = model.get("seed", 0)
    rounds = _object(config.get("rounds") or {}, "rounds")
    weighted = rounds.get("weighted", True)
    if not isinstance(weighted, bool):
        raise JobConfigError(f"rounds.weighted must be true or false, got {weighted!r}")
    max_samples = rounds.get("max_samples_per_update")
    if max_samples is not None:
        max_samples = _integer(max_samples, "rounds.max_samples_per_update", minimum=1)
    norm_ratio = _number(
        rounds.get("update_norm_ratio", 10.0), "rounds.update_norm_ratio", minimum=1, strict=True
    )
    try:
        encoding = Encoding(
            rounds.get("encoding", DEFAULT_ENCODING), rounds.get("encoding_block_size", DEFAULT_BLOCK_SIZE)
        )
    except EncodingError as error:
        raise JobConfigError(f"rounds.encoding: {error}") from None
    checkpoint_every = _integer(rounds.get("checkpoint_every", 10), "rounds.checkpoint_every", minimum=1)
    if checkpoint_every > MAX_CHECKPOINT_EVERY:
        raise JobConfigError(
            f"rounds.checkpoint_every must be at most {MAX_CHECKPOINT_EVERY}, got {checkpoint_every}"
        )
    aggregation = _aggregation(rounds)
    evaluation = _eval(config.get("eval"))
    if aggregation.evaluates and evaluation is None:
        raise JobConfigError(
            "rounds.verification.validation_every and rounds.discard_if_loss_rises need the held-out loss: "
            "the job has no eval data"
        )

    return JobConfig(
        job_id=job_id,
        expected_peers=expected,
        result_peers=results,
        learning_rate=learning_rate,
        momentum=momentum,
        task=_string(model.get("task", "auto"), "model.task"),
        source=_source(model.get("source")),
        input_names=tuple(input_names),
        seed=_integer(seed, "model.seed", minimum=0),
        update_rounds=_integer(rounds.get("update_rounds", 1), "rounds.update_rounds", minimum=1),
        round_timeout=_number(
            rounds.get("round_timeout", 120.0), "rounds.round_timeout", minimum=0, strict=True
        ),
        weighted=weighted,
        eval=evaluation,
        resume=_resume(config.get("checkpoint")),
        max_samples_per_update=max_samples,
        update_norm_ratio=norm_ratio,
        encoding=encoding,
        checkpoint_every=checkpoint_every,
        fragments=_fragments(rounds),
        aggregation=aggregation,
    )
