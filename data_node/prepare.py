"""``hypha-data``: turn raw inputs into a dataset directory of safetensors slices a data node serves.

``hypha-data prepare-text --input FILE_OR_DIR… --output DIR [--seq-len 128] [--samples-per-slice 256]``

Byte-level tokens: every byte of the input is one token id 0..255 (int64). The inputs (files in the order
given; a directory's files recursively, in sorted path order) are concatenated and cut into sequences of
``seq_len`` tokens; a trailing partial sequence is dropped. Each slice ``DIR/00000.safetensors``, … holds
``samples_per_slice`` sequences (the last may hold fewer) as ``input_ids`` [N, seq_len] and ``labels``
[N, seq_len] (equal to ``input_ids``: the executor's causal-LM loss shifts them). The dataset's name is the
output directory's basename.

Writing needs only ``safetensors`` (no torch, no numpy): the ids are packed with :mod:`array` and handed to
``safetensors.serialize_file`` as raw pointers. A ``--tokenizer`` option is not implemented.

Exit codes:
  0  the slices were written
  2  bad command line
  3  an input is missing or unreadable, or all inputs together are shorter than one sequence
  4  the output directory already holds slices, cannot be created, or its name is not a slug
"""

from __future__ import annotations

import argparse
import os
import sys
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path

from data_node.slices import DATASET_NAME, SLICE_NAME, slice_file_name

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_OUTPUT = 4
READ_CHUNK = 1 << 20


class InputError(Exception):
    """An input path is missing or unreadable, or there is not enough text."""


class OutputError(Exception):
    """The output directory cannot take the slices."""


def input_files(paths: Sequence[Path]) -> list[Path]:
    """Files to read, in order: each path as given; a directory's regular files recursively, sorted."""
    files = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(entry for entry in path.rglob("*") if entry.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise InputError(f"input {path} does not exist")
    if not files:
        raise InputError("the inputs hold no files")
    return files


def _chunks(files: Sequence[Path]) -> Iterator[bytes]:
    for path in files:
        try:
            with open(path, "rb") as file:
                while chunk := file.read(READ_CHUNK):
                    yield chunk
        except OSError as error:
            raise InputError(f"cannot read {path}: {error}") from error


def write_slice(path: Path, tokens: bytes, *, seq_len: int) -> None:
    """Write ``tokens`` (one byte per token, a multiple of ``seq_len``) as ``input_ids``/``labels`` int64
    [len/seq_len, seq_len] to ``path``, atomically (a ``.partial`` file renamed into place)."""
    from safetensors import TensorSpec, serialize_file

    if sys.byteorder != "little":  # safetensors is little-endian and we hand it raw memory
        raise NotImplementedError("writing slices on a big-endian host")
    ids = array("q", iter(tokens))  # uint8 → int64, values 0..255 (iter: bytes alone would be raw memory)
    address, count = ids.buffer_info()
    shape = [len(tokens) // seq_len, seq_len]
    # ``ids`` must stay alive until serialize_file returns: the specs hold its raw address.
    specs = {
        name: TensorSpec(dtype="int64", shape=shape, data_ptr=address, data_len=count * ids.itemsize)
        for name in ("input_ids", "labels")
    }
    partial = path.with_name(f".{path.name}.partial")
    try:
        serialize_file(specs, str(partial), metadata={"tokenizer": "bytes", "seq_len": str(seq_len)})
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
        del ids


def prepare_text(
    *, inputs: Sequence[Path], output: Path, seq_len: int = 128, samples_per_slice: int = 256
) -> dict[str, int]:
    """Write the slices of ``inputs`` to ``output``; returns ``{slices, sequences, dropped_bytes}``."""
    if seq_len < 1 or samples_per_slice < 1:
        raise ValueError("seq_len and samples_per_slice must be positive")
    if not DATASET_NAME.match(output.resolve().name):
        raise OutputError(
            f"output directory name {output.resolve().name!r} must be a slug: it names the dataset"
        )
    files = input_files(inputs)
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"cannot create {output}: {error}") from error
    existing = sorted(entry.name for entry in output.iterdir() if SLICE_NAME.match(entry.name))
    if existing:
        raise OutputError(f"{output} already holds slices ({existing[0]}, …); use an empty directory")

    slice_bytes = seq_len * samples_per_slice
    pending = bytearray()
    slices = sequences = 0
    for chunk in _chunks(files):
        pending += chunk
        while len(pending) >= slice_bytes:
            write_slice(output / slice_file_name(slices), bytes(pending[:slice_bytes]), seq_len=seq_len)
            del pending[:slice_bytes]
            slices += 1
            sequences += samples_per_slice
    full = len(pending) // seq_len
    if full:
        write_slice(output / slice_file_name(slices), bytes(pending[: full * seq_len]), seq_len=seq_len)
        slices += 1
        sequences += full
    if slices == 0:
        raise InputError(f"the inputs hold {len(pending)} bytes, fewer than one sequence of {seq_len}")
    return {"slices": slices, "sequences": sequences, "dropped_bytes": len(pending) - full * seq_len}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hypha-data",
        description="Prepare datasets as safetensors slices for hypha-data-node.",
        epilog="exit codes: 0 done, 2 bad command line, 3 bad input, 4 bad output directory",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    text = commands.add_parser(
        "prepare-text",
        help="byte-level tokens in fixed-length sequences (input_ids, labels) for causal LM training",
        description=__doc__.split("Exit codes:")[0].split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    text.add_argument("--input", nargs="+", required=True, type=Path, metavar="FILE_OR_DIR")
    text.add_argument(
        "--output", required=True, type=Path, metavar="DIR", help="its basename names the dataset"
    )
    text.add_argument("--seq-len", type=_positive, default=128, help="tokens per sequence (default 128)")
    text.add_argument(
        "--samples-per-slice", type=_positive, default=256, help="sequences per slice file (default 256)"
    )
    return parser


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return number


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    try:
        result = prepare_text(
            inputs=arguments.input,
            output=arguments.output,
            seq_len=arguments.seq_len,
            samples_per_slice=arguments.samples_per_slice,
        )
    except InputError as error:
        print(f"hypha-data: {error}", file=sys.stderr)
        return EXIT_INPUT
    except OutputError as error:
        print(f"hypha-data: {error}", file=sys.stderr)
        return EXIT_OUTPUT
    print(
        f"wrote {result['slices']} slices ({result['sequences']} sequences of {arguments.seq_len} tokens) "
        f"to {arguments.output}; dropped {result['dropped_bytes']} trailing bytes"
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
