"""``training.dataloader_workers`` (docs/configuration.md, "Training knobs"): DataLoader worker processes read
the data slices, every bridge call stays in the trainer's process, and the batches — so the training — are the
same as with 0 workers (worker_daemon/executors/slice_workers.py)."""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from worker_daemon.executors.bridge_client import FetchedFile
from worker_daemon.executors.data import SliceStream
from worker_daemon.executors.exceptions import DataError
from worker_daemon.executors.slice_workers import WorkerSliceStream, worker_context

from .conftest import (
    ScriptedTrainerBackend,
    TinyModel,
    make_slice,
    make_update,
    running_bridge,
    update_bytes,
)
from .test_knobs_training import knobbed_job, run_in_process
from .test_training import STEPS_PER_ROUND, kind


class SliceFiles:
    """A data reference's fetch as the bridge client does it: each call writes the next slice into
    ``artifacts/`` and names it; records which process called."""

    def __init__(self, work_dir: Path, slices: list[dict[str, torch.Tensor]] | None = None) -> None:
        self.work_dir = work_dir
        (work_dir / "artifacts").mkdir(exist_ok=True)
        self.slices = slices
        self.callers: list[int] = []

    def __call__(self, reference: dict[str, Any]) -> list[FetchedFile]:
        index = len(self.callers)
        self.callers.append(os.getpid())
        tensors = make_slice(index) if self.slices is None else self.slices[index % len(self.slices)]
        path = self.work_dir / "artifacts" / str(index)
        save_file(tensors, str(path))
        return [FetchedFile(path=f"artifacts/{index}", size=path.stat().st_size)]


def tag_with_pid(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A preprocessor that says which process ran it: a ``pid`` column."""
    length = tensors["input_ids"].shape[0]
    return {"input_ids": tensors["input_ids"], "pid": torch.full((length,), os.getpid())}


def loader(stream: SliceStream, batch_size: int = 4) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(stream, batch_size=batch_size, num_workers=0)


def stream(work_dir: Path, fetch: SliceFiles, workers: int, **options: Any) -> SliceStream:
    options = {"input_names": ["input_ids", "labels"], **options}
    common = dict(fetch=fetch, reference={"type": "scheduler"}, work_dir=work_dir, **options)
    return WorkerSliceStream(workers=workers, **common) if workers else SliceStream(**common)


def test_workers_give_the_batches_of_no_workers_in_the_same_order(tmp_path: Path) -> None:
    torch.manual_seed(7)
    plain = iter(loader(stream(tmp_path / "a", SliceFiles(_dir(tmp_path / "a")), 0)))
    expected = [next(plain) for _ in range(9)]
    random_after_plain = torch.rand(4)
    torch.manual_seed(7)
    fetch = SliceFiles(_dir(tmp_path / "b"))
    with_workers = stream(tmp_path / "b", fetch, 2)
    batches = iter(loader(with_workers))
    got = [next(batches) for _ in range(9)]

    # torch's global generator (dropout…) is where it would be without workers
    assert torch.equal(torch.rand(4), random_after_plain)

    for want, have in zip(expected, got, strict=True):
        assert want.keys() == have.keys()
        for name in want:
            assert torch.equal(want[name], have[name])
    # every bridge call in this process; the slices read by the 2 workers, not here
    assert set(fetch.callers) == {os.getpid()}
    assert len(with_workers.reader_pids) == 2
    assert os.getpid() not in with_workers.reader_pids
    # at most 2 slices fetched ahead of the 8 the 9 batches of 4 (+1 looked ahead) used
    assert with_workers.slices_read <= len(fetch.callers) <= with_workers.slices_read + 2
    # read slices are deleted (by the workers): only those fetched ahead are left
    assert len(list((tmp_path / "b" / "artifacts").iterdir())) <= 2


def test_the_preprocessor_runs_in_the_worker_processes(tmp_path: Path) -> None:
    fetch = SliceFiles(_dir(tmp_path))
    with_workers = stream(
        tmp_path,
        fetch,
        2,
        input_names=["input_ids", "pid"],
        preprocess=tag_with_pid,
        preprocess_inputs=["input_ids"],
    )
    batches = iter(loader(with_workers, batch_size=5))  # one slice a batch
    pids = {int(next(batches)["pid"][0]) for _ in range(4)}

    assert worker_context() == "fork"  # from the main thread (the executor test's trainer thread: spawn)
    assert pids == with_workers.reader_pids
    assert len(pids) == 2 and os.getpid() not in pids
    assert set(fetch.callers) == {os.getpid()}


def test_a_bad_slice_read_by_a_worker_is_the_data_error_of_no_workers(tmp_path: Path) -> None:
    bad = [{"input_ids": torch.zeros(3, 4, dtype=torch.int64)}]  # no labels
    messages = []
    for workers in (0, 2):
        directory = _dir(tmp_path / str(workers))
        with pytest.raises(DataError) as caught:
            next(iter(loader(stream(directory, SliceFiles(directory, bad), workers))))
        messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert messages[1].startswith("data slice artifacts/0 has no tensor 'labels'")


def _dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


# --- through the real executor path (training_function against our real bridge) --------------------------


async def run_round_one(tiny_model: TinyModel, short_dir: Path, workers: int) -> ScriptedTrainerBackend:
    backend = ScriptedTrainerBackend(
        model_dir=tiny_model.directory,
        updates=[update_bytes(make_update(tiny_model.state, seed=1))],
        rounds=1,
    )
    job = knobbed_job(dataloader_workers=workers, max_grad_norm=0.05)
    await run_in_process(short_dir, backend, copy.deepcopy(job))
    return backend


async def test_a_job_trains_the_same_with_0_or_2_dataloader_workers(
    tiny_model: TinyModel, short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from accelerate.state import AcceleratorState, GradientState

    without = await run_round_one(tiny_model, short_dir, 0)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    with caplog.at_level(logging.DEBUG, logger="worker_daemon.executors.slice_workers"):
        with_workers = await run_round_one(tiny_model, short_dir, 2)

    def losses(backend: ScriptedTrainerBackend) -> list[float]:
        return [progress["status"]["loss"] for progress in backend.progress if kind(progress) == "status"]

    assert len(losses(without)) >= STEPS_PER_ROUND
    assert losses(with_workers) == losses(without)  # exactly: the same batches, the same steps
    assert len(with_workers.sent) == len(without.sent) == 1
    served, reference = len(with_workers.slices_served), len(without.slices_served)
    assert reference <= served <= reference + 2  # the 2 workers' read-ahead at most
    sent, reference = with_workers.sent[0].tensors, without.sent[0].tensors
    assert sent.keys() == reference.keys()
    for name in reference:
        assert torch.equal(sent[name], reference[name]), name
    # the knob took effect: the slices were read by 2 other processes
    assert "data slices are read by 2 DataLoader worker processes" in caplog.messages
    readers = {int(m.rsplit(" ", 1)[1]) for m in caplog.messages if " read by worker process " in m}
    assert len(readers) == 2 and os.getpid() not in readers


async def test_rank_0_of_a_trainer_of_two_processes_reads_through_dataloader_workers(
    tiny_model: TinyModel, short_dir: Path, tmp_path: Path
) -> None:
    """Rank 0 draws the batches on its bridge thread (spawned workers there); the ranks' losses are the one
    process's (float tolerance: two half-batch gradients averaged, as in test_processes.py)."""
    from .test_processes import run_trainer, several

    one_process = await run_round_one(tiny_model, short_dir, 0)
    backend = ScriptedTrainerBackend(
        model_dir=tiny_model.directory,
        updates=[update_bytes(make_update(tiny_model.state, seed=1))],
        rounds=1,
    )
    job = several(knobbed_job(), processes=2, dataloader_workers=2, max_grad_norm=0.05)
    work_dir = _dir(tmp_path / "two")
    async with running_bridge(work_dir, backend):
        code, output = await run_trainer(work_dir, job)

    assert code == 0, output
    assert "data slices are read by 2 DataLoader worker processes" in output
    losses = [p["status"]["loss"] for p in backend.progress if kind(p) == "status"]
    expected = [p["status"]["loss"] for p in one_process.progress if kind(p) == "status"]
    assert losses == pytest.approx(expected, rel=1e-5)
    # the same slices, and at most the 2 workers' read-ahead more of them fetched
    served, reference = len(backend.slices_served), len(one_process.slices_served)
    assert reference <= served <= reference + 2
