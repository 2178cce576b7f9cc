"""Data slices of one task's bridge: claimed from the control plane (``fetch_slice``), downloaded from the data
nodes (size and SHA-256 checked, patiently while none answers), handed out in claim order and prefetched. A
mixin of :class:`~worker_daemon.bridge.remote.RemoteBackend`."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections import deque
from pathlib import Path

import aiohttp

from worker_daemon import protocol
from worker_daemon.bridge.exceptions import BridgeError, ConnectorError, NetworkError
from worker_daemon.bridge.peer_http import CachedSlice, HttpStatusError, IntegrityError, without_query
from worker_daemon.bridge.remote.downloads import Downloads
from worker_daemon.bridge.remote.problems import TransferProblemReports, peer_host
from worker_daemon.link import ControlLink

logger = logging.getLogger(__name__)

PREFETCH_DIR = ".prefetch"
#: Shortest wait before asking for a slice again, whatever ``retry_in`` says.
MIN_SLICE_RETRY = 0.05


class SliceFetching(TransferProblemReports, Downloads):
    """``scheduler`` fetches (the attributes are :class:`RemoteBackend`'s)."""

    link: ControlLink
    work_dir: Path
    request_timeout: float
    prefetch: int
    data_wait: float
    _slice_lock: asyncio.Lock
    _prefetched: dict[str, deque[asyncio.Task[CachedSlice]]]
    _closed: bool

    async def _fetch_slice(self, dataset: str, artifacts_dir: Path) -> list[tuple[str, int]]:
        # One hand-out at a time, so that slices reach the executor in the order they were claimed.
        async with self._slice_lock:
            queue = self._prefetched.setdefault(dataset, deque())
            cached: CachedSlice | None = None
            while queue and cached is None:
                task = queue[0]
                try:
                    # shield: an executor that hangs up must not cancel a download another fetch will use.
                    cached = await asyncio.shield(task)
                except asyncio.CancelledError:
                    if task.cancelled():
                        queue.popleft()
                        continue
                    raise
                except (BridgeError, OSError) as error:
                    logger.info("task %s: prefetching a slice of %s failed: %s", self.task_id, dataset, error)
                queue.popleft()
            if cached is None:
                cached = await self._claim_and_download(dataset)
            target = artifacts_dir / str(cached.index)
            os.replace(cached.path, target)
            self.link.post(protocol.SliceAck(task_id=self.task_id, index=cached.index))
            logger.info(
                "task %s: slice %d of %s handed out (%d bytes)",
                self.task_id,
                cached.index,
                dataset,
                cached.size,
            )
            while len(queue) < self.prefetch and not self._closed:
                queue.append(asyncio.create_task(self._claim_and_download(dataset)))
            return [(str(cached.index), cached.size)]

    async def _claim_and_download(self, dataset: str) -> CachedSlice:
        assigned = await self._claim(dataset)
        cache = self.work_dir / PREFETCH_DIR
        cache.mkdir(mode=0o700, exist_ok=True)
        target = cache / str(assigned.index)
        deadline = asyncio.get_running_loop().time() + self.data_wait
        pause = self.retry_base
        passes = 0
        first_failed = None
        while True:
            failures = []
            unreached: list[tuple[str, str]] = []  # (URL without query, why) of the nodes that did not answer
            unreachable = True  # every node was down or failing (worth waiting for), none answered wrongly
            for url in assigned.urls:  # every data node serving the dataset, in turn
                try:
                    download = await self._download(
                        url,
                        target,
                        expected_size=assigned.size,
                        sha256=assigned.sha256,
                        operation="slice download",
                        trace_attributes={"hypha.dataset": dataset, "hypha.slice": assigned.index},
                    )
                except (HttpStatusError, IntegrityError, aiohttp.ClientError, TimeoutError) as error:
                    unreachable &= not isinstance(error, IntegrityError) and not (
                        isinstance(error, HttpStatusError) and error.status < 500
                    )
                    # Never the URL's query in a log or the task's output: it holds the download token.
                    where = without_query(url)
                    if isinstance(error, HttpStatusError):
                        problem = (
                            f"answered {error.status}: {error.detail}"
                            if error.detail
                            else f"answered {error.status}"
                        )
                    else:
                        problem = (str(error) or type(error).__name__).replace(url, where)
                    failures.append(f"{where}: {problem}")
                    if unreachable:
                        unreached.append((where, problem))
                    logger.warning("task %s: slice %d failed: %s", self.task_id, assigned.index, failures[-1])
                    continue
                # The data is flowing again: no node of this slice blocks the task any more.
                self.report_transfer_ok(*(peer_host(node) for node in assigned.urls))
                return CachedSlice(dataset=dataset, index=assigned.index, size=download.size, path=target)
            detail = "; ".join(failures) if failures else "no URL to download it from"
            left = deadline - asyncio.get_running_loop().time()
            if assigned.urls and unreachable:
                # Every node is down or failing: say which and why (again at each pass while waiting).
                passes += 1
                first_failed = first_failed or self.problem_clock()
                for where, problem in unreached:
                    self.report_transfer_problem(
                        peer=peer_host(where),
                        role="data_node",
                        url=where,
                        operation=f"slice download ({dataset})",
                        cause=problem,
                        attempts=passes,
                        since=first_failed,
                    )
            if not assigned.urls or not unreachable or left <= 0:
                raise ConnectorError(
                    f"slice {assigned.index} of {dataset!r} could not be downloaded: {detail}"
                )
            # No data node answers: wait for one (it may be restarting), and say so on the job's page.
            pause = min(pause * 2, self.retry_cap, left)
            line = f"waiting for data: slice {assigned.index} of {dataset} ({detail}); trying again in {pause:.0f} s"
            logger.warning("task %s: %s", self.task_id, line)
            self.link.post(protocol.TaskLog(task_id=self.task_id, lines=[line[:1000]]))
            await asyncio.sleep(pause)

    async def _claim(self, dataset: str) -> protocol.SliceAssigned:
        while True:
            message = protocol.FetchSlice(request_id=uuid.uuid4(), task_id=self.task_id, dataset=dataset)
            try:
                reply = await self.link.request(message, timeout=self.request_timeout)
            except TimeoutError:
                raise NetworkError(
                    f"the control plane did not assign a slice within {self.request_timeout:g} s"
                ) from None
            assert isinstance(reply, protocol.SliceAssigned)
            if reply.error:
                raise ConnectorError(f"no slice of {dataset!r}: {reply.error}")
            if reply.index is not None:
                return reply
            if reply.retry_in is None:
                raise ConnectorError(f"no slice of {dataset!r} is left for this task")
            await asyncio.sleep(max(reply.retry_in, MIN_SLICE_RETRY))
