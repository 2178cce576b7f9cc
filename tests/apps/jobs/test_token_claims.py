"""Transfer tokens whose claims are malformed get a 401, never a 500 (issue 12, finding 9).

A job's parameter server holds the job's transfer key, so it can sign any claims it likes: a lease id that is
not a UUID reached the database lookup and failed there. An unsigned token's claims were parsed before its
signature was checked, so a deeply nested body was a RecursionError for anyone.
"""

from __future__ import annotations

import base64
import json
import time

import pytest

from apps.jobs.models import Job
from apps.jobs.training import transfer_key
from worker_daemon.protocol import sign_transfer_token


def _claims(job: Job, **changes) -> dict:
    claims = {
        "job": str(job.pk),
        "peer": "99999999-9999-4999-8999-999999999999",
        "lease": "11111111-1111-4111-8111-111111111111",
        "role": "parameter_server",
        "exp": int(time.time() + 600),
    }
    claims.update(changes)
    return {key: value for key, value in claims.items() if value is not None}


def _unsigned(body: str) -> str:
    encoded = base64.urlsafe_b64encode(body.encode()).rstrip(b"=").decode()
    return f"{encoded}.{encoded[:43]}"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "changes",
    [
        {"lease": "not-a-uuid"},
        {"lease": 5},
        {"lease": ["11111111-1111-4111-8111-111111111111"]},
        {"lease": "1111\x00"},
        {"peer": None},
        {"peer": {"nested": True}},
        {"role": ["parameter_server"]},
        {"exp": True},
        {"deep": json.loads("[" * 900 + "]" * 900)},
    ],
    ids=[
        "lease not a uuid",
        "lease a number",
        "lease a list",
        "lease with NUL",
        "no peer",
        "peer an object",
        "role a list",
        "exp a bool",
        "deep claim",
    ],
)
def test_signed_claims_of_the_wrong_shape_are_a_401(leased_job, changes):
    # given: claims signed with the job's own key (what its parameter server could do)
    token = sign_transfer_token(transfer_key(leased_job.pk), _claims(leased_job, **changes))

    # when
    from rest_framework.test import APIClient

    client = APIClient()
    client.raise_request_exception = False
    response = client.generic(
        "PUT",
        f"/api/jobs/{leased_job.pk}/model/config.json",
        b"{}",
        content_type="application/octet-stream",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )

    # then
    assert response.status_code == 401, response.content[:300]
    assert response.json() == {"detail": "malformed transfer token"}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "token",
    [
        _unsigned("[" * 100_000 + "]" * 100_000),
        _unsigned('{"job": "' + "a" * 20_000 + '"}'),
        "a" * 20_000 + "." + "b" * 43,
    ],
    ids=["deep unsigned claims", "long unsigned claims", "long token"],
)
def test_hostile_unsigned_tokens_are_a_401(leased_job, token):
    from rest_framework.test import APIClient

    client = APIClient()
    client.raise_request_exception = False
    response = client.generic(
        "PUT",
        f"/api/jobs/{leased_job.pk}/model/config.json",
        b"{}",
        content_type="application/octet-stream",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )

    assert response.status_code == 401, response.content[:300]
    assert response.json()["detail"] in {
        "malformed transfer token",
        "transfer token signature does not match",
    }
