"""The worker gateway, driven with WebsocketCommunicator against ``hypha_site.asgi.router`` (no task runner:
queued tasks run eagerly after commit, in the thread that committed).

Refused and malformed frames must get an ``error`` frame and change nothing in the database.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.db import connections
from django.utils import timezone

from apps.jobs import services as job_services
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job
from apps.leases.models import Lease
from apps.market import services as market
from apps.market.models import Offer
from apps.workers.models import Worker
from hypha_site.asgi import router
from tests.apps.conftest import CAPACITY, REQUIREMENTS, advert, connect, hello, market_rows, offer_on
from worker_daemon import protocol

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 30.0  # generous: a loaded CI machine runs the database calls in a thread pool


snapshot = database_sync_to_async(market_rows)


@pytest.fixture
async def gateway():
    """Opens communicators (``await gateway(token)``) and disconnects every one of them at the end."""
    opened: list[WebsocketCommunicator] = []

    async def open_connection(token: str | None) -> WebsocketCommunicator:
        headers = [(b"authorization", f"Bearer {token}".encode())] if token is not None else []
        communicator = WebsocketCommunicator(router, "/ws/worker/", headers=headers)
        opened.append(communicator)
        connected, _ = await communicator.connect(timeout=TIMEOUT)
        assert connected  # refusals are accepted first, so that an error frame can say why
        return communicator

    yield open_connection
    for communicator in opened:
        if not communicator.future.done():
            await communicator.disconnect(timeout=TIMEOUT)
    # The consumers' database calls ran in asgiref's thread; with CONN_MAX_AGE (PostgreSQL) its connection
    # would outlive the test and keep the test database from being dropped at the end of the session.
    await database_sync_to_async(connections.close_all)()


async def greet(communicator: WebsocketCommunicator, **hello_fields) -> dict:
    await communicator.send_to(text_data=protocol.encode(hello(**hello_fields)))
    welcome = await communicator.receive_json_from(timeout=TIMEOUT)
    assert welcome["type"] == "welcome", welcome
    return welcome


async def receive(communicator: WebsocketCommunicator, count: int = 1) -> list[dict]:
    return [await communicator.receive_json_from(timeout=TIMEOUT) for _ in range(count)]


async def closed_with(communicator: WebsocketCommunicator) -> int:
    output = await communicator.receive_output(timeout=TIMEOUT)
    assert output["type"] == "websocket.close", output
    return output["code"]


async def eventually(check, *, timeout: float = TIMEOUT) -> None:
    """Wait until the database-reading ``check`` holds (a frame without a reply has been handled)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await database_sync_to_async(check)():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def warnings_in(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def as_frame(message: protocol._Message) -> dict:
    return json.loads(protocol.encode(message))


# --- refusing connections ---------------------------------------------------------------------------------


async def test_a_connection_without_a_token_is_closed_4000(gateway):
    # when
    communicator = await gateway(None)

    # then
    assert await receive(communicator) == [
        as_frame(
            protocol.Error(
                code=protocol.ErrorCode.REFUSED,
                message="no token: send 'Authorization: Bearer <worker token>'",
            )
        )
    ]
    assert await closed_with(communicator) == protocol.CloseCode.MISSING_TOKEN == 4000


async def test_an_unknown_token_is_closed_4001(gateway, rig_a):
    # when
    communicator = await gateway("hw_not-a-token")

    # then
    [frame] = await receive(communicator)
    assert (frame["type"], frame["code"], frame["message"]) == ("error", "refused", "unknown worker token")
    assert await closed_with(communicator) == 4001


async def test_a_revoked_token_is_closed_4003(gateway, rig_a):
    # given
    await database_sync_to_async(rig_a.revoke_token)()

    # when
    communicator = await gateway(rig_a.token)

    # then
    [frame] = await receive(communicator)
    assert frame["message"] == "the token of worker 'rig-a' has been revoked"
    assert await closed_with(communicator) == 4003


async def test_a_first_message_other_than_hello_is_closed_4004(gateway, rig_a):
    # given
    communicator = await gateway(rig_a.token)
    before = await snapshot()

    # when
    await communicator.send_json_to({"type": "lease_renewed", "lease_id": str(uuid.uuid4())})

    # then
    [frame] = await receive(communicator)
    assert frame["message"] == "the first message must be 'hello', not 'lease_renewed'"
    assert await closed_with(communicator) == 4004
    assert await snapshot() == before


async def test_an_unsupported_protocol_version_is_closed_4002(gateway, rig_a):
    # given
    communicator = await gateway(rig_a.token)
    before = await snapshot()

    # when
    await communicator.send_to(text_data=protocol.encode(hello(version=99)))

    # then
    [frame] = await receive(communicator)
    assert frame["message"] == "protocol version 99 is not supported; this control plane speaks [1]"
    assert await closed_with(communicator) == 4002
    assert await snapshot() == before


# --- refusing frames ----------------------------------------------------------------------------------------

BAD_FRAMES = {
    "not json": ("{oops", "malformed", None),
    "not an object": ("[1, 2]", "malformed", None),
    "no type": ('{"lease_id": "x"}', "malformed", None),
    "unknown type": ('{"type": "dance"}', "unknown_type", "dance"),
    "invalid field": (
        json.dumps(
            {
                "type": "offer",
                "advertisement_id": str(uuid.uuid4()),
                "attempt": 0,
                "price": -1,
                "resources": {},
            }
        ),
        "malformed",
        "offer",
    ),
    "a server message": ('{"type": "welcome"}', "unknown_type", "welcome"),
}


@pytest.mark.parametrize("case", list(BAD_FRAMES))
async def test_a_bad_frame_gets_an_error_and_changes_nothing(gateway, rig_a, case):
    # given
    text, code, ref = BAD_FRAMES[case]
    communicator = await gateway(rig_a.token)
    await greet(communicator)
    before = await snapshot()

    # when
    await communicator.send_to(text_data=text)

    # then: an error frame, the connection stays open, nothing changed
    [frame] = await receive(communicator)
    assert (frame["type"], frame["code"], frame["ref"]) == ("error", code, ref)
    assert await communicator.receive_nothing(timeout=0.1)
    assert await snapshot() == before


async def test_an_invalid_field_is_named_in_the_error(gateway, rig_a):
    # given
    communicator = await gateway(rig_a.token)
    await greet(communicator)

    # when
    await communicator.send_to(text_data=BAD_FRAMES["invalid field"][0])

    # then
    [frame] = await receive(communicator)
    assert frame["message"] == "invalid 'offer': price: Input should be greater than or equal to 0"


async def test_a_binary_frame_is_malformed(gateway, rig_a):
    # given
    communicator = await gateway(rig_a.token)
    await greet(communicator)
    before = await snapshot()

    # when
    await communicator.send_to(bytes_data=b"\x00\x01")

    # then
    [frame] = await receive(communicator)
    assert (frame["code"], frame["message"]) == ("malformed", "binary frames are not part of the protocol")
    assert await snapshot() == before


async def test_an_oversize_frame_is_refused_too_large(gateway, rig_a):
    # given
    communicator = await gateway(rig_a.token)
    await greet(communicator)
    before = await snapshot()
    limit = settings.HYPHA_WS_MAX_MESSAGE_BYTES
    text = json.dumps({"type": "release_lease", "lease_id": str(uuid.uuid4()), "reason": "x" * limit})

    # when
    await communicator.send_to(text_data=text)

    # then
    [frame] = await receive(communicator)
    assert (frame["code"], frame["message"]) == ("too_large", f"frame of {len(text)} bytes exceeds {limit}")
    assert await snapshot() == before


async def test_an_oversize_frame_is_logged_and_the_connection_stays_usable(gateway, rig_a, caplog):
    # given: a frame under the limit in characters but over it in UTF-8 bytes (3 bytes per "€")
    communicator = await gateway(rig_a.token)
    await greet(communicator)
    before = await snapshot()
    limit = settings.HYPHA_WS_MAX_MESSAGE_BYTES
    text = json.dumps(
        {"type": "release_lease", "lease_id": str(uuid.uuid4()), "reason": "€" * (limit // 2)},
        ensure_ascii=False,
    )
    assert len(text) < limit < len(text.encode())

    # when
    with caplog.at_level("WARNING", logger="apps.workers.consumers"):
        await communicator.send_to(text_data=text)
        [frame] = await receive(communicator)

    # then: refused with its byte size, logged, nothing changed
    size = len(text.encode())
    assert (frame["code"], frame["message"]) == ("too_large", f"frame of {size} bytes exceeds {limit}")
    assert warnings_in(caplog) == [f"worker rig-a sent a {size}-byte frame; refused (limit {limit})"]
    assert await snapshot() == before
    # and the connection still works: the next frame is handled
    lease_id = str(uuid.uuid4())
    await communicator.send_to(text_data=json.dumps({"type": "lease_renewed", "lease_id": lease_id}))
    [frame] = await receive(communicator)
    assert (frame["code"], frame["lease_id"]) == ("unknown_lease", lease_id)


# --- rate limits ----------------------------------------------------------------------------------------------


def renewal_of_nothing() -> str:
    """A frame that is handled (answered ``unknown_lease``) and changes nothing."""
    return json.dumps({"type": "lease_renewed", "lease_id": str(uuid.uuid4())})


RATE_LIMITED = (
    "error",
    "rate_limited",
    "over the rate limit of 0.001 frames/s (burst 3); frame dropped",
)


async def test_frames_over_the_rate_limit_are_refused_and_change_nothing(gateway, rig_a, settings, caplog):
    # given: a bucket of 3 frames that practically never refills; the hello takes one
    settings.HYPHA_WS_RATE, settings.HYPHA_WS_BURST, settings.HYPHA_WS_FLOOD_REFUSALS = 0.001, 3, 100
    communicator = await gateway(rig_a.token)
    await greet(communicator)
    before = await snapshot()

    # when: four frames, of which two fit
    with caplog.at_level("WARNING", logger="apps.workers.consumers"):
        for _ in range(4):
            await communicator.send_to(text_data=renewal_of_nothing())
        frames = await receive(communicator, 4)

    # then: two refused as they arrived, without being looked at (so answered first), two handled; logged once
    assert [(frame["type"], frame["code"], frame["message"]) for frame in frames[:2]] == [RATE_LIMITED] * 2
    assert [frame["ref"] for frame in frames[:2]] == [None, None]
    assert [frame["code"] for frame in frames[2:]] == ["unknown_lease", "unknown_lease"]
    assert warnings_in(caplog) == [
        "worker rig-a: 1 frame(s) over the rate limit (0.001 frames/s, burst 3) refused"
    ]
    # and the connection stays open, nothing changed
    assert await communicator.receive_nothing(timeout=0.1)
    assert await snapshot() == before


async def test_a_flooding_connection_is_closed_4008_and_others_are_not_affected(
    gateway, rig_a, rig_b, settings, caplog
):
    # given: two connections, each with its own bucket
    settings.HYPHA_WS_RATE, settings.HYPHA_WS_BURST, settings.HYPHA_WS_FLOOD_REFUSALS = 0.001, 3, 4
    flooder = await gateway(rig_a.token)
    bystander = await gateway(rig_b.token)
    await greet(flooder)
    await greet(bystander)

    # when: rig-a sends 2 frames that fit and 5 that do not, all at once
    with caplog.at_level("WARNING", logger="apps.workers.consumers"):
        for _ in range(7):
            await flooder.send_to(text_data=renewal_of_nothing())
        frames = await receive(flooder, 5)
        code = await closed_with(flooder)

    # then: 4 refusals are tolerated, the 5th closes the connection with the reason before it; the 2 frames
    # that fit had not been handled yet (they arrived together with the flood) and are dropped with it
    assert [frame["code"] for frame in frames] == ["rate_limited"] * 5
    assert frames[-1]["message"] == "more than 4 frames over the rate limit in 10 s"
    assert code == protocol.CloseCode.FLOODING == 4008
    assert not protocol.CloseCode(code).is_fatal  # the daemon reconnects, with backoff
    assert warnings_in(caplog) == [
        "worker rig-a: 1 frame(s) over the rate limit (0.001 frames/s, burst 3) refused",
        "worker rig-a from ?:0: more than 4 frames over the rate limit in 10 s; closing the connection",
    ]
    # and rig-b's connection still has its own two frames
    for _ in range(2):
        await bystander.send_to(text_data=renewal_of_nothing())
    assert [frame["code"] for frame in await receive(bystander, 2)] == ["unknown_lease"] * 2
    assert await bystander.receive_nothing(timeout=0.1)


async def test_frames_over_the_byte_rate_are_refused_and_change_nothing(gateway, rig_a, settings):
    # given: a byte bucket that holds the hello and two 1000-character frames, and practically never refills
    frame = json.dumps({"type": "lease_renewed", "lease_id": str(uuid.uuid4()), "pad": "x" * 900}).ljust(1000)
    settings.HYPHA_WS_BYTES_RATE = 0.001
    settings.HYPHA_WS_BYTES_BURST = len(protocol.encode(hello())) + 2 * len(frame)
    communicator = await gateway(rig_a.token)
    await greet(communicator)
    before = await snapshot()

    # when: three such frames
    for _ in range(3):
        await communicator.send_to(text_data=frame)
    frames = await receive(communicator, 3)

    # then: the third is refused as it arrives (so answered first), the two others handled
    burst = settings.HYPHA_WS_BYTES_BURST
    assert [(item["code"], item["message"]) for item in frames] == [
        ("rate_limited", f"over the rate limit of 0.001 bytes/s (burst {burst}); frame dropped"),
        ("unknown_lease", f"lease {json.loads(frame)['lease_id']} is not a lease of this worker"),
        ("unknown_lease", f"lease {json.loads(frame)['lease_id']} is not a lease of this worker"),
    ]
    assert await communicator.receive_nothing(timeout=0.1)
    assert await snapshot() == before


@pytest.mark.parametrize(
    ("limits", "frame", "message"),
    [
        pytest.param(
            {"HYPHA_WS_BACKLOG": 5},
            renewal_of_nothing(),
            "more than 5 frames (or 33554432 bytes) sent and not yet handled; closing the connection",
            id="frames",
        ),
        pytest.param(
            {"HYPHA_WS_BACKLOG_BYTES": 4096},
            json.dumps({"type": "lease_renewed", "lease_id": str(uuid.uuid4()), "pad": "x" * 900}),
            "more than 10000 frames (or 4096 bytes) sent and not yet handled; closing the connection",
            id="bytes",
        ),
    ],
)
async def test_a_backlog_over_its_bound_is_closed_4008_at_arrival(
    gateway, rig_a, rig_b, settings, caplog, limits, frame, message
):
    # given: a bucket that admits every frame, and a small backlog of frames received but not yet handled
    for name, value in limits.items():
        setattr(settings, name, value)
    flooder = await gateway(rig_a.token)
    bystander = await gateway(rig_b.token)
    await greet(flooder)
    await greet(bystander)
    before = await snapshot()

    # when: 50 frames arrive at once, far faster than each one's database call
    with caplog.at_level("WARNING", logger="apps.workers.consumers"):
        for _ in range(50):
            await flooder.send_to(text_data=frame)
        frames = await receive(flooder)
        code = await closed_with(flooder)

    # then: the connection is closed as its backlog overflows, before any of them was handled
    assert [(item["code"], item["message"]) for item in frames] == [("rate_limited", message)]
    assert code == protocol.CloseCode.FLOODING == 4008
    assert warnings_in(caplog) == [f"worker rig-a from ?:0: {message}"]
    assert await snapshot() == before
    # and the other connection is served as before
    await bystander.send_to(text_data=renewal_of_nothing())
    assert [item["code"] for item in await receive(bystander)] == ["unknown_lease"]


# --- the market over the gateway ------------------------------------------------------------------------------


async def test_three_daemons_allocate_a_job_over_the_gateway(gateway, job_owner, online_rigs, settings):
    # given: three daemons say hello with both executors; the offers settle the adverts, so a long window
    # only keeps a slow machine from closing it before the offers arrive
    settings.HYPHA_OFFER_WINDOW = 60.0
    rig_a, rig_b, rig_c = online_rigs
    daemons = {}
    for rig in online_rigs:
        daemons[rig.name] = await gateway(rig.token)
        welcome = await greet(daemons[rig.name])
        assert welcome == {
            "type": "welcome",
            "worker_id": str(rig.pk),
            "worker_name": rig.name,
            "protocol_version": 1,
            "lease_ttl": 10.0,
            "offer_ttl": 3.0,
            "leases": [],
            "advertisements": [],
        }
    a, b, c = daemons["rig-a"], daemons["rig-b"], daemons["rig-c"]

    # when: Ada submits tiny-gpt
    submitted = time.monotonic()
    job = await database_sync_to_async(job_services.create_job)(
        owner=job_owner, name="tiny-gpt", num_trainers=2, requirements=REQUIREMENTS
    )

    # then: every daemon hears both advertisements
    trainer_ad = await database_sync_to_async(advert)(job, TRAINER)
    ps_ad = await database_sync_to_async(advert)(job, PARAMETER_SERVER)
    adverts = [
        as_frame(market.advertisement_message(trainer_ad)),
        as_frame(market.advertisement_message(ps_ad)),
    ]
    assert adverts[0]["wanted"] == 2 and adverts[1]["wanted"] == 1
    for expected in adverts:
        expected.pop("window_closes_in")
    for daemon in (a, b, c):
        heard = await receive(daemon, 2)
        # the window is measured when each frame is built: HYPHA_OFFER_WINDOW less at most the time since
        # the submission (however slow the machine)
        least = 60.0 - (time.monotonic() - submitted) - 0.01  # 0.01: the clocks' rounding
        assert all(least <= frame.pop("window_closes_in") <= 60.0 for frame in heard)
        assert heard == adverts

    # when: rig-a offers for a trainer
    await a.send_to(text_data=protocol.encode(offer_on(trainer_ad, price=120.0)))

    # then: its offer is held
    [received_a] = await receive(a)
    assert (received_a["type"], received_a["advertisement_id"]) == ("offer_received", str(trainer_ad.pk))

    # when: rig-b's offer completes the trainers, which settles the advert at once
    completed = time.monotonic()
    await b.send_to(text_data=protocol.encode(offer_on(trainer_ad, price=125.0)))

    # then
    trainers_filled = as_frame(protocol.AdvertisementClosed(advertisement_id=trainer_ad.pk, reason="filled"))
    received_b, closed_b, granted_b = await receive(b, 3)
    assert received_b["type"] == "offer_received"
    assert closed_b == trainers_filled
    closed_a, granted_a = await receive(a, 2)
    assert closed_a == trainers_filled
    assert await receive(c) == [trainers_filled]
    # the lease's TTL is measured when its grant is built: at most the time since rig-b's offer less than 10 s
    least = 10.0 - (time.monotonic() - completed) - 0.01
    for granted, received, price in ((granted_a, received_a, 120.0), (granted_b, received_b, 125.0)):
        expires_in = granted.pop("expires_in")
        assert granted == {
            "type": "lease_granted",
            "lease_id": received["lease_id"],
            "advertisement_id": str(trainer_ad.pk),
            "job_id": str(job.pk),
            "role": TRAINER,
            "resources": CAPACITY.model_dump(),
            "devices": [],
            "price": price,
        }
        assert least <= expires_in <= 10.0

    # when: rig-c asks too much for the parameter server, then offers within the job's maximum
    await c.send_to(text_data=protocol.encode(offer_on(ps_ad, price=130.0)))
    [declined] = await receive(c)
    await c.send_to(text_data=protocol.encode(offer_on(ps_ad, price=100.0)))

    # then
    assert declined == {
        "type": "offer_declined",
        "advertisement_id": str(ps_ad.pk),
        "lease_id": None,
        "reason": "price above what the job pays",
    }
    received_c, closed_c, granted_c = await receive(c, 3)
    ps_filled = as_frame(protocol.AdvertisementClosed(advertisement_id=ps_ad.pk, reason="filled"))
    assert (received_c["type"], closed_c, granted_c["type"]) == ("offer_received", ps_filled, "lease_granted")
    assert granted_c["lease_id"] == received_c["lease_id"]
    assert await receive(a) == [ps_filled]
    assert await receive(b) == [ps_filled]
    for daemon in (a, b, c):
        assert await daemon.receive_nothing(timeout=0.1)
    await database_sync_to_async(job.refresh_from_db)()
    assert (job.status, job.status_reason) == (
        Job.Status.ALLOCATED,
        "ALLOCATED: all 3 leases active (2 of 2 trainers, 1 of 1 parameter server)",
    )
    leases = await database_sync_to_async(
        lambda: sorted(Lease.objects.values_list("worker__name", "status", "price"))
    )()
    assert leases == [("rig-a", "active", 120.0), ("rig-b", "active", 125.0), ("rig-c", "active", 100.0)]


@pytest.fixture
def serving_rig_a(job, rig_a) -> Lease:
    """rig-a serves tiny-gpt's parameter server: an ACTIVE lease, won through the services."""
    connect(rig_a)
    job_services.offer_made(worker=rig_a, message=offer_on(advert(job, PARAMETER_SERVER), price=100.0))
    lease = Lease.objects.get(worker=rig_a)  # the settle task ran after the offer's commit
    assert lease.status == Lease.Status.ACTIVE
    return lease


async def test_an_offer_after_its_window_is_declined_by_the_gateway_without_the_database(
    gateway, job_owner, rig_a, monkeypatch, settings
):
    # given: rig-a heard a trainer advert, whose window (60 s) no busy machine outlasts before the last offer
    settings.HYPHA_OFFER_WINDOW = 60.0
    daemon = await gateway(rig_a.token)
    await greet(daemon)
    job = await database_sync_to_async(job_services.create_job)(
        owner=job_owner, name="tiny-gpt", num_trainers=2, requirements=REQUIREMENTS
    )
    trainer_ad = await database_sync_to_async(advert)(job, TRAINER)
    heard = await receive(daemon, 2)
    assert {frame["advertisement_id"] for frame in heard} >= {str(trainer_ad.pk)}
    asked = []
    original = job_services.offer_made

    def counting(**kwargs):
        asked.append(kwargs["message"].advertisement_id)
        return original(**kwargs)

    monkeypatch.setattr(job_services, "offer_made", counting)

    # when: it offers after the window closed by the gateway's clock (the advert is still open in the database)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 120.0)
    await daemon.send_to(text_data=protocol.encode(offer_on(trainer_ad, price=120.0)))

    # then: declined at once, saying why, and the market was not asked; nothing was stored
    [declined] = await receive(daemon)
    assert declined == {
        "type": "offer_declined",
        "advertisement_id": str(trainer_ad.pk),
        "lease_id": None,
        "reason": "the offer window of attempt 0 is closed",
    }
    assert asked == []
    assert not await database_sync_to_async(Offer.objects.filter(advertisement=trainer_ad).exists)()

    # when: it offers within the window, the market decides (and holds it)
    monkeypatch.setattr(time, "time", real_time)
    await daemon.send_to(text_data=protocol.encode(offer_on(trainer_ad, price=120.0)))
    [received] = await receive(daemon)
    assert received["type"] == "offer_received" and asked == [trainer_ad.pk]
    await daemon.disconnect()


async def test_a_renewal_round_trip_extends_the_lease(gateway, rig_a, serving_rig_a):
    # given: rig-a's daemon reconnects holding its lease, which is due for renewal
    lease = serving_rig_a
    communicator = await gateway(rig_a.token)
    welcome = await greet(communicator, leases=(lease.pk,))
    assert [item["lease_id"] for item in welcome["leases"]] == [str(lease.pk)]
    due_at = timezone.now() + timedelta(seconds=3)
    await database_sync_to_async(Lease.objects.filter(pk=lease.pk).update)(expires_at=due_at)

    # when: the lease clock asks, and the daemon confirms
    await database_sync_to_async(job_services.tick_leases)()
    [request] = await receive(communicator)
    await communicator.send_to(text_data=protocol.encode(protocol.LeaseRenewed(lease_id=lease.pk)))

    # then
    assert request == {"type": "renew_lease", "lease_id": str(lease.pk), "expires_in": 10.0}
    await eventually(lambda: Lease.objects.get(pk=lease.pk).renewals == 1)
    await database_sync_to_async(lease.refresh_from_db)()
    assert (lease.status, lease.renewal_requested_at) == (Lease.Status.ACTIVE, None)
    assert lease.expires_at > due_at + timedelta(seconds=6)
    assert await communicator.receive_nothing(timeout=0.1)


async def test_releasing_a_lease_ends_it_and_readvertises_the_role(
    gateway, rig_a, job, serving_rig_a, settings
):
    # given
    lease = serving_rig_a
    communicator = await gateway(rig_a.token)
    await greet(communicator, leases=(lease.pk,))

    # when
    released = time.monotonic()
    await communicator.send_to(
        text_data=protocol.encode(protocol.ReleaseLease(lease_id=lease.pk, reason="shutting down"))
    )

    # then: the lease ended, and the role is advertised again (to rig-a too, now free)
    ended, advertisement = await receive(communicator, 2)
    assert ended == {
        "type": "lease_ended",
        "lease_id": str(lease.pk),
        "status": "released",
        "reason": "released by the worker: shutting down",
    }
    new_ad = await database_sync_to_async(advert)(job, PARAMETER_SERVER)
    expected = as_frame(market.advertisement_message(new_ad))
    # measured when the frame is built: the window less at most the time since the release
    least = settings.HYPHA_OFFER_WINDOW - (time.monotonic() - released) - 0.01
    assert least <= advertisement.pop("window_closes_in") <= settings.HYPHA_OFFER_WINDOW
    expected.pop("window_closes_in")
    assert advertisement == expected
    assert (
        new_ad.pk != await database_sync_to_async(lambda: Offer.objects.get(lease=lease).advertisement_id)()
    )
    await database_sync_to_async(lease.refresh_from_db)()
    assert (lease.status, lease.status_reason) == (
        Lease.Status.RELEASED,
        "released by the worker: shutting down",
    )


async def test_a_second_connection_of_a_worker_closes_the_first_4009(gateway, rig_a):
    # given
    first = await gateway(rig_a.token)
    await greet(first)

    # when
    second = await gateway(rig_a.token)
    await greet(second)

    # then
    [frame] = await receive(first)
    assert (frame["code"], frame["message"]) == ("refused", "superseded by a newer connection of this worker")
    assert await closed_with(first) == protocol.CloseCode.SUPERSEDED == 4009
    channel = await database_sync_to_async(lambda: Worker.objects.get(pk=rig_a.pk).channel_name)()

    # when: the first connection's close completes
    await first.disconnect(timeout=TIMEOUT)

    # then: the worker stays online on the second connection
    worker = await database_sync_to_async(Worker.objects.get)(pk=rig_a.pk)
    assert (worker.status, worker.channel_name) == (Worker.Status.ONLINE, channel)
    assert await second.receive_nothing(timeout=0.1)


@pytest.mark.parametrize(
    "message",
    [
        lambda lease_id: protocol.LeaseRenewed(lease_id=lease_id),
        lambda lease_id: protocol.RenewRefused(lease_id=lease_id, reason="not mine"),
        lambda lease_id: protocol.ReleaseLease(lease_id=lease_id, reason="not mine"),
    ],
    ids=["lease_renewed", "renew_refused", "release_lease"],
)
async def test_another_workers_lease_is_an_unknown_lease(gateway, rig_b, serving_rig_a, message):
    # given: rig-b is connected; the lease is rig-a's
    communicator = await gateway(rig_b.token)
    await greet(communicator)
    before = await snapshot()
    frame = message(serving_rig_a.pk)

    # when
    await communicator.send_to(text_data=protocol.encode(frame))

    # then
    [error] = await receive(communicator)
    assert error == as_frame(
        protocol.Error(
            code=protocol.ErrorCode.UNKNOWN_LEASE,
            message=f"lease {serving_rig_a.pk} is not a lease of this worker",
            ref=frame.type,
            lease_id=serving_rig_a.pk,
        )
    )
    assert await snapshot() == before


async def test_revoking_a_connected_worker_closes_it_4003_and_ends_its_leases(gateway, rig_a, serving_rig_a):
    # given
    communicator = await gateway(rig_a.token)
    await greet(communicator, leases=(serving_rig_a.pk,))

    # when
    await database_sync_to_async(job_services.revoke_worker)(rig_a)

    # then
    [frame] = await receive(communicator)
    assert (frame["code"], frame["message"]) == ("refused", "the token of worker 'rig-a' has been revoked")
    assert await closed_with(communicator) == protocol.CloseCode.TOKEN_REVOKED
    lease = await database_sync_to_async(Lease.objects.get)(pk=serving_rig_a.pk)
    assert (lease.status, lease.status_reason) == (Lease.Status.RELEASED, "the worker's token was revoked")
