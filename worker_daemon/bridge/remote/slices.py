"""Data slices of one task's bridge: claimed from the control plane (``fetch_slice``), downloaded from the data
nodes (size and SHA-256 checked, patiently while none answers), handed out in claim order and prefetched. A
mixin of :class:`~worker_daemon.bridge.remote.RemoteBackend`.

The prefetch (``prefetch`` places) is topped up once at most one prefetched slice is left (with the default
2 places: after every hand-out, one slice), claiming a slice per free place at once; a place whose claim is
told "none yet" (an epoch's end) is given up, never asked again behind the queue's back. The small slices of
such a group that one data node serves are then downloaded in one batch request
(:mod:`~worker_daemon.bridge.remote.batched`); the others, and any slice of a batch that fails, one at a time
as before, trying every node and waiting for them.
"""

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
from worker_daemon.bridge.remote.batched import BATCH_MAX_SLICES, SliceBatches
from worker_daemon.bridge.remote.problems import TransferProblemReports, peer_host
from worker_daemon.link import ControlLink

logger = logging.getLogger(__name__)

PREFETCH_DIR = ".prefetch"
#: Shortest wait before asking for a slice again, whatever ``retry_in`` says.
MIN_SLICE_RETRY = 0.05


class _NoSliceYet(BridgeError):
    """A prefetch place whose claim was told "none yet": it gives its place up instead of asking again."""


class SliceFetching(TransferProblemReports, SliceBatches):
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
                except _NoSliceYet:
                    logger.debug("task %s: a prefetch place of %s got no slice yet", self.task_id, dataset)
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
            # Topped up once at most one prefetched slice is left: that one (downloaded by then, unless the
            # data is late anyway) goes to the executor while the top-up downloads, as with two places and
            # one top-up per hand-out; more places make the top-ups, and batches, larger.
            free = self.prefetch - len(queue)
            if free > 0 and len(queue) <= 1 and not self._closed:
                queue.extend(self._prefetch_group(dataset, free))
            return [(str(cached.index), cached.size)]

    def _prefetch_group(self, dataset: str, count: int) -> list[asyncio.Task[CachedSlice]]:
        """``count`` places of the prefetch, claimed together and, where they can be, downloaded in one batch:
        one task per place, in claim order. Cancelling one (only :meth:`close` does) cancels the group."""
        group = asyncio.create_task(self._claim_group(dataset, count))
        return [asyncio.create_task(self._group_place(dataset, group, place)) for place in range(count)]

    async def _claim_group(
        self, dataset: str, count: int
    ) -> list[CachedSlice | protocol.SliceAssigned | BaseException]:
        """Claim ``count`` slices at once (one ``fetch_slice`` each), then download in one batch per data node
        those that can be: per place, the downloaded slice, or the claim to download alone (a large slice, a
        node without batches, a batch that failed, or "none yet" with its ``retry_in``), or the claim's
        error."""
        outcomes: list[CachedSlice | protocol.SliceAssigned | BaseException] = list(
            await asyncio.gather(*(self._claim_once(dataset) for _ in range(count)), return_exceptions=True)
        )
        # The claims race: the control plane may answer "none yet" to the first because the second was already
        # given a slice (a trainer holding an unacknowledged slice is told to wait). Places are handed out in
        # order, so slices go first: a place that waits must never stand before a slice this trainer holds —
        # its wait would last until that slice is acknowledged, which it blocks (a stall at an epoch's end).
        outcomes.sort(
            key=lambda outcome: (
                not (isinstance(outcome, protocol.SliceAssigned) and outcome.index is not None)
            )
        )
        batches: dict[str, list[tuple[int, protocol.SliceAssigned, str]]] = {}
        for place, outcome in enumerate(outcomes):
            if isinstance(outcome, protocol.SliceAssigned) and outcome.index is not None:
                target = self._batch_target(outcome)
                if target is not None:
                    batches.setdefault(target.url, []).append((place, outcome, target.token))
        if batches:
            try:
                cache = self._prefetch_cache()
            except OSError:
                batches = {}  # each place meets the error alone, and says so
        for url, members in batches.items():
            for start in range(0, len(members), BATCH_MAX_SLICES):
                chunk = members[start : start + BATCH_MAX_SLICES]
                if len(chunk) < 2:
                    continue  # one slice: its GET, which waits for the nodes if need be
                try:
                    cached = await self._download_batch(
                        dataset, url, [(assigned, token) for _, assigned, token in chunk], cache
                    )
                except (HttpStatusError, IntegrityError, aiohttp.ClientError, TimeoutError, OSError) as error:
                    # Each slice goes its own way now: every node in turn, waiting while none answers.
                    problem = f"answered {error.status}" if isinstance(error, HttpStatusError) else str(error)
                    logger.info(
                        "task %s: a batch of %d slices of %s failed (%s); downloading them one by one",
                        self.task_id,
                        len(chunk),
                        dataset,
                        problem or type(error).__name__,
                    )
                    continue
                logger.info(
                    "task %s: slices %s of %s prefetched in one batch",
                    self.task_id,
                    ", ".join(str(assigned.index) for _, assigned, _ in chunk),
                    dataset,
                )
                self.report_transfer_ok(
                    *(peer_host(node) for _, assigned, _ in chunk for node in assigned.urls)
                )
                for (place, _, _), item in zip(chunk, cached, strict=True):
                    outcomes[place] = item
        return outcomes

    async def _group_place(
        self,
        dataset: str,
        group: asyncio.Task[list[CachedSlice | protocol.SliceAssigned | BaseException]],
        place: int,
    ) -> CachedSlice:
        outcome = (await group)[place]
        if isinstance(outcome, CachedSlice):
            return outcome
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome.index is None:
            # None yet (an epoch's end, while this trainer held a slice it had not acknowledged): the place is
            # given up, not asked again. Asking again would be told to wait for as long as this trainer holds a
            # slice — and a later top-up's slice, behind this place in the queue, is held until this place is
            # handed out: the trainer would starve. The next hand-out tops the prefetch up again; with nothing
            # prefetched, the executor's request claims (and waits) itself, holding nothing.
            raise _NoSliceYet(f"no slice of {dataset!r} yet")
        return await self._download_claimed(dataset, outcome)

    def _prefetch_cache(self) -> Path:
        cache = self.work_dir / PREFETCH_DIR
        cache.mkdir(mode=0o700, exist_ok=True)
        return cache

    async def _claim_and_download(self, dataset: str) -> CachedSlice:
        return await self._download_claimed(dataset, await self._claim(dataset))

    async def _download_claimed(self, dataset: str, assigned: protocol.SliceAssigned) -> CachedSlice:
        """The claimed slice from its data nodes, each in turn, waiting (up to ``data_wait``) while none
        answers."""
        assert assigned.index is not None
        target = self._prefetch_cache() / str(assigned.index)
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
        """A claimed slice, asking again after each "none yet"."""
        while True:
            reply = await self._claim_once(dataset)
            if reply.index is not None:
                return reply
            await asyncio.sleep(max(reply.retry_in or 0.0, MIN_SLICE_RETRY))

    async def _claim_once(self, dataset: str) -> protocol.SliceAssigned:
        """One ``fetch_slice``: a claimed slice, or "none yet" (``index`` None, with ``retry_in``)."""
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
        if reply.index is None and reply.retry_in is None:
            raise ConnectorError(f"no slice of {dataset!r} is left for this task")
        return reply
