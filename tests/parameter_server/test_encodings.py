"""Encoded updates and results at the parameter server (docs/training.md, "Encodings"): over real HTTP, its
refusals, the decoded update under the norm bound, results in the job's encoding with error feedback, and a
restart that serves the last result again in its encoding."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import torch

from hypha_tensors import weights as weights_io
from hypha_tensors.encoding import decode, encode
from hypha_tensors.formats import Encoding
from parameter_server.job import parse_job
from parameter_server.rounds import RoundCoordinator
from parameter_server.server import GlobalModelFiles, ParameterServerApp, start_http, stop_http
from parameter_server.service import Stopped, run
from tests.parameter_server.conftest import ALICE, BOB, JOB_ID, aggregate_job, auth
from tests.parameter_server.test_service import Trainer, settings

INT8 = Encoding("int8", 16)


def global_weights() -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([1.0, 2.0, -0.5, 0.25] * 5), "b": torch.tensor([0.5])}


def body(tmp_path: Path, tensors: dict[str, torch.Tensor], encoding: Encoding | None, name: str) -> bytes:
    """A file as a trainer writes it: the wire tensors of ``tensors`` with the encoding's metadata (None:
    ``tensors`` as they are, without metadata, as Hypha's executors write them)."""
    path = tmp_path / f"{name}.safetensors"
    if encoding is None:
        weights_io.save(path, tensors)
    else:
        weights_io.save(path, encode(tensors, encoding), metadata=encoding.metadata())
    return path.read_bytes()


@dataclass
class Served:
    url: str
    coordinator: RoundCoordinator
    session: aiohttp.ClientSession
    tmp_path: Path
    encoding: Encoding

    async def put(self, peer: str, round_number: int, data: bytes) -> tuple[int, dict]:
        headers = {**auth(peer), "X-Samples": "1"}
        url = f"{self.url}/jobs/{JOB_ID}/rounds/{round_number}/update"
        async with self.session.put(url, data=data, headers=headers) as response:
            return response.status, await response.json(content_type=None)

    async def result(self, peer: str, round_number: int) -> Path:
        url = f"{self.url}/jobs/{JOB_ID}/rounds/{round_number}/result?wait=10"
        async with self.session.get(url, headers=auth(peer)) as response:
            assert response.status == 200
            path = self.tmp_path / f"result-{round_number}-{peer[:4]}.safetensors"
            path.write_bytes(await response.read())
            return path


@pytest.fixture(params=["int8", "float16"])
async def served(request, tmp_path: Path) -> AsyncIterator[Served]:
    encoding = INT8 if request.param == "int8" else Encoding("float16")
    files_dir = tmp_path / "model"
    files_dir.mkdir()
    weights_path = tmp_path / "global.safetensors"
    weights_io.save(weights_path, global_weights())
    results_dir = tmp_path / "results"
    results_dir.mkdir()

    async def persist(result, weights, momentum):
        # as the service writes it: the wire tensors with the encoding's metadata
        result.path = results_dir / f"{result.round_number}.safetensors"
        weights_io.save(result.path, result.file_tensors(), metadata=result.file_metadata())

    coordinator = RoundCoordinator(
        expected=[ALICE, BOB],
        weights=global_weights(),
        momentum=None,
        rounds_completed=0,
        update_rounds=3,
        round_timeout=30.0,
        weighted=True,
        learning_rate=0.7,
        momentum_factor=0.9,
        persist=persist,
        encoding=encoding,
    )
    app = ParameterServerApp(
        job_id=JOB_ID,
        transfer_key="job-key-for-tests",
        coordinator=coordinator,
        files=GlobalModelFiles(files_dir=files_dir, weights_path=weights_path, rounds_completed=0),
        signature=weights_io.signature(global_weights()),
        incoming_dir=tmp_path / "incoming",
        encoding=encoding,
    )
    runner, port = await start_http(app.make_app(), host="127.0.0.1", port=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield Served(f"http://127.0.0.1:{port}", coordinator, session, tmp_path, encoding)
    await stop_http(runner)
    await coordinator.aclose()


def deltas(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=generator) * 0.01 for name, t in global_weights().items()}


async def test_encoded_updates_are_accepted_and_the_result_applied_is_what_trainers_decode(served: Served):
    # given two rounds of encoded updates from both trainers
    theta = global_weights()
    for round_number in (1, 2):
        for index, peer in enumerate((ALICE, BOB)):
            data = body(served.tmp_path, deltas(10 * round_number + index), served.encoding, f"u{index}")
            assert await served.put(peer, round_number, data) == (
                200,
                {"round": round_number, "accepted": True},
            )

        # when a trainer fetches the result
        path = await served.result(ALICE, round_number)

        # then it is in the job's encoding, and θ_{r-1} + its decoding is the server's θ_r bit for bit
        assert weights_io.read_metadata(path)["hypha.encoding"] == served.encoding.name
        stored = weights_io.load(path)
        if served.encoding.name == "int8":
            assert sorted(stored) == ["b", "b.__scale__", "w", "w.__scale__"]
            assert stored["w"].dtype == torch.int8
        else:
            assert sorted(stored) == ["b", "w"] and stored["w"].dtype == torch.float16
        decoded = decode(stored, Encoding.from_metadata(weights_io.read_metadata(path)))
        theta = {name: theta[name] + decoded[name] for name in theta}
        assert weights_io.digest(theta) == weights_io.digest(served.coordinator.weights)
        assert all(torch.equal(theta[name], served.coordinator.weights[name]) for name in theta)


@pytest.mark.parametrize(
    ("sent", "detail"),
    [
        (None, "the update is encoded as float32; this job's updates are {job}"),
        (Encoding("bfloat16"), "the update is encoded as bfloat16; this job's updates are {job}"),
        (Encoding("int8", 32), "the update is encoded as int8 (blocks of 32); this job's updates are {job}"),
    ],
)
async def test_a_body_in_another_encoding_is_refused_with_422_and_the_round_is_unchanged(
    served: Served, sent: Encoding | None, detail: str
):
    if sent == served.encoding:
        pytest.skip("the job's own encoding")
    data = body(served.tmp_path, deltas(1), sent, "other")

    status, answer = await served.put(ALICE, 1, data)

    expected = detail.format(job=served.encoding)
    assert (status, answer) == (422, {"error": "wrong_encoding", "detail": expected})
    assert served.coordinator.received == []
    assert served.coordinator._round.refused == {ALICE: expected}
    assert served.coordinator._round.mean.count == 0


async def test_non_finite_values_or_scales_are_refused_with_422(served: Served):
    if served.encoding.name == "int8":
        wire = encode(deltas(1), INT8)
        wire["w.__scale__"] = wire["w.__scale__"].clone()
        wire["w.__scale__"][1] = float("nan")
    else:
        wire = encode(deltas(1), served.encoding)
        wire["w"] = wire["w"].clone()
        wire["w"][3] = float("inf")
    path = served.tmp_path / "bad.safetensors"
    # weights.save refuses NaN and Inf: the file is written by safetensors itself, as a hostile trainer could
    from safetensors.torch import save_file

    save_file(wire, str(path), metadata=served.encoding.metadata())

    status, answer = await served.put(ALICE, 1, path.read_bytes())

    assert status == 422 and answer["error"] == "refused_tensor"
    assert ("contains NaN" if served.encoding.name == "int8" else "contains Inf") in answer["detail"]
    assert served.coordinator.received == [] and served.coordinator._round.mean.count == 0


async def test_int8_scales_of_the_wrong_shape_are_refused_before_anything_is_added(served: Served):
    if served.encoding.name != "int8":
        pytest.skip("int8 only")
    wire = encode(deltas(1), INT8)
    wire["w.__scale__"] = torch.ones(1)
    path = served.tmp_path / "short-scales.safetensors"
    weights_io.save(path, wire, metadata=INT8.metadata())

    status, answer = await served.put(ALICE, 1, path.read_bytes())

    assert (status, answer["error"]) == (422, "refused_tensor")
    assert answer["detail"] == (
        "tensor 'w': has scales of dtype torch.float32 and shape (1,), expected torch.float32 and (2,) "
        "(blocks of 16)"
    )
    assert served.coordinator.received == []


async def test_the_norm_bound_applies_to_the_decoded_update(served: Served):
    # given: values that are small as int8 (1) but decode to 1e4 × the global weights' norm
    if served.encoding.name != "int8":
        pytest.skip("int8 only")
    wire = {
        "w": torch.ones(20, dtype=torch.int8),
        "w.__scale__": torch.full((2,), 1e4),
        "b": torch.ones(1, dtype=torch.int8),
        "b.__scale__": torch.full((1,), 1e4),
    }
    path = served.tmp_path / "huge.safetensors"
    weights_io.save(path, wire, metadata=INT8.metadata())

    status, answer = await served.put(ALICE, 1, path.read_bytes())

    assert (status, answer["error"]) == (422, "refused_update")
    assert answer["detail"].startswith("the update's L2 norm 45825.8 is over this round's bound")
    assert served.coordinator.received == [] and served.coordinator._round.mean.count == 0


async def test_the_servers_own_error_feedback_keeps_the_sum_of_results_on_the_sum_of_steps():
    # given: u = lr · g every round (momentum 0) with lr = 0.1, which float16 cannot hold (0.0999755859375)
    coordinator = RoundCoordinator(
        expected=[ALICE],
        weights={"w": torch.zeros(4)},
        momentum=None,
        rounds_completed=0,
        update_rounds=10,
        round_timeout=30.0,
        weighted=False,
        learning_rate=0.1,
        momentum_factor=0.0,
        encoding=Encoding("float16"),
    )
    sent = []
    for round_number in range(1, 11):
        await coordinator.submit(ALICE, round_number, {"w": torch.ones(4)}, samples=1)
        # the published result (the coordinator's own record of it keeps no tensors)
        result = await asyncio.wait_for(coordinator.published.get(), 10)
        assert result.round_number == round_number
        assert result.encoded["w"].dtype == torch.float16
        assert torch.equal(result.update["w"], result.encoded["w"].float())  # applied = decoded
        sent.append(result.encoded["w"][0].item())
    await coordinator.aclose()

    # then: ten steps of 0.1 arrive as 1.0 within half a float16 quantum (without feedback: 0.99976)
    assert abs(sum(sent) - 10 * torch.tensor(0.1).item()) <= 2.0**-11 / 2
    theta = torch.zeros(4)
    for value in sent:
        theta = theta + torch.full((4,), value)  # θ_r = θ_{r-1} + decoded u_r, in float32, as trainers merge
    assert torch.equal(coordinator.weights["w"], theta)
    # the first result is float16's 0.1; the second carries what the first lost
    assert sent[:2] == [0.0999755859375, 0.10003662109375]


async def test_a_restarted_server_serves_the_last_result_again_in_its_encoding(
    tmp_path, bridge, status_backend, receiver
):
    # given: an int8 job whose round 1 closed before the server stopped
    document = aggregate_job(peers=[ALICE], update_rounds=3)
    document["executor"]["config"]["rounds"].update({"encoding": "int8", "encoding_block_size": 64})
    job = parse_job(document)
    assert job.encoding == Encoding("int8", 64)
    work_dir = tmp_path / "work"
    stop = asyncio.Event()
    service = asyncio.create_task(run(job, settings(work_dir, bridge, receiver), stop))
    (ready,) = await status_backend.wait_for("ready", timeout=60)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice = Trainer(session, ready["url"], ALICE)
        theta_0 = weights_io.load(
            _written(tmp_path, "theta0", (await alice.get("model/model.safetensors"))[2])
        )
        update = {name: torch.randn(t.shape) * 0.01 for name, t in theta_0.items() if t.is_floating_point()}
        # as a trainer's state dict has it: GPT-2's lm_head is the very tensor of transformer.wte
        update["lm_head.weight"] = update["transformer.wte.weight"]
        wire = body(tmp_path, update, job.encoding, "alice-1")
        assert await alice.send(1, wire, samples=4) == 200
        status, headers, first = await alice.get("rounds/1/result?wait=20")
        (report,) = await status_backend.wait_for("round")
    stop.set()
    with pytest.raises(Stopped):
        await asyncio.wait_for(service, 10)
    assert report["encoding"] == "int8" and report["bytes_in"] == len(wire)

    # when: it starts again on the same work dir
    stop = asyncio.Event()
    service = asyncio.create_task(run(job, settings(work_dir, bridge, receiver), stop))
    ready_again = (await status_backend.wait_for("ready", 2, timeout=60))[1]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice = Trainer(session, ready_again["url"], ALICE)
        status_again, headers_again, again = await alice.get("rounds/1/result?wait=20")
        theta_1 = weights_io.load(
            _written(tmp_path, "theta1", (await alice.get("model/model.safetensors"))[2])
        )
    stop.set()
    with pytest.raises(Stopped):
        await asyncio.wait_for(service, 10)

    # then: the same result, in int8, and θ_0 + its decoding is the θ_1 the server publishes
    assert (status, status_again) == (200, 200)
    assert headers_again["X-Weights-Digest"] == headers["X-Weights-Digest"]
    for data in (first, again):
        path = _written(tmp_path, "result", data)
        assert weights_io.read_metadata(path)["hypha.encoding"] == "int8"
        assert weights_io.read_metadata(path)["hypha.block_size"] == "64"
        decoded = decode(weights_io.load(path), job.encoding)
        merged = {
            name: theta_0[name] + decoded[name] if name in decoded else theta_0[name] for name in theta_0
        }
        assert weights_io.digest(merged) == headers["X-Weights-Digest"] == weights_io.digest(theta_1)


def _written(tmp_path: Path, stem: str, data: bytes) -> Path:
    # a new file each time: safetensors may map a file, so it is never rewritten while in use
    import hashlib

    path = tmp_path / f"{stem}-{hashlib.sha256(data).hexdigest()[:12]}.safetensors"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("rounds", "message"),
    [
        ({"encoding": "int4"}, "rounds.encoding: unknown encoding 'int4'"),
        (
            {"encoding": "int8", "encoding_block_size": 4},
            "rounds.encoding: block size must be an integer from 16",
        ),
    ],
)
def test_the_job_json_refuses_an_unknown_encoding_or_block_size(rounds, message):
    from parameter_server.exceptions import JobConfigError

    document = aggregate_job(peers=[ALICE])
    document["executor"]["config"]["rounds"].update(rounds)
    with pytest.raises(JobConfigError, match=message):
        parse_job(document)
    assert parse_job(aggregate_job(peers=[ALICE])).encoding == Encoding("float32")
