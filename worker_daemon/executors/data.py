"""Training data: samples from the data slices the bridge fetches, one slice at a time, without end.

A slice (hypha-protocols.md §5) is a safetensors file of equally long tensors (``input_ids [N, T]``,
``labels [N, T]``, ``images [N, C, H, W]``…). Each fetch of the job's ``data`` reference yields the next slice
the scheduler assigns (``artifacts/<index>``); the stream is endless because the scheduler starts a new
epoch when every slice was used. Batches are made by a ``torch.utils.data.DataLoader`` and may span slices.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from worker_daemon.executors.bridge_client import FetchedFile
from worker_daemon.executors.exceptions import DataError

logger = logging.getLogger(__name__)

Sample = dict[str, torch.Tensor]
Preprocess = Callable[[dict[str, torch.Tensor]], Mapping[str, Any]]

MAX_EMPTY_SLICES = 100
"""Consecutive slices without a sample before giving up: a data reference that only yields empty files
would otherwise spin forever."""


class SliceStream(torch.utils.data.IterableDataset):
    """Endless samples ``{name: tensor}`` for the ``input_names``, fetched slice by slice.

    * ``fetch(reference)`` is the bridge call; it must return exactly one file per slice.
    * ``preprocess``, when given, gets each whole slice (name → tensor) and returns the tensors to merge
      into it (e.g. a tokenizer's or image processor's outputs), replacing the inputs it consumed.
    * A slice file is read fully into memory and deleted, so the work dir holds at most the slice being read.
    * Raises :class:`DataError` for a reply without exactly one file, an unreadable file, a missing input
      name, or tensors of different lengths along dimension 0.

    Runs in the main process only (``num_workers=0``): the bridge client is not shareable across processes.
    """

    def __init__(
        self,
        *,
        fetch: Callable[[dict[str, Any]], list[FetchedFile]],
        reference: dict[str, Any],
        work_dir: Path,
        input_names: list[str],
        preprocess: Preprocess | None = None,
        preprocess_inputs: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.fetch = fetch
        self.reference = reference
        self.work_dir = work_dir
        self.input_names = list(input_names)
        self.preprocess = preprocess
        self.preprocess_inputs = list(preprocess_inputs or [])
        self.slices_read = 0

    def __iter__(self) -> Iterator[Sample]:
        empty_in_a_row = 0
        while True:
            columns = self._next_slice()
            length = len(next(iter(columns.values())))
            if length == 0:
                empty_in_a_row += 1
                if empty_in_a_row >= MAX_EMPTY_SLICES:
                    raise DataError(f"the last {MAX_EMPTY_SLICES} data slices were all empty")
                continue
            empty_in_a_row = 0
            for index in range(length):
                yield {name: columns[name][index] for name in self.input_names}

    def _next_slice(self) -> dict[str, torch.Tensor]:
        files = self.fetch(self.reference)
        if len(files) != 1:
            raise DataError(f"a data fetch must yield exactly one file, got {[f.path for f in files]}")
        path = self.work_dir / files[0].path
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as error:
            raise DataError(f"data slice {files[0].path} is not readable safetensors: {error}") from error
        path.unlink(missing_ok=True)
        self.slices_read += 1
        if self.preprocess is not None:
            consumed = {name: tensors.pop(name) for name in self.preprocess_inputs if name in tensors}
            outputs = self.preprocess(consumed)
            tensors.update({name: torch.as_tensor(value) for name, value in outputs.items()})
        missing = [name for name in self.input_names if name not in tensors]
        if missing:
            raise DataError(
                f"data slice {files[0].path} has no tensor {missing[0]!r} (it has {sorted(tensors)})"
            )
        columns = {name: tensors[name] for name in self.input_names}
        lengths = {name: (tensor.shape[0] if tensor.dim() > 0 else -1) for name, tensor in columns.items()}
        if len(set(lengths.values())) != 1 or -1 in lengths.values():
            raise DataError(f"data slice {files[0].path} has tensors of different lengths: {lengths}")
        logger.debug("data slice %s: %d samples", files[0].path, next(iter(lengths.values())))
        return columns
