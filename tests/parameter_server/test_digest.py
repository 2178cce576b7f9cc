"""``weights.digest`` and the published-file metadata the trainers check their merged weights against."""

from __future__ import annotations

from pathlib import Path

import torch

from hypha_tensors import weights


def test_the_digest_counts_tied_names_once_and_ignores_integer_tensors() -> None:
    shared = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    tied = {"a.weight": shared, "z.weight": shared, "b": torch.ones(2), "steps": torch.tensor([3])}
    untied = {"a.weight": shared.clone(), "b": torch.ones(2)}

    assert weights.digest(tied) == weights.digest(untied)
    assert weights.digest(tied).startswith("sha256:") and len(weights.digest(tied)) == 7 + 64


def test_the_digest_sees_every_bit_the_dtype_and_the_names() -> None:
    state = {"a": torch.zeros(4), "b": torch.ones(2, 2)}
    changed = {"a": torch.tensor([0.0, 0.0, 0.0, 1e-30]), "b": torch.ones(2, 2)}
    as_double = {name: tensor.double() for name, tensor in state.items()}
    renamed = {"c": state["a"], "b": state["b"]}
    reshaped = {"a": torch.zeros(2, 2), "b": torch.ones(2, 2)}

    digests = {weights.digest(other) for other in (state, changed, as_double, renamed, reshaped)}

    assert len(digests) == 5


def test_a_published_file_says_its_round_and_digest(tmp_path: Path) -> None:
    state = {"a": torch.randn(3), "b": torch.randn(2, 2)}
    path = tmp_path / "w.safetensors"

    weights.save(path, state, metadata={"format": "pt"}, round_number=4, weights_digest=weights.digest(state))

    assert weights.publication(path) == (4, weights.digest(state))
    assert weights.digest(weights.load(path)) == weights.digest(state)
    assert weights.header_dtypes(path) == {"a": torch.float32, "b": torch.float32}
    weights.save(path, state)
    assert weights.publication(path) == (None, None)
