"""The parameter server's input parsing (tokens, headers, query, round numbers) against hostile values: a 4xx
with a JSON error, never a 500, and the round unchanged (issue 12, finding 9). File names are
test_server.py's (``test_a_hostile_file_name_gets_a_4xx``)."""

from __future__ import annotations

import base64
import json
import time
import urllib.parse

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hostile import hostile_strings
from tests.parameter_server import test_server
from tests.parameter_server.conftest import ALICE, JOB_ID, TRANSFER_KEY
from tests.parameter_server.test_server import Served, safetensors_bytes
from worker_daemon.protocol import sign_transfer_token

served = test_server.served  # the fixture: a parameter server on a real port


def _signed(**changes) -> str:
    claims = {"job": JOB_ID, "peer": ALICE, "role": "trainer", "exp": int(time.time() + 600), **changes}
    return sign_transfer_token(
        TRANSFER_KEY, {key: value for key, value in claims.items() if value is not None}
    )


def _unsigned(body: str) -> str:
    encoded = base64.urlsafe_b64encode(body.encode()).rstrip(b"=").decode()
    return f"{encoded}.{encoded[:43]}"


@pytest.mark.parametrize(
    "token",
    [
        _signed(peer=None),
        _signed(peer=["a"]),
        _signed(lease="not-a-uuid"),
        _signed(peer="a\x00b"),
        _unsigned("[" * 2000 + "]" * 2000),  # deeper than json.loads goes, within aiohttp's 8 KB header limit
        "x" * 6000 + "." + "y" * 43,  # aiohttp refuses headers over 8 KB itself (a 400)
    ],
    ids=["no peer", "peer a list", "lease not a uuid", "peer with NUL", "deep unsigned claims", "long token"],
)
async def test_malformed_claims_are_a_401_and_change_nothing(served: Served, token):
    update = safetensors_bytes(served.tmp_path, {"w": torch.tensor([0.2, -0.4]), "b": torch.tensor([0.1])})

    async with served.session.put(
        served.job_url("rounds/1/update"), data=update, headers={"Authorization": f"Bearer {token}"}
    ) as response:
        assert response.status == 401
        assert (await response.json())["error"] == "unauthorized"

    assert (await served.state())["received"] == []


def _header_safe(text: str) -> str:
    """``text`` as an HTTP header value can carry it: printable latin-1, under aiohttp's 8 KB line limit."""
    return "".join(c if " " <= c <= "~" or "\xa0" <= c <= "\xff" else "?" for c in text)[:4000]


@settings(
    max_examples=30,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(text=hostile_strings(), claim=st.sampled_from(["peer", "role", "lease", "job", "exp"]))
async def test_hostile_tokens_headers_and_queries_never_get_a_server_error(served: Served, text, claim):
    update = safetensors_bytes(served.tmp_path, {"w": torch.tensor([0.2, -0.4]), "b": torch.tensor([0.1])})
    quoted = urllib.parse.quote(text[:2000].encode("utf-8", "surrogatepass"), safe="")  # a URL aiohttp reads
    # Within aiohttp's 8 KB header limit: beyond it aiohttp's own parser answers a plain-text 400.
    signed = {"Authorization": f"Bearer {_signed(**{claim: text[:2000]})}"}
    trainer = {"Authorization": f"Bearer {_signed()}"}
    calls = [
        ("PUT", "rounds/1/update", signed),
        ("PUT", "rounds/1/update", {"Authorization": _header_safe(f"Bearer {text}")}),
        ("PUT", "rounds/1/update", {**trainer, "X-Samples": _header_safe(text)}),
        ("PUT", f"rounds/{quoted}/update", trainer),
        ("GET", f"rounds/1/result?wait={quoted}", trainer),
        ("GET", f"rounds/{quoted}/result", trainer),
        ("GET", "state", signed),
    ]
    for method, path, headers in calls:
        async with served.session.request(
            method, served.job_url(path), data=update, headers=headers
        ) as response:
            assert response.status < 500, (method, path, response.status)
            assert set(await response.json()) == {"error", "detail"} or response.status == 200
    # nothing hostile was taken: only the honest trainer's update may have arrived
    assert set((await served.state())["received"]) <= {ALICE}
    json.dumps(await served.state())
