"""Devices (GPUs) in the market: a role asks for N devices of M GB, an offer names the worker's device indices,
the lease records them, and one worker holds several leases only on disjoint devices. Refused offers leave no
trace; the API and the job's lease table show the devices."""

from __future__ import annotations

import pytest

from apps.jobs import services as job_services
from apps.jobs.models import DEFAULT_EXECUTORS, PARAMETER_SERVER, TRAINER, Job
from apps.leases.models import Lease
from apps.market import services as market
from apps.market.exceptions import OfferRefused
from tests.apps.conftest import PARAMETER_SERVER_MINIMUM, advert, connect, market_rows
from worker_daemon import protocol

pytestmark = pytest.mark.django_db

#: A 4-GPU host: 16 cores, 128 GB, 400 GB, 4 × 24 GB of VRAM.
BIG = protocol.Resources(cpu=16, memory=128, storage=400, gpu=96)
FOUR_GPUS = [protocol.Device(index=index, memory=24, name="A10") for index in range(4)]
#: What one trainer of a device job takes under ``whole``: half the host (2 of its 4 devices).
HALF = protocol.Resources(cpu=8, memory=64, storage=200, gpu=48)


def device_job(owner, *, name: str, devices: int = 2, device_memory: float = 20.0) -> Job:
    requirements = {
        TRAINER: {
            "resources": {
                "cpu": 4.0,
                "memory": 16.0,
                "storage": 0.0,
                "gpu": 0.0,
                "devices": devices,
                "device_memory": device_memory,
            },
            "executor": DEFAULT_EXECUTORS[TRAINER],
            "bid": 100.0,
            "max": 150.0,
        },
        PARAMETER_SERVER: {
            "resources": PARAMETER_SERVER_MINIMUM.model_dump(),
            "executor": DEFAULT_EXECUTORS[PARAMETER_SERVER],
            "bid": 80.0,
            "max": 120.0,
        },
    }
    created = job_services.create_job(owner=owner, name=name, num_trainers=1, requirements=requirements)
    job_services.allocate(created.pk)
    return Job.objects.get(pk=created.pk)


def offer(ad, devices: list[int], *, resources: protocol.Resources = HALF) -> protocol.Offer:
    return protocol.Offer(
        advertisement_id=ad.pk, attempt=ad.attempt, price=100.0, resources=resources, devices=devices
    )


@pytest.fixture
def gpu_rig(rig_a):
    connect(rig_a, resources=BIG)
    # the conftest's hello has no devices (an older daemon); this rig's daemon lists four
    rig_a.refresh_from_db()
    rig_a.devices = [device.model_dump() for device in FOUR_GPUS]
    rig_a.save(update_fields=["devices"])
    return rig_a


def test_hello_records_the_workers_devices(rig_a):
    hello = protocol.Hello(
        protocol_version=protocol.PROTOCOL_VERSION,
        resources=BIG,
        devices=FOUR_GPUS,
        executors=[protocol.ExecutorDescriptor.model_validate(DEFAULT_EXECUTORS[TRAINER])],
    )

    job_services.worker_connected(worker=rig_a, channel_name="test.rig-a", hello=hello, info={})

    rig_a.refresh_from_db()
    assert rig_a.device_list() == FOUR_GPUS
    assert rig_a.devices[0] == {"index": 0, "memory": 24.0, "name": "A10"}


def test_the_advertisement_carries_the_roles_device_request(job_owner):
    job = device_job(job_owner, name="gpus", devices=2, device_memory=20.0)

    message = market.advertisement_message(advert(job, TRAINER))

    assert (message.devices, message.device_memory) == (2, 20.0)
    assert market.advertisement_message(advert(job, PARAMETER_SERVER)).devices == 0


def test_one_worker_holds_two_leases_on_disjoint_devices(job_owner, gpu_rig, sent):
    # given: two jobs whose trainer asks for 2 devices of 20 GB each, and a 4-GPU rig
    first = device_job(job_owner, name="first")
    second = device_job(job_owner, name="second")

    # when: the rig offers devices 0,1 on one and 2,3 on the other, and both adverts settle
    market.record_offer(worker=gpu_rig, message=offer(advert(first, TRAINER), [0, 1]))
    market.record_offer(worker=gpu_rig, message=offer(advert(second, TRAINER), [3, 2]))
    for job in (first, second):
        market.settle(advert(job, TRAINER).pk, closing=False)

    # then: two active leases, each with its devices, and each daemon grant names them
    leases = {lease.job_id: lease for lease in Lease.objects.filter(worker=gpu_rig)}
    assert {job_id: lease.status for job_id, lease in leases.items()} == {
        first.pk: Lease.Status.ACTIVE,
        second.pk: Lease.Status.ACTIVE,
    }
    assert leases[first.pk].devices == [0, 1]
    assert leases[second.pk].devices == [2, 3]
    grants = {
        message.job_id: message.devices for _, message in sent if isinstance(message, protocol.LeaseGranted)
    }
    assert grants == {first.pk: [0, 1], second.pk: [2, 3]}


def test_an_offer_of_a_device_another_lease_holds_is_refused_and_changes_nothing(job_owner, gpu_rig):
    first = device_job(job_owner, name="first")
    second = device_job(job_owner, name="second")
    market.record_offer(worker=gpu_rig, message=offer(advert(first, TRAINER), [0, 1]))
    before = market_rows()

    with pytest.raises(OfferRefused, match=r"device\(s\) \[1\] of worker rig-a are held by another lease"):
        market.record_offer(worker=gpu_rig, message=offer(advert(second, TRAINER), [1, 2]))

    assert market_rows() == before


@pytest.mark.parametrize(
    ("devices", "reason"),
    [
        ([0], "offers 1 devices, the role asks for 2"),
        ([0, 1, 2], "offers 3 devices, the role asks for 2"),
        ([0, 9], "device 9 is not one of the worker's devices"),
    ],
)
def test_an_offer_whose_devices_do_not_meet_the_request_is_refused(job_owner, gpu_rig, devices, reason):
    job = device_job(job_owner, name="gpus")
    before = market_rows()

    with pytest.raises(OfferRefused) as refused:
        market.record_offer(worker=gpu_rig, message=offer(advert(job, TRAINER), devices))

    assert str(refused.value) == f"offered devices do not meet the advertisement: {reason}"
    assert market_rows() == before


def test_devices_with_too_little_memory_are_refused(job_owner, gpu_rig):
    job = device_job(job_owner, name="big-gpus", device_memory=40.0)

    with pytest.raises(OfferRefused, match="device 0 has 24 GB, the role asks for 40 GB per device"):
        market.record_offer(worker=gpu_rig, message=offer(advert(job, TRAINER), [0, 1]))


def test_a_worker_without_a_device_list_cannot_take_a_device_role(job_owner, rig_b):
    connect(rig_b, resources=BIG)  # an older daemon: no devices in its hello
    rig_b.refresh_from_db()
    job = device_job(job_owner, name="gpus")

    with pytest.raises(OfferRefused, match="device 0 is not one of the worker's devices"):
        market.record_offer(worker=rig_b, message=offer(advert(job, TRAINER), [0, 1]))
    with pytest.raises(OfferRefused, match="offers 0 devices, the role asks for 2"):
        market.record_offer(worker=rig_b, message=offer(advert(job, TRAINER), []))


def test_the_lease_api_shows_its_devices(job_owner, gpu_rig):
    from rest_framework.test import APIClient

    job = device_job(job_owner, name="gpus")
    market.record_offer(worker=gpu_rig, message=offer(advert(job, TRAINER), [1, 3]))
    market.settle(advert(job, TRAINER).pk, closing=False)
    lease = Lease.objects.get(worker=gpu_rig)
    client = APIClient()
    client.force_authenticate(job_owner)

    detail = client.get(f"/api/leases/{lease.pk}/")
    job_leases = client.get(f"/api/jobs/{job.pk}/")

    assert detail.status_code == 200, detail.content
    assert detail.json()["devices"] == [1, 3]
    assert [entry["devices"] for entry in job_leases.json()["leases"]] == [[1, 3]]


def test_a_worker_holding_some_devices_is_still_asked_for_its_free_ones(job_owner, gpu_rig, rig_b):
    # given: rig-b is an older daemon (no devices); the 4-GPU rig holds devices 0,1 for a first job
    connect(rig_b, resources=BIG)
    first = device_job(job_owner, name="first")
    assert advert(first, TRAINER).targets == [str(gpu_rig.pk)]
    market.record_offer(worker=gpu_rig, message=offer(advert(first, TRAINER), [0, 1]))

    # when: two more jobs ask for 2 and for 3 devices
    two = device_job(job_owner, name="two", devices=2)
    three = device_job(job_owner, name="three", devices=3)

    # then: the 2-device advert goes to the rig (devices 2,3 are free), the 3-device one to nobody, and
    # the open adverts the rig would be sent on reconnecting are the same
    assert advert(two, TRAINER).targets == [str(gpu_rig.pk)]
    assert advert(three, TRAINER).targets == []
    open_for_rig = {message.advertisement_id for message in market.open_advertisements(gpu_rig)}
    assert advert(two, TRAINER).pk in open_for_rig
    assert advert(three, TRAINER).pk not in open_for_rig


def test_the_job_page_lease_table_shows_the_devices(job_owner, gpu_rig):
    from django.test import Client

    job = device_job(job_owner, name="gpus")
    market.record_offer(worker=gpu_rig, message=offer(advert(job, TRAINER), [2, 3]))
    market.settle(advert(job, TRAINER).pk, closing=False)
    browser = Client()
    browser.force_login(job_owner)

    html = browser.get(f"/jobs/{job.pk}/").content.decode()

    assert '<th title="the device indices (GPUs) the lease holds on its worker">Devices</th>' in html
    assert '<td class="devices">2,3</td>' in html
