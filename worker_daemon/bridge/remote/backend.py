"""The task's bridge backend: status, fetch, send and receive (see :mod:`worker_daemon.bridge.remote`), on
top of :class:`~worker_daemon.bridge.remote.slices.SliceFetching` and
:class:`~worker_daemon.bridge.remote.downloads.Downloads`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import urllib.parse
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from worker_daemon import protocol, telemetry
from worker_daemon.bridge.authorisation import DEFAULT_GRACE, UNAUTHORIZED, AuthorisationWatch
from worker_daemon.bridge.backend import ProgressValue
from worker_daemon.bridge.exceptions import ConnectorError, NetworkError
from worker_daemon.bridge.paths import resolve_in
from worker_daemon.bridge.peer_http import (
    CachedSlice,
    HttpStatusError,
    IntegrityError,
    error_detail,
    without_query,
)
from worker_daemon.bridge.references import (
    FetchReference,
    HuggingFaceReference,
    ParameterServerReference,
    PeersReference,
    SchedulerReference,
    UriReference,
)
from worker_daemon.bridge.remote.relayed import RelayTransfers, SwitchedToRelay
from worker_daemon.bridge.remote.slices import SliceFetching
from worker_daemon.bridge.remote.step_summary import StepSummary
from worker_daemon.link import ControlLink

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Where the last update sent waits for its round's result (``work_dir``-relative).
SENT_DIR = ".sent"


def result_name(peer: str, round_number: int) -> str:
    """The file round ``round_number``'s result from ``peer`` is saved as, in the executor's directory. Hypha's
    ``from_peer`` is the file name up to its first ``.``: still the peer."""
    return f"{peer}.round-{round_number}"


@dataclass
class _InFlight:
    """The last update sent, until its round's result arrives."""

    round_number: int
    peer: str
    path: Path
    samples: int
    base: str
    #: The peers' addresses as they were told when it went out (:attr:`RemoteBackend.peers_told`).
    told: int


class RemoteBackend(SliceFetching, RelayTransfers):
    """The bridge backend of one task (``task_id`` of job ``job_id``), working in ``work_dir``.

    ``peers`` maps peer ids to base URLs (``dispatch_job.peers``); ``transfer_token`` is sent as
    ``Authorization: Bearer …`` to them. Peers in ``relay_peers`` (``dispatch_job.relay``) accept no inbound
    connections: they are reached through the relay of the control plane at ``server_url`` instead. Timeouts are seconds: ``request_timeout`` bounds each control-plane
    request (a reply that does not come is a ``network_error``), ``connect_timeout``/``read_timeout`` every HTTP
    call (``read_timeout`` is per read, so large files are fine); ``result_wait`` is the long-poll ``wait``.
    Failed HTTP calls are retried ``retries`` times, after ``retry_base``·2^attempt seconds (at most
    ``retry_cap``). A transfer token the parameter server refuses (401) is retried like a lost connection
    (a fresh token comes with each lease renewal) for up to ``auth_grace`` seconds without a break; then
    ``on_authorisation_lost(reason)`` is called (the daemon fails the task with the reason) and the call
    fails. Call :meth:`close` when the task ends.
    """

    def __init__(
        self,
        *,
        task_id: uuid.UUID,
        job_id: str,
        link: ControlLink,
        work_dir: Path,
        peers: Mapping[str, str] | None = None,
        relay_peers: list[str] | None = None,
        server_url: str | None = None,
        transfer_token: str | None = None,
        request_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        result_wait: float = 30.0,
        prefetch: int = 2,
        retries: int = 3,
        retry_base: float = 0.5,
        retry_cap: float = 10.0,
        peer_wait: float = 900.0,
        data_wait: float = 900.0,
        auth_grace: float = DEFAULT_GRACE,
        on_authorisation_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.task_id = task_id
        self.job_id = job_id
        self.link = link
        self.work_dir = work_dir
        self.peers = {peer: url.rstrip("/") for peer, url in (peers or {}).items()}
        self.relay_peers = set(relay_peers or ())
        self.server_url = server_url.rstrip("/") if server_url else None
        self._relay = None
        self.transfer_token = transfer_token
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.result_wait = result_wait
        self.prefetch = prefetch
        self.retries = retries
        self.retry_base = retry_base
        self.retry_cap = retry_cap
        self.peer_wait = peer_wait
        self.data_wait = data_wait
        #: A token refused (401) for ``auth_grace`` s without a break fails the task through
        #: ``on_authorisation_lost`` (its daemon stops it with the reason) instead of retrying for ever.
        self.authorisation = AuthorisationWatch(grace=auth_grace, on_lost=on_authorisation_lost)
        self._peers_changed = asyncio.Event()
        #: How many times the control plane has told this task its peers' addresses since it started.
        self.peers_told = 0
        #: Samples reported in ``status`` values since the last ``send`` (its ``X-Samples``).
        self.samples = 0
        #: Step reports the control plane allowed this daemon to answer ``Continue`` itself (its last
        #: ``continue_for``), and the steps and samples answered so since the last forwarded report.
        self.local_continues = 0
        self._covered_steps = 0
        self._covered_samples = 0
        #: What those steps said (loss, lr, step time …), sent with the next forwarded report for the charts.
        self._covered_summary = StepSummary()
        #: Rounds the parameter server had completed when the model was fetched (its ``X-Round``).
        self.rounds_completed = 0
        self.next_send_round = 1
        # Set once the first round to receive is known: after a model fetch from the parameter server, or
        # the first update sent. Until then a result stream waits instead of asking for round 1.
        self._round_known = asyncio.Event()
        self._in_flight: _InFlight | None = None
        #: Round results announced to the executor and not yet known to be merged: (round, file).
        self._delivered: deque[tuple[int, Path]] = deque()
        self._slice_lock = asyncio.Lock()
        self._prefetched: dict[str, deque[asyncio.Task[CachedSlice]]] = {}
        #: Data nodes' batch URLs that answered 404/405: their slices are fetched one by one.
        self._batchless: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    # --- BridgeBackend -------------------------------------------------------------------------------------

    async def status(self, *, job_id: str | None, progress: ProgressValue) -> dict[str, Any]:
        """Forward ``progress`` to the control plane and return its reply — except a step report
        (``{"status": …}``) the control plane allowed to answer here (``continue_for``): that one is answered
        ``{"type": "Continue"}`` at once, and counted into the next forwarded report (``covered_steps``,
        ``covered_samples``), which the control plane sees as all of those steps."""
        step = isinstance(progress, dict) and isinstance(progress.get("status"), dict)
        merged = progress == "update-received"
        if merged:
            self._forget_merged()
        batch_size = 0
        if step:
            value = progress["status"].get("batch_size")
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                batch_size = value
            self.samples += batch_size
            if self.local_continues > 0:
                self.local_continues -= 1
                self._covered_steps += 1
                self._covered_samples += batch_size
                self._covered_summary.add(progress["status"], batch_size=batch_size)
                return {"type": "Continue"}
            if self._covered_steps:
                progress = {
                    "status": {
                        **progress["status"],
                        "covered_steps": self._covered_steps + 1,
                        "covered_samples": self._covered_samples + batch_size,
                        "covered_points": self._covered_summary.take(),
                    }
                }
        elif merged:
            # An eager trainer merges the last round's result between two steps of a granted run: the run goes
            # on, and the next forwarded step report carries its steps (the control plane keeps the grant).
            pass
        elif self._covered_steps:
            # Only a step report may end a granted run of steps; the control plane grants none past the last.
            logger.warning(
                "task %s: %d steps answered locally were never reported", self.task_id, self._covered_steps
            )
        if not merged:
            self.local_continues = self._covered_steps = self._covered_samples = 0
            self._covered_summary.clear()
        message = protocol.StatusReport(request_id=uuid.uuid4(), task_id=self.task_id, progress=progress)
        try:
            reply = await self.link.request(message, timeout=self.request_timeout)
        except TimeoutError:
            raise NetworkError(
                f"the control plane did not answer the status within {self.request_timeout:g} s"
            ) from None
        assert isinstance(reply, protocol.StatusReply)
        if step and reply.reply.get("type") in ("Continue", "ScheduleUpdate"):
            self.local_continues = reply.continue_for
        return dict(reply.reply)

    async def fetch(self, *, reference: FetchReference, artifacts_dir: Path) -> list[tuple[str, int]]:
        match reference:
            case SchedulerReference():
                return await self._fetch_slice(reference.dataset, artifacts_dir)
            case ParameterServerReference():
                return await self._fetch_model(reference, artifacts_dir)
            case UriReference():
                return await self._fetch_uri(reference.value, artifacts_dir)
            case HuggingFaceReference():
                return await self._fetch_huggingface(reference, artifacts_dir)
        raise ConnectorError(f"unsupported reference {reference!r}")  # pragma: no cover

    async def send(self, *, reference: PeersReference, path: Path) -> None:
        peers = reference.peers if reference.strategy.type == "All" else reference.peers[:1]
        round_number = self.next_send_round
        self.next_send_round += 1
        self._round_known.set()
        samples, self.samples = self.samples, 0
        if not peers:
            logger.warning("task %s: update for round %d names no peer; not sent", self.task_id, round_number)
            return
        sent = None
        if len(peers) == 1:
            # Kept until the round's result arrives: a parameter server restarted elsewhere lost it.
            sent = self.work_dir / SENT_DIR / f"round-{round_number}"
            sent.parent.mkdir(mode=0o700, exist_ok=True)
            await asyncio.to_thread(shutil.copyfile, path, sent)
        for peer in peers:
            base, told = await self._send_update(peer, round_number=round_number, path=path, samples=samples)
            if sent is not None:
                self._in_flight = _InFlight(round_number, peer, sent, samples, base, told)

    async def receive(
        self, *, reference: PeersReference, directory: Path
    ) -> AsyncIterator[tuple[str, int, str, dict[str, Any]]]:
        peer = self._result_peer(reference)
        resolve_in(directory, peer)  # a peer id that cannot be a file name fails before any download
        await self._round_known.wait()
        round_number = self.rounds_completed + 1
        delay = self.retry_base
        while True:
            # A model fetched meanwhile may say the job is further along than this stream.
            round_number = max(round_number, self.rounds_completed + 1)
            base = await self._peer_url(peer)  # the current address: the parameter server may have moved
            await self._resend_if_moved(round_number, base)
            url = f"{base}/jobs/{self.job_id}/rounds/{round_number}/result"
            name = result_name(peer, round_number)
            target = resolve_in(directory, name)
            if self._relayed(peer):
                relayed = await self._relay_result(round_number, target)
                if relayed is None:
                    continue  # not closed yet: the long-poll waited; ask again
                outcome, size, included = relayed
                if outcome == "pruned":
                    line = (
                        f"round {round_number}'s result was deleted from the relay before this trainer "
                        "received it; the trainer goes on from the full global weights"
                    )
                    logger.warning("task %s: %s", self.task_id, line)
                    self.link.post(protocol.TaskLog(task_id=self.task_id, lines=[line]))
                    round_number += 1
                    continue
                logger.info(
                    "task %s: received round %d result through the relay (%d bytes, included: %s)",
                    self.task_id,
                    round_number,
                    size,
                    "true" if included else "false",
                )
                self._forget_sent(round_number)
                self._delivered.append((round_number, target))
                yield name, size, peer, {"round": round_number}
                round_number += 1
                continue
            try:
                result = await self._download(
                    url,
                    target,
                    params={"wait": f"{self.result_wait:g}"},
                    headers=self._auth(),
                    read_timeout=self.result_wait + self.read_timeout,
                    no_content_ok=True,
                    operation="result fetch",
                    trace_attributes={"hypha.round": round_number},
                )
            except HttpStatusError as error:
                if error.status == UNAUTHORIZED and self.authorisation.refused(
                    f"round {round_number}: {error}"
                ):
                    return  # the task is being failed with the reason; nothing more can be received
                if error.status == 410:
                    # Only when this bridge fell more than the kept rounds behind (it downloads every round
                    # as it closes): the executor sees the gap in the rounds and fetches the full weights.
                    line = (
                        f"round {round_number}'s result was pruned by the parameter server before this "
                        "trainer received it; the trainer goes on from the full global weights"
                    )
                    logger.warning("task %s: %s", self.task_id, line)
                    self.link.post(protocol.TaskLog(task_id=self.task_id, lines=[line]))
                    round_number += 1
                    continue
                if error.status == 404 and round_number > 1:
                    # Past the job's last round: there is nothing more to receive (the executor was told
                    # Done). End the stream, as Hypha's bridge does when receiving cannot go on.
                    logger.info("task %s: no round %d: the job's rounds are over", self.task_id, round_number)
                    return
                logger.warning("task %s: waiting for round %d result: %s", self.task_id, round_number, error)
            except (aiohttp.ClientError, TimeoutError, OSError) as error:
                logger.warning(
                    "task %s: round %d result from %s failed: %s",
                    self.task_id,
                    round_number,
                    base,
                    str(error) or type(error).__name__,
                )
            else:
                delay = self.retry_base
                self.authorisation.accepted()
                if result.status == 204:  # still open after `wait`: ask again
                    continue
                logger.info(
                    "task %s: received round %d result (%d bytes, included: %s)",
                    self.task_id,
                    round_number,
                    result.size,
                    result.headers.get("X-Included", "?"),
                )
                self._forget_sent(round_number)
                self._delivered.append((round_number, target))
                yield name, result.size, peer, {"round": round_number}
                round_number += 1
                continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.retry_cap)

    async def close(self) -> None:
        """Stop prefetching (claimed slices stay unacknowledged) and close the HTTP session. Idempotent."""
        self._closed = True
        tasks = [task for queue in self._prefetched.values() for task in queue]
        self._prefetched.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._relay = None
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    # --- model files ---------------------------------------------------------------------------------------

    async def _fetch_model(
        self, reference: ParameterServerReference, artifacts_dir: Path
    ) -> list[tuple[str, int]]:
        written = []
        for filename in reference.filenames:
            target = resolve_in(artifacts_dir, filename)
            target.parent.mkdir(parents=True, exist_ok=True)

            async def download_from(base: str, filename: str = filename, target: Path = target):
                url = f"{base}/jobs/{self.job_id}/model/{urllib.parse.quote(filename)}"
                return await self._download(url, target, headers=self._auth(), operation="model download")

            try:
                # The path (direct or relay) comes with the address: wait for it before choosing.
                await self._peer_url(reference.peer)
                try:
                    if not self._relayed(reference.peer):
                        download, base = await self._at_peer(
                            reference.peer, f"model file {filename}", download_from
                        )
                except SwitchedToRelay:
                    pass
                if self._relayed(reference.peer):
                    size, rounds_held = await self._relay_model_file(filename, target)
                    written.append((filename, size))
                    if rounds_held is not None:
                        self._learn_rounds(rounds_held)
                    continue
            except HttpStatusError as error:
                raise ConnectorError(f"model file {filename}: {error}") from error
            url = f"{base}/jobs/{self.job_id}/model/{urllib.parse.quote(filename)}"
            written.append((filename, download.size))
            rounds = download.headers.get("X-Round")
            if rounds is not None:
                try:
                    self._learn_rounds(int(rounds))
                except ValueError:
                    logger.warning("task %s: ignoring X-Round %r from %s", self.task_id, rounds, url)
        return written

    def _learn_rounds(self, completed: int) -> None:
        self.rounds_completed = max(0, completed)
        self.next_send_round = self.rounds_completed + 1
        self._round_known.set()

    async def _fetch_uri(self, value: str, artifacts_dir: Path) -> list[tuple[str, int]]:
        segment = urllib.parse.unquote(urllib.parse.urlsplit(value).path.rsplit("/", 1)[-1])
        name = segment or "part-0.bin"
        target = resolve_in(artifacts_dir, name)
        download = await self._with_retries(
            value, lambda: self._download(value, target, operation="uri download")
        )
        return [(name, download.size)]

    async def _fetch_huggingface(
        self, reference: HuggingFaceReference, artifacts_dir: Path
    ) -> list[tuple[str, int]]:
        try:
            import huggingface_hub  # heavy, and only needed by jobs that name a Hub repository
        except ImportError:
            raise ConnectorError("huggingface_hub is not installed on this worker") from None
        written = []
        for filename in reference.filenames:
            target = resolve_in(artifacts_dir, filename)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                cached = await asyncio.to_thread(
                    huggingface_hub.hf_hub_download,
                    repo_id=reference.repository,
                    filename=filename,
                    revision=reference.revision or "main",
                    token=reference.token,
                )
            except Exception as error:  # the hub raises many kinds (HTTP, offline, not found)
                raise ConnectorError(f"{reference.repository}/{filename}: {error}") from None
            await asyncio.to_thread(shutil.copyfile, cached, target)
            written.append((filename, target.stat().st_size))
        return written

    # --- updates -------------------------------------------------------------------------------------------

    async def _send_update(
        self, peer: str, *, round_number: int, path: Path, samples: int
    ) -> tuple[str, int]:
        """PUT the update to ``peer`` (patiently: :meth:`_at_peer`); returns the base URL it went to and how
        many addresses the control plane had given when that attempt began (``peers_told``). An address given
        while the attempt was in flight is newer than the server that answered (a lost server still answers
        while it stops): :meth:`_resend_if_moved` sends the update there too. A 4xx is logged, not retried:
        the parameter server's reason says why."""
        told = self.peers_told

        async def put(base: str) -> None:
            nonlocal told
            told = self.peers_told  # this attempt's address is the one given by then
            url = f"{base}/jobs/{self.job_id}/rounds/{round_number}/update"
            await self._put_update(url, path=path, samples=samples, round_number=round_number)

        try:
            await self._peer_url(peer)  # the path (direct or relay) comes with the address
            try:
                if not self._relayed(peer):
                    _, base = await self._at_peer(peer, f"round {round_number} update", put)
            except SwitchedToRelay:
                pass
            if self._relayed(peer):
                told = self.peers_told
                await self._relay_update(round_number=round_number, path=path, samples=samples)
                base = self.peers.get(peer, "")
        except HttpStatusError as error:
            logger.warning(
                "task %s: the parameter server refused the round %d update (HTTP %d): %s",
                self.task_id,
                round_number,
                error.status,
                error.detail,
            )
            return self.peers.get(peer, ""), told
        logger.info("task %s: round %d update sent (%d samples)", self.task_id, round_number, samples)
        return base, told

    async def _at_peer(self, peer: str, what: str, operation: Callable[[str], Awaitable[T]]) -> tuple[T, str]:
        """``operation(base URL)`` against ``peer``, and the base URL it succeeded at. Connection errors,
        timeouts and 5xx are retried for up to ``peer_wait`` seconds, each time at the peer's current address
        (a parameter server that died is restarted elsewhere, and the control plane says where; a new address
        ends a pause at once); a long wait is said on the job's page and reported to the control plane
        (``transfer_problem``, cleared by ``transfer_ok`` once the peer answers). A 4xx is raised as it is."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.peer_wait
        pause = self.retry_base
        attempt = 0
        first_failed = None
        while True:
            base = await self._peer_url(peer)
            if self._relayed(peer):
                raise SwitchedToRelay()  # the control plane says this peer is reached through the relay now
            try:
                done = await operation(base), base
            except HttpStatusError as error:
                # A refused token is retried too: a fresh one comes with the lease's next renewal.
                if error.status < 500 and (
                    error.status != UNAUTHORIZED or self.authorisation.refused(f"{what}: {error}")
                ):
                    self.report_transfer_ok(peer)  # it answered: reachable, whatever it said
                    raise
                failure: Exception = error
            except IntegrityError as error:
                self.report_transfer_ok(peer)
                raise ConnectorError(f"{what}: {error}") from error
            except (aiohttp.ClientError, TimeoutError) as error:
                failure = error
            else:
                self.authorisation.accepted()
                self.report_transfer_ok(peer)
                return done
            attempt += 1
            first_failed = first_failed or self.problem_clock()
            detail = str(failure) or type(failure).__name__
            left = deadline - loop.time()
            problem = {
                "peer": peer,
                "role": "parameter_server",
                "url": base,
                "operation": what,
                "cause": detail,
                "attempts": attempt,
                "since": first_failed,
            }
            if left <= 0:
                self.report_transfer_problem(**problem)  # the cause the task is about to fail of
                raise ConnectorError(f"{what}: {detail}") from failure
            pause = min(pause, left)
            line = f"waiting for the parameter server: {what} from {base} failed ({detail}); trying again in {pause:.1f} s"
            logger.warning("task %s: %s", self.task_id, line)
            if (
                attempt > self.retries
            ):  # a passing failure is retried quietly; a long one shows on the job page
                self.link.post(protocol.TaskLog(task_id=self.task_id, lines=[line[:1000]]))
                self.report_transfer_problem(**problem)
            await self._wait_for_peers(pause)
            pause = min(pause * 2, self.retry_cap)

    async def _put_update(self, url: str, *, path: Path, samples: int, round_number: int) -> None:
        headers = {**self._auth(), "X-Samples": str(samples), "Content-Type": "application/octet-stream"}
        session = self._http()
        with (
            telemetry.span(
                "update upload",
                **{
                    "http.request.method": "PUT",
                    "url.full": without_query(url),
                    "hypha.task_id": self.task_id,
                    "hypha.round": round_number,
                    "hypha.samples": samples,
                },
            ) as current,
            path.open("rb") as body,
        ):
            async with session.put(url, data=body, headers=headers, timeout=self._timeout()) as response:
                telemetry.annotate(current, **{"http.response.status_code": response.status})
                if response.status >= 300:
                    raise HttpStatusError(url, response.status, await error_detail(response))

    async def _resend_if_moved(self, round_number: int, base: str) -> None:
        """The control plane told this task its parameter server's address again since the update for
        ``round_number`` went out: a new server may have resumed from the last saved round — elsewhere, or at
        the same address (its daemon restarted) — and never seen it. Send it again (a server that has it
        answers 409, and nothing changes)."""
        sent = self._in_flight
        if sent is None or sent.round_number != round_number or sent.told == self.peers_told:
            return
        logger.warning(
            "task %s: the parameter server's address was given again (%s, was %s); sending the round %d "
            "update again",
            self.task_id,
            base,
            sent.base,
            round_number,
        )
        sent.base, sent.told = await self._send_update(
            sent.peer, round_number=round_number, path=sent.path, samples=sent.samples
        )

    def _forget_merged(self) -> None:
        """The executor merged a round (``"update-received"``): the one of the last update it sent, and every
        round before it (a trainer that fetched the full weights skips the rounds they include). Their result
        files go; later ones, not read yet, stay."""
        merged = self.next_send_round - 1
        while self._delivered and self._delivered[0][0] <= merged:
            _, path = self._delivered.popleft()
            path.unlink(missing_ok=True)

    def _forget_sent(self, round_number: int) -> None:
        sent = self._in_flight
        if sent is not None and sent.round_number <= round_number:
            sent.path.unlink(missing_ok=True)
            self._in_flight = None

    # --- HTTP ----------------------------------------------------------------------------------------------

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.transfer_token}"} if self.transfer_token else {}

    def update_peers(self, peers: Mapping[str, str], *, relay: list[str] | None = None) -> None:
        """New addresses of peers (a repeated ``dispatch_job``: the parameter server listens now, or moved),
        and which of them are reached through the relay (``None``: as before)."""
        self.peers.update({peer: url.rstrip("/") for peer, url in peers.items()})
        if relay is not None:
            self.relay_peers = set(relay)
        self.peers_told += 1
        self._peers_changed.set()

    async def _wait_for_peers(self, timeout: float) -> None:
        """Sleep ``timeout`` seconds, or less if a peer's address is given meanwhile."""
        self._peers_changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._peers_changed.wait(), timeout)

    async def _peer_url(self, peer: str) -> str:
        """The peer's base URL, waiting up to ``peer_wait`` seconds for the control plane to say it (trainers
        are dispatched while their parameter server is still starting)."""
        deadline = asyncio.get_running_loop().time() + self.peer_wait
        while peer not in self.peers:
            self._peers_changed.clear()
            if peer in self.peers:
                break
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise NetworkError(f"the address of peer {peer!r} was not given within {self.peer_wait:g} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._peers_changed.wait(), left)
        return self.peers[peer]

    def _result_peer(self, reference: PeersReference) -> str:
        candidates = reference.peers or list(self.peers)
        if not candidates:
            raise ConnectorError("no peer to receive results from")
        if len(candidates) > 1:
            logger.warning(
                "task %s: results from %d peers; only %s is polled",
                self.task_id,
                len(candidates),
                candidates[0],
            )
        return candidates[0]
