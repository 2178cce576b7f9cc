"""``hypha-data``: turn raw inputs into a dataset directory of safetensors slices a data node serves.

``hypha-data prepare-text --input FILE_OR_DIR… --output DIR [--seq-len 128] [--samples-per-slice 256]
[--tokenizer TOKENIZER_DIR]``

The inputs (files in the order given; a directory's files recursively, in sorted path order) are turned into
one stream of token ids and cut into sequences of ``seq_len`` tokens; a trailing partial sequence is dropped.
Each slice ``DIR/00000.safetensors``, … holds ``samples_per_slice`` sequences (the last may hold fewer) as
``input_ids`` [N, seq_len] and ``labels`` [N, seq_len], both int64 (``labels`` equals ``input_ids``: the
executor's causal-LM loss shifts them); the slice's metadata ``tokenizer`` is ``bytes`` or the tokenizer
directory's basename. Tokens:

* by default byte-level: every byte of the input is one token id 0..255 (any file, no decoding);
* with ``--tokenizer TOKENIZER_DIR``: the tokenizer saved there (``save_pretrained``; loaded with transformers'
  ``AutoTokenizer``, local files only, never downloaded). Each file is decoded as UTF-8 and tokenized on its
  own without special tokens, in pieces of about 1 MiB that end at a line break (text without line
  breaks is cut at whitespace every 16 MiB), and followed by the tokenizer's EOS token if it has one (so
  documents are separated).

``hypha-data prepare-images --input DIR --output DIR [--size 32] [--samples-per-slice 256] [--channels 3]
[--seed 0]``

An image folder ``DIR/<class name>/<image files>``: classes are the subdirectories sorted by name, label ids
``0..K-1`` in that order. The images are shuffled with ``--seed`` (so each slice mixes classes), squashed to
``size × size`` and written as ``pixel_values`` float32 [N, channels, size, size] (scaled to 0..1, then
normalised with mean 0.5 and std 0.5, i.e. to -1..1) and ``labels`` int64 [N]. The class name → id mapping is
printed (a JSON object on the line starting ``labels``) and stored in every slice's metadata under
``labels``; the output directory holds nothing but slices. Binary PGM/PPM are decoded without extra packages;
other formats (PNG, JPEG, …) need Pillow. See ``data_node/images.py`` for the exact pixel pipeline.

Either way the dataset's name is the output directory's basename, and the output must not hold slices yet.
If preparing fails midway, the slices written so far are removed. Writing needs only ``safetensors`` (no
torch, no numpy): values are packed with :mod:`array` and handed to ``safetensors.serialize_file`` as raw
pointers.

Exit codes:
  0  the slices were written
  2  bad command line, or --tokenizer is not a loadable tokenizer directory (or transformers is missing)
  3  an input is missing, unreadable or undecodable (an image format without Pillow, text that is not
     UTF-8 with --tokenizer), or the inputs hold less than one sequence
  4  the output directory already holds slices, cannot be created, its name is not a slug, or it lies
     inside the image folder
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
from array import array
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from data_node import adopt
from data_node.slices import DATASET_NAME, SLICE_NAME, slice_file_name

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_OUTPUT = 4
READ_CHUNK = 1 << 20
TEXT_PIECE = 1 << 20
"""Characters of text gathered before tokenizing up to the last line break (bounds memory per call)."""
TEXT_PIECE_LIMIT = 16
"""A text without line breaks is cut elsewhere once it is this many pieces long."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class InputError(Exception):
    """An input path is missing, unreadable or undecodable, or there is not enough of it."""


class OutputError(Exception):
    """The output directory cannot take the slices."""


class UsageError(Exception):
    """An option's value is unusable (e.g. ``--tokenizer`` names no loadable tokenizer)."""


# Writing slices -----------------------------------------------------------------------------------------------

Column = tuple[str, Sequence[int], array]
"""A tensor to write: safetensors dtype (``"int64"``, ``"float32"``), shape, and its values in an array."""


def write_tensors(path: Path, tensors: Mapping[str, Column], metadata: Mapping[str, str]) -> None:
    """Write ``tensors`` to the safetensors file ``path``, atomically (a ``.partial`` file renamed into place).

    Pass at most one ``metadata`` key if the file must be reproducible byte for byte: safetensors writes
    several keys in an arbitrary order, and a slice's digest is what the control plane registers.

    Each array must hold exactly the shape's number of values, in C order, of the dtype's size; several names
    may share one array."""
    from safetensors import TensorSpec, serialize_file

    if sys.byteorder != "little":  # safetensors is little-endian and we hand it raw memory
        raise NotImplementedError("writing slices on a big-endian host")
    specs = {}
    for name, (dtype, shape, values) in tensors.items():
        count = 1
        for dimension in shape:
            count *= dimension
        if count != len(values) or values.itemsize != {"int64": 8, "float32": 4}[dtype]:
            raise ValueError(
                f"tensor {name}: {len(values)} values of {values.itemsize} bytes for {dtype}{shape}"
            )
        address, length = values.buffer_info()
        # The arrays must stay alive until serialize_file returns: the specs hold their raw addresses.
        specs[name] = TensorSpec(
            dtype=dtype, shape=list(shape), data_ptr=address, data_len=length * values.itemsize
        )
    partial = path.with_name(f".{path.name}.partial")
    try:
        serialize_file(specs, str(partial), metadata=dict(metadata))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


class SliceWriter:
    """Writes slices ``00000.safetensors``, ``00001.safetensors``, … into ``output`` in order. Used as a context
    manager: if the block raises (or is interrupted), the slices it wrote are removed again, so a failed run
    never leaves a valid-looking partial dataset."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.written: list[Path] = []

    def write(self, tensors: Mapping[str, Column], metadata: Mapping[str, str]) -> None:
        path = self.output / slice_file_name(len(self.written))
        write_tensors(path, tensors, metadata)
        self.written.append(path)

    def __enter__(self) -> SliceWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if kind is not None:
            for path in self.written:
                path.unlink(missing_ok=True)


def check_output_name(output: Path) -> None:
    """Raise :class:`OutputError` unless the output directory's basename is a slug (it names the dataset)."""
    if not DATASET_NAME.match(output.resolve().name):
        raise OutputError(
            f"output directory name {output.resolve().name!r} must be a slug: it names the dataset"
        )


def prepare_output(output: Path) -> None:
    """Create ``output`` if needed; raise :class:`OutputError` if that fails or it already holds slices."""
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"cannot create {output}: {error}") from error
    existing = sorted(entry.name for entry in output.iterdir() if SLICE_NAME.match(entry.name))
    if existing:
        raise OutputError(f"{output} already holds slices ({existing[0]}, …); use an empty directory")


# Text ---------------------------------------------------------------------------------------------------------


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


def load_tokenizer(path: Path) -> Any:
    """The tokenizer saved in directory ``path`` (``AutoTokenizer.from_pretrained``, local files only).

    Raises :class:`UsageError` if ``path`` is no directory holding ``tokenizer.json`` or
    ``tokenizer_config.json``, if transformers is not installed, or if loading fails."""
    if not path.is_dir():
        raise UsageError(
            f"--tokenizer {path} is not a directory (save one with tokenizer.save_pretrained(DIR))"
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(f"--tokenizer {path} holds no {' or '.join(TOKENIZER_FILES)}")
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise UsageError(f"--tokenizer needs transformers (pip install transformers): {error}") from error
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # transformers raises OSError, ValueError, KeyError, JSON errors…
        raise UsageError(f"cannot load a tokenizer from {path}: {type(error).__name__}: {error}") from error


def _byte_tokens(files: Sequence[Path]) -> Iterator[array]:
    for path in files:
        try:
            with open(path, "rb") as file:
                while chunk := file.read(READ_CHUNK):
                    yield array("q", iter(chunk))  # uint8 → int64 (iter: bytes alone would be raw memory)
        except OSError as error:
            raise InputError(f"cannot read {path}: {error}") from error


def _encode(tokenizer: Any, text: str) -> array:
    # verbose=False: no "longer than the model's maximum length" warning; we cut sequences ourselves.
    return array("q", tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _piece_end(text: str) -> int:
    """Where to cut ``text`` for tokenizing: after its last line break; with none, wait (0) until it is
    ``TEXT_PIECE_LIMIT`` long, then cut after its last whitespace, or anywhere."""
    cut = text.rfind("\n") + 1
    if cut or len(text) < TEXT_PIECE_LIMIT * TEXT_PIECE:
        return cut
    return max(text.rfind(" "), text.rfind("\t")) + 1 or len(text)


def _tokenizer_tokens(files: Sequence[Path], tokenizer: Any) -> Iterator[array]:
    eos = tokenizer.eos_token_id
    for path in files:
        decoder = codecs.getincrementaldecoder("utf-8-sig")()
        text = ""
        try:
            with open(path, "rb") as file:
                while chunk := file.read(READ_CHUNK):
                    text += decoder.decode(chunk)
                    if len(text) >= TEXT_PIECE:
                        cut = _piece_end(text)
                        if cut:
                            yield _encode(tokenizer, text[:cut])
                            text = text[cut:]
                text += decoder.decode(b"", final=True)
        except OSError as error:
            raise InputError(f"cannot read {path}: {error}") from error
        except UnicodeDecodeError as error:
            raise InputError(f"{path} is not UTF-8 text: {error}") from error
        if text:
            yield _encode(tokenizer, text)
        if eos is not None:
            yield array("q", [eos])


def _token_columns(ids: array, seq_len: int) -> dict[str, Column]:
    shape = [len(ids) // seq_len, seq_len]
    return {"input_ids": ("int64", shape, ids), "labels": ("int64", shape, ids)}


def prepare_text(
    *,
    inputs: Sequence[Path],
    output: Path,
    seq_len: int = 128,
    samples_per_slice: int = 256,
    tokenizer: Path | None = None,
) -> dict[str, int]:
    """Write the slices of ``inputs`` to ``output`` (byte-level tokens, or ``tokenizer``'s if given).

    Returns ``{slices, sequences, tokens, dropped_tokens}``. Raises :class:`InputError`,
    :class:`OutputError`, or :class:`UsageError` (for ``tokenizer``); nothing is written unless the inputs
    and the tokenizer are usable."""
    if seq_len < 1 or samples_per_slice < 1:
        raise ValueError("seq_len and samples_per_slice must be positive")
    check_output_name(output)
    files = input_files(inputs)
    if tokenizer is None:
        tokens = _byte_tokens(files)
        metadata = {"tokenizer": "bytes"}
    else:
        loaded = load_tokenizer(tokenizer)
        tokens = _tokenizer_tokens(files, loaded)
        metadata = {"tokenizer": tokenizer.resolve().name}
    prepare_output(output)

    slice_tokens = seq_len * samples_per_slice
    pending = array("q")
    total = sequences = 0
    with SliceWriter(output) as writer:
        for ids in tokens:
            pending.extend(ids)
            total += len(ids)
            while len(pending) >= slice_tokens:
                writer.write(_token_columns(pending[:slice_tokens], seq_len), metadata)
                del pending[:slice_tokens]
                sequences += samples_per_slice
        full = len(pending) // seq_len
        if full:
            writer.write(_token_columns(pending[: full * seq_len], seq_len), metadata)
            sequences += full
        if not writer.written:
            raise InputError(f"the inputs hold {total} tokens, fewer than one sequence of {seq_len}")
    return {
        "slices": len(writer.written),
        "sequences": sequences,
        "tokens": total,
        "dropped_tokens": len(pending) - full * seq_len,
    }


# Images -------------------------------------------------------------------------------------------------------


def prepare_images(
    *,
    input_dir: Path,
    output: Path,
    size: int = 32,
    samples_per_slice: int = 256,
    channels: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Write the image folder ``input_dir`` as slices of ``pixel_values``/``labels`` to ``output``.

    Returns ``{slices, images, classes, ignored}`` (``classes``: the names, a class's id is its index;
    ``ignored``: files skipped as not images). Raises :class:`InputError` (no class directories, a class
    without images, an undecodable image, or a format that needs Pillow when it is not installed — checked
    before anything is written) or :class:`OutputError`."""
    import random

    from data_node import images

    if size < 1 or samples_per_slice < 1 or channels not in (1, 3):
        raise ValueError("size and samples_per_slice must be positive, channels 1 or 3")
    check_output_name(output)
    try:
        folder = images.image_folder(input_dir)
    except images.ImageError as error:
        raise InputError(str(error)) from error
    if output.resolve().is_relative_to(input_dir.resolve()):
        raise OutputError(f"output {output} must not lie inside the image folder {input_dir}")
    image_module = images.pillow()
    if image_module is None:
        needing = [sample.path for sample in folder.samples if images.needs_pillow(sample.path)]
        if needing:
            raise InputError(
                f"{len(needing)} images (e.g. {needing[0]}) are not PGM/PPM: decoding them needs Pillow "
                "(pip install pillow)"
            )
    prepare_output(output)

    order = list(folder.samples)
    random.Random(seed).shuffle(order)
    labels = {name: index for index, name in enumerate(folder.classes)}
    metadata = {"labels": json.dumps(labels, ensure_ascii=False)}
    with SliceWriter(output) as writer:
        for start in range(0, len(order), samples_per_slice):
            batch = order[start : start + samples_per_slice]
            pixels = array("f")
            ids = array("q", (sample.label for sample in batch))
            for sample in batch:
                try:
                    images.load_image(
                        sample.path, size=size, channels=channels, image_module=image_module, out=pixels
                    )
                except images.ImageError as error:
                    raise InputError(str(error)) from error
            writer.write(
                {
                    "pixel_values": ("float32", [len(batch), channels, size, size], pixels),
                    "labels": ("int64", [len(batch)], ids),
                },
                metadata,
            )
    return {
        "slices": len(writer.written),
        "images": len(order),
        "classes": folder.classes,
        "ignored": folder.ignored,
    }


# Command line -------------------------------------------------------------------------------------------------


def _section(command: str) -> str:
    """The module docstring's paragraphs about ``command``, then the common ones (for its ``--help``)."""
    body = __doc__.split("Exit codes:")[0]
    text_part, rest = body.split("``hypha-data prepare-images", 1)
    images_part, common = ("``hypha-data prepare-images" + rest).split("Either way", 1)
    own = text_part.split("\n\n", 1)[1] if command == "prepare-text" else images_part
    return f"{own.strip()}\n\nEither way{common.rstrip()}\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hypha-data",
        description="Prepare datasets as safetensors slices for hypha-data-node, or import existing slices.",
        epilog="exit codes: 0 done, 2 bad command line or tokenizer, 3 bad input, 4 bad output directory",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    text = commands.add_parser(
        "prepare-text",
        help="token sequences (input_ids, labels) for causal LM training: byte-level or --tokenizer",
        description=_section("prepare-text"),
        epilog="exit codes: 0 done, 2 bad command line or tokenizer, 3 bad input, 4 bad output directory",
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
    text.add_argument(
        "--tokenizer",
        type=Path,
        metavar="TOKENIZER_DIR",
        help="a local tokenizer directory (save_pretrained) instead of byte-level tokens; needs transformers",
    )
    pictures = commands.add_parser(
        "prepare-images",
        help="an image folder DIR/<class>/<images> as pixel_values and labels for image classification",
        description=_section("prepare-images"),
        epilog="exit codes: 0 done, 2 bad command line, 3 bad input, 4 bad output directory",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pictures.add_argument(
        "--input", required=True, type=Path, metavar="DIR", help="DIR/<class name>/<images>"
    )
    pictures.add_argument(
        "--output", required=True, type=Path, metavar="DIR", help="its basename names the dataset"
    )
    pictures.add_argument(
        "--size", type=_positive, default=32, help="height and width in pixels (default 32)"
    )
    pictures.add_argument(
        "--samples-per-slice", type=_positive, default=256, help="images per slice file (default 256)"
    )
    pictures.add_argument(
        "--channels", type=int, choices=(3, 1), default=3, help="3 (RGB, default) or 1 (greyscale)"
    )
    pictures.add_argument(
        "--seed", type=int, default=0, help="seed of the shuffle across classes (default 0)"
    )
    adopt_command = commands.add_parser(
        "import",
        help="adopt existing safetensors slices (any names) as a dataset directory, linking, not copying",
        description=adopt.__doc__.split("\n\n", 1)[1],
        epilog="exit codes: 0 done, 2 bad command line, 3 a file is no usable slice or differs from the "
        "first, 4 the dataset directory cannot be created or already holds slices",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    adopt_command.add_argument(
        "source", type=Path, metavar="DIR", help="directory holding *.safetensors slices"
    )
    adopt_command.add_argument("--name", required=True, help="the dataset's name (a slug)")
    adopt_command.add_argument(
        "--into",
        type=Path,
        default=Path("."),
        metavar="PARENT",
        help="where to create the dataset directory PARENT/NAME (default: the current directory)",
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


def _run(arguments: argparse.Namespace) -> None:
    if arguments.command == "import":
        _run_import(arguments)
        return
    if arguments.command == "prepare-text":
        result = prepare_text(
            inputs=arguments.input,
            output=arguments.output,
            seq_len=arguments.seq_len,
            samples_per_slice=arguments.samples_per_slice,
            tokenizer=arguments.tokenizer,
        )
        unit = "bytes" if arguments.tokenizer is None else "tokens"
        print(
            f"wrote {result['slices']} slices ({result['sequences']} sequences of {arguments.seq_len} tokens) "
            f"to {arguments.output}; dropped {result['dropped_tokens']} trailing {unit}"
        )
        return
    result = prepare_images(
        input_dir=arguments.input,
        output=arguments.output,
        size=arguments.size,
        samples_per_slice=arguments.samples_per_slice,
        channels=arguments.channels,
        seed=arguments.seed,
    )
    if result["ignored"]:
        print(f"hypha-data: ignored {result['ignored']} files that are not images", file=sys.stderr)
    print(
        f"wrote {result['slices']} slices ({result['images']} images of {arguments.channels}×{arguments.size}"
        f"×{arguments.size}, {len(result['classes'])} classes) to {arguments.output}"
    )
    labels = {name: index for index, name in enumerate(result["classes"])}
    print(f"labels {json.dumps(labels, ensure_ascii=False)}")


def _run_import(arguments: argparse.Namespace) -> None:
    try:
        result = adopt.import_slices(source=arguments.source, name=arguments.name, into=arguments.into)
    except adopt.SliceCheckError as error:
        raise InputError(str(error)) from error
    except adopt.ImportTargetError as error:
        raise OutputError(str(error)) from error
    if result["ignored"]:
        print(
            f"hypha-data: ignored {result['ignored']} entries that are not *.safetensors files",
            file=sys.stderr,
        )
    for index, path in result["slices"]:
        print(f"{slice_file_name(index)} -> {path.resolve()}")
    print(
        f"linked {len(result['slices'])} slices ({result['samples']} samples of {result['tensors']}) "
        f"as {result['directory']}; serve it with hypha-data-node --dataset {result['directory']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    try:
        _run(arguments)
    except UsageError as error:
        print(f"hypha-data: {error}", file=sys.stderr)
        return EXIT_USAGE
    except InputError as error:
        print(f"hypha-data: {error}", file=sys.stderr)
        return EXIT_INPUT
    except OutputError as error:
        print(f"hypha-data: {error}", file=sys.stderr)
        return EXIT_OUTPUT
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
