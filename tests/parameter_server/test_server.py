"""The HTTP API (parameter_server/server.py) on a real port, with a two-tensor model."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import torch
from torch.testing import assert_close

from hypha_tensors import weights as weights_io
from parameter_server.rounds import RoundCoordinator
from parameter_server.server import GlobalModelFiles, ParameterServerApp, start_http, stop_http
from tests.parameter_server.conftest import ALICE, BOB, CAROL, JOB_ID, OTHER_JOB_ID, PS_PEER, auth, token


def global_weights() -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}


def safetensors_bytes(tmp_path: Path, tensors: dict[str, torch.Tensor], name: str = "update") -> bytes:
    path = tmp_path / f"{name}.safetensors"
    weights_io.save(path, tensors)
    return path.read_bytes()


def raw_safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """A safetensors file written by hand, so that it can hold what ``weights.save`` refuses (NaN)."""
    import json

    header, data, offset = {}, b"", 0
    for name, tensor in tensors.items():
        raw = tensor.contiguous().numpy().tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        data += raw
        offset += len(raw)
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


@dataclass
class Served:
    url: str
    app: ParameterServerApp
    coordinator: RoundCoordinator
    session: aiohttp.ClientSession
    tmp_path: Path

    def job_url(self, path: str) -> str:
        return f"{self.url}/jobs/{JOB_ID}/{path}"

    async def put_update(
        self, peer: str, round_number: int, body: bytes, samples: int | None = 1, **auth_kwargs
    ):
        headers = auth(peer, **auth_kwargs)
        if samples is not None:
            headers["X-Samples"] = str(samples)
        async with self.session.put(
            self.job_url(f"rounds/{round_number}/update"), data=body, headers=headers
        ) as r:
            return r.status, await r.json(content_type=None)

    async def state(self) -> dict:
        async with self.session.get(self.job_url("state"), headers=auth(ALICE)) as response:
            return await response.json()


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    files_dir = tmp_path / "model"
    files_dir.mkdir()
    (files_dir / "config.json").write_text('{"model_type": "tiny"}')
    weights_path = tmp_path / "global.safetensors"
    weights_io.save(weights_path, global_weights(), metadata={"format": "pt"})
    results_dir = tmp_path / "results"
    results_dir.mkdir()

    async def persist(result, weights, momentum):
        result.path = results_dir / f"{result.round_number}.safetensors"
        weights_io.save(result.path, result.update)

    coordinator = RoundCoordinator(
        expected=[ALICE, BOB, CAROL],
        weights=global_weights(),
        momentum=None,
        rounds_completed=0,
        update_rounds=3,
        round_timeout=30.0,
        weighted=True,
        learning_rate=0.5,
        momentum_factor=0.5,
        persist=persist,
    )
    app = ParameterServerApp(
        job_id=JOB_ID,
        transfer_key="job-key-for-tests",
        coordinator=coordinator,
        files=GlobalModelFiles(files_dir=files_dir, weights_path=weights_path, rounds_completed=0),
        signature=weights_io.signature(global_weights()),
        incoming_dir=tmp_path / "incoming",
    )
    runner, port = await start_http(app.make_app(), host="127.0.0.1", port=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield Served(f"http://127.0.0.1:{port}", app, coordinator, session, tmp_path)
    await stop_http(runner)
    await coordinator.aclose()


async def test_three_trainers_send_and_the_result_is_served(served: Served):
    # given: a long poll waiting before the round closes
    first_poll = asyncio.create_task(
        served.session.get(served.job_url("rounds/1/result?wait=0.1"), headers=auth(ALICE))
    )
    update = safetensors_bytes(served.tmp_path, {"w": torch.tensor([0.2, -0.4]), "b": torch.tensor([0.1])})

    # when
    assert await served.put_update(ALICE, 1, update, samples=2) == (200, {"round": 1, "accepted": True})
    assert (await served.state()) == {
        "round": 1,
        "rounds_completed": 0,
        "expected": [ALICE, BOB, CAROL],
        "received": [ALICE],
    }
    async with await first_poll as response:
        assert response.status == 204
    waiting = asyncio.create_task(
        served.session.get(served.job_url("rounds/1/result?wait=5"), headers=auth(ALICE))
    )
    assert (await served.put_update(BOB, 1, update, samples=1))[0] == 200
    assert (await served.put_update(CAROL, 1, update, samples=None))[0] == 200

    # then: g = the update, u = 0.75·g
    async with await waiting as response:
        assert response.status == 200
        assert response.headers["X-Included"] == "true"
        assert response.headers["X-Round"] == "1"
        path = served.tmp_path / "fetched.safetensors"
        path.write_bytes(await response.read())
    fetched = weights_io.load(path)
    assert_close(fetched, {"w": torch.tensor([0.15, -0.3]), "b": torch.tensor([0.075])})
    assert (await served.state())["round"] == 2


async def test_a_trainer_left_out_gets_x_included_false(served: Served):
    served.coordinator.round_timeout = 0.1
    update = safetensors_bytes(served.tmp_path, {"w": torch.tensor([0.2, -0.4]), "b": torch.tensor([0.1])})
    await served.put_update(ALICE, 1, update)

    async with served.session.get(served.job_url("rounds/1/result?wait=5"), headers=auth(CAROL)) as response:
        assert response.status == 200
        assert response.headers["X-Included"] == "false"
    assert await served.put_update(CAROL, 1, update) == (
        409,
        {"error": "round_conflict", "detail": "round 1 is closed"},
    )


async def test_the_model_file_carries_its_round(served: Served):
    async with served.session.get(served.job_url("model/model.safetensors"), headers=auth(CAROL)) as response:
        assert response.status == 200
        assert response.headers["X-Round"] == "0"
        assert await response.read() == (served.tmp_path / "global.safetensors").read_bytes()
    async with served.session.get(served.job_url("model/config.json"), headers=auth(CAROL)) as response:
        assert (response.status, await response.text()) == (200, '{"model_type": "tiny"}')
    for missing in ("absent.json", "../global.safetensors"):
        async with served.session.get(served.job_url(f"model/{missing}"), headers=auth(CAROL)) as response:
            assert response.status == 404


REFUSALS = [
    (
        "wrong name",
        {"w": torch.tensor([0.1, 0.1]), "bias": torch.tensor([0.1])},
        "refused_tensor",
        "'b' refused: missing",
    ),
    (
        "extra name",
        {**global_weights(), "x": torch.tensor([0.1])},
        "refused_tensor",
        "'x' refused: unknown name",
    ),
    (
        "wrong shape",
        {"w": torch.tensor([0.1, 0.1, 0.1]), "b": torch.tensor([0.1])},
        "refused_tensor",
        "'w' refused: shape (3,), expected (2,)",
    ),
    (
        "wrong dtype",
        {"w": torch.tensor([0.1, 0.1], dtype=torch.float64), "b": torch.tensor([0.1])},
        "refused_tensor",
        "'w' refused: dtype torch.float64, expected torch.float32",
    ),
]


@pytest.mark.parametrize(("case", "tensors", "kind", "detail"), REFUSALS, ids=[case[0] for case in REFUSALS])
async def test_a_bad_update_is_refused_and_the_round_goes_on(served: Served, case, tensors, kind, detail):
    # when
    status, body = await served.put_update(ALICE, 1, safetensors_bytes(served.tmp_path, tensors))

    # then
    assert (status, body["error"]) == (422, kind)
    assert detail in body["detail"]
    assert (await served.state())["received"] == []
    assert served.coordinator._round.refused == {ALICE: body["detail"]}
    good = safetensors_bytes(served.tmp_path, {"w": torch.tensor([0.2, -0.4]), "b": torch.tensor([0.1])})
    assert (await served.put_update(ALICE, 1, good))[0] == 200
    assert (await served.state())["received"] == [ALICE]
    assert served.coordinator._round.refused == {}


async def test_nan_inf_and_broken_files_are_refused(served: Served):
    nan = raw_safetensors_bytes({"w": torch.tensor([float("nan"), 0.0]), "b": torch.tensor([0.1])})
    inf = raw_safetensors_bytes({"w": torch.tensor([0.0, 0.0]), "b": torch.tensor([float("inf")])})
    good = safetensors_bytes(served.tmp_path, {"w": torch.tensor([0.2, -0.4]), "b": torch.tensor([0.1])})

    cases = [(nan, "refused_tensor", "contains NaN"), (inf, "refused_tensor", "contains Inf")]
    cases += [
        (good[: len(good) - 3], "not_safetensors", ""),
        (b"not a safetensors file at all", "not_safetensors", ""),
    ]
    for body, kind, detail in cases:
        status, answer = await served.put_update(BOB, 1, body)
        assert (status, answer["error"]) == (422, kind), answer
        assert detail in answer["detail"]
    assert (await served.state())["received"] == []
    assert list((served.tmp_path / "incoming").iterdir()) == []


async def test_an_update_over_the_size_limit_gets_413(served: Served):
    limit = served.app.max_update_bytes
    assert limit == 2 * (served.tmp_path / "global.safetensors").stat().st_size + (1 << 20)

    status, body = await served.put_update(ALICE, 1, b"\0" * (limit + 1))

    assert (status, body["error"]) == (413, "too_large")
    assert served.coordinator._round.refused == {ALICE: "too large"}
    assert (await served.state())["received"] == []


async def test_a_duplicate_update_gets_409_and_counts_once(served: Served):
    update = safetensors_bytes(served.tmp_path, {"w": torch.tensor([0.2, -0.4]), "b": torch.tensor([0.1])})
    assert (await served.put_update(ALICE, 1, update))[0] == 200

    assert await served.put_update(ALICE, 1, update) == (
        409,
        {"error": "round_conflict", "detail": f"{ALICE} already sent its update for round 1"},
    )
    assert (await served.put_update(BOB, 2, update))[0] == 409
    assert (await served.put_update(BOB, 7, update))[0] == 404
    assert (await served.state())["received"] == [ALICE]
    assert served.coordinator._round.mean.count == 1


@pytest.mark.parametrize(
    ("headers", "status", "kind"),
    [
        ({}, 401, "unauthorized"),
        ({"Authorization": "Bearer nonsense"}, 401, "unauthorized"),
        ({"Authorization": f"Bearer {token(ALICE, key='another-key')}"}, 401, "unauthorized"),
        ({"Authorization": f"Bearer {token(ALICE, ttl=-5)}"}, 401, "unauthorized"),
        ({"Authorization": f"Bearer {token(ALICE, job=OTHER_JOB_ID)}"}, 401, "unauthorized"),
        ({"Authorization": f"Bearer {token(PS_PEER, role='parameter_server')}"}, 403, "forbidden"),
        ({"Authorization": f"Bearer {token('stranger')}"}, 403, "forbidden"),
    ],
    ids=["missing", "malformed", "wrong key", "expired", "other job", "not a trainer", "not expected"],
)
async def test_updates_need_a_valid_token_of_an_expected_trainer(served: Served, headers, status, kind):
    update = safetensors_bytes(served.tmp_path, {"w": torch.tensor([0.2, -0.4]), "b": torch.tensor([0.1])})

    async with served.session.put(
        served.job_url("rounds/1/update"), data=update, headers=headers
    ) as response:
        assert response.status == status
        assert (await response.json())["error"] == kind

    assert (await served.state())["received"] == []


async def test_reads_need_a_token_of_the_job(served: Served):
    async with served.session.get(f"{served.url}/healthz") as response:
        assert response.status == 401
    async with served.session.get(
        f"{served.url}/healthz", headers=auth(PS_PEER, role="parameter_server")
    ) as response:
        assert (response.status, await response.json()) == (200, {"job": JOB_ID, "round": 1})
    async with served.session.get(
        served.job_url("model/config.json"), headers=auth(ALICE, ttl=-1)
    ) as response:
        assert response.status == 401
    async with served.session.get(
        served.job_url("rounds/1/result"), headers=auth(PS_PEER, role="parameter_server")
    ) as response:
        assert response.status == 403
    async with served.session.get(f"{served.url}/jobs/{OTHER_JOB_ID}/state", headers=auth(ALICE)) as response:
        assert (response.status, (await response.json())["error"]) == (404, "unknown_job")


async def test_bad_query_and_headers_get_400(served: Served):
    update = safetensors_bytes(served.tmp_path, {"w": torch.tensor([0.2, -0.4]), "b": torch.tensor([0.1])})
    headers = {**auth(ALICE), "X-Samples": "-3"}
    async with served.session.put(
        served.job_url("rounds/1/update"), data=update, headers=headers
    ) as response:
        assert (response.status, (await response.json())["error"]) == (400, "bad_request")
    async with served.session.get(
        served.job_url("rounds/1/result?wait=soon"), headers=auth(ALICE)
    ) as response:
        assert response.status == 400
    assert (await served.state())["received"] == []


# --- hostile updates (issue 12, finding 4) and hostile file names (finding 9) -----------------------------


def hostile_update() -> dict[str, torch.Tensor]:
    """Finite float32 values near the top of the range: their sample-weighted sum overflows float32."""
    return {"w": torch.tensor([1e38, 1e38]), "b": torch.tensor([1e38])}


HONEST_A = {"w": torch.tensor([0.2, -0.4]), "b": torch.tensor([0.1])}
HONEST_B = {"w": torch.tensor([0.6, 0.0]), "b": torch.tensor([-0.3])}


async def test_an_update_of_huge_finite_tensors_is_refused_and_the_round_closes_without_it(served: Served):
    # given
    hostile = safetensors_bytes(served.tmp_path, hostile_update(), name="hostile")

    # when: the job's first update is 1e38 everywhere, claiming 10^9 samples
    status, body = await served.put_update(CAROL, 1, hostile, samples=1_000_000_000)

    # then: refused with the reason; nothing of it is in the round
    assert (status, body["error"]) == (422, "refused_update")
    assert "norm" in body["detail"]
    assert (await served.state())["received"] == []
    assert served.coordinator._round.refused == {CAROL: body["detail"]}
    assert served.coordinator._round.mean.count == 0

    # when: the honest trainers send, and the control plane stops waiting for the hostile one
    assert (await served.put_update(ALICE, 1, safetensors_bytes(served.tmp_path, HONEST_A), samples=1))[
        0
    ] == 200
    assert (await served.put_update(BOB, 1, safetensors_bytes(served.tmp_path, HONEST_B), samples=3))[
        0
    ] == 200
    served.coordinator.expect(1, [ALICE, BOB], None)
    async with served.session.get(served.job_url("rounds/1/result?wait=5"), headers=auth(ALICE)) as response:
        assert response.status == 200
        path = served.tmp_path / "fetched.safetensors"
        path.write_bytes(await response.read())

    # then: g = (1·a + 3·b)/4 = w [0.5, -0.1], b [-0.2]; u = 0.75·g; the server still serves round 2
    assert_close(weights_io.load(path), {"w": torch.tensor([0.375, -0.075]), "b": torch.tensor([-0.15])})
    assert_close(served.coordinator.weights, {"w": torch.tensor([1.375, 1.925]), "b": torch.tensor([0.35])})
    assert not served.coordinator.failure.done()
    assert (await served.state())["round"] == 2


async def test_x_samples_over_the_jobs_cap_is_refused_before_the_body_is_read(served: Served):
    # given: the control plane's cap on the samples one trainer may claim in a round
    served.app.max_samples_per_update = 1000
    update = safetensors_bytes(served.tmp_path, HONEST_A)

    # when
    status, body = await served.put_update(ALICE, 1, update, samples=1_000_000_000)

    # then
    assert (status, body) == (
        422,
        {
            "error": "refused_samples",
            "detail": "X-Samples 1000000000 is more than a trainer can have trained on in a round "
            "(at most 1000 in this job)",
        },
    )
    assert served.coordinator._round.refused == {ALICE: body["detail"]}
    assert (await served.state())["received"] == []
    assert served.coordinator._round.bytes_in == 0
    # the same update with an honest count is accepted
    assert (await served.put_update(ALICE, 1, update, samples=1000))[0] == 200
    assert served.coordinator._round.refused == {}


async def test_an_aggregate_that_is_not_finite_discards_the_round_and_the_server_goes_on(served: Served):
    # given: an outer learning rate that turns any update into Inf in float32
    served.coordinator.learning_rate = 1e39
    update = safetensors_bytes(served.tmp_path, HONEST_A)
    before = {name: tensor.clone() for name, tensor in served.coordinator.weights.items()}

    # when
    for peer in (ALICE, BOB, CAROL):
        assert (await served.put_update(peer, 1, update))[0] == 200
    async with served.session.get(served.job_url("rounds/1/result?wait=5"), headers=auth(ALICE)) as response:
        assert response.status == 200
        path = served.tmp_path / "fetched.safetensors"
        path.write_bytes(await response.read())

    # then: round 1 published with u = 0, the weights and the momentum unchanged, the reason recorded
    assert_close(weights_io.load(path), {"w": torch.zeros(2), "b": torch.zeros(1)}, rtol=0, atol=0)
    assert_close(served.coordinator.weights, before, rtol=0, atol=0)
    assert served.coordinator.momentum is None
    result = served.coordinator.result(1)
    assert (result.stepped, result.discarded) == (False, "the outer step is not finite ('b' contains Inf)")
    assert not served.coordinator.failure.done()

    # when: round 2 with a sane learning rate
    served.coordinator.learning_rate = 0.5
    for peer in (ALICE, BOB, CAROL):
        assert (await served.put_update(peer, 2, update))[0] == 200
    result = await served.coordinator.wait_result(2, 5)

    # then: a first step (m = g): u = 0.75·g
    assert result is not None and result.stepped and result.discarded is None
    assert_close(served.coordinator.weights, {"w": torch.tensor([1.15, 1.7]), "b": torch.tensor([0.575])})


@pytest.mark.parametrize("filename", ["%00", "config.json%00", "a%00/b", "%ED%A0%80"])
async def test_a_hostile_file_name_gets_a_4xx(served: Served, filename):
    async with served.session.get(served.job_url(f"model/{filename}"), headers=auth(CAROL)) as response:
        assert 400 <= response.status < 500
        assert (await response.json())["error"] in ("bad_request", "not_found")
    assert (await served.state())["round"] == 1


@pytest.mark.parametrize(
    "samples", ["\xb2", "9" * 5000, "1e9", " "], ids=["superscript two", "5000 digits", "1e9", "blank"]
)
async def test_an_x_samples_int_cannot_parse_is_a_400_and_changes_nothing(served: Served, samples):
    update = safetensors_bytes(served.tmp_path, HONEST_A)
    headers = {**auth(ALICE), "X-Samples": samples}

    async with served.session.put(
        served.job_url("rounds/1/update"), data=update, headers=headers
    ) as response:
        status, body = response.status, await response.json()

    if samples == " ":  # blank: no count, the update weighs 1
        assert status == 200
        return
    assert (status, body["error"]) == (400, "bad_request")
    assert (await served.state())["received"] == []
    assert served.coordinator._round.bytes_in == 0
