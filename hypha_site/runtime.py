"""How side effects leave a transaction: Celery tasks and channel-layer messages, sent on commit.

With ``REDIS_URL`` set, :func:`enqueue_on_commit` is plain ``task.apply_async`` to the Celery broker and the
beat process runs the clocks. In the embedded default there is no broker: the daphne process hosts an
:class:`EmbeddedRunner` on its event loop that runs the *same* Celery task functions (``task.apply``) and the
*same* beat schedule. Tasks run through ``sync_to_async`` on the event loop's thread pool, so a task that
``group_send``\\ s reaches the in-memory channel layer of the consumers in the same process.

Outside a server (tests, management commands) there is no runner: immediate tasks run eagerly in the
calling thread, which is what Celery's ``task_always_eager`` does.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable
from typing import Any

from asgiref.sync import async_to_sync, sync_to_async
from celery import Task
from django.conf import settings
from django.db import close_old_connections, transaction

logger = logging.getLogger(__name__)

#: Channel-layer sends in flight at once in :func:`group_send_many`.
SEND_CONCURRENCY = 16


def enqueue_on_commit(task: Task, *args: Any) -> None:
    """Queue ``task(*args)`` once the current transaction commits (at once outside a transaction)."""
    transaction.on_commit(lambda: enqueue(task, *args))


def enqueue(task: Task, *args: Any) -> None:
    if not settings.EMBEDDED_TRANSPORTS:
        task.apply_async(args=args)
        return
    runner = EmbeddedRunner.current()
    if runner is not None:
        runner.submit(task, args)
    else:
        # Eagerly, in the caller's thread: its database connection is the caller's, maybe still inside an
        # atomic block (a test capturing on_commit callbacks), so it is not ours to close.
        _run_task(task, args, close_connection=False)


def send_on_commit(send: Callable[[], None]) -> None:
    """Run a channel-layer send after commit; a failure to deliver is logged, never raised into the caller."""

    def deliver() -> None:
        try:
            send()
        except Exception:  # a broker outage must not undo or fail the committed work
            logger.exception("channel layer delivery failed")

    transaction.on_commit(deliver)


def group_send(group: str, message: dict) -> None:
    """Send to a channel-layer group from synchronous code (a service, a task)."""
    from channels.layers import get_channel_layer

    async_to_sync(get_channel_layer().group_send)(group, message)


def group_send_many(sends: list[tuple[str, dict]]) -> None:
    """Send each ``(group, message)`` from synchronous code, all in one trip into asyncio.

    From a thread without an event loop (a Celery task, a service) every ``async_to_sync`` call runs a new
    event loop, and channels_redis opens a new Redis connection for each loop: sent one call at a time, a
    lease tick's renewal requests or a settlement's declines cost ≈ 3 ms each; 200 in one call ≈ 0.25 ms
    each (``bench/channel_sends.py``; docs/benchmarks.md, "Fleet"). Every send is attempted; the first
    failure is raised after the others.
    """
    if not sends:
        return
    from channels.layers import get_channel_layer

    layer = get_channel_layer()

    async def send_all() -> None:
        # Each send in flight holds one Redis connection of this (new) loop's pool: a few at a time.
        limit = asyncio.Semaphore(SEND_CONCURRENCY)

        async def send(group: str, message: dict) -> None:
            async with limit:
                await layer.group_send(group, message)

        results = await asyncio.gather(
            *(send(group, message) for group, message in sends), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async_to_sync(send_all)()


def _run_task(task: Task, args: tuple, *, close_connection: bool = True) -> None:
    try:
        task.apply(args=args, throw=True)
    except Exception:
        logger.exception("task %s%r failed", task.name, args)
    finally:
        if close_connection:
            close_old_connections()


class EmbeddedRunner:
    """Runs Celery tasks and the beat schedule inside the server's event loop (embedded default only).

    Tasks run one at a time on the thread that ``sync_to_async(thread_sensitive=True)`` uses, the same
    thread the consumers' database calls use; on SQLite that serialises every write in the process.
    """

    _current: EmbeddedRunner | None = None
    _lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._periodic: list[asyncio.Task] = []
        self._pending: set[asyncio.Task] = set()

    @classmethod
    def current(cls) -> EmbeddedRunner | None:
        runner = cls._current
        if runner is not None and runner.loop.is_closed():
            cls._current = None  # its loop is gone (a test's loop, say): start afresh on the next one
            return None
        return runner

    @classmethod
    def start(cls, loop: asyncio.AbstractEventLoop | None = None) -> EmbeddedRunner:
        """Start the runner on ``loop`` (the running loop by default); idempotent per process."""
        with cls._lock:
            if cls._current is not None:
                return cls._current
            runner = cls(loop or asyncio.get_running_loop())
            cls._current = runner
        runner._start_clocks()
        logger.info("embedded task runner started (%d clocks)", len(settings.CELERY_BEAT_SCHEDULE))
        return runner

    @classmethod
    def stop(cls) -> None:
        with cls._lock:
            runner, cls._current = cls._current, None
        if runner is not None:
            for task in runner._periodic:
                runner.loop.call_soon_threadsafe(task.cancel)

    def submit(self, task: Task, args: tuple) -> None:
        def schedule() -> None:
            pending = self.loop.create_task(sync_to_async(_run_task, thread_sensitive=True)(task, args))
            self._pending.add(pending)
            pending.add_done_callback(self._pending.discard)

        # A fresh context: the caller's (a sync_to_async thread) marks asgiref's single executor as busy, and
        # a task that inherited it would refuse to run ("would deadlock").
        self.loop.call_soon_threadsafe(schedule, context=contextvars.Context())

    def _start_clocks(self) -> None:
        from hypha_site.celery import app

        for name, entry in settings.CELERY_BEAT_SCHEDULE.items():
            task = app.tasks[entry["task"]]
            period = float(entry["schedule"])
            self._periodic.append(self.loop.create_task(self._clock(name, task, period)))

    async def _clock(self, name: str, task: Task, period: float) -> None:
        run = sync_to_async(_run_task, thread_sensitive=True)
        while True:
            started = self.loop.time()
            await run(task, ())
            await asyncio.sleep(max(0.0, period - (self.loop.time() - started)))
