"""Pseudo-gradient out, update in: exact round trips with GPT-2's tied weights, and refusals that change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hypha_tensors import weights
from worker_daemon.executors.exceptions import UpdateError
from worker_daemon.executors.pseudo_gradient import (
    compute_delta,
    float_state,
    load_into,
    merge,
    snapshot,
    tied_groups,
)

from .conftest import make_tiny_gpt2, make_update

TIED = ("lm_head.weight", "transformer.wte.weight")


@pytest.fixture
def model() -> torch.nn.Module:
    return make_tiny_gpt2()


def perturb(model: torch.nn.Module, seed: int) -> None:
    """What inner steps do: change every parameter in place (tied ones once, through the shared tensor)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)


def test_tied_groups_find_gpt2s_shared_embedding(model: torch.nn.Module) -> None:
    groups = tied_groups(float_state(model))
    assert [group for group in groups if len(group) > 1] == [list(TIED)]
    assert sum(len(group) for group in groups) == len(float_state(model))


def test_snapshot_is_a_tied_copy(model: torch.nn.Module) -> None:
    # when
    copy = snapshot(float_state(model))
    perturb(model, seed=1)

    # then: one object for the tied pair, detached from the live model
    assert copy[TIED[0]] is copy[TIED[1]]
    assert not torch.equal(copy[TIED[0]], model.lm_head.weight)


def test_delta_save_load_merge_round_trip_is_exact(model: torch.nn.Module, tmp_path: Path) -> None:
    # given: θ_prev, then inner steps
    global_previous = snapshot(float_state(model))
    perturb(model, seed=1)
    live_before = {name: tensor.clone() for name, tensor in float_state(model).items()}

    # when: the delta goes out through a file, a known u comes back through a file
    delta = compute_delta(float_state(model), global_previous)
    weights.save(tmp_path / "delta.safetensors", delta)
    update = make_update(float_state(model), seed=7)
    weights.save(tmp_path / "u.safetensors", update)
    merged = merge(global_previous, weights.load(tmp_path / "u.safetensors"))
    load_into(model, merged)

    # then: the delta is exactly local − prev and was stored once per tied pair
    with safe_open(str(tmp_path / "delta.safetensors"), framework="pt") as file:
        stored = sorted(file.keys())
    assert stored == sorted(set(live_before) - {"transformer.wte.weight"})
    sent = weights.load(tmp_path / "delta.safetensors")
    assert sorted(sent) == sorted(live_before)
    for name in live_before:
        assert torch.equal(sent[name], live_before[name] - global_previous[name])
    # ... and θ_new is exactly θ_prev + u, loaded in place with the tie intact
    for name, value in float_state(model).items():
        assert torch.equal(value, global_previous[name] + update[name])
        assert merged[name] is merged[TIED[0]] or name not in TIED
    assert model.lm_head.weight is model.transformer.wte.weight


def test_gpt2_tied_weights_survive_save_and_load(model: torch.nn.Module, tmp_path: Path) -> None:
    # when
    weights.save(tmp_path / "w.safetensors", float_state(model))
    loaded = weights.load(tmp_path / "w.safetensors")

    # then
    assert loaded[TIED[0]] is loaded[TIED[1]]
    assert torch.equal(loaded[TIED[1]], model.transformer.wte.weight)


def test_compute_delta_leaves_the_live_model_alone(model: torch.nn.Module) -> None:
    global_previous = snapshot(float_state(model))
    perturb(model, seed=2)
    before = {name: tensor.clone() for name, tensor in float_state(model).items()}

    delta = compute_delta(float_state(model), global_previous)

    assert all(torch.equal(float_state(model)[name], before[name]) for name in before)
    assert delta[TIED[0]] is delta[TIED[1]]
    assert all(
        tensor.data_ptr() != before_tensor.data_ptr()
        for tensor, before_tensor in [(delta[n], float_state(model)[n]) for n in before]
    )


@pytest.mark.parametrize("kept", TIED)
def test_merge_accepts_a_tied_group_under_either_name(model: torch.nn.Module, kept: str) -> None:
    # given: a file without the alias table, like save_model's (only one name of the pair)
    global_previous = snapshot(float_state(model))
    update = make_update(float_state(model), seed=3)
    partial = {name: tensor.clone() for name, tensor in update.items() if name not in TIED or name == kept}

    merged = merge(global_previous, partial)

    assert merged[TIED[0]] is merged[TIED[1]]
    assert torch.equal(merged[TIED[1]], global_previous[TIED[1]] + update[kept])


def refused_updates(state: dict[str, torch.Tensor]) -> dict[str, tuple[dict[str, torch.Tensor], str]]:
    update = {name: tensor.clone() for name, tensor in make_update(state, seed=4).items()}
    missing = {name: tensor for name, tensor in update.items() if name not in TIED}
    unknown = {**update, "extra.weight": torch.zeros(2)}
    wrong_shape = {**update, "transformer.ln_f.weight": torch.zeros(3)}
    nan = {**update, "transformer.ln_f.bias": torch.full_like(update["transformer.ln_f.bias"], float("nan"))}
    integer = {
        **update,
        "transformer.ln_f.bias": torch.zeros(update["transformer.ln_f.bias"].shape, dtype=torch.int64),
    }
    differing = {**update, TIED[0]: update[TIED[0]] + 1}
    return {
        "missing": (missing, "no tensor 'lm_head.weight'"),
        "unknown": (unknown, "unknown tensor 'extra.weight'"),
        "shape": (wrong_shape, "'transformer.ln_f.weight' has shape"),
        "nan": (nan, "'transformer.ln_f.bias' contains NaN"),
        "integer": (integer, "not a floating-point tensor"),
        "tied values differ": (differing, "tied tensors"),
    }


@pytest.mark.parametrize("case", ["missing", "unknown", "shape", "nan", "integer", "tied values differ"])
def test_a_refused_update_changes_nothing(model: torch.nn.Module, case: str) -> None:
    # given
    global_previous = snapshot(float_state(model))
    previous_values = {name: tensor.clone() for name, tensor in global_previous.items()}
    perturb(model, seed=5)
    live_before = {name: tensor.clone() for name, tensor in float_state(model).items()}
    update, message = refused_updates(float_state(model))[case]

    # when
    with pytest.raises(UpdateError, match=message):
        merge(global_previous, update)

    # then: neither the previous global weights nor the model moved
    assert all(torch.equal(global_previous[name], previous_values[name]) for name in previous_values)
    assert all(torch.equal(float_state(model)[name], live_before[name]) for name in live_before)


def test_load_into_refuses_a_wrong_shape_before_copying_anything(model: torch.nn.Module) -> None:
    before = {name: tensor.clone() for name, tensor in float_state(model).items()}
    bad = {name: torch.zeros_like(tensor) for name, tensor in before.items()}
    bad["transformer.ln_f.weight"] = torch.zeros(3)

    with pytest.raises(UpdateError, match="transformer.ln_f.weight"):
        load_into(model, bad)

    assert all(torch.equal(float_state(model)[name], before[name]) for name in before)


def test_merge_reads_a_full_state_dict_file_written_by_others(model: torch.nn.Module, tmp_path: Path) -> None:
    """Hypha's trainers and parameter server write every name (tied ones as separate copies)."""
    global_previous = snapshot(float_state(model))
    update = {name: tensor.clone() for name, tensor in make_update(float_state(model), seed=6).items()}
    save_file(update, str(tmp_path / "full.safetensors"))

    merged = merge(global_previous, weights.load(tmp_path / "full.safetensors"))

    assert all(torch.equal(merged[name], global_previous[name] + update[name]) for name in update)
