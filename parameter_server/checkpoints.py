"""Round checkpoints: the global weights and the outer momentum after each round, one directory per round.

Layout of ``directory``::

    round-000000041/            a complete round (never modified once renamed into place)
        round.json              {"format": 1, "round_number": 41, "has_momentum": true, "has_result": true,
                                 "participants": ["<peer>", ...]}
        weights.safetensors     the global weights θ after the round (tied weights stored once)
        momentum.safetensors    the outer momentum m (absent when ``momentum`` was None)
        result.safetensors      the round's outer update u_r trainers fetch (absent for round 0)
    round-000000042/
    .partial-round-000000043-x1y2z3/   a save in progress, or left by a crash: ignored by ``load_latest``

Atomicity: ``save_round`` writes everything into a ``.partial-…`` directory, fsyncs the files and that
directory, then ``os.rename``s it to ``round-NNNNNNNNN`` and fsyncs ``directory``. A crash at any point
before the rename leaves the previous round as the latest complete one; after it, the new round is complete.
One writer per ``directory`` is assumed (the parameter server of one job): ``save_round`` deletes
``.partial-…`` leftovers of earlier crashes.

A parameter server that restarts elsewhere resumes from a copy of its last round kept by the control plane:
:func:`round_files` lists a round's files for the upload, :func:`adopt_round` installs downloaded ones.

Bit-identity: tensors are stored as their raw little-endian bytes by safetensors, so ``load_latest`` returns
tensors equal bit for bit (signed zeros included) to the ones saved, with the same names, shapes and dtypes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from parameter_server import weights as weights_io
from parameter_server.exceptions import CheckpointError, ParameterServerError

CHECKPOINT_FORMAT = 1
MANIFEST_NAME = "round.json"
WEIGHTS_NAME = "weights.safetensors"
MOMENTUM_NAME = "momentum.safetensors"
RESULT_NAME = "result.safetensors"
PARTIAL_PREFIX = ".partial-"
_ROUND_DIRECTORY = re.compile(r"round-(\d{9,})")


@dataclass(frozen=True)
class RoundState:
    """What a round leaves behind: its number, the global weights after it, the outer momentum (None
    before the first outer step) and, when saved, the round's update u_r and who took part in it."""

    round_number: int
    weights: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor] | None
    result: dict[str, torch.Tensor] | None = None
    participants: tuple[str, ...] = ()


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
) -> Path:
    """Save one round atomically and return its directory.

    * ``directory`` is created if needed. ``round_number`` must be an int >= 0 (``ValueError``) and not
      already saved (``CheckpointError``; a round is never overwritten).
    * ``weights``, ``momentum`` and ``result`` (u_r, with the round's ``participants``) go through ``weights.save``: a NaN/Inf or a non-tensor raises
      ``TensorRefused`` and no round directory (partial or complete) is left behind.
    * ``keep``: if given (>= 1), only the ``keep`` most recent complete rounds are kept afterwards.
    * Any failure before the final rename leaves the previous rounds exactly as they were; ``OSError`` from
      the file system propagates.
    """
    if isinstance(round_number, bool) or not isinstance(round_number, int) or round_number < 0:
        raise ValueError(f"round_number must be an int >= 0, got {round_number!r}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep!r}")
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
            weights_io.save(partial / RESULT_NAME, result)
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "round_number": round_number,
            "has_momentum": momentum is not None,
            "has_result": result is not None,
            "participants": [str(peer) for peer in participants],
        }
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
    except CheckpointError:
        raise
    except (OSError, ValueError, ParameterServerError) as error:
        raise CheckpointError(f"round {round_number} in {path} cannot be read: {error}") from error
    return RoundState(
        round_number=round_number,
        weights=weights,
        momentum=momentum,
        result=result,
        participants=tuple(str(peer) for peer in participants),
    )


def round_files(directory: str | Path, round_number: int) -> dict[str, Path]:
    """The files of complete round ``round_number`` (name → path), the manifest last: the order to upload
    them in, so that a copy is complete once its manifest arrives."""
    path = Path(directory) / round_directory_name(round_number)
    names = [name for name in (WEIGHTS_NAME, MOMENTUM_NAME, RESULT_NAME) if (path / name).is_file()]
    return {name: path / name for name in [*names, MANIFEST_NAME]}


def adopt_round(directory: str | Path, source: str | Path) -> RoundState:
    """Install the round whose files were downloaded into ``source`` (a directory inside ``directory``,
    named ``.partial-…``) as a complete round, and return it.

    The manifest names the round; one already saved there is kept as it is. ``CheckpointError`` if the files
    do not make a readable round: ``source`` is removed and nothing is installed."""
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
        state = _read_round(source, number)
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
