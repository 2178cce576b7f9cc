"""An image-classification job on a tiny ResNet (BatchNorm after every convolution) with real processes
(issue 13, finding 2): BatchNorm's running statistics are averaged by the parameter server, never given
Nesterov momentum (which turned running_var 1.0 into −0.32 after one round and the model's outputs into NaN).

Every round must have a finite eval loss, and the final model's running statistics must be the trainers'
mean: the parameter server's global weights before the last round plus the mean of the trainers' last
pseudo-gradients (their ``updates/<round>.safetensors``, kept with ``HYPHA_KEEP_WORK_DIRS=1``).
"""

from __future__ import annotations

import math
import random
import zipfile
from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import BIN_DIR, only_in_mode, services_mode
from tests.parameter_server.test_buffers import TINY_RESNET

pytestmark = [
    pytest.mark.timeout(600),
    only_in_mode("embedded", "the training math it checks is the same over either transport"),
]

ROUNDS = 3
TRAINERS = 2


def write_images(root: Path, *, per_class: int = 32, size: int = 8) -> Path:
    """Three classes of noisy PPM images, each mostly red, green or blue."""
    generator = random.Random(0)
    for label, name in enumerate(("red", "green", "blue")):
        directory = root / name
        directory.mkdir(parents=True)
        for index in range(per_class):
            pixels = bytearray()
            for _ in range(size * size):
                channels = [generator.randint(0, 120) for _ in range(3)]
                channels[label] = generator.randint(130, 255)
                pixels.extend(channels)
            (directory / f"{index}.ppm").write_bytes(f"P6 {size} {size} 255\n".encode() + bytes(pixels))
    return root


def test_a_batchnorm_model_keeps_a_finite_eval_loss_and_averaged_running_statistics(tmp_path: Path) -> None:
    import subprocess

    from bench.cluster import diloco_spec, training_cluster
    from hypha_tensors import weights

    # given: 96 images of 8×8 in slices of 16 (one held out for eval) and a tiny ResNet built from a config
    dataset = tmp_path / "colours"
    subprocess.run(
        [str(BIN_DIR / "hypha-data"), "prepare-images", "--input", str(write_images(tmp_path / "images")),
         "--output", str(dataset), "--size", "8", "--samples-per-slice", "16"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    spec = diloco_spec(
        dataset="colours", trainers=TRAINERS, rounds=ROUNDS, inner_steps=4, batch_size=8, holdout=1,
        round_timeout=60.0,
    )  # fmt: skip
    spec["model"] = {
        "source": {"type": "config", "config": dict(TINY_RESNET)},
        "type": "image-classification",
        "input_names": ["pixel_values", "labels"],
    }
    root = tmp_path / "cluster"
    with training_cluster(
        root=root,
        dataset_dir=dataset,
        workers=TRAINERS + 1,
        mode="services" if services_mode() else "embedded",
        settings={"HYPHA_LEASE_TTL": "10"},
        daemon_env={"HYPHA_KEEP_WORK_DIRS": "1"},
        benchmark=False,
    ) as cluster:
        # when
        job_id = cluster.submit(spec, name="e2e-tiny-resnet")
        job = cluster.follow(job_id, timeout=300)

        # then: completed with a finite eval loss after every round (a NaN model has none, and says why)
        assert job["status"] == "completed", f"{job['status_reason']}\n{cluster.logs()}"
        rounds = job["rounds"]
        assert [round_["number"] for round_ in rounds] == list(range(1, ROUNDS + 1))
        assert all(len(round_["participants"]) == TRAINERS for round_ in rounds), rounds
        evaluations = [(round_["eval_loss"], round_["eval_error"]) for round_ in rounds]
        assert all(loss is not None and math.isfinite(loss) and error == "" for loss, error in evaluations), (
            evaluations
        )
        archive = cluster.download_model(job_id, tmp_path / "model.zip")
        with zipfile.ZipFile(archive) as bundle:
            downloaded = tmp_path / "downloaded.safetensors"
            downloaded.write_bytes(bundle.read("model.safetensors"))

    # and: the final running statistics are the trainers' sample-weighted mean of their local ones
    final = weights.load(downloaded)
    checkpoints = sorted(root.glob("workers/*/hypha-*/checkpoints/round-*"), key=lambda path: path.name)
    assert len(checkpoints) == 2, checkpoints  # rounds ROUNDS − 1 and ROUNDS are kept
    before_last = weights.load(next(checkpoints[0].glob("*weights*.safetensors")))
    last_updates = sorted(root.glob(f"workers/*/hypha-*/updates/{ROUNDS}.safetensors"))
    assert len(last_updates) == TRAINERS, last_updates
    # fixed H and one batch size: every trainer's update weighs the same in the mean
    samples = [metrics["samples"] for metrics in rounds[-1]["trainer_metrics"].values()]
    assert samples == [4 * 8] * TRAINERS, samples
    deltas = [weights.load(path) for path in last_updates]
    buffers = sorted(name for name in final if name.endswith((".running_mean", ".running_var")))
    assert len(buffers) == 12
    for name in buffers:
        mean = before_last[name] + sum(delta[name] for delta in deltas) / TRAINERS
        torch.testing.assert_close(final[name], mean, rtol=0, atol=1e-6, msg=name)
    assert all(bool((final[name] > 0).all()) for name in buffers if name.endswith("running_var"))
    assert {tensor.dtype for tensor in final.values() if tensor.dtype.is_floating_point} == {torch.float32}
