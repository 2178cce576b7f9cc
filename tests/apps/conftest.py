"""Personas and transports for the control plane's app tests.

The cast (every test asserts against these numbers):

* ``job_owner`` — Ada, who submits jobs.
* ``rig_a``, ``rig_b``, ``rig_c`` — three registered worker hosts, offline until a test connects them. Each
  has the same capacity (:data:`CAPACITY`: 8 cores, 32 GB memory, 100 GB storage, 24 GB VRAM) and, once
  connected with :func:`connect`, offers both executors. ``worker.token`` is its gateway token.
* ``online_rigs`` — the three rigs, connected through :func:`apps.jobs.services.worker_connected`.
* ``job`` — Ada's "tiny-gpt": 2 trainers + 1 parameter server (:data:`REQUIREMENTS`), allocated once, so it is
  ALLOCATING with one open advertisement per role.

Offers follow the ``whole`` strategy unless a test says otherwise: a rig offers its full capacity, so it can
hold one lease at a time.

Every test under tests/apps gets the market's default timing (whatever the environment says) and isolated
transports: a fresh channel layer (on Redis a unique prefix, so parallel runs and earlier tests never see
each other's groups), and in services mode Celery runs tasks eagerly in the calling thread, as the embedded
mode does outside a server (the tests run no Celery worker process).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model

from apps.jobs import services as job_services
from apps.jobs.models import DEFAULT_EXECUTORS, PARAMETER_SERVER, TRAINER, Job, JobEvent
from apps.leases.models import Lease, LeaseEvent
from apps.market.models import Advertisement, Offer
from apps.workers import services as worker_services
from apps.workers.models import Worker
from hypha_site.celery import app as celery_app
from worker_daemon import protocol


def market_rows() -> dict[str, list]:
    """Every row the market workflows write, to show that a refused call wrote nothing."""
    return {
        "workers": list(Worker.objects.values()),
        "jobs": list(Job.objects.values()),
        "job events": list(JobEvent.objects.values()),
        "adverts": list(Advertisement.objects.values()),
        "offers": list(Offer.objects.values()),
        "leases": list(Lease.objects.values()),
        "lease events": list(LeaseEvent.objects.values()),
    }


CAPACITY = protocol.Resources(cpu=8, memory=32, storage=100, gpu=24)
TRAIN = protocol.ExecutorDescriptor.model_validate(DEFAULT_EXECUTORS[TRAINER])
AGGREGATE = protocol.ExecutorDescriptor.model_validate(DEFAULT_EXECUTORS[PARAMETER_SERVER])

#: What each role asks of one worker (its advertised minimum).
TRAINER_MINIMUM = protocol.Resources(cpu=4, memory=16, storage=50, gpu=16)
PARAMETER_SERVER_MINIMUM = protocol.Resources(cpu=2, memory=8, storage=20, gpu=0)
REQUIREMENTS = {
    TRAINER: {
        "resources": TRAINER_MINIMUM.model_dump(),
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


# --- transports -------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _market_timing(settings):
    """The market's timing at its defaults, whatever the environment says, so tests can assert exact times; but
    a 60 s offer window, not the default 1 s: a busy machine must not close a window between a test's advert
    and its offers (a test that needs a closed window closes it, as ``_window_closed`` does)."""
    settings.HYPHA_LEASE_TTL = 10.0
    settings.HYPHA_RENEW_AT_REMAINING = 0.67
    settings.HYPHA_OFFER_TTL = 3.0
    settings.HYPHA_OFFER_WINDOW = 60.0
    settings.HYPHA_READVERTISE_BASE = 1.0
    settings.HYPHA_READVERTISE_MAX = 30.0


@pytest.fixture(autouse=True)
def _isolated_transports(settings):
    """A fresh channel layer per test, and Celery tasks run eagerly (see the module docstring)."""
    layer = dict(django_settings.CHANNEL_LAYERS["default"])
    if "CONFIG" in layer:
        layer["CONFIG"] = {**layer["CONFIG"], "prefix": f"hypha-test-{uuid.uuid4().hex[:12]}"}
    # Assigning the setting fires setting_changed, which makes channels drop its cached layer.
    settings.CHANNEL_LAYERS = {"default": layer}
    previous = celery_app.conf.task_always_eager, celery_app.conf.task_eager_propagates
    celery_app.conf.task_always_eager = True
    celery_app.conf.task_eager_propagates = True
    yield
    celery_app.conf.task_always_eager, celery_app.conf.task_eager_propagates = previous


# --- personas ---------------------------------------------------------------------------------------------


@pytest.fixture
def sent(monkeypatch) -> list[tuple[uuid.UUID, protocol._Message]]:
    """Every message the control plane sends to a daemon, in order (still delivered as usual)."""
    messages: list = []
    original = worker_services.send_to_workers

    def record(pairs):
        pairs = list(pairs)
        messages.extend(pairs)
        original(pairs)

    monkeypatch.setattr(worker_services, "send_to_workers", record)
    return messages


@pytest.fixture
def job_owner(db):
    return get_user_model().objects.create_user(username="ada", password=None)


def _registered(name: str) -> Worker:
    worker, token = worker_services.create_worker(name=name)
    worker.token = token  # shown once at registration; kept here for the tests that connect over the gateway
    return worker


@pytest.fixture
def rig_a(db) -> Worker:
    return _registered("rig-a")


@pytest.fixture
def rig_b(db) -> Worker:
    return _registered("rig-b")


@pytest.fixture
def rig_c(db) -> Worker:
    return _registered("rig-c")


@pytest.fixture
def online_rigs(rig_a, rig_b, rig_c) -> list[Worker]:
    for rig in (rig_a, rig_b, rig_c):
        connect(rig)
        rig.refresh_from_db()
    return [rig_a, rig_b, rig_c]


@pytest.fixture
def job(job_owner) -> Job:
    return submit_job(job_owner, name="tiny-gpt")


@pytest.fixture
def frozen_now(monkeypatch):
    """Stop ``timezone.now()`` at the current instant, so computed times can be asserted exactly."""
    from django.utils import timezone

    now = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: now)
    return now


# --- helpers ----------------------------------------------------------------------------------------------


def hello(
    *,
    resources: protocol.Resources = CAPACITY,
    executors: tuple[protocol.ExecutorDescriptor, ...] = (TRAIN, AGGREGATE),
    leases: tuple = (),
    version: int = protocol.PROTOCOL_VERSION,
    benchmark: protocol.BenchmarkResult | None = None,
    reachable: str = "true",
) -> protocol.Hello:
    # The rigs say they accept connections: the control plane then never tries their made-up URLs (a test
    # of "auto", which it checks with a real request, says so: tests/apps/jobs/test_transfers.py).
    return protocol.Hello(
        protocol_version=version,
        daemon_version="test",
        resources=resources,
        executors=list(executors),
        price_floor=50.0,
        strategy="whole",
        leases=list(leases),
        benchmark=benchmark,
        reachable=reachable,
    )


def connect(worker: Worker, *, channel_name: str | None = None, **hello_fields) -> protocol.Welcome:
    """Connect ``worker`` as its daemon would (a hello on a new channel) and return the welcome."""
    return job_services.worker_connected(
        worker=worker,
        channel_name=channel_name or f"test.{worker.name}",
        hello=hello(**hello_fields),
        info={"peer": "127.0.0.1:0"},
    )


def submit_job(owner, *, name: str, num_trainers: int = 2) -> Job:
    """Create a job and run its allocation (what the queued ``allocate_job`` task does after commit)."""
    created = job_services.create_job(
        owner=owner, name=name, num_trainers=num_trainers, requirements=REQUIREMENTS
    )
    job_services.allocate(created.pk)
    return Job.objects.get(pk=created.pk)


def advert(job: Job, role: str) -> Advertisement:
    """The job's newest advertisement for ``role``."""
    return job.advertisements.filter(role=role).order_by("-created_at").first()


def offer_on(
    ad: Advertisement,
    *,
    price: float,
    resources: protocol.Resources = CAPACITY,
    attempt: int | None = None,
    benchmark_score: float | None = None,
) -> protocol.Offer:
    return protocol.Offer(
        advertisement_id=ad.pk,
        attempt=ad.attempt if attempt is None else attempt,
        price=price,
        resources=resources,
        benchmark_score=benchmark_score,
    )


def benchmark(score: float) -> protocol.BenchmarkResult:
    """A worker's benchmark result of ``score`` samples/s (the ranking and reputation tests' workers)."""
    return protocol.BenchmarkResult(
        score=score,
        device="cuda",
        model="tiny-gpt-2x128",
        parameters=445952,
        batch_size=8,
        steps=40,
        step_seconds=8 / score,
        measured_at=datetime(2026, 11, 22, 3, 0, tzinfo=UTC),
    )
