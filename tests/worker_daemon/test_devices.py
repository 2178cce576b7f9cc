"""Devices (GPUs) as resources on the daemon: the worker TOML's device list, the protocol's checks of device
fields, the arbiter's choice of free devices, two leases on disjoint devices of one daemon, and
``CUDA_VISIBLE_DEVICES`` as a real task process sees it."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path

import pytest

from worker_daemon import arbiter, protocol
from worker_daemon.config import WorkerConfig, load_config
from worker_daemon.connection import WorkerSession
from worker_daemon.exceptions import ConfigError
from worker_daemon.jobs import JobManager
from worker_daemon.leases import LeaseBook

JOB = uuid.UUID(int=42)


def config_file(directory: Path, resources: str, executors: str = "") -> Path:
    path = directory / "worker.toml"
    path.write_text(
        f'work_dir = "{directory / "w"}"\n[resources]\ncpu = 8\nmemory = 64\nstorage = 100\n{resources}\n'
        "[offer]\nprice = 100.0\nfloor = 100.0\n" + executors
    )
    return path


def devices(*memories: float) -> list[protocol.Device]:
    return [protocol.Device(index=index, memory=memory) for index, memory in enumerate(memories)]


# --- the worker TOML ------------------------------------------------------------------------------------


def test_gpus_shorthand_lists_that_many_devices_and_sums_their_vram(tmp_path):
    config = load_config(config_file(tmp_path, "gpus = 4\ngpu_memory = 24"), environ={})

    assert config.devices == devices(24, 24, 24, 24)
    assert config.capacity.gpu == 96.0


def test_device_tables_take_index_and_name_or_their_position(tmp_path):
    resources = (
        '[[resources.devices]]\nmemory = 80\nname = "H100"\nindex = 3\n[[resources.devices]]\nmemory = 24\n'
    )

    config = load_config(config_file(tmp_path, resources), environ={})

    assert config.devices == [
        protocol.Device(index=3, memory=80, name="H100"),
        protocol.Device(index=1, memory=24),
    ]
    assert config.capacity.gpu == 104.0


def test_hyphas_gpu_key_alone_is_total_vram_without_a_device_list(tmp_path):
    config = load_config(config_file(tmp_path, "gpu = 24"), environ={})

    assert config.devices == []
    assert config.capacity.gpu == 24.0


@pytest.mark.parametrize(
    ("resources", "complaint"),
    [
        ("gpus = -1\ngpu_memory = 24", "resources.gpus"),
        ("gpus = 1000000000\ngpu_memory = 24", "resources.gpus"),
        ("gpus = 2", "gpus needs gpu_memory"),
        ("gpu_memory = 24", "gpu_memory needs gpus"),
        ("gpus = 1\ngpu_memory = -5", "resources.gpu_memory"),
        ('gpus = "4"\ngpu_memory = 24', "resources.gpus"),
        ("gpus = 1\ngpu_memory = 24\n[[resources.devices]]\nmemory = 24", "not both"),
        (
            "[[resources.devices]]\nmemory = 24\nindex = 0\n[[resources.devices]]\nmemory = 24\nindex = 0",
            "twice",
        ),
        ("[[resources.devices]]\nmemory = 24\nindex = -1", "resources.devices[0].index"),
        ("[[resources.devices]]\nindex = 0", "resources.devices[0].memory"),
        ("[[resources.devices]]\nmemory = 1e12", "resources.devices[0].memory"),
    ],
)
def test_a_bad_device_list_is_a_config_error_naming_it(tmp_path, resources, complaint):
    with pytest.raises(ConfigError) as raised:
        load_config(config_file(tmp_path, resources), environ={})

    assert complaint in str(raised.value)


def test_an_executor_may_not_set_cuda_visible_devices_when_devices_are_listed(tmp_path):
    executors = (
        '[[executors]]\nclass = "train"\nname = "x"\nruntime = "process"\ncmd = "true"\n'
        'env = { CUDA_VISIBLE_DEVICES = "0" }\n'
    )

    with pytest.raises(ConfigError, match=r"executors\[0\].env: CUDA_VISIBLE_DEVICES is set by the daemon"):
        load_config(config_file(tmp_path, "gpus = 2\ngpu_memory = 24", executors), environ={})
    # without a device list the daemon leaves it alone, so an executor may pin a device itself
    assert load_config(config_file(tmp_path, "gpu = 24", executors), environ={}).devices == []


# --- the protocol ---------------------------------------------------------------------------------------


def hello(**fields) -> str:
    frame = {"type": "hello", "protocol_version": 1, "resources": {}, "executors": [], **fields}
    return json.dumps(frame)


def test_a_hello_without_devices_is_an_old_daemon_with_none():
    assert protocol.parse_daemon_message(hello()).devices == []


@pytest.mark.parametrize(
    "device_list",
    [
        [{"index": 0, "memory": 24}, {"index": 0, "memory": 24}],
        [{"index": -1, "memory": 24}],
        [{"index": 0, "memory": -1}],
        [{"index": 0, "memory": 1e300}],
        [{"index": index, "memory": 1} for index in range(65)],
        "four",
    ],
)
def test_a_hostile_device_list_in_hello_is_a_protocol_error(device_list):
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_daemon_message(hello(devices=device_list))


@pytest.mark.parametrize("indices", [[0, 0], [-1], [10**9], list(range(65))])
def test_an_offer_with_hostile_device_indices_is_a_protocol_error(indices):
    frame = {
        "type": "offer",
        "advertisement_id": str(uuid.uuid4()),
        "attempt": 0,
        "price": 1,
        "resources": {},
    }
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_daemon_message(json.dumps({**frame, "devices": indices}))


def test_devices_fit_says_why_an_offer_does_not_fit():
    worker = devices(24, 80)

    assert protocol.devices_fit(worker, [1], count=1, memory=40) is None
    assert protocol.devices_fit(worker, [], count=0, memory=0) is None
    assert protocol.devices_fit(worker, [0], count=1, memory=40) == (
        "device 0 has 24 GB, the role asks for 40 GB per device"
    )
    assert (
        protocol.devices_fit(worker, [7], count=1, memory=0) == "device 7 is not one of the worker's devices"
    )
    assert protocol.devices_fit(worker, [0], count=2, memory=0) == "offers 1 devices, the role asks for 2"
    assert (
        protocol.devices_fit(worker, [0], count=0, memory=0) == "offers devices to a role that asks for none"
    )


# --- the arbiter ----------------------------------------------------------------------------------------


def test_choose_devices_takes_the_smallest_that_fit():
    worker = devices(80, 24, 48, 24)

    assert protocol.choose_devices(worker, count=2, memory=20) == [1, 3]
    assert protocol.choose_devices(worker, count=2, memory=40) == [0, 2]
    assert protocol.choose_devices(worker, count=3, memory=40) is None
    assert protocol.choose_devices(worker, count=0, memory=1000) == []


def test_the_arbiter_drops_an_advert_asking_for_more_devices_than_are_free(make):
    advertisement = make.advertisement(resources={}).model_copy(update={"devices": 2, "device_memory": 40.0})
    keys = {("train", "diloco-transformer")}
    capacity = protocol.Resources(cpu=8, gpu=200)

    reason = arbiter.rejection_reason(
        advertisement, executors=keys, floor=0, capacity=capacity, free_devices=devices(80, 24)
    )
    passed = arbiter.rejection_reason(
        advertisement, executors=keys, floor=0, capacity=capacity, free_devices=devices(80, 48)
    )

    assert reason == "needs 2 free devices of 40 GB; this worker has 2 free"
    assert passed is None


def test_a_whole_offer_of_some_devices_offers_their_share(make):
    advertisement = make.advertisement(resources={"cpu": 1}).model_copy(update={"devices": 1})
    worker = devices(24, 24, 24, 24)
    capacity = protocol.Resources(cpu=8, memory=64, storage=100, gpu=96)

    [planned] = arbiter.plan_offers(
        [advertisement],
        executors={("train", "diloco-transformer")},
        capacity=capacity,
        floor=0,
        price=100,
        strategy="whole",
        free_devices=worker[2:],
        devices=worker,
    )

    assert planned.devices == (2,)
    assert planned.resources == protocol.Resources(cpu=2, memory=16, storage=25, gpu=24)


# --- two leases on disjoint devices of one daemon ---------------------------------------------------------


@pytest.fixture
def four_gpu_session(tmp_path, clock) -> WorkerSession:
    config = WorkerConfig.model_validate(
        {
            "work_dir": str(tmp_path),
            "resources": {"cpu": 8, "memory": 64, "storage": 100, "gpus": 4, "gpu_memory": 24},
            "offer": {"price": 120.0, "floor": 100.0},
        }
    )
    return WorkerSession(config=config, daemon_version="9.9", clock=clock)


def device_advert(make, count: int) -> protocol.Advertisement:
    return make.advertisement(resources={"cpu": 1}).model_copy(
        update={"devices": count, "device_memory": 20.0}
    )


def test_one_daemon_offers_and_holds_two_leases_on_disjoint_devices(four_gpu_session, make):
    # given: a 4-GPU daemon and two adverts of 2 devices each
    session = four_gpu_session
    first, second, third = (device_advert(make, 2) for _ in range(3))
    session.handle(make.welcome(advertisements=[first, second]))

    # when: it offers on both, and both are granted
    offers = session.evaluate()
    for offer in offers:
        advert = first if offer.advertisement_id == first.advertisement_id else second
        session.handle(
            protocol.LeaseGranted(
                lease_id=uuid.uuid4(),
                advertisement_id=offer.advertisement_id,
                job_id=advert.job_id,
                role="trainer",
                resources=offer.resources,
                devices=offer.devices,
                price=offer.price,
                expires_in=60,
            )
        )

    # then: two offers on disjoint devices, two leases holding them, and nothing left for a third advert
    assert sorted(sorted(offer.devices) for offer in offers) == [[0, 1], [2, 3]]
    assert sorted(lease.devices for lease in session.book.leases) == [(0, 1), (2, 3)]
    assert session.book.free_devices() == []
    session.handle(third)
    assert session.evaluate() == []
    assert session.hello().devices == devices(24, 24, 24, 24)


def test_a_grant_of_devices_already_held_is_released_not_double_booked(four_gpu_session, make):
    session = four_gpu_session
    session.book.activate(
        lease_id=uuid.UUID(int=1),
        job_id=JOB,
        role="trainer",
        resources=protocol.ZERO,
        price=1,
        ttl=60,
        devices=[0],
    )

    held = session.book.activate(
        lease_id=uuid.UUID(int=2),
        job_id=JOB,
        role="trainer",
        resources=protocol.ZERO,
        price=1,
        ttl=60,
        devices=[0],
    )
    unknown = session.book.activate(
        lease_id=uuid.UUID(int=3),
        job_id=JOB,
        role="trainer",
        resources=protocol.ZERO,
        price=1,
        ttl=60,
        devices=[9],
    )

    assert held is None and unknown is None
    assert [lease.devices for lease in session.book.leases] == [(0,)]


# --- CUDA_VISIBLE_DEVICES as a task sees it -------------------------------------------------------------

EXECUTOR = """
import json, os, sys
with open(sys.argv[1], "w") as file:
    json.dump({"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}, file)
"""


def process_executor(script: Path, record: Path) -> str:
    return (
        '[[executors]]\nclass = "train"\nname = "env-executor"\nruntime = "process"\n'
        f'cmd = "{sys.executable}"\nargs = ["{script}", "{record}"]\n'
    )


def dispatch(lease_id: uuid.UUID) -> protocol.DispatchJob:
    return protocol.DispatchJob(
        task_id=uuid.uuid4(),
        lease_id=lease_id,
        job_id=JOB,
        role="trainer",
        spec={"job_id": str(JOB), "executor": {"class": "train", "descriptor": {"name": "env-executor"}}},
        peers={},
    )


async def run_task(manager: JobManager, lease_id: uuid.UUID, record: Path) -> str | None:
    task = manager.start(dispatch(lease_id))
    exited = await asyncio.wait_for(task.runner, 20)
    assert exited.exit_code == 0, exited.log_tail
    return json.loads(record.read_text())["CUDA_VISIBLE_DEVICES"]


async def test_each_task_sees_only_its_leases_devices(short_dir, link, monkeypatch):
    # given: a 4-GPU worker (the daemon itself sees all four) with leases on devices 1,3 and 2, and one with none
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    script, record = short_dir / "executor.py", short_dir / "record.json"
    script.write_text(EXECUTOR)
    config = load_config(
        config_file(short_dir, "gpus = 4\ngpu_memory = 24", process_executor(script, record)), environ={}
    )
    book = LeaseBook(capacity=config.capacity, devices=config.devices)
    leases = {name: uuid.uuid4() for name in ("two", "one", "none")}
    for name, held in (("two", [3, 1]), ("one", [2]), ("none", [])):
        book.activate(
            lease_id=leases[name],
            job_id=JOB,
            role="trainer",
            resources=protocol.ZERO,
            price=1,
            ttl=60,
            devices=held,
        )
    manager = JobManager(config=config, book=book, server_url="wss://cp.example/", link=link)

    # when: a task runs under each lease
    try:
        seen = {name: await run_task(manager, lease_id, record) for name, lease_id in leases.items()}
    finally:
        await manager.stop_all(timeout=5.0)

    # then: each sees exactly its devices; the one with none sees no GPU at all
    assert seen == {"two": "1,3", "one": "2", "none": ""}


async def test_without_a_device_list_the_variable_is_left_as_the_daemon_has_it(short_dir, link, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    script, record = short_dir / "executor.py", short_dir / "record.json"
    script.write_text(EXECUTOR)
    config = load_config(config_file(short_dir, "gpu = 24", process_executor(script, record)), environ={})
    book = LeaseBook(capacity=config.capacity)
    lease_id = uuid.uuid4()
    book.activate(lease_id=lease_id, job_id=JOB, role="trainer", resources=protocol.ZERO, price=1, ttl=60)
    manager = JobManager(config=config, book=book, server_url="wss://cp.example/", link=link)

    try:
        seen = await run_task(manager, lease_id, record)
    finally:
        await manager.stop_all(timeout=5.0)

    assert seen == "5"
