"""An owner's discard through the whole parameter server (parameter_server/service.py,
RoundCoordinator.request_discard): the control plane's ``Expect`` reply says ``"discard": n``, and round n + 1
closes by going back to round n − 1's weights and momentum; trainers over HTTP, a real bridge."""

from __future__ import annotations

import asyncio

import aiohttp
import torch
from torch.testing import assert_close

from hypha_tensors.formats import Encoding
from parameter_server import checkpoints
from parameter_server.job import parse_job
from parameter_server.service import run
from tests.parameter_server.conftest import ALICE, BOB, CAROL, aggregate_job
from tests.parameter_server.test_rounds import coordinator, delta, next_published
from tests.parameter_server.test_service import Trainer, delta_like, from_bytes, settings, to_bytes

DAVE = "44444444-4444-4444-8444-444444444444"


async def test_the_owner_discards_the_last_closed_round_and_everyone_ends_at_the_round_before(
    tmp_path, bridge, status_backend, receiver
):
    # given: a three-round job; each round's last trainer is a replacement the control plane is asked about
    # at once, so that the Expect reply (and what it says of a discard) is read before the round closes
    job = parse_job(aggregate_job(peers=[ALICE, BOB], update_rounds=3, round_timeout=600.0))
    work = tmp_path / "work"
    service = asyncio.create_task(run(job, settings(work, bridge, receiver), asyncio.Event()))
    (ready,) = await status_backend.wait_for("ready", timeout=60)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        alice, bob = Trainer(session, ready["url"], ALICE), Trainer(session, ready["url"], BOB)
        carol, dave = Trainer(session, ready["url"], CAROL), Trainer(session, ready["url"], DAVE)
        theta_0 = from_bytes(tmp_path, (await alice.get("model/model.safetensors"))[2])

        async def round_of(number: int, trainers: list[Trainer]) -> tuple[dict, dict]:
            for seed, trainer in enumerate(trainers):
                body = to_bytes(tmp_path, delta_like(theta_0, 10 * number + seed))
                assert await trainer.send(number, body, samples=4) == 200
            status, _, data = await alice.get(f"rounds/{number}/result?wait=30")
            assert status == 200
            for trainer in trainers[1:]:
                assert (await trainer.get(f"rounds/{number}/result?wait=30"))[0] == 200
            return from_bytes(tmp_path, data), from_bytes(
                tmp_path, (await alice.get("model/model.safetensors"))[2]
            )

        _, theta_1 = await round_of(1, [alice, bob])
        # when: round 2's Expect says a malformed discard (ignored), round 3's discards round 2
        status_backend.expect = {
            "type": "Expect",
            "peers": [ALICE, BOB, CAROL],
            "due_in": None,
            "discard": "2",
        }
        _, theta_2 = await round_of(2, [alice, carol, bob])
        round_1 = checkpoints.load_round(work / "checkpoints", 1)
        assert round_1 is not None and round_1.momentum is not None
        status_backend.expect = {
            "type": "Expect",
            "peers": [ALICE, BOB, CAROL, DAVE],
            "due_in": None,
            "discard": 2,
        }
        u_3, theta_3 = await round_of(3, [alice, dave, carol, bob])
        assert await asyncio.wait_for(service, 60) == 0

    reports = await status_backend.wait_for("round", 3)
    # then: round 2 stepped as usual; round 3 says it is the owner's discard, its trainers counted
    assert reports[1]["discarded"] is None
    assert reports[2]["discarded"].startswith("the owner discarded round 2: ")
    assert sorted(reports[2]["participants"]) == sorted([ALICE, BOB, CAROL, DAVE])
    # every trainer's merge θ_2 + u_3 is the published θ_3 bit for bit, and θ_3 is θ_1 within the two
    # roundings of fl(θ_2 + fl(θ_1 − θ_2)) (exact where θ_2 is within a factor 2 of θ_1)
    eps = torch.finfo(torch.float32).eps
    for name, tensor in theta_2.items():
        assert torch.equal(tensor + u_3[name], theta_3[name]), name
        error = (theta_3[name] - theta_1[name]).abs()
        assert bool((error <= eps * (theta_1[name].abs() + tensor.abs())).all()), name
        halved = (tensor / theta_1[name] >= 0.5) & (tensor / theta_1[name] <= 2)
        assert torch.equal(theta_3[name][halved], theta_1[name][halved]), name
    # the outer momentum is round 1's again: the next step would be the one round 2 took
    round_3 = checkpoints.load_round(work / "checkpoints", 3)
    assert round_3 is not None and round_3.momentum is not None
    assert round_3.momentum.keys() == round_1.momentum.keys()
    assert all(torch.equal(round_3.momentum[name], round_1.momentum[name]) for name in round_1.momentum)


async def test_a_discard_that_cannot_be_honoured_is_refused_and_a_lost_round_steps_as_usual():
    # given: round 1 closed, round 2 open (the coordinator alone, as in test_rounds.py)
    rounds = coordinator(rounds_completed=1)
    lossy = coordinator(rounds_completed=1, encoding=Encoding("float16"))

    def missing() -> None:
        return None

    # then: only the last closed round of an open round, only a lossless encoding
    assert rounds.request_discard(2, missing) == "round 2 is not the last closed round of an open round"
    assert rounds.request_discard(0, missing) == "round 0 is not the last closed round of an open round"
    assert lossy.request_discard(1, missing) == "the float16 encoding cannot send the way back exactly"

    # when: round 0 is not kept any more (a server resumed from the control plane's copy)
    assert rounds.request_discard(1, missing) is None
    await rounds.submit("alice", 2, delta([0.2, 0.2], [0.2]), samples=1)
    await rounds.submit("bob", 2, delta([0.2, 0.2], [0.2]), samples=1)
    result = await next_published(rounds)

    # then: round 2 steps as usual (Nesterov's first step: 0.5 · (0.2 + 0.5 · 0.2))
    assert result.stepped and result.discarded is None
    assert_close(rounds.weights["w"], torch.tensor([1.15, 2.15]))
