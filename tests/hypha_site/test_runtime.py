"""The embedded runner: Celery tasks and the beat schedule run inside the server's event loop.

Each test starts the runner on its own loop and stops it (and waits for its thread to be idle) at the end.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.contrib.auth import get_user_model
from django.db import connections
from django.utils import timezone

from apps.jobs import services as job_services
from apps.jobs import tasks
from apps.jobs.models import Job
from apps.leases import services as lease_services
from apps.leases.models import Lease
from apps.workers import services as worker_services
from hypha_site.runtime import EmbeddedRunner, enqueue
from worker_daemon import protocol

pytestmark = pytest.mark.django_db(transaction=True)

REQUIREMENTS = {
    "trainer": {
        "resources": {"cpu": 1.0, "memory": 1.0, "storage": 0.0, "gpu": 0.0},
        "executor": {"class": "train", "name": "diloco-transformer"},
        "bid": 100.0,
        "max": 100.0,
    },
    "parameter_server": {
        "resources": {"cpu": 1.0, "memory": 1.0, "storage": 0.0, "gpu": 0.0},
        "executor": {"class": "aggregate", "name": "parameter-server"},
        "bid": 100.0,
        "max": 100.0,
    },
}


async def until(check, *, timeout: float = 30.0) -> None:
    """Wait until the database-reading ``check`` holds (generous: a busy machine may be slow to get there)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await database_sync_to_async(check)():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.fixture(autouse=True)
async def _close_thread_connections():
    """Tasks and clocks ran in asgiref's thread; close its connection (CONN_MAX_AGE would keep it open, and
    an open connection keeps PostgreSQL from dropping the test database). Queued behind any tick still
    running there, so this also waits for it."""
    yield
    await database_sync_to_async(connections.close_all)()


@pytest.fixture
def embedded(settings):
    # The runner is the embedded mode's; in services mode this routes enqueue() to it all the same.
    settings.EMBEDDED_TRANSPORTS = True
    return settings


@pytest.fixture
async def runner(embedded):
    runner = EmbeddedRunner.start()
    yield runner
    EmbeddedRunner.stop()
    await asyncio.sleep(0)  # let the clocks' cancellation land
    await asyncio.gather(*runner._periodic, *runner._pending, return_exceptions=True)
    assert EmbeddedRunner.current() is None


@pytest.fixture
def ada(db):
    return get_user_model().objects.create_user(username="ada-runtime", password=None)


async def test_start_is_idempotent_and_stop_forgets_the_runner(embedded):
    # when
    first = EmbeddedRunner.start()
    second = EmbeddedRunner.start()

    # then
    try:
        assert first is second is EmbeddedRunner.current()
        assert first.loop is asyncio.get_running_loop()
        assert len(first._periodic) == 4  # the lease and market clocks, the relay and task-log sweeps
    finally:
        EmbeddedRunner.stop()
    await asyncio.gather(*first._periodic, return_exceptions=True)
    assert EmbeddedRunner.current() is None
    assert all(task.cancelled() for task in first._periodic)


async def test_a_task_enqueued_from_a_sync_to_async_thread_runs_on_the_loop(runner, ada, caplog):
    # given: create_job queues allocate_job on commit, from the thread the consumers' database calls use
    caplog.set_level(logging.ERROR, logger="hypha_site.runtime")

    # when
    job = await database_sync_to_async(job_services.create_job)(
        owner=ada, name="tiny", num_trainers=1, requirements=REQUIREMENTS
    )

    # then: the runner ran it, without asgiref's "would deadlock" refusal
    await until(lambda: Job.objects.get(pk=job.pk).advertisements.count() == 2)
    assert await database_sync_to_async(lambda: Job.objects.get(pk=job.pk).status)() == Job.Status.ALLOCATING
    assert [record.getMessage() for record in caplog.records] == []


async def test_enqueue_from_a_plain_thread_runs_on_the_loop(runner, ada):
    # given
    job = await database_sync_to_async(Job.objects.create)(owner=ada, name="later", requirements=REQUIREMENTS)

    # when: a thread outside asgiref's executor queues the allocation
    await sync_to_async(enqueue, thread_sensitive=False)(tasks.allocate_job, str(job.pk))

    # then
    await until(lambda: Job.objects.get(pk=job.pk).advertisements.count() == 2)


@pytest.fixture
def counted_ticks(monkeypatch):
    """Count the clocks' calls (the tasks call these service functions)."""
    calls = {"leases": 0, "market": 0}
    tick_leases, tick_market = job_services.tick_leases, job_services.tick_market

    def counting_leases():
        calls["leases"] += 1
        return tick_leases()

    def counting_market():
        calls["market"] += 1
        return tick_market()

    monkeypatch.setattr(job_services, "tick_leases", counting_leases)
    monkeypatch.setattr(job_services, "tick_market", counting_market)
    return calls


@pytest.fixture
def fast_clocks(embedded):
    embedded.CELERY_BEAT_SCHEDULE = {
        "lease-clock": {"task": "apps.jobs.tasks.tick_leases", "schedule": 0.05},
        "market-clock": {"task": "apps.jobs.tasks.tick_market", "schedule": 0.05},
    }


async def test_the_clocks_tick_periodically(fast_clocks, counted_ticks, runner):
    # when: the runner runs (about six ticks each in 0.3 s; a busy machine may take longer)
    deadline = asyncio.get_running_loop().time() + 30.0
    while min(counted_ticks.values()) < 3:
        assert asyncio.get_running_loop().time() < deadline, f"the clocks did not tick: {counted_ticks}"
        await asyncio.sleep(0.05)

    # then: each clock ticked again and again, not once
    assert counted_ticks["leases"] >= 3
    assert counted_ticks["market"] >= 3


async def test_the_lease_clock_expires_a_run_out_lease(fast_clocks, ada):
    # given: an ACTIVE lease that ran out
    def given() -> Lease:
        worker, _ = worker_services.create_worker(name="rig-runtime")
        job_services.worker_connected(
            worker=worker,
            channel_name="test.rig-runtime",
            hello=protocol.Hello(
                protocol_version=1, resources=protocol.Resources(cpu=8, memory=32), executors=[]
            ),
            info={},
        )
        job = Job.objects.create(owner=ada, name="short", requirements=REQUIREMENTS)
        lease = lease_services.reserve(
            worker_id=worker.pk, job=job, role="trainer", resources=protocol.Resources(cpu=1), price=1.0
        )
        lease.activate(ttl=timedelta(seconds=10))
        Lease.objects.filter(pk=lease.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
        return lease

    lease = await database_sync_to_async(given)()

    # when
    runner = EmbeddedRunner.start()
    try:
        await until(lambda: Lease.objects.get(pk=lease.pk).status == Lease.Status.EXPIRED)
    finally:
        EmbeddedRunner.stop()
        await asyncio.gather(*runner._periodic, return_exceptions=True)

    # then
    ended = await database_sync_to_async(Lease.objects.get)(pk=lease.pk)
    assert ended.status_reason == "not renewed before it ran out"


def test_the_clocks_ticks_expire_in_the_broker_so_a_backlog_is_dropped(settings):
    """A saturated Celery worker must not run a queue of stale lease ticks one after another (each would
    renew and expire leases late): beat sends the clocks' ticks with ``expires``, which the worker honours by
    revoking the ones it takes too late (bench/fleet.py at 1,000 daemons)."""
    for name in ("lease-clock", "market-clock"):
        entry = settings.CELERY_BEAT_SCHEDULE[name]
        expires = entry["options"]["expires"]
        assert entry["schedule"] < expires <= max(2.0, 4 * entry["schedule"]), entry
