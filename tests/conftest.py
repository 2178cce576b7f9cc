"""Fixtures shared by the control plane's tests.

Sections are owned by the people who wrote them; add yours in a section of its own. This module is loaded for
every test, the worker daemon's too, which run without Django: import Django and ``apps`` inside fixtures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    from apps.jobs.models import Job
    from apps.workers.models import Worker

# ======================================================================================================
# CI's two runs (tests/modes.py): the worker daemon's, data node's, CLI's, tensor format's and parameter
# server's tests run in the embedded run only — unless they use the control plane's database (a django_db
# mark, or a fixture of pytest-django's that needs it): the rest do not depend on the control plane's mode,
# and running them twice cost CI ~5 minutes of its 45.
# ======================================================================================================

_MODE_INDEPENDENT_DIRS = ("worker_daemon", "data_node", "hypha_cli", "hypha_tensors", "parameter_server")
#: pytest-django's autouse fixtures request django_db_blocker for every test: only these say a test uses it.
_CONTROL_PLANE_FIXTURES = frozenset({"db", "transactional_db", "live_server"})


def _uses_the_control_plane(item: pytest.Item) -> bool:
    return item.get_closest_marker("django_db") is not None or bool(
        _CONTROL_PLANE_FIXTURES & set(getattr(item, "fixturenames", ()))
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.modes import services_mode

    if not services_mode():
        return
    tests_dir = Path(__file__).resolve().parent
    skip = pytest.mark.skip(
        reason="runs in embedded mode only: it does not use the control plane, whose mode is all that differs"
    )
    for item in items:
        relative = Path(item.path).resolve().relative_to(tests_dir)
        if relative.parts[0] in _MODE_INDEPENDENT_DIRS and not _uses_the_control_plane(item):
            item.add_marker(skip)


# ======================================================================================================
# Personas of the REST API and admin tests (apps/*/api, apps/*/admin.py)
#
#   alice     a user who submits jobs                     (token + APIClient authenticated with it)
#   bob       a user who runs a worker, bobs-gpu          (token + APIClient)
#   carol     a user with no jobs and no workers: sees nothing of the others'
#   operator  staff and superuser: sees everything, uses the admin
#   anonymous an APIClient without credentials
#
#   bobs_worker   bob's worker, online: 8 CPU, 32 GB, 100 GB, 24 GB VRAM; offers train and aggregate
#   alices_job    alice's job "demo" (1 trainer), advertised: one open advert per role
#   leased_job    alices_job after bobs_worker offered 90 on its trainer advert and won: an ACTIVE lease
# ======================================================================================================


@dataclass
class Persona:
    user: User
    token: str
    client: APIClient


def _persona(username: str, *, staff: bool = False) -> Persona:
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    from apps.workers.models import UserToken

    # No password (hashing one takes a noticeable fraction of a second); the admin tests use force_login.
    user = get_user_model().objects.create_user(
        username=username, password=None, is_staff=staff, is_superuser=staff
    )
    _, token = UserToken.issue(user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return Persona(user=user, token=token, client=client)


@pytest.fixture
def alice(db) -> Persona:
    return _persona("alice")


@pytest.fixture
def bob(db) -> Persona:
    return _persona("bob")


@pytest.fixture
def carol(db) -> Persona:
    return _persona("carol")


@pytest.fixture
def operator(db) -> Persona:
    return _persona("operator", staff=True)


@pytest.fixture
def anonymous(db) -> APIClient:
    from rest_framework.test import APIClient

    return APIClient()


@pytest.fixture
def bobs_worker(bob) -> Worker:
    from apps.workers import services as worker_services
    from worker_daemon import protocol

    worker, _token = worker_services.create_worker(name="bobs-gpu", owner=bob.user)
    worker.mark_online(
        channel_name="test-channel",
        resources=protocol.Resources(cpu=8, memory=32, storage=100, gpu=24),
        executors=[
            protocol.ExecutorDescriptor.model_validate({"class": "train", "name": "diloco-transformer"}),
            protocol.ExecutorDescriptor.model_validate({"class": "aggregate", "name": "parameter-server"}),
        ],
        price_floor=10.0,
        strategy="whole",
        info={},
    )
    return worker


@pytest.fixture
def alices_job(alice, settings) -> Job:
    """Advertised by calling the allocation directly: in a test's transaction nothing runs after commit."""
    from apps.jobs import services as job_services

    # Offer windows and temporary leases that outlast a slow test, so offers made by a test are still taken.
    settings.HYPHA_OFFER_WINDOW = 600.0
    settings.HYPHA_OFFER_TTL = 1200.0
    job = job_services.create_job(
        owner=alice.user,
        name="demo",
        num_trainers=1,
        spec={"rounds": 3},
        requirements={
            "trainer": {
                "resources": {"cpu": 1.0, "memory": 4.0, "storage": 0.0, "gpu": 8.0},
                "executor": {"class": "train", "name": "diloco-transformer"},
                "bid": 80.0,
                "max": 100.0,
            },
            "parameter_server": {
                "resources": {"cpu": 1.0, "memory": 2.0, "storage": 0.0, "gpu": 0.0},
                "executor": {"class": "aggregate", "name": "parameter-server"},
                "bid": 20.0,
                "max": 30.0,
            },
        },
    )
    job_services.allocate(job.pk)
    job.refresh_from_db()
    return job


@pytest.fixture
def leased_job(alices_job, bobs_worker) -> Job:
    from apps.jobs import services as job_services
    from apps.leases.models import Lease
    from apps.market.models import Advertisement, Offer
    from worker_daemon import protocol

    advertisement = alices_job.advertisements.get(role="trainer")
    job_services.offer_made(
        worker=bobs_worker,
        message=protocol.Offer(
            advertisement_id=advertisement.pk,
            attempt=0,
            price=90.0,
            resources=protocol.Resources(cpu=1, memory=4, storage=0, gpu=8),
        ),
    )
    job_services.settle_advertisement(advertisement.pk, closing=False)
    alices_job.refresh_from_db()
    assert Lease.objects.get(job=alices_job).status == Lease.Status.ACTIVE
    assert Offer.objects.get(advertisement=advertisement).status == Offer.Status.ACCEPTED
    assert Advertisement.objects.get(pk=advertisement.pk).status == Advertisement.Status.FILLED
    return alices_job


# ======================================================================================================
# end of the REST API and admin personas
# ======================================================================================================
