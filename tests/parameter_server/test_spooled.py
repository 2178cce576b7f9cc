"""hypha_tensors/spooled.py: an update body read from its spool file one tensor at a time, as the parameter
server reads it (tests/parameter_server/test_update_memory.py measures the memory; here, the values)."""

from __future__ import annotations

import pytest
import torch

from hypha_tensors import spooled as spooled_module
from hypha_tensors import weights as weights_io
from hypha_tensors.encoding import DecodedView, decode, encode, group
from hypha_tensors.exceptions import TensorRefused, WeightsFileError
from hypha_tensors.formats import Encoding
from hypha_tensors.spooled import SpooledFile, SpooledView


def test_each_tensor_reads_back_bit_for_bit_aliases_included(tmp_path):
    shared = torch.randn(3, 4)
    tensors = {"a": shared, "alias": shared, "b": torch.arange(5, dtype=torch.float16), "i": torch.arange(3)}
    weights_io.save(tmp_path / "u.safetensors", tensors)

    with SpooledFile(tmp_path / "u.safetensors") as file:
        assert file.names == ["a", "alias", "b", "i"]
        for name, tensor in tensors.items():
            read = file.read(name)
            assert read.dtype == tensor.dtype and torch.equal(read, tensor)
            assert file.signature(name) == (tuple(tensor.shape), tensor.dtype)
        assert (
            file.read("a").data_ptr() != file.read("a").data_ptr()
        )  # nothing cached: fresh memory each read
        file.check_finite()


@pytest.mark.parametrize("encoding", [Encoding("int8", 64), Encoding("float16"), Encoding("float32")])
def test_a_spooled_view_decodes_and_adds_as_a_view_of_the_loaded_file(tmp_path, encoding):
    update = {"w": torch.randn(1000) * 1e-2, "v": torch.randn(7, 9)}
    path = tmp_path / "u.safetensors"
    weights_io.save(path, encode(update, encoding), metadata=encoding.metadata())
    loaded = DecodedView(group(weights_io.load(path), encoding), encoding)

    with SpooledFile(path) as file:
        view = SpooledView(file, group({name: name for name in file.names}, encoding), encoding)
        assert sorted(view) == ["v", "w"]
        for name in view:
            assert view.signature(name) == loaded.signature(name)
            assert torch.equal(view[name], loaded[name])
            assert torch.equal(view[name], decode(weights_io.load(path), encoding)[name])
            ours, theirs = torch.ones_like(update[name]), torch.ones_like(update[name])
            view.add_into(name, ours, alpha=3.0)
            loaded.add_into(name, theirs, alpha=3.0)
            assert torch.equal(ours, theirs)
        assert list(view.restrict(["w"])) == ["w"] and torch.equal(view.restrict(["w"])["w"], loaded["w"])


def test_nan_and_inf_are_found_in_any_slice_as_load_finds_them(tmp_path, monkeypatch):
    monkeypatch.setattr(spooled_module, "FINITE_SLICE", 64)  # 16 float32 values a slice
    for bad, reason in ((float("nan"), "contains NaN"), (float("inf"), "contains Inf")):
        tensor = torch.zeros(100)
        tensor[77] = bad
        path = tmp_path / "bad.safetensors"
        path.write_bytes(_raw({"a": torch.zeros(3), "z": tensor}))
        with pytest.raises(TensorRefused) as loaded:
            weights_io.load(path)
        with SpooledFile(path) as file, pytest.raises(TensorRefused) as spooled:
            file.check_finite()
        assert (
            (spooled.value.name, spooled.value.reason)
            == (loaded.value.name, loaded.value.reason)
            == ("z", reason)
        )


def test_what_is_not_safetensors_is_refused_as_load_refuses_it(tmp_path):
    weights_io.save(tmp_path / "good.safetensors", {"w": torch.randn(100)})
    good = (tmp_path / "good.safetensors").read_bytes()
    for name, body in {"empty": b"", "random": b"\x07" * 300, "truncated": good[:-10]}.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(body)
        with pytest.raises(WeightsFileError):
            weights_io.load(path)
        with pytest.raises(WeightsFileError):
            SpooledFile(path)


def _raw(tensors: dict[str, torch.Tensor]) -> bytes:
    """A safetensors file written by hand (it may hold what ``weights.save`` refuses: NaN, Inf)."""
    import json
    import struct

    header, data, offset = {}, b"", 0
    for name, tensor in tensors.items():
        raw = tensor.contiguous().numpy().tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        data += raw
        offset += len(raw)
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data
