"""The held-out loss checks through the whole parameter server (parameter_server/service.py,
parameter_server/rounds/validation.py): trainers over HTTP, the eval slice from the local data node. A round
whose loss rises is discarded (u = 0, θ kept, the report says why); in a round that validates, an update that
makes the model worse alone is rejected and the round steps on the other."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import torch
from torch.testing import assert_close

from hypha_tensors import weights as weights_io
from parameter_server.job import parse_job
from parameter_server.service import run
from tests.parameter_server.conftest import ALICE, BOB, aggregate_job
from tests.parameter_server.test_service import Trainer, delta_like, from_bytes, settings, to_bytes


def eval_slice(tmp_path, receiver) -> dict:
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, 256, (4, 8), generator=generator)
    path = tmp_path / "slice.safetensors"
    weights_io.save(path, {"input_ids": input_ids, "labels": input_ids})
    receiver.slices[0] = path.read_bytes()
    return {
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


async def test_a_rising_round_is_discarded_and_a_harmful_update_fails_validation(
    tmp_path, bridge, status_backend, receiver
):
    # given: the discard rule every round, validation in even rounds; the bound at arrival opened wide (it is
    # tested on its own in test_service.py)
    document = aggregate_job(peers=[ALICE, BOB], update_rounds=2, eval_config=eval_slice(tmp_path, receiver))
    document["executor"]["config"]["rounds"].update(
        {"discard_if_loss_rises": 1.5, "verification": {"validation_every": 2}, "update_norm_ratio": 1e6}
    )
    job = parse_job(document)
    service = asyncio.create_task(run(job, settings(tmp_path / "work", bridge, receiver), asyncio.Event()))
    (ready,) = await status_backend.wait_for("ready", timeout=60)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        alice, bob = Trainer(session, ready["url"], ALICE), Trainer(session, ready["url"], BOB)
        theta_0 = from_bytes(tmp_path, (await alice.get("model/model.safetensors"))[2])
        small = delta_like(theta_0, 1)
        huge = {name: 1000 * tensor for name, tensor in delta_like(theta_0, 2).items()}

        # when: round 1, both send the huge update (not validated: round 1 is odd)
        assert await alice.send(1, to_bytes(tmp_path, huge), samples=1) == 200
        assert await bob.send(1, to_bytes(tmp_path, huge), samples=1) == 200
        status, headers, data = await alice.get("rounds/1/result?wait=30")
        assert status == 200
        u_1 = from_bytes(tmp_path, data)
        assert (await bob.get("rounds/1/result"))[0] == 200
        (report_1,) = await status_backend.wait_for("round")
        theta_1 = from_bytes(tmp_path, (await bob.get("model/model.safetensors"))[2])

        # round 2 (validated): alice the huge update, bob a small one
        status_backend.replies.append({"type": "Done"})
        assert await alice.send(2, to_bytes(tmp_path, huge), samples=1) == 200
        assert await bob.send(2, to_bytes(tmp_path, small), samples=1) == 200
        status, headers, data = await bob.get("rounds/2/result?wait=30")
        assert (status, headers["X-Included"]) == (200, "true")
        u_2 = from_bytes(tmp_path, data)
        assert (await alice.get("rounds/2/result?wait=30"))[0] == 200
        assert await asyncio.wait_for(service, 60) == 0

    # then: round 1 is discarded: u = 0, θ_1 = θ_0, its eval loss the kept weights'
    assert report_1["discarded"].startswith("its held-out loss rises from ")
    assert "the previous weights and momentum are kept" in report_1["discarded"]
    assert all(not tensor.any() for tensor in u_1.values())
    assert all(torch.equal(theta_1[name], theta_0[name]) for name in theta_0)
    assert 0 < report_1["eval_loss"] < 10 and report_1["eval_error"] is None
    # round 2: alice's update is rejected by its held-out loss, the step is bob's alone (u = 0.75·small)
    _, report_2 = await status_backend.wait_for("round", 2)
    verdicts = report_2["verdicts"]
    assert verdicts[ALICE]["verdict"] == "rejected"
    assert verdicts[ALICE]["reason"].startswith("its update alone raises the held-out loss from ")
    assert verdicts[BOB]["verdict"] == "accepted" and verdicts[BOB]["loss_ratio"] < 1.5
    assert report_2["participants"] == [BOB] and report_2["discarded"] is None
    assert isinstance(report_2["eval_loss"], float)  # measured by the discard rule before the report
    assert_close(u_2, {name: 0.75 * small[name] for name in small})
