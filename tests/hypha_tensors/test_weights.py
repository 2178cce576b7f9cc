"""Safetensors I/O shared by the parameter server and the executor (hypha_tensors/weights.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import TensorSpec, safe_open, serialize_file
from safetensors.torch import load_file

from hypha_tensors import weights
from parameter_server.exceptions import TensorRefused, WeightsFileError


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a uint8 tensor, to compare bit for bit (NaN payloads and −0.0 included)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        assert actual[name].shape == expected[name].shape, name
        assert torch.equal(actual[name], expected[name]), name
        assert torch.equal(raw_bytes(actual[name]), raw_bytes(expected[name])), name


def files_in(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {
        "layer.weight": torch.randn(3, 4, generator=generator),
        "layer.bias": torch.tensor([0.0, -0.0, 1.5]),  # −0.0 must survive bit for bit
        "norm.weight": torch.randn(4, generator=generator).to(torch.bfloat16),
        "head.weight": torch.randn(2, 2, generator=generator).to(torch.float16),
        "scale": torch.tensor(2.5, dtype=torch.float64),
        "steps": torch.tensor([7], dtype=torch.int64),
    }


def write_raw(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write safetensors without weights.save's checks, as a foreign or malicious sender could."""
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    specs = {
        name: TensorSpec(
            dtype=str(tensor.dtype).removeprefix("torch."),
            shape=tensor.shape,
            data_ptr=tensor.data_ptr(),
            data_len=tensor.numel() * tensor.element_size(),
        )
        for name, tensor in tensors.items()
    }
    serialize_file(specs, str(path), metadata=metadata)


# ------------------------------------------------------------------------------------------ round trip


def test_save_then_load_is_bit_identical_and_plain_safetensors(tmp_path, state):
    path = tmp_path / "global.safetensors"

    weights.save(path, state)

    assert files_in(tmp_path) == ["global.safetensors"]
    assert_bit_identical(weights.load(path), state)
    # any safetensors reader can read it
    assert_bit_identical(load_file(str(path)), state)
    with safe_open(str(path), framework="pt") as file:
        assert file.metadata() == {"hypha.format": "1"}


def test_load_with_expected_signature_accepts_matching_file(tmp_path, state):
    path = tmp_path / "global.safetensors"
    weights.save(path, state)
    assert_bit_identical(weights.load(path, expected=weights.signature(state)), state)
    assert_bit_identical(weights.load(path, expected=state), state)


def test_save_replaces_an_existing_file_and_makes_non_contiguous_tensors_contiguous(tmp_path):
    path = tmp_path / "global.safetensors"
    weights.save(path, {"w": torch.zeros(2)})
    transposed = torch.arange(6.0).reshape(2, 3).t()

    weights.save(path, {"w": transposed})

    assert files_in(tmp_path) == ["global.safetensors"]
    assert torch.equal(weights.load(path)["w"], torch.tensor([[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]))


def test_tied_weights_are_stored_once_and_loaded_under_every_name(tmp_path):
    # given a GPT-2-like model whose lm_head shares its weight with the token embedding
    class TinyGpt(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = torch.nn.Module()
            self.transformer.wte = torch.nn.Embedding(10, 4)
            self.transformer.ln_f = torch.nn.LayerNorm(4)
            self.lm_head = torch.nn.Linear(4, 10, bias=False)
            self.lm_head.weight = self.transformer.wte.weight

    torch.manual_seed(2)
    model = TinyGpt()
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    path = tmp_path / "gpt.safetensors"

    # when
    weights.save(path, state)

    # then the tensor is in the file once, with the alias in the metadata
    with safe_open(str(path), framework="pt") as file:
        assert sorted(file.keys()) == ["lm_head.weight", "transformer.ln_f.bias", "transformer.ln_f.weight"]
        assert json.loads(file.metadata()["hypha.aliases"]) == {"transformer.wte.weight": "lm_head.weight"}
    # and every name comes back, the two tied ones as one tensor
    loaded = weights.load(path, expected=weights.signature(state))
    assert_bit_identical(loaded, state)
    assert loaded["transformer.wte.weight"] is loaded["lm_head.weight"]
    # and a fresh model loads it (re-tying is the model's business: here its own tie survives)
    fresh = TinyGpt()
    fresh.load_state_dict(loaded)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def test_distinct_views_of_one_storage_are_saved_as_separate_tensors(tmp_path):
    base = torch.arange(6.0)
    path = tmp_path / "views.safetensors"
    weights.save(path, {"first": base[:3], "second": base[3:]})
    loaded = weights.load(path)
    assert torch.equal(loaded["first"], torch.tensor([0.0, 1.0, 2.0]))
    assert torch.equal(loaded["second"], torch.tensor([3.0, 4.0, 5.0]))


def test_loading_a_file_written_by_a_trainer_without_hypha_metadata(tmp_path, state):
    path = tmp_path / "0_local_gradients.pt"
    write_raw(path, state)
    assert_bit_identical(weights.load(path, expected=state), state)


# ------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("bad_value", "reason"),
    [(float("nan"), "contains NaN"), (float("inf"), "contains Inf"), (float("-inf"), "contains Inf")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_refuses_non_finite_values_and_writes_nothing(tmp_path, state, bad_value, reason, dtype):
    state["bad"] = torch.tensor([1.0, bad_value, 2.0], dtype=dtype)

    with pytest.raises(TensorRefused) as refused:
        weights.save(tmp_path / "global.safetensors", state)

    assert (refused.value.name, refused.value.reason) == ("bad", reason)
    assert files_in(tmp_path) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_finite_values_whose_sum_overflows_are_accepted_and_both_infinities_refused(tmp_path, state, dtype):
    """The finiteness check sums first: a sum that overflows from finite values must not refuse them, and
    +Inf next to −Inf (a NaN sum) is still Inf."""
    largest = torch.finfo(dtype).max
    state["large"] = torch.tensor([largest, largest, largest], dtype=dtype)
    weights.save(tmp_path / "large.safetensors", state)
    assert torch.equal(weights.load(tmp_path / "large.safetensors")["large"], state["large"])

    state["large"] = torch.tensor([float("inf"), 1.0, float("-inf")], dtype=dtype)
    with pytest.raises(TensorRefused) as refused:
        weights.save(tmp_path / "infinite.safetensors", state)
    assert (refused.value.name, refused.value.reason) == ("large", "contains Inf")


def test_save_refuses_a_non_tensor_and_leaves_the_old_file(tmp_path, state):
    path = tmp_path / "global.safetensors"
    weights.save(path, state)
    before = path.read_bytes()

    with pytest.raises(TensorRefused, match="'layer.bias'.*not a tensor"):
        weights.save(path, {**state, "layer.bias": [0.0, 0.0, 1.5]})

    assert path.read_bytes() == before
    assert files_in(tmp_path) == ["global.safetensors"]


def test_save_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path, state, monkeypatch):
    # given an existing file
    path = tmp_path / "global.safetensors"
    weights.save(path, state)
    before = path.read_bytes()

    # when the disk fills up after part of the new file was written
    def fail_after_partial_write(specs, filename, metadata=None):
        Path(filename).write_bytes(b"\x00" * 10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights, "serialize_file", fail_after_partial_write)
    with pytest.raises(OSError, match="No space left"):
        weights.save(path, {"w": torch.ones(3)})

    # then the old file is intact and nothing else is there
    assert path.read_bytes() == before
    assert files_in(tmp_path) == ["global.safetensors"]


def test_save_refuses_reserved_metadata_keys(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        weights.save(tmp_path / "w.safetensors", {"w": torch.ones(1)}, metadata={"hypha.aliases": "{}"})
    assert files_in(tmp_path) == []


@pytest.mark.parametrize(
    ("change", "name", "reason"),
    [
        ({"layer.weight": torch.zeros(4, 3)}, "layer.weight", "shape (4, 3), expected (3, 4)"),
        (
            {"layer.bias": torch.zeros(3, dtype=torch.float64)},
            "layer.bias",
            "dtype torch.float64, expected torch.float32",
        ),
        ({"scale": None}, "scale", "missing"),
        ({"extra.weight": torch.zeros(1)}, "extra.weight", "unknown name"),
    ],
    ids=["shape", "dtype", "missing", "extra"],
)
def test_load_refuses_a_file_unlike_the_expected_one_and_leaves_it_alone(
    tmp_path, state, change, name, reason
):
    # given a file from a sender that does not match the global weights
    sent = {**state, **change}
    sent = {key: value for key, value in sent.items() if value is not None}
    path = tmp_path / "update.safetensors"
    write_raw(path, sent)
    before = path.read_bytes()

    # when
    with pytest.raises(TensorRefused) as refused:
        weights.load(path, expected=weights.signature(state))

    # then the right tensor is named, and the file (the only one) is untouched
    assert (refused.value.name, refused.value.reason) == (name, reason)
    assert path.read_bytes() == before
    assert files_in(tmp_path) == ["update.safetensors"]


@pytest.mark.parametrize(
    ("bad_value", "reason"), [(float("nan"), "contains NaN"), (float("inf"), "contains Inf")]
)
def test_load_refuses_non_finite_values(tmp_path, bad_value, reason):
    path = tmp_path / "update.safetensors"
    write_raw(path, {"ok": torch.ones(2), "bad": torch.tensor([0.0, bad_value], dtype=torch.float16)})

    with pytest.raises(TensorRefused) as refused:
        weights.load(path)

    assert (refused.value.name, refused.value.reason) == ("bad", reason)
    assert files_in(tmp_path) == ["update.safetensors"]


def good_file_bytes(tmp_path: Path) -> bytes:
    source = tmp_path / "source" / "good.safetensors"
    source.parent.mkdir()
    weights.save(source, {"w": torch.arange(16.0)})
    return source.read_bytes()


@pytest.mark.parametrize(
    ("make_bytes", "reason"),
    [
        (lambda good: good[:-3], "incomplete metadata"),  # truncated tensor data
        (lambda good: good[:20], "header"),  # truncated header
        (lambda good: b"", "header too small"),
        (lambda good: random.Random(0).randbytes(1024), "header"),
        (lambda good: b"PK\x03\x04 this is a zip, a .pt pickle archive", "header"),
    ],
    ids=["truncated-data", "truncated-header", "empty", "random-bytes", "torch-pickle"],
)
def test_load_refuses_bytes_that_are_not_complete_safetensors(tmp_path, make_bytes, reason):
    path = tmp_path / "update.safetensors"
    path.write_bytes(make_bytes(good_file_bytes(tmp_path)))
    before = path.read_bytes()

    with pytest.raises(WeightsFileError, match=reason) as refused:
        weights.load(path)

    assert refused.value.path == path
    assert str(path) in str(refused.value)
    assert path.read_bytes() == before


def test_load_of_a_missing_file_is_a_weights_file_error(tmp_path):
    with pytest.raises(WeightsFileError) as refused:
        weights.load(tmp_path / "absent.safetensors")
    assert refused.value.path == tmp_path / "absent.safetensors"
    assert files_in(tmp_path) == []


@pytest.mark.parametrize(
    ("aliases", "reason"),
    [
        ("not json", "not JSON"),
        ('["a"]', "not an object"),
        ('{"b": "nowhere"}', "not in the file"),
        ('{"w": "w"}', "also a stored tensor"),
    ],
)
def test_load_refuses_inconsistent_alias_metadata(tmp_path, aliases, reason):
    path = tmp_path / "w.safetensors"
    write_raw(path, {"w": torch.ones(1)}, metadata={"hypha.aliases": aliases})
    with pytest.raises(WeightsFileError, match=reason):
        weights.load(path)


# ------------------------------------------------------------------------------------------- validate


def test_validate_accepts_a_matching_state_and_reports_the_first_problem_by_name(state):
    weights.validate(state, reference=state)
    weights.validate(state, reference=weights.signature(state))
    weights.validate(state)

    with pytest.raises(TensorRefused, match="'layer.bias' refused: missing"):
        weights.validate({k: v for k, v in state.items() if k != "layer.bias"}, reference=state)
    with pytest.raises(TensorRefused, match="'zzz' refused: unknown name"):
        weights.validate({**state, "zzz": torch.ones(1)}, reference=state)
    with pytest.raises(TensorRefused, match=r"'scale' refused: shape \(1,\), expected \(\)"):
        weights.validate({**state, "scale": torch.ones(1, dtype=torch.float64)}, reference=state)
    with pytest.raises(TensorRefused, match="'steps' refused: dtype torch.int32"):
        weights.validate({**state, "steps": torch.tensor([7], dtype=torch.int32)}, reference=state)
    with pytest.raises(TensorRefused, match="'layer.weight' refused: contains NaN"):
        weights.validate({**state, "layer.weight": torch.full((3, 4), float("nan"))}, reference=state)


def test_round_trip_of_bool_integer_float8_and_empty_tensors(tmp_path):
    state = {
        "mask": torch.tensor([True, False]),
        "int8": torch.tensor([-3], dtype=torch.int8),
        "fp8": torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 3),
    }
    path = tmp_path / "odd.safetensors"
    weights.save(path, state)
    assert_bit_identical(weights.load(path, expected=weights.signature(state)), state)
    # float8 has no torch.isfinite: the check still refuses Inf (float8_e5m2 has one)
    with pytest.raises(TensorRefused, match="'fp8'.*Inf"):
        weights.save(
            tmp_path / "inf.safetensors", {"fp8": torch.tensor([float("inf")]).to(torch.float8_e5m2)}
        )
    assert files_in(tmp_path) == ["odd.safetensors"]
