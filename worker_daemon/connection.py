"""The daemon's session with the control plane: one outbound websocket, reconnected for as long as it runs.

Two layers, so that the decisions are testable without a network:

* :class:`WorkerSession` is the protocol state machine. It turns each control-plane message into replies
  and updates its :class:`~worker_daemon.leases.LeaseBook`; :meth:`WorkerSession.evaluate` asks the
  arbiter which open advertisements to offer on. No I/O, no asyncio.
* :class:`WorkerDaemon` drives it: connects with ``Authorization: Bearer <token>``, sends ``hello``, feeds
  received frames to the session and sends its replies, batches advertisements for a short window before
  evaluating them, prunes expired leases every 250 ms, reconnects with exponential backoff and full jitter,
  and drains on shutdown (stops its tasks, releases every lease, waits up to 3 s for ``lease_ended``, closes
  normally). Task messages (``dispatch_job``, ``cancel_job`` and the replies to a bridge's requests) go to its
  :class:`~worker_daemon.jobs.JobManager`, which sends through a :class:`~worker_daemon.link.ControlLink`
  that the daemon connects after each ``welcome``; a task whose lease leaves the book is cancelled.
* The worker benchmark (:mod:`worker_daemon.benchmark`) runs in a child process at start (when asked to, as
  the CLI does unless ``benchmark = false``) and on ``run_benchmark``. Connecting does not wait for it:
  ``hello`` carries the last result if there is one, and a ``benchmark_result`` frame reports each run that
  ends later. While it runs the daemon makes no offers (a task would skew the score, and the benchmark
  would slow the task); a ``run_benchmark`` that arrives while a task runs or a lease is held is answered
  with an error instead.

:func:`run_daemon` runs one daemon to completion and returns the process exit code
(:class:`~worker_daemon.exceptions.ExitCode`). A refused token (4000/4001/4003) or protocol version (4002)
ends it, and so does 4009: another daemon process connected with this worker's token after it (each process
names itself on the handshake, :data:`INSTANCE_HEADER`), so it stops rather than take the worker back.

What survives a lost connection: ACTIVE leases stay in the book (they keep their local expiry and are
claimed again in the next ``hello``); reservations for pending offers and the open advertisements are
dropped, because the control plane forgets them with the connection. While the connection is lost a lease
is kept :data:`DISCONNECTED_LEASE_GRACE` seconds past its local expiry, and the daemon retries at least
every quarter lease TTL: a restarted control plane gives every lease one TTL from its restart (it cannot
tell a lease whose renewal fell in its outage from a dead daemon's), and a daemon that is back within it
keeps its leases and its running tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from worker_daemon import arbiter, benchmark, protocol
from worker_daemon.config import WorkerConfig, websocket_url
from worker_daemon.exceptions import (
    BenchmarkError,
    ExitCode,
    FatalConnectionError,
    SupersededError,
    TokenRefusedError,
    UnsupportedVersionError,
    WorkerDaemonError,
)
from worker_daemon.jobs import JobManager
from worker_daemon.leases import LeaseBook

logger = logging.getLogger(__name__)

#: Added to the control plane's offer TTL for the local reservation, so that a reservation never lapses
#: locally while the control plane may still grant it (clocks and message delays differ by a little).
OFFER_SAFETY_MARGIN = 1.0
#: Timing constants assumed until ``welcome`` tells the real ones (the original's values, §3.10, with a
#: generous offer window).
DEFAULT_OFFER_TTL = 5.0
DEFAULT_LEASE_TTL = 10.0
#: Seconds an ACTIVE lease is kept past its local expiry while the connection is lost (it could not be
#: renewed: the control plane may be restarting, and will give it one TTL from its restart). Long enough
#: for a restart of daphne and Celery with migrations; a daemon that was cut off while the control plane ran
#: learns at its next welcome that the lease ended, and stops its task then, or after this grace at the latest.
DISCONNECTED_LEASE_GRACE = 60.0

SHUTDOWN_REASON = "daemon shutting down"
#: The handshake header naming this daemon process (a random id per process, the same on every reconnect), so
#: that the control plane tells a daemon reconnecting from a restarted one: a restarted daemon takes the worker
#: over, and the process it replaced is refused from then on (close 4009) instead of taking it back.
INSTANCE_HEADER = "Hypha-Daemon-Instance"
NOT_FREE_REASON = "resources no longer free"


def daemon_version() -> str:
    """The installed ``hypha`` package version, or ``0.1.0`` when running from a source tree."""
    from importlib import metadata

    try:
        return metadata.version("hypha")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def _describe_resources(resources: protocol.Resources) -> str:
    return (
        f"cpu {resources.cpu:g}, memory {resources.memory:g} GB, storage {resources.storage:g} GB, "
        f"gpu {resources.gpu:g} GB"
    )


@dataclass(frozen=True, slots=True)
class Outcome:
    """What handling one message produced: frames to send back, and whether to re-evaluate adverts."""

    replies: tuple[protocol.DaemonMessage, ...] = ()
    reevaluate: bool = False


class WorkerSession:
    """The daemon's side of the protocol as a plain state machine (see the protocol module docstring).

    ``handle`` and ``evaluate`` return what to send; the caller sends it. The session outlives
    connections: call :meth:`disconnected` when one is lost and :meth:`hello` when the next one opens.
    """

    def __init__(
        self,
        *,
        config: WorkerConfig,
        daemon_version: str = "",
        clock: Callable[[], float] = time.monotonic,
        book: LeaseBook | None = None,
        disconnected_lease_grace: float = DISCONNECTED_LEASE_GRACE,
    ) -> None:
        self.config = config
        self.disconnected_lease_grace = disconnected_lease_grace
        #: Whether a connection that was welcomed has been lost and no welcome has come since: the leases
        #: then get their grace (see the module docstring).
        self.cut_off = False
        self.daemon_version = daemon_version
        self.book = (
            book
            if book is not None
            else LeaseBook(capacity=config.capacity, clock=clock, devices=config.devices)
        )
        self._clock = clock
        # Local deadline of each advert's offer window (advertisement.window_closes_in after it arrived).
        self._window_deadlines: dict[uuid.UUID, float] = {}
        self._executor_keys = frozenset(descriptor.key() for descriptor in config.descriptors())
        # Insertion order is arrival order, which breaks ties between equal scores.
        self._advertisements: dict[uuid.UUID, protocol.Advertisement] = {}
        # The attempt of each advertisement this daemon offered on, or logged a refusal for: offers and
        # refusal log lines happen at most once per (advertisement, attempt).
        self._offered_attempt: dict[uuid.UUID, int] = {}
        self._rejected_attempt: dict[uuid.UUID, int] = {}
        self.worker_id: uuid.UUID | None = None
        self.worker_name: str | None = None
        self.offer_ttl = DEFAULT_OFFER_TTL
        self.lease_ttl = DEFAULT_LEASE_TTL
        self.welcomed = False
        self.shutting_down = False
        #: Leases released at shutdown whose ``lease_ended`` has not arrived yet.
        self.awaiting_end: set[uuid.UUID] = set()
        #: The last benchmark that finished (sent in ``hello`` and with every offer), and whether one runs now
        #: (no offers meanwhile).
        self.benchmark: protocol.BenchmarkResult | None = None
        self.benchmarking = False

    @property
    def open_advertisements(self) -> list[protocol.Advertisement]:
        return list(self._advertisements.values())

    def hello(self) -> protocol.Hello:
        """The first frame of every connection: capacity, executors, floor and the ACTIVE leases held."""
        return protocol.Hello(
            protocol_version=protocol.PROTOCOL_VERSION,
            daemon_version=self.daemon_version,
            resources=self.config.capacity,
            devices=list(self.book.devices),
            executors=self.config.descriptors(),
            price_floor=self.config.offer.floor,
            strategy=self.config.strategy,
            leases=self.book.lease_ids(),
            benchmark=self.benchmark,
            reachable=self.config.parameter_server.reachable,
        )

    def handle(self, message: protocol.ServerMessage) -> Outcome:
        """Apply one control-plane message; return the replies to send and whether to re-evaluate."""
        match message:
            case protocol.Welcome():
                return self._on_welcome(message)
            case protocol.Advertisement():
                return Outcome(reevaluate=self._remember(message))
            case protocol.AdvertisementClosed():
                self._forget(message.advertisement_id)
                logger.debug("advertisement %s closed: %s", message.advertisement_id, message.reason)
                return Outcome()
            case protocol.OfferReceived():
                reservation = self.book.attach_lease(
                    advertisement_id=message.advertisement_id,
                    lease_id=message.lease_id,
                    ttl=message.expires_in + OFFER_SAFETY_MARGIN,
                )
                if reservation is None:
                    # The reservation lapsed locally; lease_granted will try to reserve again.
                    logger.info(
                        "offer on advertisement %s received, but it is no longer reserved here",
                        message.advertisement_id,
                    )
                return Outcome()
            case protocol.OfferDeclined():
                self.book.free_reservation(message.advertisement_id)
                logger.info(
                    "offer on advertisement %s declined: %s", message.advertisement_id, message.reason
                )
                return Outcome(reevaluate=True)
            case protocol.LeaseGranted():
                return self._on_lease_granted(message)
            case protocol.RenewLease():
                return self._on_renew(message)
            case protocol.LeaseEnded():
                dropped = self.book.drop(message.lease_id)
                self.awaiting_end.discard(message.lease_id)
                suffix = f": {message.reason}" if message.reason else ""
                if dropped is None:
                    logger.info(
                        "lease %s ended (%s)%s; it was not held here",
                        message.lease_id,
                        message.status,
                        suffix,
                    )
                else:
                    logger.info("lease %s ended (%s)%s", message.lease_id, message.status, suffix)
                return Outcome(reevaluate=True)
            case (
                protocol.DispatchJob()
                | protocol.TransferToken()
                | protocol.CancelJob()
                | protocol.StatusReply()
                | protocol.SliceAssigned()
                | protocol.RunBenchmark()
            ):
                # Tasks are the job manager's business; benchmarks the daemon's (worker_daemon.jobs); the daemon routes these to it.
                return Outcome()
            case protocol.Error():
                logger.warning(
                    "control plane error %s: %s%s",
                    message.code.value,
                    message.message,
                    f" (answering {message.ref})" if message.ref else "",
                )
                return Outcome()
        return Outcome()  # pragma: no cover - the match is exhaustive over ServerMessage

    def evaluate(self) -> list[protocol.Offer]:
        """Reserve resources for, and return, the offers to make on open advertisements now.

        Considers the advertisements not yet offered on in their current attempt, in the arbiter's order;
        each offer reserves its resources for ``offer_ttl`` + 1 s, and one that does not fit is skipped (and
        tried again when resources are freed).
        """
        if self.shutting_down or self.benchmarking:
            return []
        held_advertisements = {lease.advertisement_id for lease in self.book.leases}
        candidates = []
        for advertisement in self._advertisements.values():
            advertisement_id = advertisement.advertisement_id
            if self._offered_attempt.get(advertisement_id) == advertisement.attempt:
                continue
            # Its window closed: an offer would only be declined (a later attempt comes as a new advert).
            if self._clock() >= self._window_deadlines.get(advertisement_id, math.inf):
                continue
            # One worker serves a role once: never offer again on an advertisement we hold a lease for.
            if advertisement_id in held_advertisements:
                continue
            reason = arbiter.rejection_reason(
                advertisement,
                executors=self._executor_keys,
                floor=self.config.offer.floor,
                capacity=self.book.capacity,
                free_devices=self.book.free_devices(),
            )
            if reason is not None:
                if self._rejected_attempt.get(advertisement_id) != advertisement.attempt:
                    self._rejected_attempt[advertisement_id] = advertisement.attempt
                    logger.info(
                        "not offering on advertisement %s attempt %d (job %s, role %s): %s",
                        advertisement_id,
                        advertisement.attempt,
                        advertisement.job_id,
                        advertisement.role,
                        reason,
                    )
                continue
            candidates.append(advertisement)

        offers = []
        for planned in arbiter.plan_offers(
            candidates,
            executors=self._executor_keys,
            capacity=self.book.capacity,
            floor=self.config.offer.floor,
            price=self.config.offer.price,
            strategy=self.config.strategy,
            free_devices=self.book.free_devices(),
            devices=self.book.devices,
        ):
            advertisement = planned.advertisement
            devices: tuple[int, ...] | list[int] | None = planned.devices
            if not self.book.devices_free(planned.devices):
                # An offer planned before this one took some of them: choose again among those still free.
                devices = protocol.choose_devices(
                    self.book.free_devices(), count=advertisement.devices, memory=advertisement.device_memory
                )
                if devices is None:
                    continue
            reservation = self.book.reserve(
                advertisement_id=advertisement.advertisement_id,
                attempt=advertisement.attempt,
                resources=planned.resources,
                ttl=self.offer_ttl + OFFER_SAFETY_MARGIN,
                devices=devices,
            )
            if reservation is None:
                continue
            self._offered_attempt[advertisement.advertisement_id] = advertisement.attempt
            offers.append(
                protocol.Offer(
                    advertisement_id=advertisement.advertisement_id,
                    attempt=advertisement.attempt,
                    price=planned.price,
                    resources=planned.resources,
                    devices=list(reservation.devices),
                    benchmark_score=self.benchmark.score if self.benchmark is not None else None,
                )
            )
            logger.info(
                "offer on advertisement %s attempt %d (job %s, role %s, bid %g): price %g for %s",
                advertisement.advertisement_id,
                advertisement.attempt,
                advertisement.job_id,
                advertisement.role,
                advertisement.bid,
                planned.price,
                _describe_resources(planned.resources),
            )
        return offers

    def prune(self) -> bool:
        """Drop reservations and leases whose local expiry passed (leases: plus the grace, while cut off
        from the control plane), and forget adverts whose offer window passed; True if anything was freed."""
        grace = self.disconnected_lease_grace if self.cut_off else 0.0
        self._forget_past_windows()
        reservations, leases = self.book.prune(lease_grace=grace)
        for reservation in reservations:
            logger.debug("reservation for advertisement %s expired", reservation.advertisement_id)
        for lease in leases:
            self.awaiting_end.discard(lease.lease_id)
            if self.cut_off:
                logger.warning(
                    "lease %s not renewed, dropped: the control plane was unreachable for its TTL and %gs "
                    "more (job %s, role %s)",
                    lease.lease_id,
                    grace,
                    lease.job_id,
                    lease.role,
                )
                continue
            logger.warning(
                "lease %s not renewed, dropped (job %s, role %s)", lease.lease_id, lease.job_id, lease.role
            )
        return bool(reservations or leases)

    def disconnected(self) -> None:
        """Forget what died with the connection: open adverts and the reservations of pending offers."""
        self.book.drop_reservations()
        self._advertisements.clear()
        self._window_deadlines.clear()
        self._offered_attempt.clear()
        self._rejected_attempt.clear()
        self.cut_off = self.cut_off or self.welcomed
        self.welcomed = False

    def begin_shutdown(self) -> list[protocol.ReleaseLease]:
        """Stop offering and return a ``release_lease`` for every held lease (remembered in
        :attr:`awaiting_end` until its ``lease_ended`` arrives)."""
        self.shutting_down = True
        releases = [
            protocol.ReleaseLease(lease_id=lease.lease_id, reason=SHUTDOWN_REASON)
            for lease in self.book.leases
        ]
        self.awaiting_end = {release.lease_id for release in releases}
        return releases

    # --- handlers ----------------------------------------------------------------------------------------

    def _on_welcome(self, message: protocol.Welcome) -> Outcome:
        self.worker_id = message.worker_id
        self.worker_name = message.worker_name
        self.offer_ttl = message.offer_ttl
        self.lease_ttl = message.lease_ttl
        self.welcomed = True
        self.cut_off = False
        replies: list[protocol.DaemonMessage] = []
        # welcome.leases is the control plane's view of what we may keep: exactly those survive.
        keep = {info.lease_id: info for info in message.leases if info.status == "active"}
        for lease in self.book.leases:
            if lease.lease_id not in keep:
                self.book.drop(lease.lease_id)
                logger.info(
                    "lease %s dropped: the control plane no longer has it (job %s, role %s)",
                    lease.lease_id,
                    lease.job_id,
                    lease.role,
                )
        for info in keep.values():
            if self.book.renew(info.lease_id, ttl=info.expires_in):
                continue
            # We claimed it in hello but it lapsed locally since: take it back if it still fits.
            adopted = self.book.activate(
                lease_id=info.lease_id,
                job_id=info.job_id,
                role=info.role,
                resources=info.resources,
                price=info.price,
                ttl=info.expires_in,
                devices=info.devices,
            )
            if adopted is None:
                logger.warning("lease %s cannot be kept: %s; releasing it", info.lease_id, NOT_FREE_REASON)
                replies.append(protocol.ReleaseLease(lease_id=info.lease_id, reason=NOT_FREE_REASON))
        logger.info(
            "welcomed as worker %s (%s): lease_ttl %gs, offer_ttl %gs, %d lease(s) kept, "
            "%d open advertisement(s)",
            message.worker_name,
            message.worker_id,
            message.lease_ttl,
            message.offer_ttl,
            len(self.book.leases),
            len(message.advertisements),
        )
        for advertisement in message.advertisements:
            self._remember(advertisement)
        return Outcome(replies=tuple(replies), reevaluate=True)

    def _on_lease_granted(self, message: protocol.LeaseGranted) -> Outcome:
        lease = self.book.activate(
            lease_id=message.lease_id,
            job_id=message.job_id,
            role=message.role,
            resources=message.resources,
            price=message.price,
            ttl=message.expires_in,
            advertisement_id=message.advertisement_id,
            devices=message.devices,
        )
        if lease is None:
            logger.warning(
                "lease %s granted but its resources are no longer free; releasing it", message.lease_id
            )
            return Outcome(
                replies=(protocol.ReleaseLease(lease_id=message.lease_id, reason=NOT_FREE_REASON),),
                reevaluate=True,
            )
        logger.info(
            "lease %s granted: job %s, role %s, price %g, %s, expires in %gs",
            message.lease_id,
            message.job_id,
            message.role,
            message.price,
            _describe_resources(message.resources),
            message.expires_in,
        )
        if self.shutting_down:
            # A grant that crossed our shutdown: give it straight back.
            self.awaiting_end.add(message.lease_id)
            return Outcome(
                replies=(protocol.ReleaseLease(lease_id=message.lease_id, reason=SHUTDOWN_REASON),)
            )
        return Outcome(reevaluate=True)

    def _on_renew(self, message: protocol.RenewLease) -> Outcome:
        if message.lease_id in self.awaiting_end:
            reason = SHUTDOWN_REASON
        elif self.book.renew(message.lease_id, ttl=message.expires_in):
            logger.info("lease %s renewed for %gs", message.lease_id, message.expires_in)
            return Outcome(replies=(protocol.LeaseRenewed(lease_id=message.lease_id),))
        else:
            reason = "lease not held by this daemon"
        logger.warning("refusing to renew lease %s: %s", message.lease_id, reason)
        return Outcome(replies=(protocol.RenewRefused(lease_id=message.lease_id, reason=reason),))

    def _remember(self, advertisement: protocol.Advertisement) -> bool:
        """Store an advertisement unless we already know this or a later attempt; True if stored."""
        known = self._advertisements.get(advertisement.advertisement_id)
        if known is not None and known.attempt >= advertisement.attempt:
            return False
        # Re-insert so that a new attempt counts as a new arrival.
        self._advertisements.pop(advertisement.advertisement_id, None)
        self._advertisements[advertisement.advertisement_id] = advertisement
        if advertisement.window_closes_in is None:
            self._window_deadlines.pop(advertisement.advertisement_id, None)
        else:
            self._window_deadlines[advertisement.advertisement_id] = (
                self._clock() + advertisement.window_closes_in
            )
        return True

    def _forget_past_windows(self) -> None:
        """Forget adverts whose offer window has passed: no offer can be made on them any more (a later attempt
        arrives as a new advert), and the control plane tells only the daemons it sent an attempt to when the
        attempt closes — not one that heard of the advert in its welcome."""
        now = self._clock()
        for advertisement_id in [key for key, deadline in self._window_deadlines.items() if deadline <= now]:
            self._forget(advertisement_id)

    def _forget(self, advertisement_id: uuid.UUID) -> None:
        self._advertisements.pop(advertisement_id, None)
        self._window_deadlines.pop(advertisement_id, None)
        self._offered_attempt.pop(advertisement_id, None)
        self._rejected_attempt.pop(advertisement_id, None)


class WorkerDaemon:
    """One daemon: a :class:`WorkerSession` driven over a reconnecting websocket.

    ``run()`` returns the exit code; ``request_shutdown()`` (what SIGTERM and SIGINT call) makes it release
    its leases and return 0. Timing parameters are seconds and exist so tests and benchmarks can shrink
    them; ``uniform`` draws the jittered backoff delays (``random.uniform`` by default).
    """

    def __init__(
        self,
        *,
        config: WorkerConfig,
        server_url: str,
        token: str,
        batch_window: float = 0.02,
        prune_interval: float = 0.25,
        backoff_base: float = 0.5,
        backoff_cap: float = 30.0,
        open_timeout: float = 10.0,
        ping_interval: float = 10.0,
        send_timeout: float = 10.0,
        shutdown_timeout: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        uniform: Callable[[float, float], float] = random.uniform,
        jobs: JobManager | None = None,
        benchmark_at_start: bool = False,
        benchmark_timeout: float = benchmark.TIMEOUT,
        benchmark_budget: float | None = None,
        disconnected_lease_grace: float = DISCONNECTED_LEASE_GRACE,
        warm_start: bool = False,
    ) -> None:
        self.url = websocket_url(server_url)
        self.session = WorkerSession(
            config=config,
            daemon_version=daemon_version(),
            clock=clock,
            disconnected_lease_grace=disconnected_lease_grace,
        )
        #: Runs the dispatched tasks; it reads the session's lease book.
        self.jobs = (
            jobs
            if jobs is not None
            else JobManager(config=config, book=self.session.book, server_url=self.url)
        )
        self._token = token
        #: This process's id on the handshake (:data:`INSTANCE_HEADER`).
        self.instance_id = uuid.uuid4().hex
        self._batch_window = batch_window
        self._prune_interval = prune_interval
        self._backoff_base = backoff_base
        self._backoff_cap = backoff_cap
        self._open_timeout = open_timeout
        self._ping_interval = ping_interval
        self._send_timeout = send_timeout
        self._shutdown_timeout = shutdown_timeout
        self._uniform = uniform
        self._shutdown = asyncio.Event()
        # Set whenever the session may have changed; the shutdown drain waits on it.
        self._changed = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._ws: ClientConnection | None = None
        self._evaluation_task: asyncio.Task[None] | None = None
        self._evaluation_wanted = False
        self._attempt = 0
        self._benchmark_at_start = benchmark_at_start
        self._benchmark_timeout = benchmark_timeout
        self._benchmark_budget = benchmark_budget
        self._benchmark_task: asyncio.Task[None] | None = None
        # Keep a warm spare for the built-in executors (worker_daemon.spares), from the start or, when the
        # benchmark runs at start, from its end (its imports would slow the benchmark).
        self._warm_start = warm_start
        # The run_benchmark requests the running benchmark answers (None: the one at start).
        self._benchmark_requests: list[uuid.UUID | None] = []
        self._hellos_sent = 0

    @property
    def connected(self) -> bool:
        return self._ws is not None

    def request_shutdown(self, *, reason: str = "shutdown requested") -> None:
        """Start a clean shutdown (idempotent): release leases if connected, then make ``run`` return 0."""
        if self._shutdown.is_set():
            logger.info("%s; already shutting down", reason)
            return
        logger.info("%s; shutting down", reason)
        self._shutdown.set()

    async def run(self, *, install_signal_handlers: bool = False) -> int:
        """Connect, serve and reconnect until shut down or refused; return the exit code."""
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if install_signal_handlers else ()
        for signal_number in signals:
            loop.add_signal_handler(
                signal_number,
                lambda name=signal_number.name: self.request_shutdown(reason=f"received {name}"),
            )
        pruner = asyncio.create_task(self._prune_forever())
        if self._benchmark_at_start:
            self.start_benchmark()
        elif self._warm_start:
            self.jobs.start_spares()
        try:
            while not self._shutdown.is_set():
                try:
                    await self._connect_once()
                except FatalConnectionError as error:
                    logger.error("%s; giving up (exit code %d)", error, error.exit_code)
                    return error.exit_code
                except (OSError, TimeoutError, WebSocketException) as error:
                    logger.warning(
                        "connection to %s failed: %s", self.url, str(error) or type(error).__name__
                    )
                if self._shutdown.is_set():
                    break
                delay = self.backoff_delay(self._attempt)
                self._attempt += 1
                logger.info("reconnecting to %s in %.2fs (attempt %d)", self.url, delay, self._attempt)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._shutdown.wait(), delay)
            logger.info("shut down cleanly")
            return ExitCode.OK
        except WorkerDaemonError as error:
            logger.error("%s", error)
            return error.exit_code
        finally:
            # Tasks still running here were not stopped by a drain (no connection): stop them now.
            await self.jobs.stop_all(reason=SHUTDOWN_REASON)
            for background in (pruner, self._benchmark_task):
                if background is not None:
                    background.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await background
            for signal_number in signals:
                loop.remove_signal_handler(signal_number)

    def backoff_delay(self, attempt: int) -> float:
        """The delay before reconnect number ``attempt + 1``: uniform in [0, min(cap, base·2^attempt)], and
        at most a quarter lease TTL while the daemon holds leases."""
        # Full jitter (AWS architecture blog): spreads the reconnects of many daemons after a server restart.
        ceiling = min(self._backoff_cap, self._backoff_base * 2 ** min(attempt, 32))
        if self.session.book.leases:
            # A restarted control plane keeps our leases for one TTL from its restart: be back well within it.
            ceiling = min(ceiling, self.session.lease_ttl / 4)
        return self._uniform(0.0, ceiling)

    async def _connect_once(self) -> None:
        """One connection: open it (abandoned at once if shutdown is requested meanwhile), then serve it."""
        logger.info("connecting to %s", self.url)
        opening = asyncio.create_task(self._open())
        shutdown = asyncio.create_task(self._shutdown.wait())
        try:
            await asyncio.wait({opening, shutdown}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            shutdown.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await shutdown
            if not opening.done():
                opening.cancel()
        if not opening.done() or opening.cancelled():
            # Shutting down mid-handshake: nothing is held on this connection yet, so just abandon it.
            try:
                websocket = await opening
            except (asyncio.CancelledError, OSError, TimeoutError, WebSocketException, WorkerDaemonError):
                return
            await websocket.close()  # the handshake won the race with the cancellation
            return
        await self._serve(opening.result())

    async def _open(self) -> ClientConnection:
        try:
            return await connect(
                self.url,
                additional_headers={
                    "Authorization": f"Bearer {self._token}",
                    INSTANCE_HEADER: self.instance_id,
                },
                user_agent_header=f"hypha-worker-daemon/{self.session.daemon_version}",
                open_timeout=self._open_timeout,
                ping_interval=self._ping_interval,
                ping_timeout=self._ping_interval * 2,
                close_timeout=self._shutdown_timeout,
            )
        except InvalidStatus as error:
            status = error.response.status_code
            if status in (401, 403):
                raise TokenRefusedError(
                    f"the control plane refused the worker token (HTTP {status} on the handshake)",
                    close_code=status,
                ) from None
            raise

    async def _serve(self, websocket: ClientConnection) -> None:
        """Run one open connection until it closes or a shutdown has drained it. Raises
        :class:`FatalConnectionError` when the control plane closes with a fatal code."""
        self._ws = websocket
        receiver = asyncio.create_task(self._receive(websocket))
        shutdown = asyncio.create_task(self._shutdown.wait())
        watchdog = asyncio.create_task(self._expect_welcome(websocket))
        try:
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                self._hellos_sent += 1
                await self._send(websocket, self.session.hello())
            await asyncio.wait({receiver, shutdown}, return_when=asyncio.FIRST_COMPLETED)
            if self._shutdown.is_set() and not receiver.done():
                await self._drain(websocket, receiver)
                return
            await asyncio.wait({receiver})
            error = receiver.exception()
            if isinstance(error, TimeoutError):
                logger.warning("sending to the control plane timed out after %gs", self._send_timeout)
            elif error is not None and not isinstance(error, ConnectionClosed):
                # A bug in handling a frame: log it with its traceback, then reconnect from a clean slate.
                logger.error("internal error while handling a control-plane frame", exc_info=error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(websocket.wait_closed(), self._shutdown_timeout)
            self._check_close(websocket.close_code, websocket.close_reason or "")
        finally:
            self._ws = None
            tasks = [receiver, shutdown, watchdog]
            if self._evaluation_task is not None:
                tasks.append(self._evaluation_task)
                self._evaluation_task = None
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await websocket.close()
            self.session.disconnected()
            self.jobs.link.disconnected()
            self._changed.set()

    def _check_close(self, code: int | None, reason: str) -> None:
        try:
            close_code = protocol.CloseCode(code) if code is not None else None
        except ValueError:
            close_code = None
        name = f" ({close_code.name})" if close_code is not None else ""
        detail = f"code {code}{name}" + (f", reason {reason!r}" if reason else "")
        if close_code == protocol.CloseCode.SUPERSEDED:
            # Another daemon with our token connected after us (a restart while this process hung, or the same
            # token configured twice). Reconnecting would take the worker back, and it would take it back in
            # turn: one of the two must stop, and the newer one is the one the operator started last.
            raise SupersededError(
                f"another daemon connected with this worker's token and took the worker over ({detail}); "
                "this one stops. Run exactly one daemon per worker token",
                close_code=code,
                reason=reason,
            )
        if close_code is not None and close_code.is_fatal:
            error_type = (
                UnsupportedVersionError
                if close_code == protocol.CloseCode.UNSUPPORTED_VERSION
                else TokenRefusedError
            )
            raise error_type(
                f"the control plane closed the connection: {detail}", close_code=code, reason=reason
            )
        logger.warning("connection to %s closed: %s", self.url, detail)

    async def _receive(self, websocket: ClientConnection) -> None:
        try:
            async for frame in websocket:
                try:
                    message = protocol.parse_server_message(frame)
                except protocol.ProtocolError as error:
                    logger.warning("ignoring an invalid frame from the control plane: %s", error.message)
                    continue
                outcome = self.session.handle(message)
                if isinstance(message, protocol.Welcome):
                    self._attempt = 0
                    # Frames queued while disconnected (a task's job_exited, …) go out now, in order.
                    self.jobs.link.connected(lambda reply, ws=websocket: self._send(ws, reply))
                for reply in outcome.replies:
                    await self._send(websocket, reply)
                if isinstance(message, protocol.RunBenchmark):
                    self.start_benchmark(request_id=message.request_id)
                self.jobs.handle(message)
                self.jobs.cancel_orphans()
                if outcome.reevaluate:
                    self._schedule_evaluation()
                self._changed.set()
        finally:
            self._changed.set()

    async def _send(self, websocket: ClientConnection, message: protocol.DaemonMessage) -> None:
        # One sender at a time keeps frames whole; the timeout bounds a send stuck on a dead peer's window.
        async with self._send_lock:
            await asyncio.wait_for(websocket.send(protocol.encode(message)), self._send_timeout)

    async def _expect_welcome(self, websocket: ClientConnection) -> None:
        await asyncio.sleep(self._open_timeout)
        if not self.session.welcomed:
            logger.warning("no welcome within %gs after hello; reconnecting", self._open_timeout)
            await websocket.close(1002, "welcome expected")

    def _schedule_evaluation(self) -> None:
        self._evaluation_wanted = True
        websocket = self._ws
        if websocket is not None and (self._evaluation_task is None or self._evaluation_task.done()):
            self._evaluation_task = asyncio.create_task(self._evaluate_soon(websocket))

    async def _evaluate_soon(self, websocket: ClientConnection) -> None:
        # Adverts that arrive within one window are judged together, so the best of them gets the offer.
        try:
            while self._evaluation_wanted:
                await asyncio.sleep(self._batch_window)
                self._evaluation_wanted = False
                for offer in self.session.evaluate():
                    await self._send(websocket, offer)
        except (ConnectionClosed, TimeoutError):
            # The receiver sees the closed connection too and ends the session; reservations are dropped.
            pass
        except Exception:
            # A background task's error would otherwise vanish; the daemon keeps serving.
            logger.exception("internal error while evaluating advertisements")

    def start_benchmark(self, *, request_id: uuid.UUID | None = None) -> bool:
        """Run the worker benchmark in the background; its ``benchmark_result`` answers ``request_id``.

        Returns False when it did not start: one runs already (its result answers this request too), or the
        daemon is busy with a task or lease (answered at once with an error, since the score would mean
        nothing).
        """
        if self._benchmark_task is not None and not self._benchmark_task.done():
            self._benchmark_requests.append(request_id)
            return False
        busy = len(self.jobs.tasks) + len(self.session.book.leases)
        if busy:
            message = f"busy: {busy} task(s) or lease(s) held; run the benchmark when the worker is idle"
            logger.info("benchmark requested but not run: %s", message)
            self.jobs.link.post(protocol.BenchmarkReport(request_id=request_id, error=message))
            return False
        self._benchmark_requests = [request_id]
        self._benchmark_task = asyncio.create_task(self._benchmark(hellos_before=self._hellos_sent))
        return True

    async def _benchmark(self, *, hellos_before: int) -> None:
        self.session.benchmarking = True
        logger.info("running the worker benchmark (no offers until it ends)")
        try:
            result = await benchmark.measure(
                self.session.config, timeout=self._benchmark_timeout, time_budget=self._benchmark_budget
            )
        except BenchmarkError as error:
            logger.warning("worker benchmark failed: %s", error)
            reports = [
                protocol.BenchmarkReport(request_id=request_id, error=str(error))
                for request_id in self._benchmark_requests
            ]
        else:
            logger.info("worker benchmark: %s", benchmark.describe(result))
            self.session.benchmark = result
            reports = [
                protocol.BenchmarkReport(request_id=request_id, benchmark=result)
                for request_id in self._benchmark_requests
            ]
        finally:
            self.session.benchmarking = False
            self._changed.set()
            self._schedule_evaluation()
            if self._warm_start:
                self.jobs.start_spares()
        for report in reports:
            # A result at start that no hello missed yet travels in the next hello instead.
            if report.request_id is None and self._hellos_sent == hellos_before and report.error == "":
                continue
            self.jobs.link.post(report)
        self._benchmark_requests = []

    async def _prune_forever(self) -> None:
        while True:
            await asyncio.sleep(self._prune_interval)
            if self.session.prune():
                self.jobs.cancel_orphans()
                self._changed.set()
                self._schedule_evaluation()

    async def _drain(self, websocket: ClientConnection, receiver: asyncio.Task[None]) -> None:
        """Stop the tasks (their ``job_exited`` sent first), release every lease, wait up to
        ``shutdown_timeout`` for their ``lease_ended``, close normally."""
        if self.jobs.tasks:
            await self.jobs.stop_all(reason=SHUTDOWN_REASON)
            await self.jobs.link.flush(timeout=self._shutdown_timeout)
        self.jobs.closing = True
        releases = self.session.begin_shutdown()
        for release in releases:
            logger.info("releasing lease %s: %s", release.lease_id, release.reason)
            try:
                await self._send(websocket, release)
            except (ConnectionClosed, TimeoutError):
                break
        deadline = asyncio.get_running_loop().time() + self._shutdown_timeout
        while self.session.awaiting_end and not receiver.done():
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                logger.warning(
                    "no lease_ended for %d lease(s) within %gs; closing anyway",
                    len(self.session.awaiting_end),
                    self._shutdown_timeout,
                )
                break
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        await websocket.close(1000, SHUTDOWN_REASON)


async def run_daemon(
    *,
    config: WorkerConfig,
    server_url: str,
    token: str,
    install_signal_handlers: bool = False,
    batch_window: float = 0.02,
    prune_interval: float = 0.25,
    backoff_base: float = 0.5,
    backoff_cap: float = 30.0,
    open_timeout: float = 10.0,
    ping_interval: float = 10.0,
    shutdown_timeout: float = 3.0,
    benchmark_at_start: bool = False,
    warm_start: bool = False,
) -> int:
    """Run one worker daemon until it is shut down or refused; return its exit code.

    ``server_url`` is the control plane's address (``http(s)://…``) or its worker websocket
    (``ws(s)://…/ws/worker/``). With ``install_signal_handlers`` SIGTERM and SIGINT trigger the clean
    shutdown; otherwise use :class:`WorkerDaemon` directly and call ``request_shutdown``. With
    ``benchmark_at_start`` (the CLI passes the config's ``benchmark``) the worker benchmark runs at start;
    with ``warm_start`` (the CLI passes the config's) a warm spare is kept for the built-in executors.
    """
    try:
        daemon = WorkerDaemon(
            config=config,
            server_url=server_url,
            token=token,
            batch_window=batch_window,
            prune_interval=prune_interval,
            backoff_base=backoff_base,
            backoff_cap=backoff_cap,
            open_timeout=open_timeout,
            ping_interval=ping_interval,
            shutdown_timeout=shutdown_timeout,
            benchmark_at_start=benchmark_at_start,
            warm_start=warm_start,
        )
    except WorkerDaemonError as error:
        logger.error("%s", error)
        return error.exit_code
    return await daemon.run(install_signal_handlers=install_signal_handlers)
