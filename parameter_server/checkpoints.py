"""Round checkpoints: the global weights and the outer momentum after each round, one directory per round.

Layout of ``directory``::

    round-000000041/            a complete round (never modified once renamed into place)
        round.json              {"format": 1, "round_number": 41, "has_momentum": true, "has_result": true,
                                 "participants": ["<peer>", ...], "base_round": 40,
                                 "chain": [{"round": 41, "stepped": true}], "digest": "sha256:…"}
        weights.safetensors     the global weights θ after the round (tied weights stored once)
        momentum.safetensors    the outer momentum m (absent when ``momentum`` was None)
        result.safetensors      the round's outer update u_r as published (its encoding, ``hypha.round``,
                                ``hypha.digest``: the file trainers fetch; absent for round 0)
    round-000000042/
    .partial-round-000000043-x1y2z3/   a save in progress, or left by a crash: ignored by ``load_latest``

Atomicity: ``save_round`` writes everything into a ``.partial-…`` directory, fsyncs the files and that
directory, then ``os.rename``s it to ``round-NNNNNNNNN`` and fsyncs ``directory``. A crash at any point
before the rename leaves the previous round as the latest complete one; after it, the new round is complete.
One writer per ``directory`` is assumed (the parameter server of one job): ``save_round`` deletes
``.partial-…`` leftovers of earlier crashes.

**Incremental copies** (docs/training.md, "A parameter server lost"). A parameter server that restarts
elsewhere resumes from a copy of its last round kept by the control plane, and that copy is incremental:
θ_r = θ_b + u_{b+1} + … + u_r, each u as published, decoded and added in float32 in order — the very
operations the round computed (``RoundCoordinator._step``: ``θ + deQ(u)`` per tensor), so replaying them
gives θ_r bit for bit. ``base_round`` b is the last round whose weights were uploaded; ``chain`` lists the
rounds b+1..r with whether each took a step (a round that did not kept θ as it was: adding its zeros would
turn a −0.0 into +0.0); ``digest`` is θ_r's :func:`~hypha_tensors.weights.digest`, which the replay must
reproduce. A manifest without ``base_round`` (an older server's) is a round of full weights.
:func:`round_files` lists what a round uploads (the weights only at a base round), :func:`adopt_round`
installs downloaded files, replaying the chain and checking the digest.

Bit-identity: tensors are stored as their raw little-endian bytes by safetensors, so ``load_latest`` returns
tensors equal bit for bit (signed zeros included) to the ones saved, with the same names, shapes and dtypes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hypha_tensors import weights as weights_io
from hypha_tensors.encoding import decode
from hypha_tensors.formats import Encoding, EncodingError
from parameter_server.exceptions import ERRORS, CheckpointError

CHECKPOINT_FORMAT = 1
MANIFEST_NAME = "round.json"
WEIGHTS_NAME = "weights.safetensors"
MOMENTUM_NAME = "momentum.safetensors"
RESULT_NAME = "result.safetensors"
PARTIAL_PREFIX = ".partial-"
_ROUND_DIRECTORY = re.compile(r"round-(\d{9,})")
#: A chain file of a downloaded copy: round N's result as published (the control plane's name for it).
CHAIN_RESULT = re.compile(r"result-(\d{1,9})\.safetensors")


def chain_result_name(round_number: int) -> str:
    """``result-41.safetensors``: round 41's result in a copy kept by the control plane."""
    return f"result-{round_number}.safetensors"


@dataclass(frozen=True)
class ChainLink:
    """A round of an incremental copy: its number and whether it took a step (added its result to θ)."""

    round_number: int
    stepped: bool


@dataclass(frozen=True)
class RoundState:
    """What a round leaves behind: its number, the global weights after it, the outer momentum (None
    before the first outer step) and, when saved, the round's update u_r and who took part in it; and, for
    the control plane's incremental copy, the round whose weights it builds on (``base_round``; None: a
    round saved without it, which counts as its own base), the rounds since (``chain``) and θ's digest."""

    round_number: int
    weights: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor] | None
    result: dict[str, torch.Tensor] | None = None
    participants: tuple[str, ...] = ()
    base_round: int | None = None
    chain: tuple[ChainLink, ...] = ()
    digest: str | None = None


def round_directory_name(round_number: int) -> str:
    """``round-000000042``: zero-padded so that names sort like numbers."""
    return f"round-{round_number:09d}"


def _complete_rounds(directory: Path) -> list[tuple[int, Path]]:
    rounds = []
    for entry in directory.iterdir():
        match = _ROUND_DIRECTORY.fullmatch(entry.name)
        if match and entry.is_dir():
            rounds.append((int(match.group(1)), entry))
    return sorted(rounds)


def _fsync_path(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def save_round(
    directory: str | Path,
    *,
    round_number: int,
    weights: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor] | None,
    result: Mapping[str, torch.Tensor] | None = None,
    participants: tuple[str, ...] | list[str] = (),
    keep: int | None = None,
    base_round: int | None = None,
    chain: Sequence[ChainLink] = (),
    digest: str | None = None,
    result_metadata: Mapping[str, str] | None = None,
) -> Path:
    """Save one round atomically and return its directory.

    * ``directory`` is created if needed. ``round_number`` must be an int >= 0 (``ValueError``) and not
      already saved (``CheckpointError``; a round is never overwritten).
    * ``weights``, ``momentum`` and ``result`` (u_r, with the round's ``participants``) go through
      ``weights.save``: a NaN/Inf or a non-tensor raises ``TensorRefused`` and no round directory (partial
      or complete) is left behind. ``result_metadata`` (the encoding's header entries) and ``digest`` (θ's,
      with the round number) are written into the result file's header, as in the published file.
    * ``base_round``, ``chain`` and ``digest`` go into the manifest (the module docstring); ``chain`` must
      name exactly the rounds ``base_round + 1 .. round_number`` (``ValueError``). Without ``base_round``
      the manifest has none of the three (a round of full weights, as older servers saved them).
    * ``keep``: if given (>= 1), only the ``keep`` most recent complete rounds are kept afterwards.
    * Any failure before the final rename leaves the previous rounds exactly as they were; ``OSError`` from
      the file system propagates.
    """
    if isinstance(round_number, bool) or not isinstance(round_number, int) or round_number < 0:
        raise ValueError(f"round_number must be an int >= 0, got {round_number!r}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep!r}")
    if base_round is not None:
        if not 0 <= base_round <= round_number:
            raise ValueError(f"base_round must be from 0 to {round_number}, got {base_round!r}")
        if [link.round_number for link in chain] != list(range(base_round + 1, round_number + 1)):
            raise ValueError(f"the chain must name rounds {base_round + 1} to {round_number}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / round_directory_name(round_number)
    if final.exists():
        raise CheckpointError(f"round {round_number} is already saved in {final}")
    for leftover in directory.glob(f"{PARTIAL_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)

    partial = Path(tempfile.mkdtemp(prefix=f"{PARTIAL_PREFIX}{final.name}-", dir=directory))
    try:
        weights_io.save(partial / WEIGHTS_NAME, weights)
        if momentum is not None:
            weights_io.save(partial / MOMENTUM_NAME, momentum)
        if result is not None:
            weights_io.save(
                partial / RESULT_NAME,
                result,
                metadata=result_metadata,
                round_number=round_number if digest is not None else None,
                weights_digest=digest,
            )
        manifest: dict[str, Any] = {
            "format": CHECKPOINT_FORMAT,
            "round_number": round_number,
            "has_momentum": momentum is not None,
            "has_result": result is not None,
            "participants": [str(peer) for peer in participants],
        }
        if base_round is not None:
            manifest["base_round"] = base_round
            manifest["chain"] = [{"round": link.round_number, "stepped": link.stepped} for link in chain]
            if digest is not None:
                manifest["digest"] = digest
        with open(partial / MANIFEST_NAME, "w", encoding="utf-8") as file:
            json.dump(manifest, file, sort_keys=True)
            file.flush()
            os.fsync(file.fileno())
        _fsync_path(partial)
        os.rename(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _fsync_path(directory)

    if keep is not None:
        for _, old in _complete_rounds(directory)[:-keep]:
            # Rename first so that a crash mid-delete leaves a ".partial-" leftover, never a half round.
            doomed = directory / f"{PARTIAL_PREFIX}deleting-{old.name}"
            os.rename(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    return final


def load_latest(directory: str | Path) -> RoundState | None:
    """The most recent complete round in ``directory``, or None if there is none (or no directory).

    ``.partial-…`` directories are ignored. If the latest complete round cannot be read (a missing or
    corrupt file, a manifest that does not match its directory), ``CheckpointError`` is raised rather
    than silently falling back to an older round: going back in time must be an operator's decision.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    rounds = _complete_rounds(directory)
    if not rounds:
        return None
    round_number, path = rounds[-1]
    return _read_round(path, round_number)


def load_round(directory: str | Path, round_number: int) -> RoundState | None:
    """Complete round ``round_number`` in ``directory`` (None if it is not kept there): an owner's discard
    goes back to the round before the last one (parameter_server/rounds/coordinator.py). ``CheckpointError``
    if it cannot be read."""
    path = Path(directory) / round_directory_name(round_number)
    if not path.is_dir():
        return None
    return _read_round(path, round_number)


def _read_round(path: Path, round_number: int) -> RoundState:
    try:
        with open(path / MANIFEST_NAME, encoding="utf-8") as file:
            manifest = json.load(file)
        if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path / MANIFEST_NAME}: unknown checkpoint format")
        if manifest.get("round_number") != round_number:
            raise CheckpointError(f"{path / MANIFEST_NAME}: says round {manifest.get('round_number')!r}")
        weights = weights_io.load(path / WEIGHTS_NAME)
        momentum = weights_io.load(path / MOMENTUM_NAME) if manifest.get("has_momentum") else None
        result = weights_io.load(path / RESULT_NAME) if manifest.get("has_result") else None
        participants = manifest.get("participants", [])
        if not isinstance(participants, list):
            raise CheckpointError(f"{path / MANIFEST_NAME}: participants is not a list")
        base_round, chain, digest = _chain_of(manifest, round_number, path / MANIFEST_NAME)
    except CheckpointError:
        raise
    except (OSError, ValueError, *ERRORS) as error:
        raise CheckpointError(f"round {round_number} in {path} cannot be read: {error}") from error
    return RoundState(
        round_number=round_number,
        weights=weights,
        momentum=momentum,
        result=result,
        participants=tuple(str(peer) for peer in participants),
        base_round=base_round,
        chain=chain,
        digest=digest,
    )


def _chain_of(
    manifest: dict[str, Any], round_number: int, where: Path
) -> tuple[int | None, tuple[ChainLink, ...], str | None]:
    """(``base_round``, ``chain``, ``digest``) of a manifest; (None, (), None) for one without a base round.
    ``CheckpointError`` unless the chain names exactly the rounds after the base up to ``round_number``."""
    base = manifest.get("base_round")
    if base is None:
        return None, (), None
    if isinstance(base, bool) or not isinstance(base, int) or not 0 <= base <= round_number:
        raise CheckpointError(f"{where}: base_round {base!r} is not a round from 0 to {round_number}")
    links = manifest.get("chain")
    if not isinstance(links, list) or not all(
        isinstance(link, dict)
        and isinstance(link.get("round"), int)
        and not isinstance(link.get("round"), bool)
        and isinstance(link.get("stepped"), bool)
        for link in links
    ):
        raise CheckpointError(f"{where}: chain is not a list of {{round, stepped}}")
    chain = tuple(ChainLink(link["round"], link["stepped"]) for link in links)
    if [link.round_number for link in chain] != list(range(base + 1, round_number + 1)):
        raise CheckpointError(f"{where}: the chain does not name rounds {base + 1} to {round_number}")
    digest = manifest.get("digest")
    if digest is not None and not (isinstance(digest, str) and digest.startswith("sha256:")):
        raise CheckpointError(f"{where}: digest {str(digest)[:80]!r} is not a sha256: digest")
    return base, chain, digest


def round_files(directory: str | Path, round_number: int) -> dict[str, Path]:
    """The files complete round ``round_number`` uploads to the control plane (name → path), the manifest
    last: the order to upload them in, so that a copy is complete once its manifest arrives. The weights go
    only at a base round (its manifest's ``base_round`` is the round itself, or it has none): other rounds
    send their momentum and result, and the control plane's copy replays them on the base's weights."""
    path = Path(directory) / round_directory_name(round_number)
    try:
        with open(path / MANIFEST_NAME, encoding="utf-8") as file:
            manifest = json.load(file)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"round {round_number} in {path} has no readable manifest: {error}") from error
    base = manifest.get("base_round", round_number) if isinstance(manifest, dict) else round_number
    candidates = (
        (WEIGHTS_NAME, MOMENTUM_NAME, RESULT_NAME) if base == round_number else (MOMENTUM_NAME, RESULT_NAME)
    )
    names = [name for name in candidates if (path / name).is_file()]
    return {name: path / name for name in [*names, MANIFEST_NAME]}


def adopt_round(directory: str | Path, source: str | Path) -> RoundState:
    """Install the round whose files were downloaded into ``source`` (a directory inside ``directory``,
    named ``.partial-…``) as a complete round, and return it.

    ``source`` holds what the control plane keeps: the manifest (it names the round, its base round and the
    chain), ``weights.safetensors`` (the base round's weights), ``momentum.safetensors`` and
    ``result-N.safetensors`` for each round of the chain and for the round itself (``result.safetensors``
    from an older control plane, whose copies are full). The chain is replayed on the base weights in order
    (the module docstring) and the weights it gives must have the manifest's ``digest``: never a silently
    different model. The round is installed with its full weights and ``result.safetensors``, its manifest
    unchanged (the next round's upload builds on the same base); one already saved there is kept as it is.
    ``CheckpointError`` if the files do not make a readable round or replay to other weights: ``source`` is
    removed and nothing is installed."""
    directory, source = Path(directory), Path(source)
    try:
        try:
            with open(source / MANIFEST_NAME, encoding="utf-8") as file:
                manifest = json.load(file)
        except (OSError, ValueError) as error:
            raise CheckpointError(f"the downloaded checkpoint has no readable manifest: {error}") from error
        number = manifest.get("round_number") if isinstance(manifest, dict) else None
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise CheckpointError(f"{source / MANIFEST_NAME}: no round number")
        base, chain, digest = _chain_of(manifest, number, source / MANIFEST_NAME)
        replayed = base is not None and base < number
        if replayed:
            weights_io.save(source / WEIGHTS_NAME, _replay(source, chain))
        own = source / chain_result_name(number)
        if own.is_file():
            os.replace(own, source / RESULT_NAME)
        for entry in source.iterdir():
            if CHAIN_RESULT.fullmatch(entry.name):
                entry.unlink()
        state = _read_round(source, number)
        if digest is not None:
            found = weights_io.digest(state.weights)
            if found != digest:
                how = (
                    f"replayed from round {base}'s weights and the results of rounds {base + 1} to {number}"
                    if replayed
                    else "as downloaded"
                )
                raise CheckpointError(
                    f"round {number}'s weights {how} have the digest {found}, but its round.json says "
                    f"{digest}: the control plane's copy is inconsistent; not resuming from it"
                )
        final = directory / round_directory_name(number)
        if not final.exists():
            for entry in source.iterdir():
                _fsync_path(entry)
            _fsync_path(source)
            os.rename(source, final)
            _fsync_path(directory)
    except OSError as error:
        raise CheckpointError(f"the downloaded checkpoint cannot be installed: {error}") from error
    finally:
        shutil.rmtree(source, ignore_errors=True)
    return state


def _replay(source: Path, chain: Sequence[ChainLink]) -> dict[str, torch.Tensor]:
    """θ_r from the base weights in ``source`` and the chain's results there: each result decoded as its
    header says and, if its round took a step, added per tensor exactly as the round added it."""
    where = source / WEIGHTS_NAME
    try:
        weights = weights_io.load(where)
        floating = {name: tensor for name, tensor in weights.items() if tensor.dtype.is_floating_point}
        for link in chain:
            where = source / chain_result_name(link.round_number)
            said, _ = weights_io.publication(where)
            if said is not None and said != link.round_number:
                raise CheckpointError(
                    f"{where.name} is round {said}'s result, not round {link.round_number}'s"
                )
            metadata = weights_io.read_metadata(where)
            update = decode(weights_io.load(where), Encoding.from_metadata(metadata))
            # Names and shapes of the global weights' floating-point tensors: a result of another model
            # must not be added by broadcasting (the digest would catch it, but not say why).
            for name in sorted(update):
                if name not in floating or update[name].shape != floating[name].shape:
                    raise CheckpointError(f"{where.name}: {name!r} is not a tensor of the weights' shape")
            if link.stepped:
                # The round's own operation (RoundCoordinator._step), in the same dtypes: the same bits.
                weights = {
                    name: tensor + update[name] if name in update else tensor
                    for name, tensor in weights.items()
                }
    except CheckpointError:
        raise
    except (ValueError, EncodingError, *ERRORS) as error:
        raise CheckpointError(f"the checkpoint's {where.name} cannot be replayed: {error}") from error
    return weights
