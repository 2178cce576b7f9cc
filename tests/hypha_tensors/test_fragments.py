"""Streaming DiLoCo's partition of a model into fragments (hypha_tensors.fragments)."""

from __future__ import annotations

import pytest
import torch

from hypha_tensors.fragments import (
    FragmentError,
    fragment_of_round,
    largest_share,
    partition,
    partition_state,
)


def _gpt2_like(layers: int, block: int = 100, embedding: int = 150) -> list[tuple[list[str], int]]:
    groups: list[tuple[list[str], int]] = [
        (["lm_head.weight", "transformer.wte.weight"], embedding),
        (["transformer.wpe.weight"], 10),
        (["transformer.ln_f.weight"], 1),
        (["transformer.ln_f.bias"], 1),
    ]
    for index in range(layers):
        groups.append(([f"transformer.h.{index}.attn.weight"], block // 2))
        groups.append(([f"transformer.h.{index}.mlp.weight"], block // 2))
    return groups


def test_rounds_cycle_through_the_fragments_from_round_one():
    assert [fragment_of_round(r, 3) for r in range(1, 8)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError):
        fragment_of_round(0, 3)


def test_every_name_in_exactly_one_fragment_and_blocks_whole_and_strided():
    groups = _gpt2_like(layers=8, block=100, embedding=40)
    parts = partition(groups, 4)
    names = [name for group, _ in groups for name in group]
    assert sorted(name for part in parts for name in part) == sorted(names)
    for index in range(8):
        owners = {f for f, part in enumerate(parts) if f"transformer.h.{index}.attn.weight" in part}
        assert owners == {f for f, part in enumerate(parts) if f"transformer.h.{index}.mlp.weight" in part}
        # Equal blocks are placed first, largest first: the paper's strided pattern.
        assert owners == {index % 4}
    # Tied names go together.
    together = [f for f, part in enumerate(parts) if "lm_head.weight" in part]
    assert together == [f for f, part in enumerate(parts) if "transformer.wte.weight" in part]


def test_a_large_embedding_does_not_pile_on_a_fragment_of_blocks():
    groups = _gpt2_like(layers=4, block=100, embedding=150)
    parts = partition(groups, 2)
    elements = {group[0]: size for group, size in groups}
    # Units: embedding 150, four blocks of 100, 10, 1, 1 = 562; halves of 281 at best.
    assert largest_share(parts, elements) <= 301 / 562


def test_the_same_partition_whatever_the_order_and_the_names_given():
    groups = _gpt2_like(layers=6)
    reordered = [(list(reversed(names)), size) for names, size in reversed(groups)]
    assert partition(groups, 3) == partition(reordered, 3)


def test_too_few_units_or_a_bad_count_is_a_clear_error():
    groups = [(["a.weight"], 10), (["b.weight"], 10)]
    with pytest.raises(FragmentError, match="too few for 3 fragments"):
        partition(groups, 3)
    with pytest.raises(FragmentError, match="2 to 64"):
        partition(groups, 1)
    with pytest.raises(FragmentError, match="two groups"):
        partition([(["a"], 1), (["a", "b"], 1)], 2)


def test_partition_state_counts_a_tied_tensor_once():
    shared = torch.zeros(30)
    state = {"emb": shared, "head": shared, "h.0.w": torch.zeros(10), "h.1.w": torch.zeros(10)}
    parts = partition_state(state, [["emb", "head"], ["h.0.w"], ["h.1.w"]], 2)
    assert parts[0] == frozenset({"emb", "head"})
    assert parts[1] == frozenset({"h.0.w", "h.1.w"})
