"""``hypha-data import``: existing safetensors slices under any names become a dataset directory of links,
after their headers are checked, and the data node serves them byte for byte."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from safetensors.torch import save_file

from data_node import tokens
from data_node.prepare import EXIT_INPUT, EXIT_OUTPUT, main
from data_node.server import ServedDataset, build_app
from data_node.slices import InvalidDatasetDirectory, scan, sha256_of

KEY = "k" * 64


def write_slice(path: Path, samples: int, *, ids_dtype=torch.int64, width: int = 4, **extra) -> Path:
    tensors = {
        "input_ids": torch.arange(samples * width, dtype=ids_dtype).reshape(samples, width),
        "labels": torch.ones(samples, dtype=torch.int64),
        **extra,
    }
    save_file(tensors, str(path), metadata={"source": path.name})
    return path


@pytest.fixture
def shards(tmp_path) -> Path:
    """Hypha-style slices: any names, one stray file; natural order is shard-1, shard-2, shard-10."""
    source = tmp_path / "brought"
    source.mkdir()
    write_slice(source / "shard-10.safetensors", 3)
    write_slice(source / "shard-2.safetensors", 2)
    write_slice(source / "shard-1.safetensors", 5)
    (source / "README.txt").write_text("not a slice")
    return source


def run_cli(*arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "data_node.prepare", "import", *arguments],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_import_links_the_slices_in_natural_order_and_the_node_serves_their_bytes(tmp_path, shards):
    # when: run as a user would, from a working directory, with the default --into (the current directory)
    work = tmp_path / "work"
    work.mkdir()
    result = run_cli(str(shards), "--name", "my-corpus", cwd=work)

    # then: three links, no copies, in natural order
    assert result.returncode == 0, result.stderr
    assert "ignored 1 entries" in result.stderr
    dataset = work / "my-corpus"
    expected = [
        shards / "shard-1.safetensors",
        shards / "shard-2.safetensors",
        shards / "shard-10.safetensors",
    ]
    assert sorted(entry.name for entry in dataset.iterdir()) == [f"{i:05d}.safetensors" for i in range(3)]
    for index, source in enumerate(expected):
        link = dataset / f"{index:05d}.safetensors"
        assert link.is_symlink()
        assert link.readlink() == source.resolve()
        assert f"{index:05d}.safetensors -> {source.resolve()}" in result.stdout
    assert "10 samples" in result.stdout
    assert "input_ids I64[N, 4], labels I64[N]" in result.stdout

    # and: the data node scans the directory and serves each source file's bytes, inline and streamed
    slices = scan(dataset)
    assert [slice_.sha256 for slice_ in slices] == [sha256_of(source) for source in expected]
    for inline_limit in (1 << 20, 0):
        served = ServedDataset(name="my-corpus", slices=slices)
        async with TestClient(
            TestServer(build_app(served, download_key=KEY, inline_limit=inline_limit))
        ) as client:
            for index, source in enumerate(expected):
                token = tokens.sign(
                    KEY, dataset="my-corpus", index=index, job="j", peer="p", expires=int(time.time() + 60)
                )
                response = await client.get(f"/datasets/my-corpus/slices/{index}?token={token}")
                assert response.status == 200
                assert await response.read() == source.read_bytes()
                assert response.headers["X-Sha256"] == sha256_of(source)


@pytest.mark.parametrize(
    ("bad_file", "complaint"),
    [
        (
            lambda p: write_slice(p, 2, ids_dtype=torch.int32),
            "tensor 'input_ids' is I32[N, 4], but in shard-1.safetensors it is I64[N, 4]",
        ),
        (
            lambda p: write_slice(p, 2, width=8),
            "tensor 'input_ids' is I64[N, 8], but in shard-1.safetensors it is I64[N, 4]",
        ),
        (
            lambda p: write_slice(p, 2, mask=torch.ones(2)),
            "tensor names differ from shard-1.safetensors's (missing [], extra ['mask'])",
        ),  # fmt: skip
        (
            lambda p: save_file({"input_ids": torch.ones(2, 4, dtype=torch.int64)}, str(p)),
            "(missing ['labels'], extra [])",
        ),  # fmt: skip
        (lambda p: write_slice(p, 2, extra_labels=torch.ones(3)), "different lengths along dimension 0"),
        (lambda p: save_file({"input_ids": torch.tensor(1), "labels": torch.ones(1)}, str(p)), "is a scalar"),
        (lambda p: p.write_bytes(b"this is not a safetensors file at all"), "not a safetensors file"),
        (
            lambda p: p.write_bytes(write_slice(p, 2).read_bytes()[:-3]),
            "not a safetensors file (header describes",
        ),
    ],
)
def test_a_slice_that_differs_is_refused_by_name_and_nothing_is_created(
    tmp_path, shards, bad_file, complaint, capsys
):
    # given
    bad = shards / "shard-7.safetensors"
    bad_file(bad)

    # when
    code = main(["import", str(shards), "--name", "my-corpus", "--into", str(tmp_path / "datasets")])

    # then
    assert code == EXIT_INPUT
    error = capsys.readouterr().err
    assert error.startswith(f"hypha-data: {bad}: ")
    assert complaint in error
    assert not (tmp_path / "datasets").exists()


def test_the_message_names_the_bad_file(tmp_path, shards):
    write_slice(shards / "shard-7.safetensors", 2, ids_dtype=torch.float32)
    result = run_cli(str(shards), "--name", "my-corpus", cwd=tmp_path)
    assert result.returncode == EXIT_INPUT
    assert result.stderr.strip() == (
        f"hypha-data: {shards / 'shard-7.safetensors'}: tensor 'input_ids' is F32[N, 4], but in "
        "shard-1.safetensors it is I64[N, 4] (dtype and per-sample shape must match)"
    )


def test_a_directory_already_holding_slices_or_a_bad_name_is_refused(tmp_path, shards, capsys):
    assert main(["import", str(shards), "--name", "c", "--into", str(tmp_path)]) == 0
    before = sorted(path.name for path in (tmp_path / "c").iterdir())

    assert main(["import", str(shards), "--name", "c", "--into", str(tmp_path)]) == EXIT_OUTPUT
    assert "already holds slices" in capsys.readouterr().err
    assert sorted(path.name for path in (tmp_path / "c").iterdir()) == before

    assert main(["import", str(shards), "--name", "no/slug", "--into", str(tmp_path)]) == EXIT_OUTPUT
    assert "must be a slug" in capsys.readouterr().err


def test_no_safetensors_files_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["import", str(tmp_path / "empty"), "--name", "c", "--into", str(tmp_path)]) == EXIT_INPUT
    assert "holds no *.safetensors files" in capsys.readouterr().err


def test_the_node_names_a_link_whose_file_went_away(tmp_path, shards):
    assert main(["import", str(shards), "--name", "c", "--into", str(tmp_path)]) == 0
    (shards / "shard-2.safetensors").unlink()
    with pytest.raises(InvalidDatasetDirectory, match=r"00001\.safetensors links to .*shard-2\.safetensors"):
        scan(tmp_path / "c")
