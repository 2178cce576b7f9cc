"""The bridge backend of a batch inference task (docs/inference.md, "The executor"): a
:class:`~worker_daemon.bridge.remote.RemoteBackend` whose slices and sends follow the inference contract.

* ``scheduler`` fetch: one ``fetch_slice`` claim at a time (asked again after ``retry_in`` while none is
  ready), the slice downloaded and checked as a trainer's is — but **no** ``slice_ack`` and no prefetch: an
  inference slice becomes USED only when its result is stored, and a slice claimed ahead would sit ASSIGNED
  to this task while it works on another. ``slice_assigned`` with ``done`` (every slice of the job is used or
  assigned elsewhere for good, or this task's own with their results on the way) is answered ``[]``, the
  executor's signal to exit — once this task's queued results are stored or given up (then the control plane
  is asked again: a refused result may have given slices back).
* ``send`` of a file whose reference names a data slice (``resource = {dataset, index}``): the bridge has
  answered 200 already; the file is queued and uploaded, one at a time in the order sent, as
  ``PUT {server}/api/jobs/{job}/results/{index}/`` with the task's current transfer token (the one the
  parameter server uses for the job's model upload, refreshed with each lease renewal), its SHA-256
  (``X-Content-SHA256``) and ``X-Result-Format`` (``jsonl`` or ``safetensors``). Connection errors,
  timeouts, 5xx, 408 and 429 are retried with doubling pauses (at most ``retry_cap`` s) for up to
  ``result_deadline`` s; a refused token (401) like that for up to ``auth_grace`` s, then the task is failed;
  any other 4xx (409: the slice is not this task's any more; 413: too large) is final, logged and said in
  the task's log. A send without a data slice is a trainer's update, sent as :class:`RemoteBackend` sends it.
* ``uri`` fetch of a path (``/api/uploads/<id>/content/``: the job's uploaded model) from the control plane,
  with the transfer token, as ``artifacts/upload``; other ``uri`` and ``huggingface`` fetches as for a trainer.
* :meth:`close` waits up to ``drain_timeout`` s for the queued results before giving up on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from worker_daemon import protocol, telemetry
from worker_daemon.bridge.authorisation import UNAUTHORIZED
from worker_daemon.bridge.exceptions import ConnectorError, NetworkError
from worker_daemon.bridge.paths import resolve_in
from worker_daemon.bridge.peer_http import error_detail
from worker_daemon.bridge.references import PeersReference
from worker_daemon.bridge.remote.backend import RemoteBackend
from worker_daemon.bridge.remote.slices import MIN_SLICE_RETRY
from worker_daemon.bridge.server import is_control_plane_path

logger = logging.getLogger(__name__)

#: The executor class whose tasks get an :class:`InferenceBackend` (the daemon's :mod:`worker_daemon.jobs`).
INFERENCE_CLASS = "inference"
#: Statuses of a result upload that are worth asking again (besides 5xx).
RETRYABLE = (408, 429)
HASH_CHUNK = 1 << 20
#: The file an uploaded model (a path on the control plane) is fetched as, in ``artifacts/``.
UPLOAD_NAME = "upload"


@dataclass(frozen=True)
class _Result:
    dataset: str
    index: int
    path: Path


def result_format(path: Path) -> str:
    """``jsonl`` or ``safetensors`` (the ``X-Result-Format``), from the file's suffix, else from its first byte
    (a JSON Lines file starts with ``{``; a safetensors file with its header's length)."""
    if path.suffix in (".jsonl", ".json"):
        return "jsonl"
    if path.suffix == ".safetensors":
        return "safetensors"
    with path.open("rb") as file:
        return "jsonl" if file.read(1) == b"{" else "safetensors"


def file_digest(path: Path) -> tuple[int, str]:
    """(size, SHA-256 hex) of ``path``."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as file:
        while chunk := file.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


class InferenceBackend(RemoteBackend):
    """A :class:`RemoteBackend` for an inference task (see the module docstring). ``result_deadline`` bounds
    the retries of one result upload; ``drain_timeout`` how long :meth:`close` waits for queued ones."""

    def __init__(
        self, *, result_deadline: float = 900.0, drain_timeout: float = 30.0, **options: Any
    ) -> None:
        super().__init__(**options)
        self.result_deadline = result_deadline
        self.drain_timeout = drain_timeout
        self._results: asyncio.Queue[_Result | None] = asyncio.Queue()
        self._uploader: asyncio.Task[None] | None = None
        #: Indices of the results the control plane stored (2xx), and of those given up, in order.
        self.results_stored: list[int] = []
        self.results_failed: list[int] = []
        #: Results queued and not yet stored or given up.
        self.uploads_pending = 0

    # --- slices --------------------------------------------------------------------------------------------

    async def _fetch_slice(self, dataset: str, artifacts_dir: Path) -> list[tuple[str, int]]:
        async with self._slice_lock:
            while True:
                reply = await self._claim_inference(dataset)
                if getattr(reply, "done", False):
                    if self.uploads_pending:
                        # "Done" counts this task's own slices whose results are on their way: the executor
                        # may exit only once they are stored (or given up). Then ask again: a result the
                        # control plane refused may have given slices back.
                        await self._results.join()
                        continue
                    logger.info("task %s: no slice of %s is left for this task", self.task_id, dataset)
                    return []
                if reply.error:
                    raise ConnectorError(f"no slice of {dataset!r}: {reply.error}")
                if reply.index is not None:
                    break
                if reply.retry_in is None:
                    raise ConnectorError(f"no slice of {dataset!r} is left for this task")
                await asyncio.sleep(max(reply.retry_in, MIN_SLICE_RETRY))
            cached = await self._download_claimed(dataset, reply)
            os.replace(cached.path, artifacts_dir / str(cached.index))
            logger.info(
                "task %s: slice %d of %s handed out (%d bytes)",
                self.task_id,
                cached.index,
                dataset,
                cached.size,
            )
            return [(str(cached.index), cached.size)]

    async def _claim_inference(self, dataset: str) -> protocol.SliceAssigned:
        message = protocol.FetchSlice(request_id=uuid.uuid4(), task_id=self.task_id, dataset=dataset)
        try:
            reply = await self.link.request(message, timeout=self.request_timeout)
        except TimeoutError:
            raise NetworkError(
                f"the control plane did not assign a slice within {self.request_timeout:g} s"
            ) from None
        assert isinstance(reply, protocol.SliceAssigned)
        return reply

    # --- the model -----------------------------------------------------------------------------------------

    async def _fetch_uri(self, value: str, artifacts_dir: Path) -> list[tuple[str, int]]:
        """A ``uri`` that is a path (an uploaded model, ``/api/uploads/<id>/content/``) from the control plane,
        with the task's transfer token, into ``artifacts/upload`` (the executor unpacks an archive); any other
        as :class:`RemoteBackend` fetches it."""
        if not is_control_plane_path(value):
            return await super()._fetch_uri(value, artifacts_dir)
        if not self.server_url:
            raise ConnectorError(f"{value} is on the control plane, whose URL this daemon does not know")
        url = self.server_url + value
        target = resolve_in(artifacts_dir, UPLOAD_NAME)
        download = await self._with_retries(
            url, lambda: self._download(url, target, headers=self._auth(), operation="upload download")
        )
        return [(UPLOAD_NAME, download.size)]

    # --- results -------------------------------------------------------------------------------------------

    async def send(self, *, reference: PeersReference, path: Path) -> None:
        if reference.resource is None:
            await super().send(reference=reference, path=path)
            return
        # Queued before any await: sends the bridge started in order are uploaded in that order.
        self._results.put_nowait(_Result(reference.resource.dataset, reference.resource.index, path))
        self.uploads_pending += 1
        if self._uploader is None:
            self._uploader = asyncio.create_task(self._upload_all(), name=f"results-{self.task_id}")

    async def _upload_all(self) -> None:
        while (result := await self._results.get()) is not None:
            try:
                stored = await self._upload(result)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception(
                    "task %s: uploading the result of slice %d failed", self.task_id, result.index
                )
                stored = False
            (self.results_stored if stored else self.results_failed).append(result.index)
            self.uploads_pending -= 1
            self._results.task_done()

    def _give_up(self, result: _Result, why: str) -> bool:
        line = f"the result of slice {result.index} of {result.dataset} was not stored: {why}"
        logger.error("task %s: %s", self.task_id, line)
        self.link.post(protocol.TaskLog(task_id=self.task_id, lines=[line[:1000]]))
        return False

    async def _upload(self, result: _Result) -> bool:
        """Upload one result, patiently (see the module docstring); True once the control plane stored it."""
        if not self.server_url:
            return self._give_up(result, "this daemon knows no control plane URL")
        try:
            size, sha256 = await asyncio.to_thread(file_digest, result.path)
            kind = await asyncio.to_thread(result_format, result.path)
        except OSError as error:
            return self._give_up(result, f"cannot read {result.path.name}: {error}")
        url = f"{self.server_url}/api/jobs/{self.job_id}/results/{result.index}/"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.result_deadline
        pause = self.retry_base
        attempt = 0
        while True:
            attempt += 1
            try:
                status, detail = await self._put_result(url, result, size=size, sha256=sha256, kind=kind)
            except (aiohttp.ClientError, TimeoutError) as error:
                status, detail = None, str(error) or type(error).__name__
            except OSError as error:
                return self._give_up(result, f"cannot read {result.path.name}: {error}")
            if status is not None and 200 <= status < 300:
                self.authorisation.accepted()
                logger.info(
                    "task %s: result of slice %d stored (%d bytes, %s, HTTP %d)",
                    self.task_id,
                    result.index,
                    size,
                    kind,
                    status,
                )
                return True
            problem = f"HTTP {status}: {detail}" if status is not None else detail
            if status == UNAUTHORIZED:
                if self.authorisation.refused(f"result of slice {result.index}: {problem}"):
                    return self._give_up(result, problem)  # the task is being failed with the reason
            elif status is not None and status < 500 and status not in RETRYABLE:
                return self._give_up(result, problem)
            left = deadline - loop.time()
            if left <= 0:
                return self._give_up(result, f"{problem} (after {attempt} attempts)")
            pause = min(pause, left)
            line = f"storing the result of slice {result.index} failed ({problem}); trying again in {pause:.1f} s"
            logger.warning("task %s: %s", self.task_id, line)
            if (
                attempt > self.retries
            ):  # a passing failure is retried quietly; a long one shows on the job page
                self.link.post(protocol.TaskLog(task_id=self.task_id, lines=[line[:1000]]))
            await asyncio.sleep(pause)
            pause = min(pause * 2, self.retry_cap)

    async def _put_result(
        self, url: str, result: _Result, *, size: int, sha256: str, kind: str
    ) -> tuple[int, str]:
        headers = {
            **self._auth(),
            "Content-Type": "application/octet-stream",
            "Content-Length": str(size),
            "X-Content-SHA256": sha256,
            "X-Result-Format": kind,
        }
        with (
            telemetry.span(
                "result upload",
                **{
                    "http.request.method": "PUT",
                    "url.full": url,
                    "hypha.task_id": self.task_id,
                    "hypha.slice": result.index,
                },
            ) as current,
            result.path.open("rb") as body,
        ):
            async with self._http().put(url, data=body, headers=headers, timeout=self._timeout()) as response:
                telemetry.annotate(current, **{"http.response.status_code": response.status})
                detail = await error_detail(response) if response.status >= 300 else ""
                return response.status, detail

    async def close(self) -> None:
        """Wait up to ``drain_timeout`` s for the queued results, then close as :class:`RemoteBackend` does."""
        uploader, self._uploader = self._uploader, None
        if uploader is not None:
            self._results.put_nowait(None)
            try:
                await asyncio.wait_for(asyncio.shield(uploader), self.drain_timeout)
            except TimeoutError:
                # The queue holds the end marker and no longer the result in flight: one each.
                logger.error(
                    "task %s: %d result(s) not stored within %g s of the task's end",
                    self.task_id,
                    self._results.qsize(),
                    self.drain_timeout,
                )
                uploader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await uploader
        await super().close()
