"""``hypha-data prepare-text``: byte tokens in fixed-length sequences, written as sorted safetensors slices."""

from __future__ import annotations

import keyword
import math
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from data_node.prepare import EXIT_INPUT, EXIT_OUTPUT, main


def read_slice(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as file:
        return {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (not a dict)


def test_a_tiny_text_gives_exact_slices(tmp_path):
    # given: 28 bytes → 7 sequences of 4 → slices of 3, 3, 1
    source = tmp_path / "a.txt"
    source.write_bytes(b"hello world, this is a test!")

    # when
    code = main(["prepare-text", "--input", str(source), "--output", str(tmp_path / "tiny"), "--seq-len", "4",
                 "--samples-per-slice", "3"])  # fmt: skip

    # then
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == [
        "00000.safetensors",
        "00001.safetensors",
        "00002.safetensors",
    ]
    slices = [read_slice(tmp_path / "tiny" / f"{i:05d}.safetensors") for i in range(3)]
    assert [s["input_ids"].tolist() for s in slices] == [
        [[104, 101, 108, 108], [111, 32, 119, 111], [114, 108, 100, 44]],
        [[32, 116, 104, 105], [115, 32, 105, 115], [32, 97, 32, 116]],
        [[101, 115, 116, 33]],
    ]
    for tensors in slices:
        assert str(tensors["input_ids"].dtype) == "torch.int64"
        assert tensors["labels"].tolist() == tensors["input_ids"].tolist()


def test_a_stdlib_source_file_gives_its_bytes_back_in_order(tmp_path):
    # given
    source = Path(keyword.__file__)
    data = source.read_bytes()
    seq_len, per_slice = 16, 10
    sequences = len(data) // seq_len

    # when
    code = main(["prepare-text", "--input", str(source), "--output", str(tmp_path / "kw"),
                 "--seq-len", str(seq_len), "--samples-per-slice", str(per_slice)])  # fmt: skip

    # then
    assert code == 0
    paths = sorted((tmp_path / "kw").iterdir())
    assert len(paths) == math.ceil(sequences / per_slice)
    rows = []
    for path in paths:
        tensors = read_slice(path)
        assert tensors["input_ids"].shape[1] == seq_len
        assert tensors["labels"].tolist() == tensors["input_ids"].tolist()
        rows.extend(tensors["input_ids"].tolist())
    assert [len(read_slice(p)["input_ids"]) for p in paths[:-1]] == [per_slice] * (len(paths) - 1)
    assert rows == [list(data[i * seq_len : (i + 1) * seq_len]) for i in range(sequences)]


def test_a_directory_is_read_recursively_in_sorted_order(tmp_path):
    # given
    (tmp_path / "in" / "b").mkdir(parents=True)
    (tmp_path / "in" / "b" / "z.txt").write_bytes(b"CD")
    (tmp_path / "in" / "a.txt").write_bytes(b"AB")

    # when
    main(["prepare-text", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "d"), "--seq-len", "2"])

    # then
    assert read_slice(tmp_path / "d" / "00000.safetensors")["input_ids"].tolist() == [[65, 66], [67, 68]]


def test_too_little_text_or_a_missing_input_is_exit_3(tmp_path):
    (tmp_path / "short.txt").write_bytes(b"abc")
    assert (
        main(["prepare-text", "--input", str(tmp_path / "short.txt"), "--output", str(tmp_path / "o")])
        == EXIT_INPUT
    )
    assert (
        main(["prepare-text", "--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o")])
        == EXIT_INPUT
    )
    assert not list((tmp_path / "o").glob("*.safetensors"))


def test_an_output_directory_with_slices_is_refused_and_left_alone(tmp_path):
    # given
    (tmp_path / "t.txt").write_bytes(b"x" * 300)
    assert main(["prepare-text", "--input", str(tmp_path / "t.txt"), "--output", str(tmp_path / "o")]) == 0
    before = (tmp_path / "o" / "00000.safetensors").read_bytes()

    # when
    code = main(
        [
            "prepare-text",
            "--input",
            str(tmp_path / "t.txt"),
            "--output",
            str(tmp_path / "o"),
            "--seq-len",
            "2",
        ]
    )

    # then
    assert code == EXIT_OUTPUT
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["00000.safetensors"]
    assert (tmp_path / "o" / "00000.safetensors").read_bytes() == before


@pytest.mark.parametrize("script", ["hypha-data", "hypha-data-node"])
def test_help_is_instant_and_imports_no_heavy_modules(script):
    # when
    code = (
        "import sys, runpy; sys.argv = ['x', '--help']\n"
        f"module = {'data_node.prepare' if script == 'hypha-data' else 'data_node'!r}\n"
        "try:\n    runpy.run_module(module, run_name='__main__')\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = {'torch', 'safetensors', 'aiohttp', 'django'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)

    # then
    assert result.returncode == 0, result.stderr
    assert "exit codes" in result.stdout
