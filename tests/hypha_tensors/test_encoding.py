"""The wire encodings (hypha_tensors/): hand-computed values, the int8 error bound, refusals, error feedback."""

from __future__ import annotations

import pytest
import torch

from hypha_tensors.encoding import (
    MAX_SCALE,
    DecodedView,
    EncodedTensor,
    ErrorFeedback,
    decode,
    decode_tensor,
    encode,
    encode_tensor,
    encode_with_feedback,
    group,
)
from hypha_tensors.formats import Encoding, EncodingError

INT8 = Encoding("int8", 16)
FLOAT16 = Encoding("float16")
BFLOAT16 = Encoding("bfloat16")
FLOAT32 = Encoding()

# --- what an encoding is -------------------------------------------------------------------------------------


def test_encodings_say_themselves_in_metadata_and_read_back():
    assert FLOAT32.metadata() == {"hypha.encoding": "float32"}
    assert INT8.metadata() == {"hypha.encoding": "int8", "hypha.block_size": "16"}
    for encoding in (FLOAT32, FLOAT16, BFLOAT16, INT8, Encoding("int8")):
        assert Encoding.from_metadata(encoding.metadata()) == encoding
    # a file without the key (Hypha's executors) is float32
    assert Encoding.from_metadata({"format": "pt"}) == FLOAT32
    assert Encoding.from_metadata(None) == FLOAT32
    assert str(INT8) == "int8 (blocks of 16)" and str(FLOAT16) == "float16"
    assert (FLOAT32.lossy, FLOAT16.lossy, INT8.lossy) == (False, True, True)


def test_only_int8_has_a_block_size_so_the_others_compare_equal_whatever_was_given():
    assert Encoding("float16", 64) == Encoding("float16") and Encoding("float16", 64).block_size == 256
    assert Encoding("int8", 64) != Encoding("int8", 128)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"hypha.encoding": "int4"}, "is not an encoding"),
        ({"hypha.encoding": "int8"}, "needs hypha.block_size"),
        ({"hypha.encoding": "int8", "hypha.block_size": "-4"}, "needs hypha.block_size"),
        ({"hypha.encoding": "int8", "hypha.block_size": "8"}, "block size must be an integer from 16"),
        ({"hypha.encoding": "int8", "hypha.block_size": "²"}, "needs hypha.block_size"),
    ],
)
def test_metadata_that_names_no_usable_encoding_is_refused(metadata, message):
    with pytest.raises(EncodingError, match=message):
        Encoding.from_metadata(metadata)


@pytest.mark.parametrize(("name", "size"), [("int4", 256), ("int8", 15), ("int8", 2**20 + 1), ("int8", True)])
def test_unknown_encodings_and_block_sizes_are_refused(name, size):
    with pytest.raises(EncodingError):
        Encoding(name, size)


# --- float32, float16, bfloat16 ------------------------------------------------------------------------------


def test_float32_sends_the_tensors_themselves():
    tensors = {"a": torch.tensor([1 / 3, -2.0]), "b": torch.zeros(2, 2, dtype=torch.float64)}
    encoded = encode(tensors, FLOAT32)
    assert encoded == tensors and all(encoded[name] is tensors[name] for name in tensors)
    assert all(value is tensors[name] for name, value in decode(encoded, FLOAT32).items())


def test_float16_and_bfloat16_round_to_nearest_and_decode_exactly():
    third = {"x": torch.tensor([1 / 3, 1.0, -0.0])}
    half = encode(third, FLOAT16)["x"]
    brain = encode(third, BFLOAT16)["x"]
    assert (half.dtype, brain.dtype) == (torch.float16, torch.bfloat16)
    assert decode({"x": half}, FLOAT16)["x"].tolist() == [0.333251953125, 1.0, -0.0]
    assert decode({"x": brain}, BFLOAT16)["x"].tolist() == [0.333984375, 1.0, -0.0]
    assert decode({"x": half}, FLOAT16)["x"].dtype == torch.float32


def test_a_value_past_float16s_range_is_refused_not_sent_as_inf():
    with pytest.raises(EncodingError, match="'big': is past float16's range"):
        encode({"big": torch.tensor([70000.0])}, FLOAT16)
    assert encode({"big": torch.tensor([70000.0])}, BFLOAT16)["big"].item() == 70144.0


# --- int8 ----------------------------------------------------------------------------------------------------


def test_int8_by_hand_two_blocks_the_last_one_short():
    # block 1: max |x| = 127, so s = 1 and q = round(x) (ties to even); block 2: max |x| = 63.5, s = 0.5
    first = [127.0, 0.5, 1.5, -2.5, 3.7, -127.0] + [0.0] * 10
    second = [0.3, -63.5, 10.0, 0.25]
    tensor = torch.tensor(first + second).reshape(4, 5)

    values, scales = encode_tensor(tensor, INT8)

    assert values.dtype == torch.int8 and values.shape == (4, 5)
    assert values.reshape(-1).tolist() == [127, 0, 2, -2, 4, -127] + [0] * 10 + [1, -127, 20, 0]
    assert scales.dtype == torch.float32 and scales.tolist() == [1.0, 0.5]
    decoded = decode_tensor(EncodedTensor(values, scales), INT8)
    assert decoded.shape == (4, 5) and decoded.dtype == torch.float32
    assert decoded.reshape(-1).tolist() == [127.0, 0.0, 2.0, -2.0, 4.0, -127.0] + [0.0] * 10 + [
        0.5,
        -63.5,
        10.0,
        0.0,
    ]


def test_int8_travels_as_the_tensor_and_its_scales_under_one_name_each():
    encoded = encode({"w": torch.ones(3, 7), "b": torch.tensor(2.0)}, INT8)
    assert sorted(encoded) == ["b", "b.__scale__", "w", "w.__scale__"]
    assert (encoded["w"].shape, encoded["w.__scale__"].shape) == ((3, 7), (2,))
    scale = torch.tensor(2.0, dtype=torch.float32) / 127
    assert (encoded["b"].shape, encoded["b.__scale__"].tolist()) == ((), [scale.item()])
    assert decode(encoded, INT8)["b"].item() == pytest.approx(2.0, rel=1e-6)


@pytest.mark.parametrize("shape", [(1000,), (17, 33), (5, 3, 16), (1,), ()])
@pytest.mark.parametrize("block_size", [16, 256])
def test_int8_round_trip_error_is_at_most_absmax_over_254_per_block(shape, block_size):
    encoding = Encoding("int8", block_size)
    generator = torch.Generator().manual_seed(sum(shape) + block_size)
    tensor = torch.randn(shape, generator=generator) * torch.logspace(-6, 3, 1).item()
    tensor = tensor * (torch.rand(shape, generator=generator) * 100)  # blocks of very different sizes

    decoded = decode_tensor(encode_tensor(tensor, encoding), encoding)

    flat, error = tensor.reshape(-1), (decoded - tensor).abs().reshape(-1)
    for start in range(0, flat.numel(), block_size):
        block = slice(start, start + block_size)
        bound = flat[block].abs().max().item() / 254
        assert error[block].max().item() <= bound * (1 + 1e-5), (start, bound)


def test_zeros_are_exact_with_zero_scales_and_empty_tensors_have_no_blocks():
    values, scales = encode_tensor(torch.zeros(40), INT8)
    assert values.tolist() == [0] * 40 and scales.tolist() == [0.0, 0.0, 0.0]
    assert decode_tensor(EncodedTensor(values, scales), INT8).tolist() == [0.0] * 40
    empty = encode_tensor(torch.zeros(0, 4), INT8)
    assert (empty.values.shape, empty.scales.shape) == ((0, 4), (0,))
    assert decode_tensor(empty, INT8).shape == (0, 4)


# --- refusals ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", [FLOAT32, FLOAT16, BFLOAT16, INT8])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused_in_every_encoding(encoding, bad):
    with pytest.raises(EncodingError, match="'x': contains NaN or Inf"):
        encode({"x": torch.tensor([1.0, bad])}, encoding)


def test_integer_tensors_and_names_ending_in_the_scale_suffix_are_not_encoded():
    with pytest.raises(EncodingError, match="not a floating-point tensor"):
        encode({"steps": torch.tensor([3])}, INT8)
    with pytest.raises(EncodingError, match="may not end in"):
        encode({"w.__scale__": torch.ones(2)}, INT8)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (EncodedTensor(torch.zeros(20, dtype=torch.int8), None), "has no scales"),
        (EncodedTensor(torch.zeros(20, dtype=torch.int8), torch.ones(1)), r"shape \(1,\), expected"),
        (EncodedTensor(torch.zeros(20, dtype=torch.int8), torch.ones(2, dtype=torch.float16)), "dtype"),
        (EncodedTensor(torch.zeros(20, dtype=torch.int8), torch.tensor([1.0, -1.0])), "negative"),
        (EncodedTensor(torch.zeros(20, dtype=torch.int8), torch.tensor([1.0, float("nan")])), "not finite"),
        (EncodedTensor(torch.zeros(20, dtype=torch.int8), torch.tensor([1.0, MAX_SCALE * 2])), "over"),
        (EncodedTensor(torch.zeros(20), torch.ones(2)), "has dtype torch.float32; int8"),
    ],
)
def test_int8_decoding_refuses_missing_or_bad_scales_and_other_dtypes(entry, message):
    with pytest.raises(EncodingError, match=message):
        decode_tensor(entry, INT8, name="w")


def test_the_largest_scale_accepted_decodes_to_finite_values():
    entry = EncodedTensor(torch.tensor([-128, 127], dtype=torch.int8), torch.tensor([MAX_SCALE]))
    assert bool(torch.isfinite(decode_tensor(entry, Encoding("int8", 16))).all())


def test_decoding_refuses_non_finite_half_values_and_wrong_dtypes():
    with pytest.raises(EncodingError, match="contains NaN or Inf"):
        decode({"x": torch.tensor([float("nan")], dtype=torch.float16)}, FLOAT16)
    with pytest.raises(EncodingError, match="has dtype torch.bfloat16; float16 sends torch.float16"):
        decode({"x": torch.ones(2, dtype=torch.bfloat16)}, FLOAT16)
    with pytest.raises(EncodingError, match="not a floating-point one"):
        decode({"x": torch.ones(2, dtype=torch.int8)}, FLOAT32)


def test_scales_without_their_tensor_or_in_an_encoding_without_scales_are_refused():
    with pytest.raises(EncodingError, match="'w.__scale__': scales without their tensor"):
        group({"b": torch.zeros(2, dtype=torch.int8), "w.__scale__": torch.ones(1)}, INT8)
    with pytest.raises(EncodingError, match="float16 has no scales"):
        group({"w": torch.zeros(2, dtype=torch.float16), "w.__scale__": torch.ones(1)}, FLOAT16)


# --- ties and lazy decoding ----------------------------------------------------------------------------------


def test_tied_names_share_what_they_are_encoded_and_decoded_to():
    shared = torch.randn(4, 8)
    encoded = encode({"wte": shared, "lm_head": shared, "other": torch.randn(3)}, INT8)
    assert encoded["wte"] is encoded["lm_head"] and encoded["wte.__scale__"] is encoded["lm_head.__scale__"]
    decoded = decode(encoded, INT8)
    assert decoded["wte"] is decoded["lm_head"] and decoded["other"] is not decoded["wte"]


def test_a_decoded_view_decodes_at_every_read_and_knows_signatures_without_decoding():
    tensors = {"w": torch.randn(5, 9), "b": torch.randn(3)}
    entries = group(encode(tensors, INT8), INT8)
    view = DecodedView(entries, INT8, dtypes={"w": torch.float64})

    assert sorted(view) == ["b", "w"] and len(view) == 2
    assert view.signature("w") == ((5, 9), torch.float64) and view.signature("b") == ((3,), torch.float32)
    first, second = view["w"], view["w"]
    assert first is not second and torch.equal(first, second) and first.dtype == torch.float64
    assert torch.equal(view["b"], decode(encode(tensors, INT8), INT8)["b"])
    assert list(view.restrict(["b"])) == ["b"]
    float_view = DecodedView(group(tensors, FLOAT32), FLOAT32)
    assert float_view["w"] is tensors["w"] and float_view.signature("b") == ((3,), torch.float32)


# --- error feedback ------------------------------------------------------------------------------------------


def test_error_feedback_sends_what_rounding_keeps_losing_by_hand():
    # one block: 127 sets s = 1, so 0.3 alone would round to 0 every time and never arrive
    feedback = ErrorFeedback(INT8)
    delta = {"x": torch.tensor([127.0, 0.3] + [0.0] * 14)}
    sent = [decode(feedback.encode(delta), INT8)["x"][1].item() for _ in range(10)]

    assert sent[:3] == [0.0, 1.0, 0.0]  # v = 0.3 → 0, e = 0.3; v = 0.6 → 1, e = -0.4; v = -0.1 → 0
    assert sum(sent) == 3.0  # ten times 0.3, within half a quantum
    assert abs(feedback.residual["x"][1].item()) <= 0.5
    assert decode(encode(delta, INT8), INT8)["x"][1].item() == 0.0  # without feedback: nothing, every round


@pytest.mark.parametrize("encoding", [INT8, Encoding("int8", 256), FLOAT16, BFLOAT16])
def test_over_rounds_the_sum_sent_tracks_the_sum_of_true_updates_within_one_quantum(encoding):
    generator = torch.Generator().manual_seed(7)
    residual: dict[str, torch.Tensor] = {}
    true_sum = torch.zeros(8, 100, dtype=torch.float64)
    sent_sum = torch.zeros(8, 100, dtype=torch.float64)
    without = torch.zeros(8, 100, dtype=torch.float64)
    for _ in range(20):
        delta = {"w": torch.randn(8, 100, generator=generator) * 0.01 + 0.001}
        result = encode_with_feedback(delta, residual, encoding, keep_decoded=True)
        assert torch.equal(result.decoded["w"], decode(result.encoded, encoding)["w"])
        residual = result.residual
        true_sum += delta["w"].double()
        sent_sum += result.decoded["w"].double()
        without += decode(encode(delta, encoding), encoding)["w"].double()
        last = result.decoded["w"].double()

    gap = (true_sum - sent_sum).abs()
    # one quantum: int8, a block's scale; float16/bfloat16, a unit in the last place of what was last sent
    if encoding.name == "int8":
        block = encoding.block_size
        flat = last.reshape(-1)
        quanta = torch.cat(
            [
                flat[start : start + block].abs().max().repeat(min(block, flat.numel() - start)) / 127
                for start in range(0, flat.numel(), block)
            ]
        ).reshape(8, 100)
    else:
        # float16's subnormals below 2^-14 have a fixed quantum of 2^-24
        mantissa, smallest = (10, 2.0**-24) if encoding.name == "float16" else (7, 0.0)
        quanta = torch.clamp(last.abs() * 2.0**-mantissa, min=smallest)
    assert bool((gap <= quanta * (1 + 1e-3) + 1e-9).all()), (gap / quanta).max()
    # and the residual is exactly what separates them (up to float32 rounding of the running sums)
    assert torch.allclose(true_sum - sent_sum, residual["w"].double(), atol=1e-6)
    assert (true_sum - without).abs().max() > (true_sum - sent_sum).abs().max()


def test_float32_keeps_no_residual_and_sends_the_same_tensors():
    delta = {"w": torch.randn(3)}
    result = encode_with_feedback(delta, {"w": torch.ones(3)}, FLOAT32, keep_decoded=True)
    assert result.encoded["w"] is delta["w"] and result.decoded["w"] is delta["w"] and result.residual == {}


def test_a_failed_encoding_leaves_the_residual_as_it_was():
    feedback = ErrorFeedback(INT8)
    feedback.encode({"w": torch.tensor([127.0, 0.3] + [0.0] * 14)})
    before = feedback.residual["w"].clone()
    with pytest.raises(EncodingError, match="contains NaN or Inf"):
        feedback.encode({"w": torch.tensor([float("nan")] + [0.0] * 15)})
    with pytest.raises(EncodingError, match="its residual"):
        feedback.encode({"w": torch.zeros(3)})
    assert torch.equal(feedback.residual["w"], before)
    assert feedback.metadata() == {"hypha.encoding": "int8", "hypha.block_size": "16"}


def test_tied_names_share_their_residual():
    shared = torch.tensor([127.0, 0.3] + [0.0] * 14)
    result = encode_with_feedback({"a": shared, "b": shared}, None, INT8)
    assert result.residual["a"] is result.residual["b"]
    assert result.encoded["a"] is result.encoded["b"]


def test_error_feedback_keeps_the_residual_of_tensors_not_sent_this_time():
    """Streaming DiLoCo sends one fragment per round: encoding fragment B must not drop fragment A's residual."""
    feedback = ErrorFeedback(Encoding("int8", 64))
    a = torch.linspace(-1.0, 1.0, 256) * 1.2345
    feedback.encode({"a": a})
    kept = feedback.residual["a"].clone()
    assert kept.abs().max() > 0
    feedback.encode({"b": torch.linspace(-3.0, 3.0, 256)})
    assert set(feedback.residual) == {"a", "b"}
    assert torch.equal(feedback.residual["a"], kept)
