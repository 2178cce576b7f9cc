"""Worker identity, presence and the outbound half of the gateway (messages to connected daemons).

Channel-layer groups: every connected daemon joins its own :func:`worker_group`, where everything for it
arrives — the advertisements it could take (the market sends each to the workers that fit it, not to all:
:mod:`apps.market.targeting`), leases, renewal requests, closes. All sends happen after commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from django.db import transaction

from apps.workers.exceptions import AuthenticationFailed, WorkerOffline
from apps.workers.models import Worker, hash_token
from hypha_site.runtime import group_send, group_send_many, send_on_commit
from worker_daemon import protocol

logger = logging.getLogger(__name__)

#: ``Worker.connection_info`` key listing the daemon processes (their handshake instance ids) that a newer
#: daemon of the worker superseded, and which are refused (4009) when they come back.
SUPERSEDED_KEY = "superseded_instances"
#: Enough for any number of restarts in a row: a superseded process that is still around comes back within
#: its reconnect backoff, long before this many newer daemons have been started.
SUPERSEDED_KEPT = 16


def worker_group(worker_id) -> str:
    return f"worker.{worker_id}"


def manages(user, worker: Worker) -> bool:
    """Whether ``user`` may see everything of ``worker`` (its owner, its token's state, every lease on it) and
    act on it: its owner and staff. Every other signed-in user sees only its public facts (the pool)."""
    return bool(user.is_staff or (worker.owner_id is not None and worker.owner_id == user.pk))


def create_worker(*, name: str, owner=None) -> tuple[Worker, str]:
    """Create a worker and its token (returned once, stored hashed)."""
    return Worker.create_with_token(name=name, owner=owner)


def authenticate(token: str | None, *, instance: str = "") -> Worker:
    """The worker owning ``token``; :class:`AuthenticationFailed` with the close code to use otherwise.

    ``instance`` is the daemon process's id from its handshake (``""`` when it sent none): a process that a
    newer daemon of the same worker superseded is refused with 4009, so that a daemon that hung (or a second
    daemon given the same token) does not take the worker back from the one started after it.
    """
    if not token:
        raise AuthenticationFailed(
            protocol.CloseCode.MISSING_TOKEN, "no token: send 'Authorization: Bearer <worker token>'"
        )
    worker = Worker.objects.filter(token_hash=hash_token(token)).first()
    if worker is None:
        raise AuthenticationFailed(protocol.CloseCode.INVALID_TOKEN, "unknown worker token")
    if worker.is_revoked:
        raise AuthenticationFailed(
            protocol.CloseCode.TOKEN_REVOKED, f"the token of worker {worker.name!r} has been revoked"
        )
    if instance and instance in worker.connection_info.get(SUPERSEDED_KEY, ()):
        raise AuthenticationFailed(
            protocol.CloseCode.SUPERSEDED,
            f"a newer daemon took over worker {worker.name!r}; this one was superseded and must stop "
            "(run one daemon per worker token)",
        )
    return worker


def record_connection(*, worker: Worker, channel_name: str, hello: protocol.Hello, info: dict) -> Worker:
    """Mark the worker online on ``channel_name`` with what its daemon reports; the newest connection wins.

    An older connection still open is closed with 4009. When the newest connection comes from another daemon
    process than the last one (``info["instance"]``), that process is remembered as superseded, so that it is
    refused (4009) if it connects again rather than take the worker back: one daemon per worker, the newest.
    """
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker.pk)
        previous_channel = worker.channel_name
        info = {
            **info,
            SUPERSEDED_KEY: superseded_instances(worker.connection_info, info.get("instance", "")),
        }
        worker.mark_online(
            channel_name=channel_name,
            resources=hello.resources,
            executors=hello.executors,
            price_floor=hello.price_floor,
            strategy=hello.strategy,
            info=info,
            reachable=hello.reachable,
            devices=hello.devices,
        )
        if hello.benchmark is not None:
            worker.record_benchmark(hello.benchmark)
        if previous_channel and previous_channel != channel_name:
            # An older connection of the same daemon may linger (half-open TCP): tell it to go.
            close_connections(
                worker.pk,
                code=protocol.CloseCode.SUPERSEDED,
                message="superseded by a newer connection of this worker",
                keep_channel=channel_name,
            )
    return worker


def superseded_instances(previous_info: dict, instance: str) -> list[str]:
    """The daemon processes refused from now on, once ``instance`` connects after the connection described by
    ``previous_info``: the ones refused before, and the previous one if it is another process (the most
    recent :data:`SUPERSEDED_KEPT`)."""
    superseded = [item for item in previous_info.get(SUPERSEDED_KEY, []) if item != instance]
    previous = previous_info.get("instance", "")
    if previous and previous != instance and previous not in superseded:
        superseded.append(previous)
    return superseded[-SUPERSEDED_KEPT:]


def benchmark_reported(*, worker: Worker, message: protocol.BenchmarkReport) -> Worker:
    """A daemon's benchmark ended: keep its score and details, or note why it failed."""
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker.pk)
        if message.benchmark is not None:
            worker.record_benchmark(message.benchmark)
            logger.info("worker %s benchmark: %.1f samples/s", worker.name, message.benchmark.score)
        else:
            worker.record_benchmark_failure(message.error)
            logger.warning("worker %s benchmark failed: %s", worker.name, message.error)
    return worker


def request_benchmark(worker: Worker) -> protocol.RunBenchmark:
    """Ask the worker's daemon to run its benchmark now (after commit); its ``benchmark_result`` frame
    brings the score. Raises :class:`WorkerOffline` when the daemon is not connected."""
    if worker.status != Worker.Status.ONLINE:
        raise WorkerOffline(f"worker {worker.name} is offline: its daemon cannot run a benchmark now")
    message = protocol.RunBenchmark()
    send_to_worker(worker.pk, message)
    logger.info("worker %s asked to run its benchmark (request %s)", worker.name, message.request_id)
    return message


def record_disconnection(*, worker: Worker, channel_name: str) -> bool:
    """Mark the worker offline unless a newer connection already took over; True if it went offline."""
    went_offline = worker.mark_offline(channel_name=channel_name)
    if went_offline:
        logger.info("worker %s went offline", worker.name)
    return went_offline


def close_revoked(worker: Worker) -> None:
    """Close the worker's connections after commit because its token is being revoked."""
    close_connections(
        worker.pk,
        code=protocol.CloseCode.TOKEN_REVOKED,
        message=f"the token of worker {worker.name!r} has been revoked",
    )


def rotate_token(worker: Worker) -> str:
    """Issue a new token and close connections made with the old one (they get 4001 when they return)."""
    token = worker.rotate_token()
    close_connections(
        worker.pk,
        code=protocol.CloseCode.INVALID_TOKEN,
        message=f"the token of worker {worker.name!r} was replaced; restart the daemon with the new one",
    )
    return token


# --- messages to daemons ----------------------------------------------------------------------------------


def send_to_worker(worker_id, message: protocol._Message) -> None:
    """Send ``message`` to the worker's daemon after commit (dropped if it is not connected)."""
    send_to_workers([(worker_id, message)])


def send_to_workers(messages: Iterable[tuple[object, protocol._Message]]) -> None:
    """Send each ``(worker id, message)`` to its daemon after commit, in one trip to the channel layer.

    The one way frames reach daemons (:func:`send_to_worker` is this with one message). An advertisement's
    frame also tells the gateway when its offer window closes (``window``), and a closing one which advert
    it closes (``closed``): each connection then declines an offer that comes too late without a database
    call (see the consumer).
    """
    sends = [(worker_group(worker_id), frame_event(message)) for worker_id, message in messages]
    if sends:
        send_on_commit(lambda: group_send_many(sends))


def frame_event(message: protocol._Message) -> dict:
    """The channel-layer event that carries ``message`` to a daemon's connection."""
    return {"type": "gateway.frame", "text": protocol.encode(message), **window_note(message)}


def window_note(message: protocol._Message) -> dict:
    """What the gateway connection notes of ``message`` (:meth:`WorkerGatewayConsumer._note_window`): when an
    advert attempt's offer window closes (``window``), or which advert a close closes (``closed``)."""
    if isinstance(message, protocol.Advertisement) and message.window_closes_in is not None:
        return {
            "window": {
                "id": str(message.advertisement_id),
                "attempt": message.attempt,
                "closes_at": time.time() + message.window_closes_in,
            }
        }
    if isinstance(message, protocol.AdvertisementClosed):
        return {"closed": str(message.advertisement_id)}
    return {}


def close_connections(worker_id, *, code: int, message: str, keep_channel: str | None = None) -> None:
    """Close the worker's connections (except ``keep_channel``) after commit, with an error frame first."""
    send_on_commit(
        lambda: group_send(
            worker_group(worker_id),
            {
                "type": "gateway.close",
                "code": int(code),
                "message": message,
                "keep_channel": keep_channel or "",
            },
        )
    )
