"""Property-based fuzzing of the REST API from its own OpenAPI schema (schemathesis): no request gets a 5xx,
and every response matches what the schema documents.

The schema is the one ``GET /api/schema/`` serves (the same as docs/openapi.yaml, see test_openapi.py).
Requests go in-process to Django's WSGI handler: the views, middleware and serializers are those daphne runs
(ASGI differs only in the handler), and the requests share the test's database transaction, which an ASGI
test client, running the app on another thread, would not.

Each operation is one pytest test. Per operation Hypothesis runs :data:`MAX_EXAMPLES` generated requests, both
valid (``positive``) and invalid (``negative``) ones, derandomized so every run sends the same requests, plus
schemathesis' deterministic coverage cases (boundary values, missing and wrong-typed fields).

The caller is alice, a normal user who owns one of everything: a job (advertised, with a lease and an offer
by bob's worker), a worker, an upload; and a dataset is registered. Every read is sent again as the operator
(staff see everyone's objects). A generated id that is a valid UUID is sent twice: as generated (an unknown
object: 404) and as the id of alice's object of that kind, so detail views and actions run on a real object
too. The staff-only action (``benchmark``) is called as the operator, the data-node registration with a data
node's token, the model upload with a transfer token of the job's trainer (valid signature, wrong role).

Bounds: :data:`MAX_EXAMPLES` per operation, under 2,000 requests in all: 20 to 30 seconds on 2 cores (SQLite or
PostgreSQL), about twice that when the machine is busy.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from tests.modes import only_in_mode

#: Generated requests per operation in the fuzzing phase (valid and invalid ones mixed). The examples and
#: coverage phases add their own bounded, deterministic set. Raise it locally to dig deeper; CI runs this
#: module twice (SQLite, then PostgreSQL), so it stays well under a minute each.
MAX_EXAMPLES = 15

CONFIG = SchemathesisConfig.from_dict(
    {
        "generation": {
            "mode": "all",
            "max-examples": MAX_EXAMPLES,
            # derandomized: every run sends the same requests, so a failure in CI reproduces locally
            "deterministic": True,
            # no .hypothesis/ directory in the work tree
            "database": "none",
        },
        # Every other check stays on: no 5xx (not_a_server_error), the status code, content type, headers and
        # body of each response as documented. These two judge the *request* by the schema alone, which
        # cannot say all that the API checks:
        "checks": {
            # A valid-looking request may still be refused: a worker name already taken, `max` below `bid`,
            # slice indices that are not 0..n-1, a DiLoCo spec (a free-form object in the schema) that names
            # an unregistered dataset. A 400 with field errors is right there.
            "positive_data_acceptance": {"enabled": False},
            # DRF is lenient where the schema is strict: it takes 0 for a string field and "2" for an integer
            # one, and ignores a malformed `limit`/`offset`; our list filters ignore an empty parameter on
            # purpose (hypha_site/api.py FilteredListMixin). None of these changes anything it should not.
            "negative_data_rejection": {"enabled": False},
        },
        "phases": {
            "examples": {"enabled": True},
            "coverage": {"enabled": True},
            "fuzzing": {"enabled": True},
        },
    }
)

# POST /api/jobs/diloco/ also reads Hypha's scheduler TOML, a string in the schema: sent as it is.
schemathesis.serializer.alias("application/toml", "text/plain")
schema = schemathesis.openapi.from_wsgi("/api/schema/", get_wsgi_application(), config=CONFIG)


@dataclass
class World:
    user_token: str
    staff_token: str
    data_node_token: str
    transfer_token: str
    ids: dict[str, str]


@pytest.fixture
def world(alice, operator, leased_job, settings, tmp_path) -> World:
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    from apps.datasets import services as dataset_services
    from apps.jobs import training
    from apps.market.models import Offer
    from apps.workers import services as worker_services

    settings.HYPHA_DATA_DIR = tmp_path
    worker, _token = worker_services.create_worker(name="alices-gpu", owner=alice.user)
    node, node_token = dataset_services.create_data_node(name="data-east", url="http://east.example:8100")
    dataset = dataset_services.register_dataset(node, "tiny-text", [(0, 100, "a" * 64)])
    upload = training.store_upload(alice.user, "tiny.zip", iter([b"PK zip"]), limit=1 << 20)
    lease = leased_job.leases.get()
    ids = {
        "jobs": str(leased_job.pk),
        "workers": str(worker.pk),
        "advertisements": str(leased_job.advertisements.first().pk),
        "offers": str(Offer.objects.get(advertisement__job=leased_job).pk),
        "leases": str(lease.pk),
        "uploads": str(upload.pk),
        "datasets": dataset.name,
    }
    # Django's test client does the same: the handler would otherwise close the connection that holds the
    # test's transaction at the start and end of every request.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield World(
        user_token=alice.token,
        staff_token=operator.token,
        data_node_token=node_token,
        transfer_token=training.transfer_token(lease),
        ids=ids,
    )
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


def _callers(case, world: World) -> list[dict[str, str]]:
    """The ``Authorization`` headers to send the case with: a read also as staff, who see everyone's objects."""
    path = case.operation.path
    if path == "/api/datasets/register/" or path.startswith("/api/datanodes/"):
        return [{"Authorization": f"Bearer {world.data_node_token}"}]
    if path == "/api/jobs/{id}/model/{filename}":
        return [{"Authorization": f"Bearer {world.transfer_token}"}]
    if path == "/api/workers/{id}/benchmark/":
        return [{"Authorization": f"Token {world.staff_token}"}]
    if case.method.upper() == "GET":
        return [
            {"Authorization": f"Token {world.user_token}"},
            {"Authorization": f"Token {world.staff_token}"},
        ]
    return [{"Authorization": f"Token {world.user_token}"}]


def _known_object(case, world: World) -> bool:
    """Point the case's ``id``/``name`` at alice's object of that kind; False when there is nothing to point."""
    collection = case.operation.path.split("/")[2]
    parameters = case.path_parameters or {}
    if "id" in parameters:
        try:
            uuid.UUID(str(parameters["id"]))
        except ValueError:
            return False
        parameters["id"] = world.ids[collection]
        return True
    if "name" in parameters and collection == "datasets":
        parameters["name"] = world.ids[collection]
        return True
    return False


@only_in_mode(
    "services", "PostgreSQL refuses what SQLite takes (NUL bytes in strings): the stricter run finds more"
)
@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_the_api_answers_every_request_without_a_server_error(case, world):
    callers = _callers(case, world)
    for headers in callers:
        case.call_and_validate(headers=headers)
    if _known_object(case, world):
        for headers in callers:
            case.call_and_validate(headers=headers)
