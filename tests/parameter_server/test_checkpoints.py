"""Round checkpoints (parameter_server/checkpoints.py): round trips, atomicity, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hypha_tensors.encoding import decode, encode
from hypha_tensors.formats import Encoding
from hypha_tensors.weights import digest
from parameter_server import checkpoints
from parameter_server.checkpoints import (
    ChainLink,
    RoundState,
    adopt_round,
    chain_result_name,
    load_latest,
    round_files,
    save_round,
)
from parameter_server.exceptions import CheckpointError, TensorRefused


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_identical(
    actual: dict[str, torch.Tensor] | None, expected: dict[str, torch.Tensor] | None
) -> None:
    assert (actual is None) == (expected is None)
    if expected is None:
        return
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        assert torch.equal(actual[name], expected[name]), name
        assert torch.equal(raw_bytes(actual[name]), raw_bytes(expected[name])), name


def entries(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


def make_state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    embedding = torch.randn(8, 4, generator=generator)
    return {
        "transformer.wte.weight": embedding,
        "lm_head.weight": embedding,  # tied
        "transformer.ln_f.bias": torch.tensor([0.0, -0.0, 1.0, -1.0]),
        "block.weight": torch.randn(4, 4, generator=generator).to(torch.bfloat16),
        "block.bias": torch.randn(4, generator=generator).to(torch.float16),
    }


def make_momentum(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "block.weight": torch.randn(4, 4, generator=generator),
        "block.bias": torch.randn(4, generator=generator),
    }


def test_load_latest_of_nothing_is_none(tmp_path):
    assert load_latest(tmp_path / "absent") is None
    assert load_latest(tmp_path) is None


def test_round_trip_is_bit_identical_and_latest_wins(tmp_path):
    # given round 0 (no momentum yet) and round 1 (with momentum)
    weights_0, weights_1, momentum_1 = make_state(0), make_state(1), make_momentum(1)
    save_round(tmp_path, round_number=0, weights=weights_0, momentum=None)
    path = save_round(tmp_path, round_number=1, weights=weights_1, momentum=momentum_1)

    # when
    state = load_latest(tmp_path)

    # then round 1 comes back bit for bit, tied names included
    assert path == tmp_path / "round-000000001"
    assert isinstance(state, RoundState)
    assert state.round_number == 1
    assert_bit_identical(state.weights, weights_1)
    assert_bit_identical(state.momentum, momentum_1)
    assert state.weights["lm_head.weight"] is state.weights["transformer.wte.weight"]
    assert entries(tmp_path) == ["round-000000000", "round-000000001"]
    assert entries(path) == ["momentum.safetensors", "round.json", "weights.safetensors"]
    assert json.loads((path / "round.json").read_text()) == {
        "format": 1,
        "has_momentum": True,
        "has_result": False,
        "participants": [],
        "round_number": 1,
    }
    assert (state.result, state.participants) == (None, ())


def test_a_round_keeps_its_result_and_participants_and_travels_as_files(tmp_path):
    # given round 3 saved with its update u_3 and who took part
    weights, momentum, result = make_state(3), make_momentum(3), make_momentum(4)
    save_round(
        tmp_path / "here",
        round_number=3,
        weights=weights,
        momentum=momentum,
        result=result,
        participants=["peer-a", "peer-b"],
    )

    # when its files are listed for the upload and copied into another server's partial directory
    files = round_files(tmp_path / "here", 3)
    assert list(files) == ["weights.safetensors", "momentum.safetensors", "result.safetensors", "round.json"]
    elsewhere = tmp_path / "elsewhere"
    partial = elsewhere / ".partial-download-x"
    partial.mkdir(parents=True)
    for name, path in files.items():
        shutil.copyfile(path, partial / name)
    state = adopt_round(elsewhere, partial)

    # then the copy is a complete round there, bit for bit
    assert state.round_number == 3
    assert_bit_identical(state.weights, weights)
    assert_bit_identical(state.momentum, momentum)
    assert_bit_identical(state.result, result)
    assert state.participants == ("peer-a", "peer-b")
    assert entries(elsewhere) == ["round-000000003"]
    assert load_latest(elsewhere).round_number == 3


def test_adopting_files_that_are_no_round_leaves_nothing(tmp_path):
    partial = tmp_path / ".partial-download-y"
    partial.mkdir()
    (partial / "round.json").write_text(json.dumps({"format": 1, "round_number": "two"}))
    with pytest.raises(CheckpointError, match="no round number"):
        adopt_round(tmp_path, partial)
    assert entries(tmp_path) == []

    partial.mkdir()
    (partial / "round.json").write_text(json.dumps({"format": 1, "round_number": 2, "has_momentum": False}))
    with pytest.raises(CheckpointError, match="cannot be read"):
        adopt_round(tmp_path, partial)  # the weights are missing


def test_a_round_without_momentum_loads_with_none(tmp_path):
    save_round(tmp_path, round_number=0, weights=make_state(0), momentum=None)
    state = load_latest(tmp_path)
    assert state.round_number == 0
    assert state.momentum is None
    assert_bit_identical(state.weights, make_state(0))


def test_rounds_sort_by_number_not_by_name(tmp_path):
    save_round(tmp_path, round_number=9, weights=make_state(9), momentum=None)
    save_round(tmp_path, round_number=10, weights=make_state(10), momentum=None)
    assert load_latest(tmp_path).round_number == 10


def test_crash_between_writing_and_renaming_leaves_the_previous_round_loadable(tmp_path, monkeypatch):
    # given a saved round 4
    save_round(tmp_path, round_number=4, weights=make_state(4), momentum=make_momentum(4))

    # when saving round 5 fails after every file was written, just before the rename
    written = []

    def crash(source, destination):
        written.extend(entries(Path(source)))
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(checkpoints.os, "rename", crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_round(tmp_path, round_number=5, weights=make_state(5), momentum=make_momentum(5))
    monkeypatch.undo()

    # then round 5 had been fully written, yet round 4 is still the latest, intact, and nothing is left over
    assert written == ["momentum.safetensors", "round.json", "weights.safetensors"]
    state = load_latest(tmp_path)
    assert state.round_number == 4
    assert_bit_identical(state.weights, make_state(4))
    assert_bit_identical(state.momentum, make_momentum(4))
    assert entries(tmp_path) == ["round-000000004"]


def test_leftovers_of_a_killed_save_are_ignored_then_cleaned_up(tmp_path):
    # given round 2, and the partial directory of a round-3 save killed halfway (a truncated weights file)
    save_round(tmp_path, round_number=2, weights=make_state(2), momentum=None)
    partial = tmp_path / ".partial-round-000000003-abc123"
    partial.mkdir()
    (partial / "weights.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")

    # then round 2 is the latest
    assert load_latest(tmp_path).round_number == 2

    # and the next save removes the leftover
    save_round(tmp_path, round_number=3, weights=make_state(3), momentum=None)
    assert entries(tmp_path) == ["round-000000002", "round-000000003"]
    assert_bit_identical(load_latest(tmp_path).weights, make_state(3))


def test_non_finite_weights_are_refused_and_leave_no_round_behind(tmp_path):
    save_round(tmp_path, round_number=0, weights=make_state(0), momentum=None)
    bad_momentum = make_momentum(1)
    bad_momentum["block.bias"][2] = float("nan")

    with pytest.raises(TensorRefused, match="'block.bias'.*NaN"):
        save_round(tmp_path, round_number=1, weights=make_state(1), momentum=bad_momentum)

    assert entries(tmp_path) == ["round-000000000"]
    assert load_latest(tmp_path).round_number == 0


def test_an_existing_round_is_never_overwritten(tmp_path):
    save_round(tmp_path, round_number=1, weights=make_state(1), momentum=None)
    with pytest.raises(CheckpointError, match="round 1 is already saved"):
        save_round(tmp_path, round_number=1, weights=make_state(2), momentum=None)
    assert_bit_identical(load_latest(tmp_path).weights, make_state(1))
    assert entries(tmp_path) == ["round-000000001"]


@pytest.mark.parametrize("round_number", [-1, 1.0, True, "3"])
def test_bad_round_numbers_are_refused(tmp_path, round_number):
    with pytest.raises(ValueError, match="round_number"):
        save_round(tmp_path, round_number=round_number, weights=make_state(0), momentum=None)
    assert entries(tmp_path) == []


def test_keep_deletes_all_but_the_most_recent_rounds(tmp_path):
    for round_number in range(4):
        save_round(
            tmp_path, round_number=round_number, weights=make_state(round_number), momentum=None, keep=2
        )
    assert entries(tmp_path) == ["round-000000002", "round-000000003"]
    assert load_latest(tmp_path).round_number == 3


def test_a_corrupt_latest_round_is_an_error_not_a_silent_fallback(tmp_path):
    save_round(tmp_path, round_number=0, weights=make_state(0), momentum=None)
    latest = save_round(tmp_path, round_number=1, weights=make_state(1), momentum=None)
    weights_file = latest / "weights.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:-1])

    with pytest.raises(CheckpointError, match="round 1 .* cannot be read"):
        load_latest(tmp_path)


def test_a_manifest_that_does_not_match_its_directory_is_an_error(tmp_path):
    latest = save_round(tmp_path, round_number=7, weights=make_state(7), momentum=None)
    (latest / "round.json").write_text(json.dumps({"format": 1, "round_number": 8, "has_momentum": False}))
    with pytest.raises(CheckpointError, match="says round 8"):
        load_latest(tmp_path)


# --- incremental copies: the control plane keeps a base round's weights and the results since -----------------


def float32_weights(seed: int) -> dict[str, torch.Tensor]:
    """float32 master weights as the parameter server holds them: tied names, signed zeros, an integer buffer."""
    generator = torch.Generator().manual_seed(seed)
    embedding = torch.randn(8, 4, generator=generator)
    return {
        "transformer.wte.weight": embedding,
        "lm_head.weight": embedding,  # tied
        "transformer.ln_f.bias": torch.tensor([0.0, -0.0, 1.0, -1.0]),
        "block.weight": torch.randn(4, 300, generator=generator),
        "block.num_batches_tracked": torch.tensor(7),
    }


def run_rounds(
    directory: Path, encoding: Encoding, *, rounds: int, every: int, unstepped: tuple[int, ...] = ()
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, bytes]]:
    """Save rounds 0..``rounds`` as the parameter server does (θ_r = θ_{r-1} + deQ(Q(u_r)), a new base every
    ``every`` rounds, the rounds in ``unstepped`` keeping θ) and keep what the control plane keeps of the
    uploads. Returns the last θ, the last momentum and the copy (download name → bytes)."""
    weights = float32_weights(0)
    save_round(
        directory, round_number=0, weights=weights, momentum=None, base_round=0, digest=digest(weights)
    )
    copy = {name: path.read_bytes() for name, path in round_files(directory, 0).items()}
    base, chain, momentum = 0, (), None
    floating = [name for name, tensor in weights.items() if tensor.dtype.is_floating_point]
    for number in range(1, rounds + 1):
        generator = torch.Generator().manual_seed(100 + number)
        stepped = number not in unstepped
        update = {
            name: torch.randn(weights[name].shape, generator=generator) * 0.01 * stepped for name in floating
        }
        update["lm_head.weight"] = update["transformer.wte.weight"]
        encoded = encode(update, encoding)
        if stepped:
            applied = decode(encoded, encoding)
            weights = {
                name: tensor + applied[name] if name in applied else tensor
                for name, tensor in weights.items()
            }
        momentum = {name: torch.randn(weights[name].shape, generator=generator) for name in floating}
        chain = (*chain, ChainLink(number, stepped))
        if number - base >= every:
            base, chain = number, ()
        save_round(
            directory,
            round_number=number,
            weights=weights,
            momentum=momentum,
            result=encoded,
            keep=2,
            base_round=base,
            chain=chain,
            digest=digest(weights),
            result_metadata=encoding.metadata(),
        )
        files = round_files(directory, number)
        if "weights.safetensors" in files:
            copy = {}
        for name, path in files.items():
            copy[chain_result_name(number) if name == "result.safetensors" else name] = path.read_bytes()
        # The results replayed (the base's own is not) and the round's own, to serve it again.
        wanted = {chain_result_name(n) for n in (*range(base + 1, number + 1), number)}
        copy = {name: data for name, data in copy.items() if not name.startswith("result-") or name in wanted}
    return weights, momentum, copy


def adopt_copy(directory: Path, copy: dict[str, bytes]):
    partial = directory / ".partial-download-x"
    partial.mkdir(parents=True)
    for name, data in copy.items():
        (partial / name).write_bytes(data)
    return adopt_round(directory, partial)


@pytest.mark.parametrize("encoding", [Encoding("float32"), Encoding("int8", 16), Encoding("bfloat16")])
def test_an_incremental_copy_replays_to_the_saved_weights_bit_for_bit(tmp_path, encoding):
    # given rounds 0..5 with a base every 3 rounds: the copy holds round 3's weights and the results of 4 and 5
    weights, momentum, copy = run_rounds(tmp_path / "lost", encoding, rounds=5, every=3)
    assert sorted(copy) == [
        "momentum.safetensors",
        "result-4.safetensors",
        "result-5.safetensors",
        "round.json",
        "weights.safetensors",
    ]
    assert list(round_files(tmp_path / "lost", 5)) == [
        "momentum.safetensors",
        "result.safetensors",
        "round.json",
    ]
    run_rounds(tmp_path / "base", encoding, rounds=3, every=3)
    assert list(round_files(tmp_path / "base", 3)) == [
        "weights.safetensors",
        "momentum.safetensors",
        "result.safetensors",
        "round.json",
    ]

    # when another server adopts it
    state = adopt_copy(tmp_path / "elsewhere", copy)

    # then it holds round 5's weights and momentum bit for bit, its result as published, and the chain
    assert state.round_number == 5
    assert_bit_identical(state.weights, weights)
    assert_bit_identical(state.momentum, momentum)
    assert state.digest == digest(weights) == digest(state.weights)
    assert (state.base_round, state.chain) == (3, (ChainLink(4, True), ChainLink(5, True)))
    lost = load_latest(tmp_path / "lost")
    assert_bit_identical(state.result, lost.result)
    assert entries(tmp_path / "elsewhere") == ["round-000000005"]
    assert entries(tmp_path / "elsewhere" / "round-000000005") == [
        "momentum.safetensors",
        "result.safetensors",
        "round.json",
        "weights.safetensors",
    ]


def test_a_round_that_took_no_step_is_not_added_in_the_replay(tmp_path):
    # given rounds 1 and 2 took no step: θ kept as it was, −0.0 included (adding their zeros would give +0.0)
    weights, _, copy = run_rounds(
        tmp_path / "lost", Encoding("float32"), rounds=2, every=10, unstepped=(1, 2)
    )
    assert raw_bytes(weights["transformer.ln_f.bias"])[4:8].tolist() == [0, 0, 0, 128]  # −0.0

    state = adopt_copy(tmp_path / "elsewhere", copy)

    assert state.chain == (ChainLink(1, False), ChainLink(2, False))
    assert_bit_identical(state.weights, weights)


def test_a_chain_that_replays_to_other_weights_is_refused_with_the_digests(tmp_path):
    # given a copy whose round 2 result is another (valid) file: its SHA-256 would match what the job names
    _, _, copy = run_rounds(tmp_path / "lost", Encoding("int8", 16), rounds=3, every=10)
    _, _, other = run_rounds(tmp_path / "other", Encoding("int8", 16), rounds=3, every=10, unstepped=(2,))
    copy["result-2.safetensors"] = other["result-2.safetensors"]
    said = json.loads(copy["round.json"])["digest"]

    # when / then
    with pytest.raises(CheckpointError) as refused:
        adopt_copy(tmp_path / "elsewhere", copy)
    message = str(refused.value)
    assert message.startswith(
        "round 3's weights replayed from round 0's weights and the results of rounds 1 to 3 have the digest sha256:"
    )
    assert message.endswith(
        f"but its round.json says {said}: the control plane's copy is inconsistent; not resuming from it"
    )
    assert entries(tmp_path / "elsewhere") == []


def test_a_copy_missing_a_result_of_its_chain_is_refused(tmp_path):
    _, _, copy = run_rounds(tmp_path / "lost", Encoding("float32"), rounds=3, every=10)
    del copy["result-2.safetensors"]
    with pytest.raises(CheckpointError, match="result-2.safetensors cannot be replayed"):
        adopt_copy(tmp_path / "elsewhere", copy)
    assert entries(tmp_path / "elsewhere") == []
