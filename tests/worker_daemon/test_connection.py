"""The daemon against a scripted control plane (a websockets server on 127.0.0.1 played by the test)."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from worker_daemon import protocol
from worker_daemon.connection import INSTANCE_HEADER, WorkerDaemon, daemon_version, run_daemon
from worker_daemon.exceptions import ExitCode

CAPACITY = protocol.Resources(cpu=8, memory=32, storage=100, gpu=24)
CAPACITY_FRAME = {"cpu": 8.0, "memory": 32.0, "storage": 100.0, "gpu": 24.0}


def test_backoff_is_full_jitter_capped_and_exponential(worker_config):
    ceilings = []

    def uniform(low, high):
        ceilings.append((low, high))
        return high / 2

    daemon = WorkerDaemon(config=worker_config, server_url="http://h", token="t", uniform=uniform)

    delays = [daemon.backoff_delay(attempt) for attempt in range(8)]

    assert ceilings == [(0.0, c) for c in (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0)]
    assert delays == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0]
    assert daemon.backoff_delay(10_000) == 15.0


async def win_lease(connection, make, advertisement, *, expires_in=30.0) -> tuple[uuid.UUID, protocol.Offer]:
    """Play the control plane's side of a won offer; return the lease id and the daemon's offer."""
    offer = await connection.expect(protocol.Offer)
    assert offer.advertisement_id == advertisement.advertisement_id
    lease_id = uuid.uuid4()
    await connection.send(
        protocol.OfferReceived(
            advertisement_id=advertisement.advertisement_id,
            offer_id=uuid.uuid4(),
            lease_id=lease_id,
            expires_in=2.0,
        )
    )
    await connection.send(
        make.grant(advertisement, lease_id, resources=offer.resources, expires_in=expires_in)
    )
    return lease_id, offer


async def test_daemon_says_hello_with_its_token(control_plane, daemons, worker_config, make):
    daemons.start(config=worker_config, server_url=control_plane.url)

    connection = await control_plane.next_connection()
    hello = await connection.expect(protocol.Hello)

    assert make.frame(hello) == {
        "type": "hello",
        "protocol_version": 1,
        "daemon_version": daemon_version(),
        "resources": CAPACITY_FRAME,
        "devices": [],
        "executors": [
            {"class": "train", "name": "diloco-transformer"},
            {"class": "aggregate", "name": "parameter-server"},
            {"class": "inference", "name": "batch-inference"},
        ],
        "price_floor": 100.0,
        "strategy": "whole",
        "leases": [],
        "benchmark": None,  # no benchmark at start for a WorkerDaemon unless asked (the CLI asks)
        "reachable": "auto",  # [parameter_server] reachable: not said
    }
    assert connection.headers["Authorization"] == "Bearer secret-token"
    assert connection.headers["User-Agent"] == f"hypha-worker-daemon/{daemon_version()}"


async def test_offers_on_a_fitting_advert_only(control_plane, daemons, worker_config, make):
    daemon, _ = daemons.start(config=worker_config, server_url=control_plane.url)
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)
    fitting = make.advertisement(bid=150.0)
    too_big = make.advertisement(bid=1000.0, resources={"gpu": 48})
    wrong_executor = make.advertisement(bid=1000.0, executors=[{"class": "infer", "name": "llm"}])
    too_cheap = make.advertisement(bid=99.0)

    await connection.send(make.welcome(advertisements=[too_big, fitting]))
    await connection.send(wrong_executor)
    await connection.send(too_cheap)

    offer = await connection.expect(protocol.Offer)
    assert make.frame(offer) == {
        "type": "offer",
        "advertisement_id": str(fitting.advertisement_id),
        "attempt": 0,
        "price": 150.0,
        "resources": CAPACITY_FRAME,
        "devices": [],
        "benchmark_score": None,
    }
    await connection.expect_silence()
    assert [r.advertisement_id for r in daemon.session.book.reservations] == [fitting.advertisement_id]


async def test_adverts_in_one_window_are_compared(control_plane, daemons, worker_config, make):
    daemons.start(config=worker_config, server_url=control_plane.url, batch_window=0.2)
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)
    await connection.send(make.welcome())
    worse, better = make.advertisement(bid=150.0), make.advertisement(bid=200.0)

    await connection.send(worse)
    await connection.send(better)

    offer = await connection.expect(protocol.Offer)
    assert (offer.advertisement_id, offer.price) == (better.advertisement_id, 200.0)
    await connection.expect_silence()
    await connection.send(protocol.OfferDeclined(advertisement_id=better.advertisement_id, reason="outbid"))
    offer = await connection.expect(protocol.Offer)
    assert (offer.advertisement_id, offer.price) == (worse.advertisement_id, 150.0)


async def test_answers_renewals(control_plane, daemons, worker_config, make):
    daemon, _ = daemons.start(config=worker_config, server_url=control_plane.url)
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)
    advertisement = make.advertisement()
    await connection.send(make.welcome(advertisements=[advertisement]))
    lease_id, _ = await win_lease(connection, make, advertisement)
    unknown = uuid.uuid4()

    await connection.send(protocol.RenewLease(lease_id=lease_id, expires_in=30.0))
    await connection.send(protocol.RenewLease(lease_id=unknown, expires_in=30.0))

    assert make.frame(await connection.expect(protocol.LeaseRenewed)) == {
        "type": "lease_renewed",
        "lease_id": str(lease_id),
    }
    assert make.frame(await connection.expect(protocol.RenewRefused)) == {
        "type": "renew_refused",
        "lease_id": str(unknown),
        "reason": "lease not held by this daemon",
    }
    [lease] = daemon.session.book.leases
    assert (lease.lease_id, lease.job_id, lease.role, lease.resources) == (
        lease_id,
        advertisement.job_id,
        "trainer",
        CAPACITY,
    )
    assert daemon.session.book.reservations == []


async def test_drops_a_lease_that_is_not_renewed(control_plane, daemons, worker_config, make, caplog):
    daemon, _ = daemons.start(config=worker_config, server_url=control_plane.url)
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)
    advertisement = make.advertisement()
    await connection.send(make.welcome(advertisements=[advertisement]))

    with caplog.at_level(logging.INFO, logger="worker_daemon.connection"):
        lease_id, _ = await win_lease(connection, make, advertisement, expires_in=0.3)
        await make.wait_until(lambda: daemon.session.book.lease_ids() == [lease_id])
        started = asyncio.get_running_loop().time()
        await make.wait_until(lambda: daemon.session.book.leases == [])

    assert asyncio.get_running_loop().time() - started < 1.0
    assert daemon.session.book.free() == CAPACITY
    assert (
        f"lease {lease_id} not renewed, dropped (job {advertisement.job_id}, role trainer)" in caplog.messages
    )
    # the freed capacity is offered again
    later = make.advertisement(bid=170.0)
    await connection.send(later)
    offer = await connection.expect(protocol.Offer)
    assert (offer.advertisement_id, offer.price) == (later.advertisement_id, 170.0)


async def test_ignores_invalid_frames(control_plane, daemons, worker_config, make):
    daemons.start(config=worker_config, server_url=control_plane.url)
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)
    await connection.send(make.welcome())

    await connection.send_raw("not json")
    await connection.send_raw('{"type": "surprise"}')
    await connection.send_raw('{"type": "advertisement", "bid": "a lot"}')
    await connection.send(protocol.Error(code=protocol.ErrorCode.UNKNOWN_LEASE, message="no such lease"))
    advertisement = make.advertisement()
    await connection.send(advertisement)

    offer = await connection.expect(protocol.Offer)
    assert offer.advertisement_id == advertisement.advertisement_id


async def test_reconnects_and_claims_its_leases(control_plane, daemons, worker_config, make):
    daemon, _ = daemons.start(config=worker_config, server_url=control_plane.url)
    first = await control_plane.next_connection()
    await first.expect(protocol.Hello)
    advertisement = make.advertisement()
    await first.send(make.welcome(advertisements=[advertisement]))
    lease_id, _ = await win_lease(first, make, advertisement)
    pending = make.advertisement(bid=500.0, resources={"cpu": 1})
    await make.wait_until(lambda: daemon.session.book.lease_ids() == [lease_id])

    # when the control plane drops the connection without a close frame
    await first.send(pending)
    first.websocket.transport.abort()

    # then the daemon comes back and claims the active lease, and only it
    second = await control_plane.next_connection()
    hello = await second.expect(protocol.Hello)
    assert hello.leases == [lease_id]
    assert daemon.session.book.reservations == []
    await second.send(make.welcome(leases=[make.lease_info(lease_id, expires_in=30.0)]))
    await make.wait_until(lambda: daemon.session.welcomed)
    assert daemon.session.book.lease_ids() == [lease_id]
    assert daemon.session.open_advertisements == []


async def test_reconnect_backoff_grows_and_resets_after_welcome(control_plane, daemons, worker_config, make):
    ceilings = []

    def uniform(low, high):
        ceilings.append(high)
        return 0.0

    daemon, _ = daemons.start(
        config=worker_config, server_url=control_plane.url, uniform=uniform, backoff_base=0.01
    )
    for _ in range(3):  # three connections closed before any welcome
        connection = await control_plane.next_connection()
        await connection.expect(protocol.Hello)
        await connection.close(4010, "server shutting down")
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)
    await connection.send(make.welcome())
    await make.wait_until(lambda: daemon.session.welcomed)
    await connection.close(1001)
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)

    assert ceilings == [0.01, 0.02, 0.04, 0.01]


async def test_welcome_drops_leases_the_control_plane_does_not_list(
    control_plane, daemons, worker_config, make
):
    daemon, _ = daemons.start(config=worker_config, server_url=control_plane.url)
    first = await control_plane.next_connection()
    await first.expect(protocol.Hello)
    advertisement = make.advertisement()
    await first.send(make.welcome(advertisements=[advertisement]))
    lease_id, _ = await win_lease(first, make, advertisement)
    await make.wait_until(lambda: daemon.session.book.lease_ids() == [lease_id])
    await first.close(1011)

    second = await control_plane.next_connection()
    assert (await second.expect(protocol.Hello)).leases == [lease_id]
    await second.send(make.welcome(leases=[]))

    await make.wait_until(lambda: daemon.session.welcomed)
    assert daemon.session.book.leases == []


@pytest.mark.parametrize(
    ("code", "exit_code"),
    [
        (protocol.CloseCode.MISSING_TOKEN, ExitCode.TOKEN_REFUSED),
        (protocol.CloseCode.INVALID_TOKEN, ExitCode.TOKEN_REFUSED),
        (protocol.CloseCode.TOKEN_REVOKED, ExitCode.TOKEN_REFUSED),
        (protocol.CloseCode.UNSUPPORTED_VERSION, ExitCode.UNSUPPORTED_VERSION),
    ],
)
async def test_fatal_close_codes_end_the_daemon(
    control_plane, daemons, worker_config, caplog, code, exit_code
):
    _, task = daemons.start(config=worker_config, server_url=control_plane.url)
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)

    with caplog.at_level(logging.ERROR, logger="worker_daemon.connection"):
        await connection.close(code, "no entry")
        result = await asyncio.wait_for(task, 5)

    assert result == exit_code
    assert int(exit_code) in (3, 4)
    assert control_plane.handshakes == 1  # no retry
    assert caplog.messages == [
        f"the control plane closed the connection: code {int(code)} ({code.name}), reason 'no entry'; "
        f"giving up (exit code {int(exit_code)})"
    ]


async def test_the_daemon_names_its_process_on_every_handshake(control_plane, daemons, worker_config, make):
    # given
    daemon, _ = daemons.start(config=worker_config, server_url=control_plane.url)
    first = await control_plane.next_connection()
    await first.expect(protocol.Hello)

    # when: the connection is lost and the daemon reconnects
    await first.close(4010, "server shutting down")
    second = await control_plane.next_connection()
    await second.expect(protocol.Hello)

    # then: both handshakes name the same process (and another daemon is another process)
    assert len(daemon.instance_id) == 32 and int(daemon.instance_id, 16) >= 0
    assert first.headers[INSTANCE_HEADER] == second.headers[INSTANCE_HEADER] == daemon.instance_id
    other = WorkerDaemon(config=worker_config, server_url=control_plane.url, token="t")
    assert other.instance_id != daemon.instance_id


async def test_a_superseded_daemon_exits_6_without_reconnecting_or_releasing(
    control_plane, daemons, worker_config, make, caplog
):
    # given: a daemon holding a lease
    daemon, task = daemons.start(config=worker_config, server_url=control_plane.url)
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)
    advertisement = make.advertisement()
    await connection.send(make.welcome(advertisements=[advertisement]))
    lease_id, _ = await win_lease(connection, make, advertisement)
    await make.wait_until(lambda: daemon.session.book.lease_ids() == [lease_id])

    # when: another daemon with the same token took the worker over
    with caplog.at_level(logging.ERROR, logger="worker_daemon.connection"):
        await connection.close(protocol.CloseCode.SUPERSEDED)
        result = await asyncio.wait_for(task, 5)

    # then: it stops, without taking the worker back and without releasing the lease (the newer daemon's now)
    assert result == ExitCode.SUPERSEDED == 6
    assert control_plane.handshakes == 1
    assert connection.received.empty()
    assert caplog.messages == [
        "another daemon connected with this worker's token and took the worker over (code 4009 (SUPERSEDED)); "
        "this one stops. Run exactly one daemon per worker token; giving up (exit code 6)"
    ]


async def test_invalid_token_exits_3(control_plane, daemons, worker_config):
    _, task = daemons.start(config=worker_config, server_url=control_plane.url)
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)

    await connection.close(4001, "invalid token")

    assert await asyncio.wait_for(task, 5) == 3


@pytest.mark.parametrize("status", [401, 403])
async def test_handshake_refused_with_401_or_403_exits_3(control_plane, daemons, worker_config, status):
    control_plane.reject_status = status
    _, task = daemons.start(config=worker_config, server_url=control_plane.url)

    assert await asyncio.wait_for(task, 5) == ExitCode.TOKEN_REFUSED
    assert control_plane.handshakes == 1


async def test_other_handshake_failures_are_retried(control_plane, daemons, worker_config):
    control_plane.reject_status = 503
    daemon, task = daemons.start(config=worker_config, server_url=control_plane.url)

    deadline = asyncio.get_running_loop().time() + 5
    while control_plane.handshakes < 3 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)

    assert control_plane.handshakes >= 3
    assert not task.done()
    daemon.request_shutdown()
    assert await asyncio.wait_for(task, 5) == ExitCode.OK


async def test_shutdown_releases_leases_then_closes_normally(control_plane, daemons, worker_config, make):
    daemon, task = daemons.start(config=worker_config, server_url=control_plane.url, shutdown_timeout=3.0)
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)
    advertisement = make.advertisement()
    await connection.send(make.welcome(advertisements=[advertisement]))
    lease_id, _ = await win_lease(connection, make, advertisement)
    await make.wait_until(lambda: daemon.session.book.lease_ids() == [lease_id])

    # when (what SIGTERM and SIGINT call)
    started = asyncio.get_running_loop().time()
    daemon.request_shutdown(reason="received SIGTERM")

    # then
    release = await connection.expect(protocol.ReleaseLease)
    assert make.frame(release) == {
        "type": "release_lease",
        "lease_id": str(lease_id),
        "reason": "daemon shutting down",
    }
    await connection.send(
        protocol.LeaseEnded(lease_id=lease_id, status="released", reason="released by worker")
    )
    assert await asyncio.wait_for(task, 5) == ExitCode.OK == 0
    assert asyncio.get_running_loop().time() - started < 1.0  # did not wait for the 3 s timeout
    await asyncio.wait_for(connection.closed.wait(), 5)
    assert connection.websocket.close_code == 1000
    assert connection.websocket.close_reason == "daemon shutting down"
    assert daemon.session.book.leases == []


async def test_shutdown_waits_at_most_the_timeout_for_lease_ended(
    control_plane, daemons, worker_config, make
):
    daemon, task = daemons.start(config=worker_config, server_url=control_plane.url, shutdown_timeout=0.3)
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)
    advertisement = make.advertisement()
    await connection.send(make.welcome(advertisements=[advertisement]))
    lease_id, _ = await win_lease(connection, make, advertisement)
    await make.wait_until(lambda: daemon.session.book.lease_ids() == [lease_id])

    daemon.request_shutdown()

    assert (await connection.expect(protocol.ReleaseLease)).lease_id == lease_id
    assert await asyncio.wait_for(task, 5) == ExitCode.OK
    await asyncio.wait_for(connection.closed.wait(), 5)
    assert connection.websocket.close_code == 1000


async def test_shutdown_while_disconnected_is_immediate(worker_config, unused_tcp_port):
    daemon = WorkerDaemon(
        config=worker_config,
        server_url=f"http://127.0.0.1:{unused_tcp_port}",
        token="t",
        backoff_base=60.0,
        backoff_cap=60.0,
        uniform=lambda low, high: high,  # every backoff is the full 60 s
    )
    task = asyncio.create_task(daemon.run())
    await asyncio.sleep(0.2)  # refused, now sleeping in backoff

    started = asyncio.get_running_loop().time()
    daemon.request_shutdown()

    # then: it does not wait out the 60 s backoff (a bound far below it, so a busy machine passes too)
    assert await asyncio.wait_for(task, 30) == ExitCode.OK
    assert asyncio.get_running_loop().time() - started < 10.0


async def test_run_daemon_returns_the_exit_code(control_plane, worker_config):
    task = asyncio.create_task(
        run_daemon(config=worker_config, server_url=control_plane.url, token="t", backoff_base=0.01)
    )
    connection = await control_plane.next_connection()
    await connection.expect(protocol.Hello)

    await connection.close(4002, "protocol version 1 is not supported")

    assert await asyncio.wait_for(task, 5) == ExitCode.UNSUPPORTED_VERSION == 4


async def test_shutdown_during_a_hanging_handshake_is_immediate(worker_config):
    # given a server that accepts TCP connections and never answers the websocket handshake
    accepted = asyncio.Event()
    writers = []

    async def silent(reader, writer):
        writers.append(writer)
        accepted.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    daemon = WorkerDaemon(
        config=worker_config, server_url=f"http://127.0.0.1:{port}", token="t", open_timeout=60
    )
    task = asyncio.create_task(daemon.run())
    await asyncio.wait_for(accepted.wait(), 5)

    # when
    started = asyncio.get_running_loop().time()
    daemon.request_shutdown()

    # then: it does not wait out the 60 s handshake timeout (a bound far below it, so a busy machine passes too)
    assert await asyncio.wait_for(task, 30) == ExitCode.OK
    assert asyncio.get_running_loop().time() - started < 10.0
    for writer in writers:
        writer.close()
    server.close()
    await server.wait_closed()


async def test_a_handshake_timeout_is_retried(worker_config, caplog):
    async def silent(reader, writer):
        await reader.read()  # never answers; returns when the daemon gives up on the connection
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    daemon = WorkerDaemon(
        config=worker_config,
        server_url=f"http://127.0.0.1:{port}",
        token="t",
        open_timeout=0.1,
        backoff_base=0.01,
    )
    with caplog.at_level(logging.INFO, logger="worker_daemon.connection"):
        task = asyncio.create_task(daemon.run())
        deadline = asyncio.get_running_loop().time() + 5
        while sum("reconnecting" in m for m in caplog.messages) < 2:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        daemon.request_shutdown()
        assert await asyncio.wait_for(task, 5) == ExitCode.OK
    server.close()
    await server.wait_closed()

    assert (
        f"connection to ws://127.0.0.1:{port}/ws/worker/ failed: timed out during opening handshake"
        in caplog.messages
    )
