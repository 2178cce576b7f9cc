"""``training.dataloader_workers`` (docs/configuration.md, "Training knobs"): data slices read by torch
DataLoader worker processes (``DataLoader(num_workers=N)``), while every bridge call stays in the trainer's
process.

The bridge client lives in the trainer's process and is not shareable, so the work is split:

* the trainer's process fetches (and thereby acknowledges) each slice, one bridge call per slice, in the
  order the scheduler hands them out — as with 0 workers; this is the sampler of an inner DataLoader, which
  torch always iterates in the main process;
* a worker process reads the fetched file: it decodes the safetensors, deletes the file, runs the job's
  preprocessor (tokeniser…) over the whole slice and checks it (:meth:`SliceStream._next_slice`, the same
  code as with 0 workers); the columns come back through shared memory;
* the inner DataLoader hands the slices back in fetch order (``in_order``), and the trainer's process cuts
  them into batches exactly as :class:`SliceStream` does with 0 workers: the same batches, in the same order,
  so a job trains identically with 0 or N workers.

Workers are forked where the platform can and the slices are first drawn on the main thread (the trainer's case
on Linux; they touch neither CUDA nor the bridge), spawned otherwise (then the preprocessor must pickle:
:func:`worker_daemon.executors.setup.load_preprocessor`'s does): :func:`worker_context`. Up to
N slices are fetched ahead of the one being trained on (``prefetch_factor=1``), so the work dir holds up to
N + 1 slice files instead of 1.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from worker_daemon.executors.bridge_client import FetchedFile
from worker_daemon.executors.data import Preprocess, SliceStream
from worker_daemon.executors.exceptions import DataError

logger = logging.getLogger(__name__)

#: What a worker hands back for one slice: its columns (or ``None``), the error it met (or ``None``), its pid.
SliceRead = tuple[dict[str, torch.Tensor] | None, str | None, int]


class _FetchedSlices(torch.utils.data.Sampler):
    """The slices the bridge hands out, without end: iterated by torch in the trainer's process only."""

    def __init__(
        self, fetch: Callable[[dict[str, Any]], list[FetchedFile]], reference: dict[str, Any]
    ) -> None:
        self.fetch = fetch
        self.reference = reference

    def __iter__(self) -> Iterator[FetchedFile]:
        while True:
            files = self.fetch(self.reference)
            if len(files) != 1:
                raise DataError(f"a data fetch must yield exactly one file, got {[f.path for f in files]}")
            yield files[0]


class _SliceReader(torch.utils.data.Dataset):
    """A fetched slice file → its checked columns; runs in a worker process (no bridge: nothing to fetch)."""

    def __init__(
        self,
        *,
        work_dir: Path,
        input_names: list[str],
        preprocess: Preprocess | None,
        preprocess_inputs: list[str] | None,
    ) -> None:
        self.work_dir = work_dir
        self.input_names = list(input_names)
        self.preprocess = preprocess
        self.preprocess_inputs = list(preprocess_inputs or [])

    def __getitem__(self, file: FetchedFile) -> SliceRead:
        reader = SliceStream(
            fetch=lambda _reference: [file],
            reference={},
            work_dir=self.work_dir,
            input_names=self.input_names,
            preprocess=self.preprocess,
            preprocess_inputs=self.preprocess_inputs,
        )
        try:
            return reader._next_slice(), None, os.getpid()
        except DataError as error:
            # Handed back as it is, not as torch's "Caught DataError in DataLoader worker process" wrapper.
            return None, str(error), os.getpid()

    def __len__(self) -> int:  # pragma: no cover - the sampler is endless; torch never asks
        raise TypeError("the slices of a job have no length")


def _keep(read: SliceRead) -> SliceRead:
    """No collation: a slice comes back as the worker made it."""
    return read


def worker_context() -> str:
    """Fork from the main thread where the platform has it (workers only read files and run the preprocessor:
    no CUDA, no bridge); spawn elsewhere, and from any other thread: a child forked from a thread pool's thread
    fails at its exit (concurrent.futures' exit hook joins that thread, "cannot join current thread", exit
    code 1), which torch reports as a worker that died."""
    if (
        "fork" in multiprocessing.get_all_start_methods()
        and threading.current_thread() is threading.main_thread()
    ):
        return "fork"
    return "spawn"


class WorkerSliceStream(SliceStream):
    """:class:`SliceStream` whose slices are read by ``workers`` DataLoader worker processes."""

    def __init__(self, *, workers: int, **options: Any) -> None:
        super().__init__(**options)
        if workers < 1:
            raise ValueError("WorkerSliceStream needs at least one worker; use SliceStream for 0")
        self.workers = workers
        self.reader_pids: set[int] = set()
        self._reads: Iterator[SliceRead] | None = None

    def slice_loader(self) -> torch.utils.data.DataLoader:
        """The inner DataLoader: one slice per item, read by ``workers`` processes, handed back in order."""
        reader = _SliceReader(
            work_dir=self.work_dir,
            input_names=self.input_names,
            preprocess=self.preprocess,
            preprocess_inputs=self.preprocess_inputs,
        )
        return torch.utils.data.DataLoader(
            reader,
            sampler=_FetchedSlices(self.fetch, self.reference),
            batch_size=None,
            collate_fn=_keep,
            num_workers=self.workers,
            prefetch_factor=1,
            multiprocessing_context=worker_context(),
            # Its own generator: the workers' base seed must not be drawn from torch's global one, which the
            # training (dropout…) goes on drawing from exactly as with 0 workers.
            generator=torch.Generator(),
        )

    def _next_slice(self) -> dict[str, torch.Tensor]:
        if self._reads is None:
            logger.info("data slices are read by %d DataLoader worker processes", self.workers)
            self._reads = iter(self.slice_loader())
        columns, error, pid = next(self._reads)
        self.slices_read += 1
        self.reader_pids.add(pid)
        logger.debug("data slice %d read by worker process %d", self.slices_read, pid)
        if error is not None:
            raise DataError(error)
        assert columns is not None
        return columns
