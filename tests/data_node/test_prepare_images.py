"""``hypha-data prepare-images``: an image folder → ``pixel_values``/``labels`` slices the data node serves and
the trainer's slice stream batches."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from data_node import images
from data_node.prepare import EXIT_INPUT, EXIT_OUTPUT, main
from data_node.slices import dataset_name, scan


def write_ppm(path: Path, width: int, height: int, pixels: list[tuple[int, int, int]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(f"P6\n# made by a test\n{width} {height}\n255\n".encode() + bytes(sum(pixels, ())))


def write_pgm(path: Path, width: int, height: int, values: list[int], maxval: int = 255) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    width_bytes = 1 if maxval < 256 else 2
    raster = b"".join(value.to_bytes(width_bytes, "big") for value in values)
    path.write_bytes(f"P5 {width} {height} {maxval}\n".encode() + raster)


def read_slice(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), framework="pt") as file:
        return {name: file.get_tensor(name) for name in file.keys()}, file.metadata()  # noqa: SIM118


def normalised(value: float, maxval: int = 255) -> float:
    return (value / maxval - 0.5) / 0.5


@pytest.fixture
def folder(tmp_path) -> Path:
    """3 classes (sorted: cat 0, dog 1, emu 2) with 3, 2 and 2 images of 2×2; image ``k`` of class ``c`` has
    red ``c * 100 + k * 10`` everywhere, green 0 / 255 / 51 / 255 by pixel and blue 7."""
    root = tmp_path / "pets"
    for label, (name, count) in enumerate([("cat", 3), ("dog", 2), ("emu", 2)]):
        for k in range(count):
            red = label * 100 + k * 10
            write_ppm(
                root / name / f"{k}.ppm", 2, 2, [(red, 0, 7), (red, 255, 7), (red, 51, 7), (red, 255, 7)]
            )
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / ".cache").mkdir()
    return root


def test_an_image_folder_gives_exact_normalised_shuffled_slices(folder, tmp_path, capsys):
    # when: 7 images, 3 per slice → slices of 3, 3, 1
    code = main(["prepare-images", "--input", str(folder), "--output", str(tmp_path / "pets-32"),
                 "--size", "2", "--samples-per-slice", "3"])  # fmt: skip

    # then
    assert code == 0
    out = capsys.readouterr()
    assert 'labels {"cat": 0, "dog": 1, "emu": 2}' in out.out.splitlines()
    assert "ignored 1 files" in out.err
    assert sorted(p.name for p in (tmp_path / "pets-32").iterdir()) == [
        f"{i:05d}.safetensors" for i in range(3)
    ]
    seen = []
    for index, rows in enumerate((3, 3, 1)):
        tensors, metadata = read_slice(tmp_path / "pets-32" / f"{index:05d}.safetensors")
        assert set(tensors) == {"pixel_values", "labels"}
        assert tensors["pixel_values"].shape == (rows, 3, 2, 2)
        assert str(tensors["pixel_values"].dtype) == "torch.float32"
        assert tensors["labels"].shape == (rows,)
        assert str(tensors["labels"].dtype) == "torch.int64"
        assert metadata.keys() == {"labels"}  # one key: safetensors writes several in random order
        assert json.loads(metadata["labels"]) == {"cat": 0, "dog": 1, "emu": 2}
        for pixels, label in zip(tensors["pixel_values"], tensors["labels"].tolist(), strict=True):
            red = round((pixels[0, 0, 0].item() + 1) / 2 * 255)
            assert red // 100 == label  # the image came from its label's class directory
            assert pixels[0].flatten().tolist() == pytest.approx([normalised(red)] * 4, abs=1e-6)
            assert pixels[1].flatten().tolist() == pytest.approx([-1.0, 1.0, -0.6, 1.0], abs=1e-6)
            assert pixels[2].flatten().tolist() == pytest.approx([normalised(7)] * 4, abs=1e-6)
            seen.append((label, red))
        if index == 0:
            assert len(set(tensors["labels"].tolist())) > 1  # shuffled across classes
    assert sorted(seen) == [(0, 0), (0, 10), (0, 20), (1, 100), (1, 110), (2, 200), (2, 210)]

    # and the data node accepts the directory as it is
    assert dataset_name(tmp_path / "pets-32") == "pets-32"
    assert [s.path.name for s in scan(tmp_path / "pets-32")] == [f"{i:05d}.safetensors" for i in range(3)]


def test_the_shuffle_is_deterministic_per_seed(folder, tmp_path):
    def labels(output: str, seed: str) -> list[int]:
        assert main(["prepare-images", "--input", str(folder), "--output", str(tmp_path / output),
                     "--size", "2", "--seed", seed, "--samples-per-slice", "100"]) == 0  # fmt: skip
        return read_slice(tmp_path / output / "00000.safetensors")[0]["pixel_values"][:, 0, 0, 0].tolist()

    first, again, other = labels("a", "0"), labels("b", "0"), labels("c", "1")
    assert first == again
    assert sorted(first) == sorted(other) and first != other
    assert (tmp_path / "a" / "00000.safetensors").read_bytes() == (
        tmp_path / "b" / "00000.safetensors"
    ).read_bytes()


def test_grey_and_colour_conversions_and_16_bit_pgm(tmp_path):
    # given: one colour PPM (class a) and one 16-bit PGM (class b), both 1×1
    write_ppm(tmp_path / "in" / "a" / "x.ppm", 1, 1, [(255, 0, 51)])
    write_pgm(tmp_path / "in" / "b" / "y.pgm", 1, 1, [16384], maxval=65535)

    # when
    assert main(["prepare-images", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "grey"),
                 "--size", "1", "--channels", "1"]) == 0  # fmt: skip
    assert main(["prepare-images", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "rgb"),
                 "--size", "1"]) == 0  # fmt: skip

    # then: colour → luma; grey → repeated
    grey, _ = read_slice(tmp_path / "grey" / "00000.safetensors")
    rgb, _ = read_slice(tmp_path / "rgb" / "00000.safetensors")
    assert grey["pixel_values"].shape == (2, 1, 1, 1) and rgb["pixel_values"].shape == (2, 3, 1, 1)
    by_label = {
        label: pixels.flatten().tolist()
        for label, pixels in zip(grey["labels"].tolist(), grey["pixel_values"], strict=True)
    }
    assert by_label[0] == pytest.approx([normalised(0.299 * 255 + 0.114 * 51)], abs=1e-6)
    assert by_label[1] == pytest.approx([normalised(16384, 65535)], abs=1e-6)
    by_label = {
        label: pixels.flatten().tolist()
        for label, pixels in zip(rgb["labels"].tolist(), rgb["pixel_values"], strict=True)
    }
    assert by_label[0] == pytest.approx([1.0, -1.0, -0.6], abs=1e-6)
    assert by_label[1] == pytest.approx([normalised(16384, 65535)] * 3, abs=1e-6)


def test_resizing_is_an_antialiased_bilinear_squash(tmp_path):
    # given: 4×2, two dark columns then two bright ones; and a uniform 5×3
    write_pgm(tmp_path / "in" / "a" / "edge.pgm", 4, 2, [0, 0, 255, 255] * 2)
    write_pgm(tmp_path / "in" / "b" / "flat.pgm", 5, 3, [80] * 15)

    # when
    assert main(["prepare-images", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "small"),
                 "--size", "2", "--channels", "1"]) == 0  # fmt: skip

    # then: Pillow's triangle weights for 4 → 2 are 0.75, 0.75, 0.25 (/1.75) around each output pixel
    tensors, _ = read_slice(tmp_path / "small" / "00000.safetensors")
    by_label = {
        label: pixels
        for label, pixels in zip(tensors["labels"].tolist(), tensors["pixel_values"], strict=True)
    }
    low, high = 0.25 * 255 / 1.75, 255 - 0.25 * 255 / 1.75
    assert by_label[0].flatten().tolist() == pytest.approx(
        [normalised(v) for v in (low, high, low, high)], abs=1e-5
    )
    assert by_label[1].flatten().tolist() == pytest.approx([normalised(80)] * 4, abs=1e-5)


def test_the_trainer_slice_stream_batches_an_image_slice_for_a_classifier(folder, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from worker_daemon.executors.bridge_client import FetchedFile
    from worker_daemon.executors.data import SliceStream

    # given: slices of 3 images of 8×8 and a fake bridge handing them out in turn
    assert main(["prepare-images", "--input", str(folder), "--output", str(tmp_path / "pets-slices"), "--size", "8",
                 "--samples-per-slice", "3"]) == 0  # fmt: skip
    slices = itertools.cycle(sorted((tmp_path / "pets-slices").iterdir()))
    (tmp_path / "work" / "artifacts").mkdir(parents=True)

    def fetch(reference: dict) -> list[FetchedFile]:
        data = next(slices).read_bytes()
        (tmp_path / "work" / "artifacts" / "0").write_bytes(data)
        return [FetchedFile(path="artifacts/0", size=len(data))]

    stream = SliceStream(
        fetch=fetch, reference={}, work_dir=tmp_path / "work", input_names=["pixel_values", "labels"]
    )

    # when: batches of 4 (spanning slices)
    loader = torch.utils.data.DataLoader(stream, batch_size=4, num_workers=0)
    batches = list(itertools.islice(loader, 2))

    # then
    for batch in batches:
        assert batch["pixel_values"].shape == (4, 3, 8, 8) and batch["pixel_values"].dtype == torch.float32
        assert batch["labels"].shape == (4,) and batch["labels"].dtype == torch.int64
        assert set(batch["labels"].tolist()) <= {0, 1, 2}
    # and a Hugging Face image classifier takes the batch as it is and returns a loss
    config = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8], depths=[1], num_labels=3
    )
    model = transformers.ResNetForImageClassification(config)
    loss = model(**batches[0]).loss
    assert loss is not None and torch.isfinite(loss)


def test_other_formats_without_pillow_are_exit_3_naming_pillow(folder, tmp_path, capsys, monkeypatch):
    # given
    monkeypatch.setattr(images, "pillow", lambda: None)
    (folder / "dog" / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n")

    # when
    code = main(["prepare-images", "--input", str(folder), "--output", str(tmp_path / "out")])

    # then
    assert code == EXIT_INPUT
    assert "photo.png" in (err := capsys.readouterr().err) and "needs Pillow" in err
    assert not (tmp_path / "out").exists()


def test_bad_folders_are_exit_3_and_a_bad_image_removes_the_slices_written(folder, tmp_path, capsys):
    # a missing folder, a folder without classes, a class without images
    assert (
        main(["prepare-images", "--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o")])
        == EXIT_INPUT
    )
    (tmp_path / "flat").mkdir()
    write_ppm(tmp_path / "flat" / "x.ppm", 1, 1, [(0, 0, 0)])
    assert (
        main(["prepare-images", "--input", str(tmp_path / "flat"), "--output", str(tmp_path / "o")])
        == EXIT_INPUT
    )
    (folder / "fox").mkdir()
    assert main(["prepare-images", "--input", str(folder), "--output", str(tmp_path / "o")]) == EXIT_INPUT
    assert "fox holds no images" in capsys.readouterr().err
    (folder / "fox").rmdir()

    # a truncated image: whichever slice it falls in, no slice is left behind
    (folder / "emu" / "9.ppm").write_bytes(b"P6\n2 2\n255\n\x00\x01")
    code = main(["prepare-images", "--input", str(folder), "--output", str(tmp_path / "o"), "--size", "2",
                 "--samples-per-slice", "1"])  # fmt: skip
    assert code == EXIT_INPUT
    assert "9.ppm is truncated" in capsys.readouterr().err
    assert list((tmp_path / "o").iterdir()) == []


def test_an_output_inside_the_image_folder_is_exit_4(folder):
    assert main(["prepare-images", "--input", str(folder), "--output", str(folder / "sliced")]) == EXIT_OUTPUT
    assert not (folder / "sliced").exists()


def test_pillow_decodes_other_formats_like_the_ppm_reader(tmp_path):
    image_module = pytest.importorskip("PIL.Image")

    # given: the same 4×4 picture as PPM and PNG
    pixels = [(x * 60, y * 80, (x + y) * 30) for y in range(4) for x in range(4)]
    write_ppm(tmp_path / "in" / "a" / "p.ppm", 4, 4, pixels)
    picture = image_module.new("RGB", (4, 4))
    picture.putdata(pixels)
    picture.save(tmp_path / "in" / "b" / "p.png") if (tmp_path / "in" / "b").mkdir() is None else None

    # when: kept at 4×4 (exact) and resized to 3×3 (Pillow rounds to 8 bits after each pass)
    for size, tolerance in ((4, 1e-6), (3, 2 / 255)):
        assert main(["prepare-images", "--input", str(tmp_path / "in"), "--output", str(tmp_path / f"s{size}"),
                     "--size", str(size)]) == 0  # fmt: skip

        # then
        tensors, _ = read_slice(tmp_path / f"s{size}" / "00000.safetensors")
        by_label = {
            label: pixels
            for label, pixels in zip(tensors["labels"].tolist(), tensors["pixel_values"], strict=True)
        }
        assert by_label[0].flatten().tolist() == pytest.approx(by_label[1].flatten().tolist(), abs=tolerance)
