"""Who may speak for a worker, over the gateway: one daemon process per worker (the newest), a revoked token
speaks for nobody, and a worker answers only for its own leases and tasks.

Driven with WebsocketCommunicator against ``hypha_site.asgi.router``, like test_consumers.py. Refused frames get
an ``error`` frame (or the refusal their reply carries) and change nothing in the database.
"""

from __future__ import annotations

import uuid

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connections

from apps.datasets import services as dataset_services
from apps.datasets.models import JobSlice, SliceEvent
from apps.jobs import services as job_services
from apps.jobs import spec as job_spec
from apps.jobs.models import PARAMETER_SERVER, TRAINER, Job, Round, Task
from apps.leases.models import Lease
from apps.market.exceptions import OfferRefused
from apps.market.models import Offer
from apps.workers.models import Worker
from hypha_site.asgi import router
from tests.apps.conftest import advert, connect, market_rows, offer_on
from tests.apps.jobs.test_training import SPEC as TRAINING_SPEC
from tests.apps.workers.test_consumers import TIMEOUT, as_frame, closed_with, eventually, greet, receive
from worker_daemon import protocol

pytestmark = pytest.mark.django_db(transaction=True)

INSTANCE_A = "a" * 32
INSTANCE_B = "b" * 32


@pytest.fixture
async def gateway():
    """Opens communicators (``await gateway(token, instance=…)``) and disconnects them all at the end."""
    opened: list[WebsocketCommunicator] = []

    async def open_connection(token: str, *, instance: str | None = None) -> WebsocketCommunicator:
        headers = [(b"authorization", f"Bearer {token}".encode())]
        if instance is not None:
            headers.append((b"hypha-daemon-instance", instance.encode()))
        communicator = WebsocketCommunicator(router, "/ws/worker/", headers=headers)
        opened.append(communicator)
        connected, _ = await communicator.connect(timeout=TIMEOUT)
        assert connected
        return communicator

    yield open_connection
    for communicator in opened:
        if not communicator.future.done():
            await communicator.disconnect(timeout=TIMEOUT)
    await database_sync_to_async(connections.close_all)()


def worker_state(worker: Worker) -> tuple:
    worker = Worker.objects.get(pk=worker.pk)
    return worker.status, worker.channel_name, worker.connection_info.get("instance"), worker.connection_info


def all_rows() -> dict[str, list]:
    """The market's rows and training's: what a refused frame must leave as it was."""
    return {
        **market_rows(),
        "tasks": list(Task.objects.values()),
        "rounds": list(Round.objects.values()),
        "job slices": list(JobSlice.objects.values()),
        "slice events": list(SliceEvent.objects.values()),
    }


snapshot = database_sync_to_async(all_rows)


# --- one daemon process per worker: the newest ---------------------------------------------------------------


async def test_a_daemon_process_a_newer_one_superseded_is_refused_4009_when_it_returns(gateway, rig_a):
    # given: process A is connected; process B (a restart while A hung) connects with the same token
    first = await gateway(rig_a.token, instance=INSTANCE_A)
    await greet(first)
    second = await gateway(rig_a.token, instance=INSTANCE_B)
    await greet(second)
    [frame] = await receive(first)
    assert (frame["code"], frame["message"]) == ("refused", "superseded by a newer connection of this worker")
    assert await closed_with(first) == protocol.CloseCode.SUPERSEDED
    await first.disconnect(timeout=TIMEOUT)
    status, channel, instance, info = await database_sync_to_async(worker_state)(rig_a)
    assert (status, instance, info["superseded_instances"]) == ("online", INSTANCE_B, [INSTANCE_A])

    # when: process A comes back (it missed the close while it hung)
    returning = await gateway(rig_a.token, instance=INSTANCE_A)

    # then: refused before its hello, and B keeps the worker
    [frame] = await receive(returning)
    assert frame == as_frame(
        protocol.Error(
            code=protocol.ErrorCode.REFUSED,
            message="a newer daemon took over worker 'rig-a'; this one was superseded and must stop "
            "(run one daemon per worker token)",
        )
    )
    assert await closed_with(returning) == protocol.CloseCode.SUPERSEDED
    await returning.disconnect(timeout=TIMEOUT)
    assert await database_sync_to_async(worker_state)(rig_a) == (status, channel, instance, info)
    assert await second.receive_nothing(timeout=0.1)


async def test_the_same_process_reconnecting_replaces_its_old_connection_and_is_not_refused(gateway, rig_a):
    # given: a daemon's connection went half-open; the daemon (the same process) connected again
    stale = await gateway(rig_a.token, instance=INSTANCE_A)
    await greet(stale)
    fresh = await gateway(rig_a.token, instance=INSTANCE_A)
    await greet(fresh)
    await receive(stale)  # the error frame
    assert await closed_with(stale) == protocol.CloseCode.SUPERSEDED
    await stale.disconnect(timeout=TIMEOUT)

    # when: it reconnects once more (another blip)
    await fresh.disconnect(timeout=TIMEOUT)
    again = await gateway(rig_a.token, instance=INSTANCE_A)

    # then: welcomed; nothing of it counts as superseded
    await greet(again)
    status, _, instance, info = await database_sync_to_async(worker_state)(rig_a)
    assert (status, instance, info["superseded_instances"]) == ("online", INSTANCE_A, [])


@pytest.mark.parametrize("header", ["", "not valid!", "x" * 65])
async def test_an_invalid_instance_header_is_ignored(gateway, rig_a, header):
    communicator = await gateway(rig_a.token, instance=header)
    await greet(communicator)
    _, _, instance, info = await database_sync_to_async(worker_state)(rig_a)
    assert (instance, info["superseded_instances"]) == ("", [])


# --- revocation ------------------------------------------------------------------------------------------------


@pytest.fixture
def serving_rig_a(job, rig_a) -> Lease:
    """rig-a serves tiny-gpt's parameter server: an ACTIVE lease, won through the services."""
    connect(rig_a)
    job_services.offer_made(worker=rig_a, message=offer_on(advert(job, PARAMETER_SERVER), price=100.0))
    lease = Lease.objects.get(worker=rig_a)
    assert lease.status == Lease.Status.ACTIVE
    return lease


async def revoked_and_closed(communicator: WebsocketCommunicator, worker: Worker) -> None:
    await database_sync_to_async(job_services.revoke_worker)(worker)
    [frame] = await receive(communicator)
    assert (frame["code"], frame["message"]) == (
        "refused",
        f"the token of worker {worker.name!r} has been revoked",
    )
    assert await closed_with(communicator) == protocol.CloseCode.TOKEN_REVOKED


async def test_frames_a_revoked_daemon_sent_before_it_heard_are_dropped(gateway, rig_a, job, serving_rig_a):
    # given: rig-a's daemon, holding its lease, is revoked
    communicator = await gateway(rig_a.token)
    await greet(communicator, leases=(serving_rig_a.pk,))
    await revoked_and_closed(communicator, rig_a)
    before = await snapshot()

    # when: frames it sent before it heard arrive (an offer on the role its lease was, a renewal)
    ad = await database_sync_to_async(advert)(job, PARAMETER_SERVER)
    won_on = await database_sync_to_async(lambda: Offer.objects.get(lease=serving_rig_a).advertisement_id)()
    assert ad.pk != won_on  # the role was advertised again
    await communicator.send_to(text_data=protocol.encode(offer_on(ad, price=100.0)))
    await communicator.send_to(text_data=protocol.encode(protocol.LeaseRenewed(lease_id=serving_rig_a.pk)))

    # then: unanswered, and nothing changed
    assert await communicator.receive_nothing(timeout=0.3)
    assert await snapshot() == before
    assert not await database_sync_to_async(Offer.objects.filter(advertisement=ad, worker=rig_a).exists)()


async def test_a_lease_won_in_the_race_with_the_revocation_ends_when_the_connection_closes(
    gateway, rig_a, job, serving_rig_a
):
    # given: rig-a is revoked; an offer it made just before was handled after the revocation's commit
    communicator = await gateway(rig_a.token)
    await greet(communicator, leases=(serving_rig_a.pk,))
    await revoked_and_closed(communicator, rig_a)
    ad = await database_sync_to_async(advert)(job, PARAMETER_SERVER)
    # an offer made after the revocation is refused ...
    with pytest.raises(OfferRefused, match="the worker's token was revoked"):
        await database_sync_to_async(job_services.offer_made)(worker=rig_a, message=offer_on(ad, price=100.0))
    # ... but one whose transaction read the worker just before the revocation committed wins a lease
    revoked_at = await database_sync_to_async(
        lambda: Worker.objects.filter(pk=rig_a.pk).values_list("token_revoked_at", flat=True).get()
    )()
    await database_sync_to_async(Worker.objects.filter(pk=rig_a.pk).update)(token_revoked_at=None)
    await database_sync_to_async(job_services.offer_made)(worker=rig_a, message=offer_on(ad, price=100.0))
    await database_sync_to_async(Worker.objects.filter(pk=rig_a.pk).update)(token_revoked_at=revoked_at)
    won = await database_sync_to_async(Lease.objects.get)(worker=rig_a, status=Lease.Status.ACTIVE)

    # when: the closed connection ends
    await communicator.disconnect(timeout=TIMEOUT)

    # then: that lease ended too, the worker is offline, and its role is advertised again
    won = await database_sync_to_async(Lease.objects.get)(pk=won.pk)
    assert (won.status, won.status_reason) == (Lease.Status.RELEASED, "the worker's token was revoked")
    worker = await database_sync_to_async(Worker.objects.get)(pk=rig_a.pk)
    assert (worker.status, worker.is_revoked) == (Worker.Status.OFFLINE, True)
    job = await database_sync_to_async(Job.objects.get)(pk=job.pk)
    assert job.status == Job.Status.ALLOCATING


async def test_a_worker_whose_token_was_rotated_meanwhile_is_not_revoked_again(
    gateway, rig_a, job, serving_rig_a
):
    # given: rig-a is revoked and, before its closed connection ends, given a new token
    communicator = await gateway(rig_a.token)
    await greet(communicator, leases=(serving_rig_a.pk,))
    await revoked_and_closed(communicator, rig_a)
    await database_sync_to_async(job_services.rotate_token)(rig_a)

    # when
    await communicator.disconnect(timeout=TIMEOUT)

    # then: the new token stays valid
    worker = await database_sync_to_async(Worker.objects.get)(pk=rig_a.pk)
    assert (worker.status, worker.is_revoked) == (Worker.Status.OFFLINE, False)


# --- a worker answers only for itself ----------------------------------------------------------------------------

#: The training tests' job, without held-out evaluation slices.
SPEC = {key: value for key, value in TRAINING_SPEC.items() if key != "evaluation"}


@pytest.fixture
def training(job_owner, online_rigs, settings) -> dict[str, Task]:
    """A running DiLoCo job: rig-a and rig-b train, rig-c is its (ready) parameter server; rig-a holds slice 0.

    Returns its tasks by worker name.
    """
    # The adverts settle once all three offers are in; a loaded machine may take longer than the default
    # 1 s window to make them.
    settings.HYPHA_OFFER_WINDOW = 60.0
    node, _ = dataset_services.create_data_node(name="data-east", url="http://east.example:8100")
    dataset_services.register_dataset(
        node, "tiny-text", [(index, 1000, f"{index:x}" * 64) for index in range(4)]
    )
    parsed = job_spec.parse_json(SPEC)
    job = job_services.create_job(
        owner=job_owner,
        name="tiny-gpt",
        num_trainers=2,
        requirements=job_spec.to_requirements(parsed),
        spec=parsed.model_dump(mode="json"),
    )
    rig_a, rig_b, rig_c = online_rigs
    job = Job.objects.get(pk=job.pk)
    job_services.offer_made(worker=rig_a, message=offer_on(advert(job, TRAINER), price=120.0))
    job_services.offer_made(worker=rig_b, message=offer_on(advert(job, TRAINER), price=125.0))
    job_services.offer_made(worker=rig_c, message=offer_on(advert(job, PARAMETER_SERVER), price=100.0))
    assert Job.objects.get(pk=job.pk).status == Job.Status.RUNNING
    tasks = {
        task.lease.worker.name: task for task in Task.objects.filter(job=job).select_related("lease__worker")
    }
    ready = protocol.StatusReport(
        request_id=uuid.uuid4(),
        task_id=tasks["rig-c"].pk,
        progress={"ready": {"url": "http://10.0.0.3:7070", "round": 0}},
    )
    job_services.status_reported(worker=rig_c, message=ready)
    fetch = protocol.FetchSlice(request_id=uuid.uuid4(), task_id=tasks["rig-a"].pk, dataset="tiny-text")
    assert job_services.slice_requested(worker=rig_a, message=fetch).index == 0
    return tasks


def refusal(task_id, ref: str) -> dict:
    return as_frame(
        protocol.Error(
            code=protocol.ErrorCode.REFUSED, message=f"task {task_id} is not a task of this worker", ref=ref
        )
    )


FRAMES_ABOUT_A_TASK = {
    "job_started": lambda task_id: protocol.JobStarted(task_id=task_id),
    "job_exited (failed)": lambda task_id: protocol.JobExited(task_id=task_id, exit_code=1, reason="forged"),
    "job_exited (cancelled)": lambda task_id: protocol.JobExited(task_id=task_id, cancelled=True),
    "task_log": lambda task_id: protocol.TaskLog(task_id=task_id, lines=["forged"]),
    "slice_ack": lambda task_id: protocol.SliceAck(task_id=task_id, index=0),
}


@pytest.mark.parametrize("owner", ["rig-a", "rig-c"], ids=["a trainer's", "the parameter server's"])
@pytest.mark.parametrize("build", list(FRAMES_ABOUT_A_TASK.values()), ids=list(FRAMES_ABOUT_A_TASK))
async def test_a_frame_about_another_workers_task_is_refused_and_changes_nothing(
    gateway, online_rigs, training, owner, build
):
    # given: rig-b, a trainer of the same job, is connected
    rig_b = online_rigs[1]
    communicator = await gateway(rig_b.token)
    await greet(communicator, leases=(training["rig-b"].lease_id,))
    await receive(communicator)  # the dispatch of its own task, sent again after the welcome
    before = await snapshot()
    frame = build(training[owner].pk)

    # when
    await communicator.send_to(text_data=protocol.encode(frame))

    # then
    assert await receive(communicator) == [refusal(training[owner].pk, frame.type)]
    assert await snapshot() == before


@pytest.mark.parametrize("owner", ["rig-a", "rig-c"], ids=["a trainer's", "the parameter server's"])
@pytest.mark.parametrize(
    "progress",
    [
        {"status": {"batch_size": 4, "loss": 2.5, "step_time": 0.1}},
        "update",
        {"ready": {"url": "http://10.0.0.9:1"}},
    ],
    ids=["step", "update", "ready"],
)
async def test_a_status_about_another_workers_task_is_answered_error_and_changes_nothing(
    gateway, online_rigs, training, owner, progress
):
    rig_b = online_rigs[1]
    communicator = await gateway(rig_b.token)
    await greet(communicator, leases=(training["rig-b"].lease_id,))
    await receive(communicator)
    before = await snapshot()
    report = protocol.StatusReport(request_id=uuid.uuid4(), task_id=training[owner].pk, progress=progress)

    # when
    await communicator.send_to(text_data=protocol.encode(report))

    # then: the bridge waiting for a reply gets Error, and the error frame says why
    assert await receive(communicator, 2) == [
        refusal(training[owner].pk, "status"),
        as_frame(protocol.StatusReply(request_id=report.request_id, reply={"type": "Error"})),
    ]
    assert await snapshot() == before


async def test_a_slice_fetched_for_another_workers_task_is_refused_and_claims_nothing(
    gateway, online_rigs, training
):
    rig_b = online_rigs[1]
    communicator = await gateway(rig_b.token)
    await greet(communicator, leases=(training["rig-b"].lease_id,))
    await receive(communicator)
    before = await snapshot()
    fetch = protocol.FetchSlice(request_id=uuid.uuid4(), task_id=training["rig-a"].pk, dataset="tiny-text")

    # when
    await communicator.send_to(text_data=protocol.encode(fetch))

    # then
    assert await receive(communicator) == [
        as_frame(
            protocol.SliceAssigned(
                request_id=fetch.request_id,
                dataset="tiny-text",
                error=f"task {training['rig-a'].pk} is not a task of this worker",
            )
        )
    ]
    assert await snapshot() == before


async def test_its_own_task_frames_are_accepted(gateway, online_rigs, training):
    """The other side of the refusals above: the same frames about rig-b's own task change its task."""
    rig_b = online_rigs[1]
    communicator = await gateway(rig_b.token)
    await greet(communicator, leases=(training["rig-b"].lease_id,))
    await receive(communicator)
    task_id = training["rig-b"].pk

    await communicator.send_to(text_data=protocol.encode(protocol.JobStarted(task_id=task_id)))
    await communicator.send_to(text_data=protocol.encode(protocol.TaskLog(task_id=task_id, lines=["step 1"])))

    await eventually(lambda: Task.objects.get(pk=task_id).log_tail == "step 1")
    assert await database_sync_to_async(lambda: Task.objects.get(pk=task_id).started_at is not None)()
    assert await communicator.receive_nothing(timeout=0.1)
