"""The eval loss of the global model after each round.

Eval slices (``eval.slices`` of the job: index, size, SHA-256, data-node URLs, each with its download token
in the query, which no message here repeats) are downloaded once, checked against their size and digest,
cached under ``work_dir/eval/`` and loaded into memory; they are safetensors
dicts of equally long tensors, like training slices (reference §5). The loss is the mean of the model's own
``loss`` output over batches of ``eval.batch_size`` samples of the ``input-names`` tensors, each batch weighted
by its number of samples, computed on the CPU under ``torch.no_grad``. The server runs :meth:`Evaluator.loss`
in a thread so that the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import torch

from hypha_tensors import weights as weights_io
from hypha_tensors.exceptions import TensorError
from parameter_server.exceptions import EvalDataError, EvalNotFinite
from parameter_server.job import EvalConfig, EvalSlice

logger = logging.getLogger("parameter_server")

DOWNLOAD_TIMEOUT = aiohttp.ClientTimeout(total=600, connect=10, sock_read=60)


def _without_query(url: str) -> str:
    """``url`` for a message: without its query (a slice URL's holds its download token)."""
    return urllib.parse.urlsplit(url)._replace(query="", fragment="").geturl()


async def _download(session: aiohttp.ClientSession, item: EvalSlice, target: Path) -> None:
    errors = []
    for url in item.urls:
        where = _without_query(url)
        digest = hashlib.sha256()
        size = 0
        partial = target.with_name(target.name + ".partial")
        try:
            async with session.get(url, timeout=DOWNLOAD_TIMEOUT) as response:
                if response.status != 200:
                    # 401: the token expired (a parameter server the control plane replaces gets new ones)
                    errors.append(f"{where}: HTTP {response.status}")
                    continue
                with open(partial, "wb") as file:
                    async for chunk in response.content.iter_chunked(1 << 20):
                        size += len(chunk)
                        if size > item.size:
                            break
                        digest.update(chunk)
                        file.write(chunk)
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            errors.append(f"{where}: {str(error).replace(url, where) or type(error).__name__}")
            partial.unlink(missing_ok=True)
            continue
        if size != item.size or digest.hexdigest() != item.sha256:
            errors.append(f"{where}: size or SHA-256 does not match slice {item.index}")
            partial.unlink(missing_ok=True)
            continue
        partial.replace(target)
        return
    raise EvalDataError(f"eval slice {item.index} cannot be downloaded: {'; '.join(errors)}")


def _file_matches(path: Path, item: EvalSlice) -> bool:
    if not path.is_file() or path.stat().st_size != item.size:
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest() == item.sha256


class Evaluator:
    """Eval loss of a model on the job's eval slices (see the module docstring)."""

    def __init__(self, *, config: EvalConfig, input_names: tuple[str, ...], cache_dir: Path) -> None:
        self.config = config
        self.input_names = input_names
        self.cache_dir = cache_dir
        self._data: dict[str, torch.Tensor] | None = None

    async def prepare(self, session: aiohttp.ClientSession) -> None:
        """Download (or find in the cache) every slice and load the inputs; ``EvalDataError`` on failure.
        Idempotent: once loaded, it does nothing."""
        if self._data is not None:
            return
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for item in self.config.slices:
            path = self.cache_dir / str(item.index)
            if not await asyncio.to_thread(_file_matches, path, item):
                await _download(session, item, path)
            paths.append(path)
        self._data = await asyncio.to_thread(self._load, paths)

    def _load(self, paths: list[Path]) -> dict[str, torch.Tensor]:
        parts: dict[str, list[torch.Tensor]] = {}
        for path in paths:
            try:
                tensors = weights_io.load(path)
            except TensorError as error:
                raise EvalDataError(f"eval slice {path.name} is not usable safetensors: {error}") from error
            names = self.input_names or tuple(sorted(tensors))
            missing = [name for name in names if name not in tensors]
            if missing:
                raise EvalDataError(f"eval slice {path.name} has no tensor {missing[0]!r}")
            lengths = {tensors[name].shape[0] if tensors[name].dim() else 0 for name in names}
            if len(lengths) != 1:
                raise EvalDataError(f"eval slice {path.name}: the input tensors differ in length")
            for name in names:
                parts.setdefault(name, []).append(tensors[name])
        return {name: torch.cat(chunks) for name, chunks in parts.items()}

    def loss(self, model: Any, weights: Mapping[str, torch.Tensor]) -> float | None:
        """Load ``weights`` into ``model`` and return its mean loss on the eval data (None if the model gives
        no loss, e.g. no labels among the inputs); ``EvalNotFinite`` if the loss is NaN or Inf (a broken
        model must be said to be broken, not shown as "no eval loss"). Call :meth:`prepare` first.
        Blocking: run it in a thread, and never two at once on the same model."""
        if self._data is None:
            raise EvalDataError("the eval data is not loaded")
        # strict=False: tied weights are given once (lm_head comes with wte). Unexpected names would mean the
        # saved names differ from the module's, and a silently unchanged model would give a wrong loss.
        outcome = model.load_state_dict(dict(weights), strict=False)
        if outcome.unexpected_keys:
            raise EvalDataError(f"the global weights do not fit the model: {outcome.unexpected_keys[:3]}")
        model.eval()
        total = 0.0
        count = 0
        length = next(iter(self._data.values())).shape[0]
        with torch.no_grad():
            for start in range(0, length, self.config.batch_size):
                batch = {
                    name: tensor[start : start + self.config.batch_size]
                    for name, tensor in self._data.items()
                }
                output = model(**batch)
                loss = getattr(output, "loss", None)
                if loss is None and isinstance(output, Mapping):
                    loss = output.get("loss")
                if loss is None and isinstance(output, torch.Tensor):
                    loss = output
                if loss is None:
                    return None
                samples = next(iter(batch.values())).shape[0]
                total += float(loss.float().mean()) * samples
                count += samples
        if count == 0:
            return None
        value = total / count
        if not math.isfinite(value):
            raise EvalNotFinite(f"the global model's eval loss is {value} (its outputs are not finite)")
        return value
