"""``hypha-data prepare-text --tokenizer DIR``: a local tokenizer's ids in fixed-length sequences."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from data_node import prepare
from data_node.prepare import EXIT_INPUT, EXIT_USAGE, main

CORPUS = ["the cat sat on the mat", "a dog ate the cat", "the mat was red and the dog was blue"]


def read_slice(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), framework="pt") as file:
        return {name: file.get_tensor(name) for name in file.keys()}, file.metadata()  # noqa: SIM118


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A word-level tokenizer trained on three lines, with an EOS token, saved like ``save_pretrained``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    directory = tmp_path_factory.mktemp("tokenizers") / "tiny-words"
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(
        str(directory)
    )
    return directory


def encode(tokenizer_dir: Path, text: str) -> list[int]:
    """The reference ids, from the ``tokenizers`` library directly (not through transformers)."""
    from tokenizers import Tokenizer

    return (
        Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    )


def test_files_are_tokenized_with_eos_between_them_and_cut_into_sequences(tmp_path, tokenizer_dir):
    # given: two documents (sorted: a.txt, then b.txt), one with an unknown word and two lines
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "b.txt").write_text("a dog ate the mat\nthe cat was blue\n")
    (tmp_path / "in" / "a.txt").write_text("the cat sat on the zebra")
    eos = encode(tokenizer_dir, "[EOS]")[0]
    ids = (
        encode(tokenizer_dir, "the cat sat on the zebra")
        + [eos]
        + encode(tokenizer_dir, "a dog ate the mat\nthe cat was blue\n")
        + [eos]
    )
    assert len(ids) == 17 and ids[5] == 0  # "zebra" is [UNK]; 12 words + [UNK] + [EOS] = 14 ids

    # when: sequences of 4 → 4 sequences (2 tokens dropped), 3 per slice
    code = main(["prepare-text", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "words"),
                 "--seq-len", "4", "--samples-per-slice", "3", "--tokenizer", str(tokenizer_dir)])  # fmt: skip

    # then
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "words").iterdir()) == [
        "00000.safetensors",
        "00001.safetensors",
    ]
    rows = []
    for index, expected_rows in enumerate((3, 1)):
        tensors, metadata = read_slice(tmp_path / "words" / f"{index:05d}.safetensors")
        assert set(tensors) == {"input_ids", "labels"}
        assert tensors["input_ids"].shape == (expected_rows, 4)
        assert str(tensors["input_ids"].dtype) == str(tensors["labels"].dtype) == "torch.int64"
        assert tensors["labels"].tolist() == tensors["input_ids"].tolist()
        assert metadata == {"tokenizer": "tiny-words"}
        rows.extend(tensors["input_ids"].tolist())
    assert rows == [ids[i : i + 4] for i in range(0, 16, 4)]


def test_long_files_are_tokenized_in_pieces_at_line_breaks_with_utf8_split_across_reads(
    tmp_path, tokenizer_dir, monkeypatch
):
    # given: tiny reads and pieces, and multi-byte characters that straddle read boundaries
    monkeypatch.setattr(prepare, "READ_CHUNK", 7)
    monkeypatch.setattr(prepare, "TEXT_PIECE", 20)
    text = "".join(f"the cat sat on the mat {i} ünïcødé\n" for i in range(30)) + "the dog"
    (tmp_path / "long.txt").write_text(text, encoding="utf-8")
    eos = encode(tokenizer_dir, "[EOS]")[0]
    expected = encode(tokenizer_dir, text) + [eos]

    # when
    result = prepare.prepare_text(
        inputs=[tmp_path / "long.txt"], output=tmp_path / "long", seq_len=5, samples_per_slice=1000,
        tokenizer=tokenizer_dir,
    )  # fmt: skip

    # then: word-level tokens do not depend on where the text was cut
    assert result == {
        "slices": 1,
        "sequences": len(expected) // 5,
        "tokens": len(expected),
        "dropped_tokens": len(expected) % 5,
    }
    tensors, _ = read_slice(tmp_path / "long" / "00000.safetensors")
    assert tensors["input_ids"].flatten().tolist() == expected[: len(expected) // 5 * 5]


def test_a_missing_or_invalid_tokenizer_is_exit_2_and_writes_nothing(tmp_path, capsys):
    # given
    (tmp_path / "t.txt").write_text("the cat " * 100)
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    (tmp_path / "file").write_text("x")

    for tokenizer in ("missing", "empty", "broken", "file"):
        # when
        code = main(["prepare-text", "--input", str(tmp_path / "t.txt"), "--output", str(tmp_path / "out"),
                     "--tokenizer", str(tmp_path / tokenizer)])  # fmt: skip

        # then
        assert code == EXIT_USAGE, tokenizer
        assert str(tmp_path / tokenizer) in capsys.readouterr().err
        assert not (tmp_path / "out").exists()


def test_text_that_is_not_utf8_is_exit_3_and_leaves_no_slices(tmp_path, tokenizer_dir, capsys):
    # given: a good file first (it fills a slice) and then a Latin-1 one
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("the cat sat on the mat " * 10)
    (tmp_path / "in" / "b.txt").write_bytes("caf\xe9".encode("latin-1"))

    # when
    code = main(["prepare-text", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                 "--seq-len", "2", "--samples-per-slice", "2", "--tokenizer", str(tokenizer_dir)])  # fmt: skip

    # then
    assert code == EXIT_INPUT
    assert "b.txt is not UTF-8" in capsys.readouterr().err
    assert list((tmp_path / "out").iterdir()) == []
