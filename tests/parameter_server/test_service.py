"""The whole parameter server in-process (parameter_server/service.py): a tiny GPT-2, a real bridge with a
recording backend, trainers over HTTP, a local data node for the eval slice and a local model receiver."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import aiohttp
import pytest
import torch
from torch.testing import assert_close

from hypha_tensors import weights as weights_io
from parameter_server.exceptions import UploadError
from parameter_server.job import parse_job
from parameter_server.service import Settings, Stopped, run
from tests.parameter_server.conftest import (
    ALICE,
    BOB,
    CAROL,
    JOB_ID,
    PS_PEER,
    TRANSFER_KEY,
    Receiver,
    aggregate_job,
    auth,
    token,
)


def settings(work_dir: Path, bridge, receiver: Receiver, **overrides) -> Settings:
    values = {
        "work_dir": work_dir,
        "socket_path": bridge.socket_path,
        "host": "127.0.0.1",
        "port": 0,
        "public_url": None,
        "transfer_key": TRANSFER_KEY,
        "transfer_token": token(PS_PEER, role="parameter_server"),
        "server_url": receiver.url,
        "final_wait": 10.0,
        "upload_deadline": 10.0,
    }
    values.update(overrides)
    return Settings(**values)


def delta_like(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(tensor.shape, generator=generator) * 0.01 for name, tensor in weights.items()}


def to_bytes(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> bytes:
    path = tmp_path / "body.safetensors"  # weights.save replaces the file, never rewrites it
    weights_io.save(path, tensors)
    return path.read_bytes()


def from_bytes(tmp_path: Path, data: bytes) -> dict[str, torch.Tensor]:
    # A new file each time: safetensors may map the file, so it must never be rewritten while in use.
    path = tmp_path / f"fetched-{hashlib.sha256(data).hexdigest()[:16]}.safetensors"
    path.write_bytes(data)
    return weights_io.load(path)


class Trainer:
    def __init__(self, session: aiohttp.ClientSession, url: str, peer: str) -> None:
        self.session, self.url, self.peer = session, f"{url}/jobs/{JOB_ID}", peer

    async def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        async with self.session.get(f"{self.url}/{path}", headers=auth(self.peer)) as response:
            return response.status, dict(response.headers), await response.read()

    async def send(self, round_number: int, body: bytes, samples: int) -> int:
        headers = {**auth(self.peer), "X-Samples": str(samples)}
        async with self.session.put(
            f"{self.url}/rounds/{round_number}/update", data=body, headers=headers
        ) as r:
            return r.status


async def test_two_rounds_with_eval_then_the_final_model_is_uploaded(
    tmp_path, bridge, status_backend, receiver
):
    # given: an eval slice of 4 sequences on the local data node
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, 256, (4, 8), generator=generator)
    slice_path = tmp_path / "slice.safetensors"
    weights_io.save(slice_path, {"input_ids": input_ids, "labels": input_ids})
    receiver.slices[0] = slice_path.read_bytes()
    eval_config = {
        "dataset": "stdlib",
        "batch_size": 16,
        "slices": [
            {
                "index": 0,
                "size": len(receiver.slices[0]),
                "sha256": hashlib.sha256(receiver.slices[0]).hexdigest(),
                "urls": [f"{receiver.url}/datasets/stdlib/slices/0"],
            }
        ],
    }
    job = parse_job(aggregate_job(peers=[ALICE, BOB], update_rounds=2, eval_config=eval_config))
    options = settings(tmp_path / "work", bridge, receiver)
    service = asyncio.create_task(run(job, options, asyncio.Event()))

    # when: the parameter server is ready
    (ready,) = await status_backend.wait_for("ready", timeout=60)
    assert ready["round"] == 0 and ready["url"].startswith("http://127.0.0.1:")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice, bob = Trainer(session, ready["url"], ALICE), Trainer(session, ready["url"], BOB)
        status, headers, data = await alice.get("model/model.safetensors")
        assert (status, headers["X-Round"]) == (200, "0")
        theta_0 = from_bytes(tmp_path, data)
        assert (await alice.get("model/config.json"))[0] == 200

        # round 1: samples 2 and 6 → g = (2·a + 6·b) / 8; first step u = lr·(1 + μ)·g = 0.75·g
        a, b = delta_like(theta_0, 1), delta_like(theta_0, 2)
        body_a, body_b = to_bytes(tmp_path, a), to_bytes(tmp_path, b)
        assert await alice.send(1, body_a, samples=2) == 200
        assert await bob.send(1, body_b, samples=6) == 200
        status, headers, data = await alice.get("rounds/1/result?wait=20")
        assert (status, headers["X-Included"]) == (200, "true")
        u_1 = from_bytes(tmp_path, data)
        digest_1 = headers["X-Weights-Digest"]
        (tmp_path / "u_1.safetensors").write_bytes(data)
        assert weights_io.publication(tmp_path / "u_1.safetensors") == (1, digest_1)
        expected_u_1 = {name: 0.75 * (2 * a[name] + 6 * b[name]) / 8 for name in a}
        assert_close(u_1, expected_u_1)
        assert (await bob.get("rounds/1/result"))[0] == 200
        (report_1,) = await status_backend.wait_for("round")
        status, headers, data = await bob.get("model/model.safetensors")
        assert headers["X-Round"] == "1"
        theta_1 = from_bytes(tmp_path, data)
        assert_close(theta_1, {name: theta_0[name] + u_1[name] for name in theta_0})
        # θ_1's digest goes with its result and its model file: what a trainer checks its merge against
        (tmp_path / "theta_1.safetensors").write_bytes(data)
        assert weights_io.publication(tmp_path / "theta_1.safetensors") == (1, digest_1)
        assert weights_io.digest(theta_1) == digest_1
        merged = {name: theta_0[name] + u_1[name] for name in theta_0}
        assert weights_io.digest(merged) == digest_1  # θ_0 + u_1 on a trainer is θ_1 bit for bit

        # round 2; the control plane answers Done to its report
        status_backend.replies.append({"type": "Done"})
        assert await alice.send(2, body_a, samples=1) == 200
        assert await bob.send(2, body_b, samples=1) == 200
        assert (await alice.get("rounds/2/result?wait=20"))[0] == 200
        assert (await bob.get("rounds/2/result?wait=20"))[0] == 200

        # then: it uploads, sees both fetches and exits 0
        assert await asyncio.wait_for(service, 30) == 0

    assert report_1 == {
        "round": 1,
        "participants": [ALICE, BOB],
        "arrivals": {ALICE: 0.0, BOB: report_1["arrivals"][BOB]},
        "left_out": [],
        "refused": {},
        "samples": 8,
        "duration": report_1["duration"],
        "bytes_in": len(body_a) + len(body_b),
        "bytes_out": report_1["bytes_out"],
        # no relay (the control plane said nothing of a path): every byte went directly
        "transfers": {
            "direct": {"in": len(body_a) + len(body_b), "out": report_1["bytes_out"]},
            "relay": {"in": 0, "out": 0},
        },
        "encoding": "float32",
        "eval_loss": report_1["eval_loss"],
        "eval_error": None,
        "discarded": None,
    }
    assert report_1["bytes_out"] > 2 * len(body_a)  # the model download and two results
    assert 0 < report_1["eval_loss"] < 10
    _, report_2 = await status_backend.wait_for("round", 2)
    assert (report_2["round"], report_2["samples"]) == (2, 2)
    # the model's data files too (save_pretrained's generation_config.json), and the weights last
    assert list(receiver.uploads) == ["generation_config.json", "config.json", "model.safetensors"]
    assert set(receiver.authorizations) == {f"Bearer {options.transfer_token}"}
    final_dir = tmp_path / "final"
    final_dir.mkdir()
    for name, data in receiver.uploads.items():
        (final_dir / name).write_bytes(data)
    final = AutoModelForCausalLM.from_pretrained(final_dir)
    with torch.no_grad():
        loss = float(final(input_ids=input_ids, labels=input_ids).loss)
    assert report_2["eval_loss"] == pytest.approx(loss, rel=1e-5)
    assert final.lm_head.weight.data_ptr() == final.transformer.wte.weight.data_ptr()


async def test_each_rounds_bytes_out_counts_its_result_downloads_even_when_they_end_after_the_close(
    tmp_path, bridge, status_backend, receiver
):
    # given: no eval (the report would go at once), trainers that fetch each result a little after it is
    # published — round 2 once showed bytes_out 0 because its downloads counted in round 3's report
    job = parse_job(aggregate_job(peers=[ALICE, BOB], update_rounds=2))
    service = asyncio.create_task(run(job, settings(tmp_path / "work", bridge, receiver), asyncio.Event()))
    (ready,) = await status_backend.wait_for("ready", timeout=60)
    sizes = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice, bob = Trainer(session, ready["url"], ALICE), Trainer(session, ready["url"], BOB)
        model = (await alice.get("model/model.safetensors"))[2]
        body = to_bytes(tmp_path, delta_like(from_bytes(tmp_path, model), 1))
        status_backend.replies.extend([{"type": "Ok"}, {"type": "Done"}])
        for round_number in (1, 2):
            # when: both send, and fetch the result 0.3 s after it is ready
            assert await alice.send(round_number, body, samples=2) == 200
            assert await bob.send(round_number, body, samples=2) == 200
            while json.loads((await alice.get("state"))[2])["rounds_completed"] < round_number:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            results = [await trainer.get(f"rounds/{round_number}/result?wait=20") for trainer in (alice, bob)]
            assert [status for status, _, _ in results] == [200, 200]
            sizes[round_number] = sum(len(data) for _, _, data in results)
        reports = await status_backend.wait_for("round", 2)
        assert await asyncio.wait_for(service, 30) == 0

    # then: each round counts its own result's downloads (round 1 the initial model too), none counts 0
    assert reports[0]["bytes_out"] == len(model) + sizes[1]
    assert reports[1]["bytes_out"] == sizes[2]
    assert reports[0]["transfers"]["direct"]["out"] == reports[0]["bytes_out"]


async def test_a_silent_trainer_is_left_out_after_the_timeout(tmp_path, bridge, status_backend, receiver):
    # given: the control plane's upload fails twice before it works
    receiver.failures = 2
    job = parse_job(aggregate_job(peers=[ALICE, BOB], update_rounds=1, round_timeout=0.3))
    service = asyncio.create_task(run(job, settings(tmp_path / "work", bridge, receiver), asyncio.Event()))
    (ready,) = await status_backend.wait_for("ready", timeout=60)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice, bob = Trainer(session, ready["url"], ALICE), Trainer(session, ready["url"], BOB)
        theta_0 = from_bytes(tmp_path, (await alice.get("model/model.safetensors"))[2])
        bad = {**delta_like(theta_0, 1), "transformer.wpe.weight": torch.zeros(3, 3)}
        assert await bob.send(1, to_bytes(tmp_path, bad), samples=4) == 422

        # when: only alice sends
        assert await alice.send(1, to_bytes(tmp_path, delta_like(theta_0, 1)), samples=4) == 200
        (report,) = await status_backend.wait_for("round")
        assert await bob.send(1, to_bytes(tmp_path, delta_like(theta_0, 1)), samples=4) == 409
        assert (await alice.get("rounds/1/result?wait=20"))[0] == 200

        # then
        assert await asyncio.wait_for(service, 30) == 0

    assert (report["participants"], report["left_out"]) == ([ALICE], [BOB])
    assert report["refused"] == {
        BOB: "tensor 'transformer.wpe.weight' refused: shape (3, 3), expected (64, 32)",
    }
    assert (report["eval_loss"], report["eval_error"]) == (None, None)  # the job has no eval
    # generation_config.json (uploaded first): 503, 503, 200; config.json: 200; model.safetensors: 200
    assert len(receiver.authorizations) == 5
    assert sorted(receiver.uploads) == ["config.json", "generation_config.json", "model.safetensors"]


async def test_the_control_plane_says_whom_to_expect_when_the_first_update_arrives(
    tmp_path, bridge, status_backend, receiver
):
    # given: bob's trainer is gone; the control plane says so when asked
    status_backend.expect = {"type": "Expect", "peers": [ALICE], "due_in": 0.0}
    job = parse_job(aggregate_job(peers=[ALICE, BOB], update_rounds=1, round_timeout=600.0))
    service = asyncio.create_task(run(job, settings(tmp_path / "work", bridge, receiver), asyncio.Event()))
    (ready,) = await status_backend.wait_for("ready", timeout=60)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice = Trainer(session, ready["url"], ALICE)
        theta_0 = from_bytes(tmp_path, (await alice.get("model/model.safetensors"))[2])

        # when: only alice sends
        assert await alice.send(1, to_bytes(tmp_path, delta_like(theta_0, 1)), samples=4) == 200
        # Asked once before the update is taken (does the control plane count samples? this one does not)
        # and once it is (whom to wait for): the same question.
        waiting, *_ = await status_backend.wait_for("waiting")
        (report,) = await status_backend.wait_for("round", timeout=10)  # not after round_timeout (600 s)
        assert (await alice.get("rounds/1/result?wait=20"))[0] == 200
        assert await asyncio.wait_for(service, 30) == 0

    # then
    assert waiting == {"round": 1}
    assert (report["participants"], report["left_out"]) == ([ALICE], [BOB])


async def test_a_replacement_trainer_the_control_plane_names_may_send(
    tmp_path, bridge, status_backend, receiver
):
    # given: bob died and "carol" replaced him; the job JSON still names alice and bob
    status_backend.expect = {"type": "Expect", "peers": [ALICE, "carol"], "due_in": None}
    job = parse_job(aggregate_job(peers=[ALICE, BOB], update_rounds=1, round_timeout=600.0))
    service = asyncio.create_task(run(job, settings(tmp_path / "work", bridge, receiver), asyncio.Event()))
    (ready,) = await status_backend.wait_for("ready", timeout=60)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice, carol = Trainer(session, ready["url"], ALICE), Trainer(session, ready["url"], "carol")
        theta_0 = from_bytes(tmp_path, (await alice.get("model/model.safetensors"))[2])

        # when: carol sends first (the parameter server asks about her), then alice
        assert await carol.send(1, to_bytes(tmp_path, delta_like(theta_0, 1)), samples=4) == 200
        assert await alice.send(1, to_bytes(tmp_path, delta_like(theta_0, 1)), samples=4) == 200
        (report,) = await status_backend.wait_for("round", timeout=10)
        assert (await carol.get("rounds/1/result?wait=20"))[0] == 200
        assert (await alice.get("rounds/1/result?wait=20"))[0] == 200
        assert await asyncio.wait_for(service, 30) == 0

    # then: closed as soon as both sent; bob, expected when the round opened, is reported as left out
    assert sorted(report["participants"]) == sorted([ALICE, "carol"])
    assert report["left_out"] == [BOB]


async def test_an_upload_that_never_succeeds_fails_the_run(tmp_path, bridge, status_backend, receiver):
    receiver.failures = 10_000
    job = parse_job(aggregate_job(peers=[ALICE], update_rounds=1))
    options = {"upload_deadline": 1.0}
    service = asyncio.create_task(
        run(job, settings(tmp_path / "work", bridge, receiver, **options), asyncio.Event())
    )
    (ready,) = await status_backend.wait_for("ready", timeout=60)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice = Trainer(session, ready["url"], ALICE)
        theta_0 = from_bytes(tmp_path, (await alice.get("model/model.safetensors"))[2])
        assert await alice.send(1, to_bytes(tmp_path, delta_like(theta_0, 1)), samples=4) == 200
        with pytest.raises(UploadError, match="config.json"):
            await asyncio.wait_for(service, 30)
    assert receiver.uploads == {}


async def test_a_restart_resumes_after_the_last_checkpoint_and_stop_ends_serving(
    tmp_path, bridge, status_backend, receiver
):
    # given: round 1 of 3 done, then the parameter server is stopped
    job = parse_job(aggregate_job(peers=[ALICE], update_rounds=3))
    stop = asyncio.Event()
    work_dir = tmp_path / "work"
    service = asyncio.create_task(run(job, settings(work_dir, bridge, receiver), stop))
    (ready,) = await status_backend.wait_for("ready", timeout=60)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice = Trainer(session, ready["url"], ALICE)
        theta_0 = from_bytes(tmp_path, (await alice.get("model/model.safetensors"))[2])
        assert await alice.send(1, to_bytes(tmp_path, delta_like(theta_0, 1)), samples=4) == 200
        theta_1 = theta_0 | {
            name: theta_0[name] + tensor
            for name, tensor in from_bytes(tmp_path, (await alice.get("rounds/1/result?wait=20"))[2]).items()
        }
        await status_backend.wait_for("round")
    stop.set()
    with pytest.raises(Stopped):
        await asyncio.wait_for(service, 10)

    # when: it starts again on the same work dir
    stop = asyncio.Event()
    service = asyncio.create_task(run(job, settings(work_dir, bridge, receiver), stop))
    ready_again = (await status_backend.wait_for("ready", 2, timeout=60))[1]

    # then
    assert ready_again["round"] == 1
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice = Trainer(session, ready_again["url"], ALICE)
        status, headers, data = await alice.get("model/model.safetensors")
        assert headers["X-Round"] == "1"
        assert_close(from_bytes(tmp_path, data), theta_1)
        state = await alice.get("state")
        assert (
            state[2]
            == b'{"round": 2, "rounds_completed": 1, "expected": ["%s"], "received": []}' % ALICE.encode()
        )
    stop.set()
    with pytest.raises(Stopped):
        await asyncio.wait_for(service, 10)


async def test_a_server_started_elsewhere_resumes_from_the_control_planes_copy_bit_for_bit(
    tmp_path, bridge, status_backend, receiver
):
    job_json = aggregate_job(peers=[ALICE, BOB], update_rounds=2)
    session_timeout = aiohttp.ClientTimeout(total=20)
    updates: dict[tuple[int, str], bytes] = {}

    async def ready_server(count: int) -> str:
        return (await status_backend.wait_for("ready", count, timeout=60))[count - 1]["url"]

    # given: a server that closed round 1 (saved with the control plane first) and is lost during round 2,
    # after alice's round 2 update reached it
    stop = asyncio.Event()
    lost = asyncio.create_task(run(parse_job(job_json), settings(tmp_path / "lost", bridge, receiver), stop))
    async with aiohttp.ClientSession(timeout=session_timeout) as session:
        url = await ready_server(1)
        alice, bob = Trainer(session, url, ALICE), Trainer(session, url, BOB)
        theta_0 = from_bytes(tmp_path, (await alice.get("model/model.safetensors"))[2])
        for number, peer, seed in ((1, ALICE, 1), (1, BOB, 2), (2, ALICE, 3), (2, BOB, 4)):
            updates[number, peer] = to_bytes(tmp_path, delta_like(theta_0, seed))
        assert await alice.send(1, updates[1, ALICE], samples=2) == 200
        assert await bob.send(1, updates[1, BOB], samples=6) == 200
        u_1 = (await alice.get("rounds/1/result?wait=20"))[2]
        assert receiver.saved == 1  # published only once the control plane has it
        assert await alice.send(2, updates[2, ALICE], samples=3) == 200
    stop.set()
    with pytest.raises(Stopped):
        await asyncio.wait_for(lost, 10)
    # round 1 builds on round 0's weights: it uploaded its momentum and result only
    saved = dict(receiver.checkpoints[1])
    assert sorted(saved) == ["momentum.safetensors", "result.safetensors", "round.json"]
    assert sorted(receiver.checkpoints[0]) == ["round.json", "weights.safetensors"]

    # when: a new server starts on an empty work dir with the job's checkpoint, and the trainers send round 2
    # (alice again: her update was lost with the server)
    resumed_job = parse_job({**job_json, "checkpoint": receiver.resume_entry()})
    resumed = asyncio.create_task(
        run(resumed_job, settings(tmp_path / "resumed", bridge, receiver), asyncio.Event())
    )
    async with aiohttp.ClientSession(timeout=session_timeout) as session:
        url = await ready_server(2)
        alice, bob = Trainer(session, url, ALICE), Trainer(session, url, BOB)
        status, headers, data = await bob.get("rounds/1/result?wait=1")  # bob had not fetched u_1 yet
        assert (status, headers["X-Included"]) == (200, "true")
        assert_bit_identical(from_bytes(tmp_path, data), from_bytes(tmp_path, u_1))
        assert await alice.send(2, updates[2, ALICE], samples=3) == 200
        assert await bob.send(2, updates[2, BOB], samples=5) == 200
        u_2_resumed = from_bytes(tmp_path, (await alice.get("rounds/2/result?wait=20"))[2])
        assert (await bob.get("rounds/2/result?wait=20"))[0] == 200
        assert await asyncio.wait_for(resumed, 30) == 0

    # then: what it restored is the saved round byte for byte, and round 2 is what an uninterrupted server
    # computes from the same updates, bit for bit (momentum restored, round 1 applied once)
    restored = tmp_path / "resumed" / "checkpoints" / "round-000000001"
    for name, data in saved.items():
        assert (restored / name).read_bytes() == data, name
    # θ_1 replayed from θ_0 and u_1: the lost server's, bit for bit
    lost_round = tmp_path / "lost" / "checkpoints" / "round-000000001"
    assert_bit_identical(
        weights_io.load(restored / "weights.safetensors"), weights_io.load(lost_round / "weights.safetensors")
    )
    assert status_backend.values.count({"ready": {"url": url, "round": 1}}) == 1
    uninterrupted = asyncio.create_task(
        run(parse_job(job_json), settings(tmp_path / "whole", bridge, receiver), asyncio.Event())
    )
    async with aiohttp.ClientSession(timeout=session_timeout) as session:
        url = await ready_server(3)
        alice, bob = Trainer(session, url, ALICE), Trainer(session, url, BOB)
        assert await alice.send(1, updates[1, ALICE], samples=2) == 200
        assert await bob.send(1, updates[1, BOB], samples=6) == 200
        assert_bit_identical(
            from_bytes(tmp_path, (await alice.get("rounds/1/result?wait=20"))[2]), from_bytes(tmp_path, u_1)
        )
        assert (await bob.get("rounds/1/result?wait=20"))[0] == 200
        assert await alice.send(2, updates[2, ALICE], samples=3) == 200
        assert await bob.send(2, updates[2, BOB], samples=5) == 200
        u_2 = from_bytes(tmp_path, (await alice.get("rounds/2/result?wait=20"))[2])
        assert (await bob.get("rounds/2/result?wait=20"))[0] == 200
        assert await asyncio.wait_for(uninterrupted, 30) == 0
    assert_bit_identical(u_2_resumed, u_2)


def assert_bit_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), name


async def test_done_in_reply_to_a_round_report_ends_the_job_early(tmp_path, bridge, status_backend, receiver):
    # given: three rounds planned, but the control plane answers the first report with Done
    status_backend.replies.extend([{"type": "Ok"}, {"type": "Done"}])
    job = parse_job(aggregate_job(peers=[ALICE], update_rounds=3))
    service = asyncio.create_task(run(job, settings(tmp_path / "work", bridge, receiver), asyncio.Event()))
    (ready,) = await status_backend.wait_for("ready", timeout=60)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice = Trainer(session, ready["url"], ALICE)
        theta_0 = from_bytes(tmp_path, (await alice.get("model/model.safetensors"))[2])
        assert await alice.send(1, to_bytes(tmp_path, delta_like(theta_0, 1)), samples=4) == 200
        await status_backend.wait_for("round")
        await asyncio.sleep(0.05)  # the reply is handled right after the report
        assert await alice.send(2, to_bytes(tmp_path, delta_like(theta_0, 1)), samples=4) == 409
        assert (await alice.get("rounds/1/result"))[0] == 200

        # then
        assert await asyncio.wait_for(service, 30) == 0
    assert sorted(receiver.uploads) == ["config.json", "generation_config.json", "model.safetensors"]
    assert len(await status_backend.wait_for("round")) == 1


# --- hostile updates (issue 12, finding 4) ------------------------------------------------------------------


async def put_update(session, url: str, peer: str, round_number: int, body: bytes, samples: int):
    headers = {**auth(peer), "X-Samples": str(samples)}
    async with session.put(
        f"{url}/jobs/{JOB_ID}/rounds/{round_number}/update", data=body, headers=headers
    ) as r:
        return r.status, await r.json(content_type=None)


async def test_an_update_of_huge_finite_tensors_is_refused_and_the_job_goes_on(
    tmp_path, bridge, status_backend, receiver
):
    # given: three trainers; the control plane stops waiting for carol once the round has its first update
    status_backend.expect = {"type": "Expect", "peers": [ALICE, BOB], "due_in": None}
    job = parse_job(aggregate_job(peers=[ALICE, BOB, CAROL], update_rounds=2, round_timeout=600.0))
    service = asyncio.create_task(run(job, settings(tmp_path / "work", bridge, receiver), asyncio.Event()))
    (ready,) = await status_backend.wait_for("ready", timeout=60)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice, bob = Trainer(session, ready["url"], ALICE), Trainer(session, ready["url"], BOB)
        theta_0 = from_bytes(tmp_path, (await alice.get("model/model.safetensors"))[2])
        hostile = {name: torch.full_like(tensor, 1e38) for name, tensor in theta_0.items()}

        # when: carol sends finite 1e38 tensors claiming 10^9 samples
        status, body = await put_update(
            session, ready["url"], CAROL, 1, to_bytes(tmp_path, hostile), 1_000_000_000
        )

        # then: refused; the server is still up and the honest trainers' round closes without it
        assert (status, body["error"]) == (422, "refused_update")
        assert not service.done()
        a, b = delta_like(theta_0, 1), delta_like(theta_0, 2)
        assert await alice.send(1, to_bytes(tmp_path, a), samples=2) == 200
        assert await bob.send(1, to_bytes(tmp_path, b), samples=6) == 200
        (report_1,) = await status_backend.wait_for("round", timeout=20)
        status, _, data = await alice.get("rounds/1/result?wait=20")
        assert status == 200
        u_1 = from_bytes(tmp_path, data)
        assert_close(u_1, {name: 0.75 * (2 * a[name] + 6 * b[name]) / 8 for name in a})
        theta_1 = from_bytes(tmp_path, (await bob.get("model/model.safetensors"))[2])
        assert_close(theta_1, {name: theta_0[name] + u_1[name] for name in theta_0})
        assert all(bool(torch.isfinite(tensor).all()) for tensor in theta_1.values())

        # and round 2 finishes the job
        assert await alice.send(2, to_bytes(tmp_path, a), samples=2) == 200
        assert await bob.send(2, to_bytes(tmp_path, b), samples=6) == 200
        assert (await alice.get("rounds/2/result?wait=20"))[0] == 200
        assert (await bob.get("rounds/2/result?wait=20"))[0] == 200
        assert await asyncio.wait_for(service, 30) == 0

    assert (report_1["participants"], report_1["left_out"]) == ([ALICE, BOB], [CAROL])
    assert report_1["refused"] == {CAROL: body["detail"]}
    assert report_1["samples"] == 8 and report_1["discarded"] is None
    assert sorted(receiver.uploads) == ["config.json", "generation_config.json", "model.safetensors"]


async def test_x_samples_is_bounded_by_the_jobs_cap_and_the_control_planes_count(
    tmp_path, bridge, status_backend, receiver
):
    # given: a cap of 100 samples per update in the job, and the control plane's count of each trainer's samples
    # A refused update is its trainer's answer for the round (the daemon never resends one after a 4xx): carol,
    # still training, keeps the round open for this test's resends.
    status_backend.expect = {
        "type": "Expect",
        "peers": [ALICE, BOB, CAROL],
        "due_in": None,
        "samples": {ALICE: 32},
    }
    document = aggregate_job(peers=[ALICE, BOB, CAROL], update_rounds=1, round_timeout=600.0)
    document["executor"]["config"]["rounds"]["max_samples_per_update"] = 100
    job = parse_job(document)
    service = asyncio.create_task(run(job, settings(tmp_path / "work", bridge, receiver), asyncio.Event()))
    (ready,) = await status_backend.wait_for("ready", timeout=60)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice = Trainer(session, ready["url"], ALICE)
        theta_0 = from_bytes(tmp_path, (await alice.get("model/model.safetensors"))[2])
        body = to_bytes(tmp_path, delta_like(theta_0, 1))

        # when / then: over the job's cap, refused without asking the control plane
        assert await put_update(session, ready["url"], BOB, 1, body, 101) == (
            422,
            {
                "error": "refused_samples",
                "detail": "X-Samples 101 is more than a trainer can have trained on in a round "
                "(at most 100 in this job)",
            },
        )
        assert "waiting" not in str(status_backend.values)
        # over the control plane's count for alice: it is asked, and the update refused
        assert await put_update(session, ready["url"], ALICE, 1, body, 33) == (
            422,
            {
                "error": "refused_samples",
                "detail": "X-Samples 33 is more than the control plane counted for this trainer in round 1 (32)",
            },
        )
        assert await status_backend.wait_for("waiting") == [{"round": 1}]
        # within both: accepted (bob's count is not given: the cap bounds it)
        assert await alice.send(1, body, samples=32) == 200
        assert await Trainer(session, ready["url"], BOB).send(1, body, samples=100) == 200
        assert await Trainer(session, ready["url"], CAROL).send(1, body, samples=1) == 200
        (report,) = await status_backend.wait_for("round", timeout=20)
        assert (await alice.get("rounds/1/result?wait=20"))[0] == 200
        assert await asyncio.wait_for(service, 30) == 0

    assert (report["participants"], report["samples"], report["refused"]) == ([ALICE, BOB, CAROL], 133, {})
