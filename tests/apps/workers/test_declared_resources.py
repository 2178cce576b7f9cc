"""What a daemon declares is bounded: the protocol refuses absurd resources in ``hello`` and ``offer`` (an error
frame, nothing stored), and an operator can cap each worker's resources in the admin (the market then counts no
more than the cap)."""

from __future__ import annotations

import json

import pytest
from channels.db import database_sync_to_async
from django.urls import reverse

from apps.jobs.models import TRAINER
from apps.leases.models import Lease
from apps.market import services as market
from apps.market.exceptions import OfferRefused
from apps.workers.models import Worker
from tests.apps.conftest import CAPACITY, advert, connect, market_rows, offer_on
from tests.apps.workers.test_consumers import gateway, greet, receive  # noqa: F401 - fixture
from worker_daemon import protocol

snapshot = database_sync_to_async(market_rows)

#: One over the most a worker may declare, per field, and the error naming it.
OVER_THE_MAXIMA = {
    "cpu": (4097, "resources: cpu of 4097 is more than a worker may declare (4096)"),
    "memory": (16385, "resources: memory of 16385 is more than a worker may declare (16384)"),
    "storage": (1e7 + 1, "resources: storage of 10000001 is more than a worker may declare (10000000)"),
    "gpu": (65537, "resources: gpu of 65537 is more than a worker may declare (65536)"),
    "absurd": (1e300, "resources: cpu of 1e+300 is more than a worker may declare (4096)"),
}


def hello_frame(**resources: float) -> str:
    frame = json.loads(
        protocol.encode(protocol.Hello(protocol_version=1, resources=protocol.Resources(cpu=2), executors=[]))
    )
    frame["resources"] = resources
    return json.dumps(frame)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("case", list(OVER_THE_MAXIMA))
async def test_a_hello_declaring_more_than_the_maxima_is_refused_and_nothing_stored(gateway, rig_a, case):  # noqa: F811
    # given
    value, message = OVER_THE_MAXIMA[case]
    field = "cpu" if case == "absurd" else case
    communicator = await gateway(rig_a.token)
    before = await snapshot()

    # when
    await communicator.send_to(text_data=hello_frame(**{field: value}))

    # then: an error frame naming the field; not welcomed, nothing stored
    [error] = await receive(communicator)
    assert (error["type"], error["code"], error["ref"], error["message"]) == (
        "error",
        "malformed",
        "hello",
        f"invalid 'hello': {message}",
    )
    assert await communicator.receive_nothing(timeout=0.1)
    assert await snapshot() == before
    assert (await database_sync_to_async(Worker.objects.get)(pk=rig_a.pk)).status == Worker.Status.OFFLINE


@pytest.mark.django_db(transaction=True)
async def test_a_hello_at_the_maxima_is_welcomed(gateway, rig_a):  # noqa: F811
    # given
    communicator = await gateway(rig_a.token)

    # when
    await communicator.send_to(text_data=hello_frame(cpu=4096, memory=16384, storage=10_000_000, gpu=65536))

    # then
    [welcome] = await receive(communicator)
    assert welcome["type"] == "welcome"
    worker = await database_sync_to_async(Worker.objects.get)(pk=rig_a.pk)
    assert worker.resources == protocol.Resources(cpu=4096, memory=16384, storage=10_000_000, gpu=65536)


def test_an_offer_declaring_more_than_the_maxima_is_malformed():
    frame = json.loads(protocol.encode(offer_on_frame()))
    frame["resources"]["gpu"] = 1e6

    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.parse_daemon_message(json.dumps(frame))

    assert refused.value.message == (
        "invalid 'offer': resources: gpu of 1000000 is more than a worker may declare (65536)"
    )


def offer_on_frame() -> protocol.Offer:
    import uuid

    return protocol.Offer(advertisement_id=uuid.uuid4(), attempt=0, price=1.0, resources=CAPACITY)


# --- the operator's cap ------------------------------------------------------------------------------------

CAP = {"max_cpu": 4, "max_memory": None, "max_storage": None, "max_gpu": 8}
CAPPED = protocol.Resources(cpu=4, memory=32, storage=100, gpu=8)


@pytest.mark.django_db
def test_the_market_counts_no_more_than_the_operators_cap(job, rig_a, rig_b):
    # given: rig-a is capped at 4 cores and 8 GB of VRAM; both declare CAPACITY (8 cores, 24 GB VRAM)
    Worker.objects.filter(pk=rig_a.pk).update(**CAP)
    for rig in (rig_a, rig_b):
        connect(rig)
        rig.refresh_from_db()

    # then: what its daemon declared is kept, its capacity is the capped one
    assert (rig_a.resources, rig_a.capacity) == (CAPACITY, CAPPED)
    assert rig_b.capacity == CAPACITY
    candidates = {candidate.worker_id: candidate for candidate in market.connected_candidates()}
    assert (candidates[rig_a.pk].capacity, candidates[rig_a.pk].free) == (CAPPED, CAPPED)

    # when: rig-a offers its whole declared capacity on an advert for 4 cores and 16 GB of VRAM
    ad = advert(job, TRAINER)
    before = market_rows()
    with pytest.raises(OfferRefused) as refused:
        market.record_offer(worker=rig_a, message=offer_on(ad, price=120.0))

    # then: refused, its cap is below the advert's minimum; nothing recorded
    assert refused.value.reason == "the operator's cap on this worker is below the advertised minimum"
    assert market_rows() == before

    # when: the cap leaves enough for the advert
    Worker.objects.filter(pk=rig_a.pk).update(max_gpu=16)
    rig_a.refresh_from_db()
    outcome = market.record_offer(worker=rig_a, message=offer_on(ad, price=120.0))

    # then: the lease holds what the cap allows, not what was declared
    lease = Lease.objects.get(pk=outcome.offer.lease_id)
    expected = protocol.Resources(cpu=4, memory=32, storage=100, gpu=16)
    assert (lease.resources, outcome.offer.resources) == (expected, expected)


@pytest.mark.django_db
def test_the_operator_sets_the_cap_in_the_admin(operator, rig_a, client):
    # given: rig-a declared CAPACITY (8 cores, 32 GB, 100 GB, 24 GB of VRAM)
    connect(rig_a)
    client.force_login(operator.user)
    url = reverse("admin:workers_worker_change", args=[rig_a.pk])
    page = client.get(url)
    form = page.context["adminform"].form
    data = {name: value for name, value in form.initial.items() if value is not None and name != "owner"}

    # when
    response = client.post(url, {**data, "max_cpu": "4", "max_gpu": "8", "max_memory": "", "max_storage": ""})

    # then
    assert response.status_code == 302, response.content.decode()[:2000]
    rig_a.refresh_from_db()
    assert (rig_a.max_cpu, rig_a.max_memory, rig_a.max_storage, rig_a.max_gpu) == (4.0, None, None, 8.0)
    assert rig_a.resources == CAPACITY  # what its daemon declared is kept
    shown = client.get(url).content.decode()
    assert "4 cores, 32 GB memory, 100 GB storage, 8 GB VRAM" in shown


@pytest.mark.django_db
def test_a_negative_cap_is_refused_in_the_admin(operator, rig_a, client):
    # given
    client.force_login(operator.user)
    url = reverse("admin:workers_worker_change", args=[rig_a.pk])
    form = client.get(url).context["adminform"].form
    data = {name: value for name, value in form.initial.items() if value is not None and name != "owner"}

    # when
    response = client.post(url, {**data, "max_cpu": "-1"})

    # then: the form is shown again with the error; nothing changed
    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {
        "max_cpu": ["Ensure this value is greater than or equal to 0."]
    }
    rig_a.refresh_from_db()
    assert rig_a.max_cpu is None
