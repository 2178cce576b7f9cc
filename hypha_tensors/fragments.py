"""Streaming DiLoCo's fragments: which tensors sync in which round (docs/training.md, "Overlap: streaming").

A job with ``rounds.overlap = "streaming"`` and ``fragments = F`` splits the model's tensors into F fragments;
round r (numbered from 1) syncs fragment :func:`fragment_of_round` ``(r − 1) mod F`` only (the job's last
round excepted: it syncs every fragment, :func:`syncs_everything`): trainers send the
pseudo-gradient of its tensors, the parameter server averages them and steps them (their Nesterov momentum is
stepped only in their rounds), and the result carries them alone. So at any moment at most one fragment of the
model is in flight, and every tensor is synced once every F rounds.

Trainers and the parameter server compute the same partition from the names and sizes of the model's tensors
(:func:`partition`), without talking about it; the parameter server refuses an update whose names are not the
round's fragment's, so a difference would be a clear error, never a silent mix-up.

The rule, deterministic in the names and sizes alone:

1. A *group* is a set of names of one tensor (tied weights: GPT-2's ``transformer.wte.weight`` and
   ``lm_head.weight``); it goes whole to one fragment. A group is known by its smallest name.
2. Groups whose smallest name has a numeric path component (``transformer.h.3.attn.c_attn.weight``) belong to
   the *block* named by the path up to that component (``transformer.h.3``); every block is one unit, as the
   Streaming DiLoCo paper syncs whole layers. Every other group (embeddings, the final norm) is a unit alone.
3. Units are placed largest first (ties: blocks in order, then by name) on the fragment that holds the fewest
   elements so far (ties: the lowest index) — with equal blocks this is the paper's strided pattern (block i in
   fragment i mod F), and a large embedding does not pile up on top of a fragment of blocks.

A model with fewer units than F cannot be split so: :class:`FragmentError`. A unit larger than 1/F of the model
(GPT-2's token embedding at F = 4) makes its fragment larger than 1/F: :func:`largest_share` says by how much.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

#: Fragments a job may ask for.
MIN_FRAGMENTS = 2
MAX_FRAGMENTS = 64
DEFAULT_FRAGMENTS = 4

_NUMERIC = re.compile(r"^\d+$")


class FragmentError(ValueError):
    """The model cannot be split into the fragments asked for."""


def fragment_of_round(round_number: int, fragments: int) -> int:
    """The fragment round ``round_number`` (from 1) syncs: ``(round_number − 1) mod fragments``."""
    if round_number < 1:
        raise ValueError(f"rounds are numbered from 1, not {round_number}")
    if fragments < 1:
        raise ValueError(f"a model has at least one fragment, not {fragments}")
    return (round_number - 1) % fragments


def syncs_everything(round_number: int, rounds: int | None) -> bool:
    """Whether round ``round_number`` of a streaming job of ``rounds`` rounds syncs every fragment: its last
    round does (docs/training.md, "Overlap: streaming": the final model holds every trainer's last steps of
    every tensor). ``rounds`` None (not known): no round does."""
    return rounds is not None and round_number >= rounds


def _block_of(name: str) -> tuple[str, int] | None:
    """``("transformer.h", 3)`` for ``transformer.h.3.attn.weight``; None for a name outside a block."""
    parts = name.split(".")
    for index, part in enumerate(parts[:-1]):
        if _NUMERIC.match(part):
            return ".".join(parts[:index]), int(part)
    return None


def partition(groups: Iterable[tuple[Sequence[str], int]], fragments: int) -> list[frozenset[str]]:
    """The names of each fragment (every name of a group, aliases included), for ``groups`` given as
    ``(names, elements)``: the names of one tensor and its element count. The rule is the module's."""
    if not MIN_FRAGMENTS <= fragments <= MAX_FRAGMENTS:
        raise FragmentError(f"fragments must be {MIN_FRAGMENTS} to {MAX_FRAGMENTS}, not {fragments}")
    units: dict[tuple[int, str, int], tuple[list[str], int]] = {}
    seen: set[str] = set()
    for names, elements in groups:
        names = sorted(names)
        if not names:
            continue
        repeated = seen.intersection(names)
        if repeated:
            raise FragmentError(f"tensor {sorted(repeated)[0]!r} is named in two groups")
        seen.update(names)
        block = _block_of(names[0])
        # Blocks first among equals (0), in their order; other groups by their name (1).
        key = (0, block[0], block[1]) if block is not None else (1, names[0], 0)
        members, size = units.get(key, ([], 0))
        units[key] = ([*members, *names], size + int(elements))
    if len(units) < fragments:
        raise FragmentError(
            f"the model has {len(units)} blocks and other tensors, too few for {fragments} fragments "
            f"(ask for at most {len(units)})"
        )
    loads = [0] * fragments
    members: list[set[str]] = [set() for _ in range(fragments)]
    for key in sorted(units, key=lambda key: (-units[key][1], key)):
        names, size = units[key]
        target = min(range(fragments), key=lambda index: (loads[index], index))
        loads[target] += size
        members[target].update(names)
    return [frozenset(names) for names in members]


def partition_state(
    state: Mapping[str, object], groups: Iterable[Sequence[str]], fragments: int
) -> list[frozenset[str]]:
    """:func:`partition` for a state dict whose tied names are grouped by ``groups`` (each name in one group;
    the element count of a group is its first name's tensor's ``numel()``)."""
    return partition(((names, state[sorted(names)[0]].numel()) for names in groups), fragments)  # type: ignore[attr-defined]


def largest_share(parts: Sequence[frozenset[str]], elements: Mapping[str, int]) -> float:
    """The largest fragment's elements ÷ the model's (each tensor counted once: ``elements`` names one name of
    each group, the others absent)."""
    total = sum(elements.values())
    if total == 0:
        return 0.0
    return max(sum(elements.get(name, 0) for name in part) for part in parts) / total
