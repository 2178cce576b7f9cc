"""What a trainer's global weights equal after each round, checked against what the parameter server published.

The contract (docs/training.md, "What a trainer's weights equal after each round"): after merging round r a
trainer holds exactly θ_r, the parameter server's global weights after round r — whether or not its own update
was in the round, however late it reads the result. Our parameter server publishes with each round's result
(and with the global model file) ``hypha.round`` and ``hypha.digest`` (:func:`hypha_tensors.weights.digest`
of θ_r); our bridge announces each result with its ``round`` and its own file. So a trainer:

* takes each round's result in order, skipping results of rounds it already has (after fetching the full
  weights, the files of the rounds they include may still be announced);
* refuses to merge a file whose size is not the event's, whose round is not the event's, or that is not the
  next round (one was missed: pruned by the parameter server);
* after merging, compares the digest of its global weights (in the published dtypes) with ``hypha.digest``;
* in a streaming job (:mod:`~worker_daemon.executors.streaming`), refuses a result whose tensors are not
  exactly the round's fragment's (it is some other round's); merges it into the full weights, the other
  tensors as they were, and compares the digest of the full θ_r;
* on any of these, fetches the full global weights (the job's model artifact, which also moves the bridge's
  rounds forward), checks their digest, and goes on from them — never on with weights it cannot vouch for.

Files without Hypha's metadata (another parameter server, Hypha's own bridge) are merged as before: there is
nothing to compare with.

A result comes in the encoding its header says (``hypha.encoding``; float32 without it) and is decoded with
:func:`hypha_tensors.encoding.decode` — the very function the parameter server applied — before the merge,
so the merged weights are its θ_r bit for bit (docs/training.md, "Encodings").
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hypha_tensors import weights
from hypha_tensors.encoding import decode
from hypha_tensors.exceptions import TensorError
from hypha_tensors.formats import Encoding, EncodingError
from worker_daemon.executors.exceptions import UpdateError
from worker_daemon.executors.pseudo_gradient import StateDict, fragment_mismatch, merge, tied_groups

if TYPE_CHECKING:
    from worker_daemon.executors.bridge_client import BridgeClient, ReceiveStream

logger = logging.getLogger("worker_daemon.executors.training")

WEIGHTS_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class Published:
    """What the parameter server said of a file: the rounds its weights include, their digest, and the names
    and dtypes of its global weights (the digest is taken in those)."""

    round_number: int | None
    digest: str | None
    dtypes: dict[str, torch.dtype]


@dataclass(frozen=True)
class Merged:
    """The global weights a round ended with: ``weights`` after ``rounds_completed`` rounds; ``digest`` their
    digest when it was checked against the parameter server's (None when it publishes none)."""

    weights: StateDict
    rounds_completed: int
    digest: str | None
    #: Why the weights were fetched in full instead of merged (None when merged).
    refetched_because: str | None = None


class OutOfSync(Exception):
    """A round's result cannot be merged into exactly θ_r; the message says why."""


def published(path: Path) -> Published:
    """The parameter server's metadata of a weights file (``UpdateError`` if it is not safetensors)."""
    try:
        round_number, digest = weights.publication(path)
        dtypes = weights.header_dtypes(path)
    except TensorError as error:
        raise UpdateError(f"{path.name} is unusable: {error}") from error
    return Published(round_number, digest, dtypes)


def load_result(path: Path) -> StateDict:
    """A result file's tensors decoded from the encoding its metadata says: ``u`` as the parameter server
    applied it (float32). ``TensorError`` for a file that is not usable safetensors,
    :class:`EncodingError` for one that cannot be decoded."""
    encoding = Encoding.from_metadata(weights.read_metadata(path))
    return decode(weights.load(path), encoding)


def state_digest(state: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype]) -> str:
    """:func:`weights.digest` of ``state`` restricted to the published names, in the published dtypes (a
    trainer may hold wider masters than the server publishes; converting them down is exact when they
    came from the server's values)."""
    missing = sorted(name for name in dtypes if dtypes[name].is_floating_point and name not in state)
    if missing:
        raise OutOfSync(f"the global weights have no tensor {missing[0]!r}")
    return weights.digest(
        {name: state[name].to(dtype) for name, dtype in dtypes.items() if dtype.is_floating_point}
    )


def model_file(work_dir: Path, artifact: Mapping[str, Any], fetched: list[Any]) -> Path | None:
    """The weights file among the files a model fetch wrote (``model.safetensors``), or None."""
    paths = [work_dir / item.path for item in fetched]
    candidates = [path for path in paths if path.name.endswith(WEIGHTS_SUFFIX)]
    named = [path for path in candidates if path.name == "model.safetensors"]
    return (named or candidates or [None])[0]


def starting_point(work_dir: Path, artifact: Mapping[str, Any]) -> Published:
    """What the fetched model file says (rounds completed, digest, dtypes) of the weights the trainer starts
    from, read once: its rounds set the LR schedule's first step, its digest is checked with
    :func:`check_start` once the model is loaded. All None when there is no such file (a model from
    elsewhere); ``UpdateError`` when it is not safetensors."""
    names = [name for name in artifact.get("filenames") or [] if str(name).endswith(WEIGHTS_SUFFIX)]
    path = work_dir / "artifacts" / (names[0] if names else "model.safetensors")
    if not path.is_file():
        return Published(None, None, {})
    return published(path)


def check_start(start: Published, state: Mapping[str, torch.Tensor]) -> None:
    """When the fetched model file carries a digest (``start``: :func:`starting_point`), ``state`` (the loaded
    model's) must match it (``UpdateError``)."""
    if start.digest is None:
        return
    ours = _digest_or_reason(state, start.dtypes)
    if ours != start.digest:
        raise UpdateError(
            f"the loaded model is not the parameter server's global weights after round "
            f"{start.round_number} (digest {ours}, published {start.digest})"
        )


def _digest_or_reason(state: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype]) -> str:
    try:
        return state_digest(state, dtypes)
    except OutOfSync as error:
        return f"none: {error}"


def receive_round(
    *,
    results: ReceiveStream,
    work_dir: Path,
    round_number: int,
    global_previous: StateDict,
    dtypes: Mapping[str, torch.dtype],
    fragment: Collection[str] | None = None,
) -> Merged:
    """Read the result of round ``round_number`` from the stream (skipping announced results of earlier
    rounds) and merge it; :class:`OutOfSync` when it cannot give θ_r, ``UpdateError`` for an unusable file.
    ``fragment``: the names of the round's fragment (a streaming job), the only tensors its result may and
    must hold (else :class:`OutOfSync`); None: every tensor, as ever."""
    while True:
        received = results.next_file()
        path = work_dir / received.path
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            if received.round is not None and received.round < round_number:
                continue  # a round the full weights already include; its file went with them
            raise OutOfSync(f"the announced result {received.path} is not there") from None
        if received.round is not None and received.round < round_number:
            logger.info("skipping round %d's result: the weights include it already", received.round)
            continue
        if received.size is not None and size != received.size:
            raise OutOfSync(f"{received.path} holds {size} bytes, its event said {received.size}")
        publication = published(path)
        file_round = publication.round_number
        if received.round is not None and file_round is not None and received.round != file_round:
            raise OutOfSync(
                f"{received.path} holds round {file_round}'s result, its event said {received.round}"
            )
        result_round = received.round if received.round is not None else file_round
        if result_round is not None and result_round < round_number:
            logger.info("skipping round %d's result: the weights include it already", result_round)
            continue
        if result_round is not None and result_round > round_number:
            raise OutOfSync(
                f"round {round_number}'s result never came (the next one is round {result_round})"
            )
        break
    try:
        update = load_result(path)
    except (TensorError, EncodingError) as error:
        raise UpdateError(f"round {round_number}: the update {received.path} is unusable: {error}") from error
    if fragment is not None:
        reason = fragment_mismatch(global_previous, set(update), fragment)
        if reason is not None:
            raise OutOfSync(f"the result {reason}")
    global_new = merge(global_previous, update, fragment)
    if publication.digest is None:
        return Merged(global_new, round_number, None)
    # A fragment's result says the digest of the full θ_r: taken over every tensor.
    reference = dtypes or {
        name: tensor.dtype for name, tensor in (update if fragment is None else global_new).items()
    }
    ours = _digest_or_reason(global_new, reference)
    if ours != publication.digest:
        raise OutOfSync(
            f"the merged weights of round {round_number} are not the parameter server's "
            f"(digest {ours}, published {publication.digest})"
        )
    return Merged(global_new, round_number, ours)


def replace_with(global_previous: StateDict, fetched: Mapping[str, torch.Tensor]) -> StateDict:
    """New global weights holding ``fetched``'s values, tied and typed like ``global_previous`` (``UpdateError``
    when a tensor is missing or of another shape)."""
    replaced: StateDict = {}
    for group in tied_groups(global_previous):
        present = [name for name in group if name in fetched]
        if not present:
            raise UpdateError(f"the fetched global weights have no tensor {group[0]!r}")
        previous, value = global_previous[group[0]], fetched[present[0]]
        if value.shape != previous.shape:
            raise UpdateError(
                f"the fetched {present[0]!r} has shape {tuple(value.shape)}, expected {tuple(previous.shape)}"
            )
        new = value.detach().to("cpu", previous.dtype, copy=True)
        for name in group:
            replaced[name] = new
    return replaced


def refetch(
    *, client: BridgeClient, artifact: dict[str, Any], work_dir: Path, global_previous: StateDict
) -> tuple[Merged, Published]:
    """Fetch the job's model artifact again (the parameter server's current global weights; the bridge
    learns its round) and return them checked against their digest, with what the file says."""
    files = client.fetch(artifact)
    path = model_file(work_dir, artifact, files)
    if path is None:
        raise UpdateError(f"the model artifact yielded no weights file ({[item.path for item in files]})")
    publication = published(path)
    if publication.digest is None or publication.round_number is None:
        raise UpdateError(
            f"the global weights cannot be vouched for: {path.name} carries no round and digest of the "
            "parameter server (the model artifact is not the parameter server's)"
        )
    try:
        fetched = weights.load(path)
    except TensorError as error:
        raise UpdateError(f"the fetched global weights are unusable: {error}") from error
    if weights.digest(fetched) != publication.digest:
        raise UpdateError(f"the fetched {path.name} does not match its own digest {publication.digest}")
    global_new = replace_with(global_previous, fetched)
    ours = _digest_or_reason(global_new, publication.dtypes)
    if ours != publication.digest:
        raise UpdateError(
            f"the fetched global weights changed when loaded (digest {ours}, published {publication.digest})"
        )
    return Merged(global_new, publication.round_number, ours), publication
