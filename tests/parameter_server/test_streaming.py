"""Streaming DiLoCo at the parameter server: round r syncs fragment (r − 1) mod F of the model alone
(parameter_server/rounds, hypha_tensors/fragments.py). The coordinator is driven with real updates; the whole
service with a tiny GPT-2 over HTTP, its result files read as a trainer reads them."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch
from torch.testing import assert_close

from hypha_tensors import weights as weights_io
from hypha_tensors.encoding import decode
from hypha_tensors.formats import Encoding
from hypha_tensors.fragments import fragment_of_round, partition
from parameter_server.exceptions import JobConfigError, UpdateRefused
from parameter_server.job import parse_job
from parameter_server.rounds import RoundCoordinator
from parameter_server.service import Stopped, run
from tests.parameter_server.conftest import ALICE, BOB, TINY_GPT2, aggregate_job, auth
from tests.parameter_server.test_service import Trainer, from_bytes, settings, to_bytes

CAROL = "carol"
LR, MU = 0.5, 0.5

# --- the coordinator ---------------------------------------------------------------------------------------------


def toy_weights() -> dict[str, torch.Tensor]:
    """Two blocks, a tied embedding (``head.weight`` is its alias), a final norm, a float buffer in block 1
    (averaged, never stepped) and an integer buffer (never synced)."""
    generator = torch.Generator().manual_seed(3)
    shapes = {
        "emb.weight": (4,),
        "h.0.w": (2,),
        "h.0.b": (1,),
        "h.1.w": (2,),
        "h.1.running_mean": (1,),
        "norm.weight": (1,),
    }
    weights = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    weights["steps"] = torch.tensor([7], dtype=torch.int64)
    return weights


TOY_ALIASES = {"head.weight": "emb.weight"}
TOY_BUFFERS = frozenset({"h.1.running_mean"})


def toy_fragments(count: int) -> list[frozenset[str]]:
    """The partition trainers compute: the floating-point tensors' tied groups (integer ones never sync)."""
    weights = toy_weights()
    groups = [
        ([name, *[alias for alias, canonical in TOY_ALIASES.items() if canonical == name]], tensor.numel())
        for name, tensor in weights.items()
        if tensor.dtype.is_floating_point
    ]
    return partition(groups, count)


def toy_coordinator(count: int, **overrides) -> RoundCoordinator:
    arguments = {
        "expected": [ALICE, BOB],
        "weights": toy_weights(),
        "momentum": None,
        "rounds_completed": 0,
        "update_rounds": 2 * count + 1,  # the job's last round (every fragment) is tested on its own
        "round_timeout": 30.0,
        "weighted": True,
        "learning_rate": LR,
        "momentum_factor": MU,
        "buffers": TOY_BUFFERS,
        "fragments": toy_fragments(count),
    }
    arguments.update(overrides)
    return RoundCoordinator(**arguments)


def floating_names(names) -> list[str]:
    weights = toy_weights()
    return sorted(name for name in names if name in weights and weights[name].dtype.is_floating_point)


def random_delta(names, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weights = toy_weights()
    return {name: torch.randn(weights[name].shape, generator=generator) * 0.1 for name in names}


async def next_published(rounds: RoundCoordinator):
    return await asyncio.wait_for(rounds.published.get(), 5)


async def test_two_cycles_step_each_fragment_with_its_own_momentum_and_leave_the_others_alone():
    # given: 3 fragments of the toy model; a reader keeps θ_1 for the whole test
    count = 3
    parts = toy_fragments(count)
    assert sorted(name for part in parts for name in part) == sorted(
        [*floating_names(toy_weights()), *TOY_ALIASES]
    )
    held = []

    async def persist(result, weights, momentum):
        if result.round_number == 1:
            held.append((weights, {name: tensor.clone() for name, tensor in weights.items()}))

    rounds = toy_coordinator(count, persist=persist)
    theta = {name: tensor.double() for name, tensor in toy_weights().items()}
    momentum: dict[str, torch.Tensor] = {}

    for round_number in range(1, 2 * count + 1):
        fragment = (round_number - 1) % count
        names = floating_names(parts[fragment])
        assert rounds.round_names(round_number) == tuple(names)
        a, b = random_delta(names, 2 * round_number), random_delta(names, 2 * round_number + 1)
        before_weights = {name: tensor.clone() for name, tensor in rounds.weights.items()}

        # when: two trainers send the round's fragment, weighted 1 and 3
        await rounds.submit(ALICE, round_number, a, samples=1)
        await rounds.submit(BOB, round_number, b, samples=3)
        result = await next_published(rounds)

        # then: the rule, written out: g over the fragment; m ← g the first time, m ← μm + g after;
        # u = lr(g + μm) (a buffer: u = g); θ ← θ + u on the fragment; everything else as it was
        expected_update = {}
        for name in names:
            g = (a[name].double() + 3 * b[name].double()) / 4
            if name in TOY_BUFFERS:
                expected_update[name] = g
            else:
                momentum[name] = g if name not in momentum else MU * momentum[name] + g
                expected_update[name] = LR * (g + MU * momentum[name])
            theta[name] = theta[name] + expected_update[name]
        assert (result.round_number, result.fragment, result.stepped) == (round_number, fragment, True)
        assert sorted(result.update) == names  # u of the fragment only
        assert sorted(result.file_tensors()) == names
        assert_close(result.update, {name: u.float() for name, u in expected_update.items()})
        assert_close(rounds.weights, {name: t.to(toy_weights()[name].dtype) for name, t in theta.items()})
        for name in rounds.weights:
            if name not in names:  # the other fragments' weights: bit for bit the previous round's
                assert torch.equal(rounds.weights[name], before_weights[name]), name
        # the momentum of every fragment stepped so far; the others' untouched since their own round
        assert_close(rounds.momentum, {name: m.float() for name, m in momentum.items()})

    # a reader's θ_1 was never written to, though the pool reused the round's buffers meanwhile
    ((weights_1, copy_1),) = held
    for name in copy_1:
        assert torch.equal(weights_1[name], copy_1[name]), name
    assert rounds.pool.reused > 0


async def test_momentum_stepped_for_every_tensor_every_round_would_differ():
    """The rule above is not vacuous: stepping every tensor's momentum every round (g = 0 outside the
    fragment) gives other weights than the coordinator's after one cycle."""
    count = 2
    parts = toy_fragments(count)
    rounds = toy_coordinator(count, expected=[ALICE])
    wrong_theta = {name: t.double() for name, t in toy_weights().items() if t.dtype.is_floating_point}
    wrong_momentum: dict[str, torch.Tensor] = {}
    for round_number in (1, 2, 3):
        names = floating_names(parts[(round_number - 1) % count])
        delta = random_delta(names, round_number)
        await rounds.submit(ALICE, round_number, delta, samples=1)
        await next_published(rounds)
        for name in wrong_theta:
            if name in TOY_BUFFERS:
                continue
            g = delta[name].double() if name in delta else torch.zeros_like(wrong_theta[name])
            wrong_momentum[name] = g if name not in wrong_momentum else MU * wrong_momentum[name] + g
            wrong_theta[name] = wrong_theta[name] + LR * (g + MU * wrong_momentum[name])
    differs = [
        name
        for name in wrong_theta
        if name not in TOY_BUFFERS and not torch.allclose(rounds.weights[name].double(), wrong_theta[name])
    ]
    assert differs


async def test_an_update_of_another_fragment_or_of_the_whole_model_is_refused_and_the_round_closes():
    # given: round 1 syncs fragment 0
    count = 2
    parts = toy_fragments(count)
    rounds = toy_coordinator(count, expected=[ALICE, BOB, CAROL])
    own, other = floating_names(parts[0]), floating_names(parts[1])
    everything = floating_names(toy_weights())

    # when: carol sends fragment 1's tensors, then the whole model
    with pytest.raises(UpdateRefused, match=r"round 1 syncs fragment 1 of 2") as refused:
        await rounds.submit(CAROL, 1, random_delta(other, 9), samples=1)
    assert "missing" in str(refused.value)
    with pytest.raises(UpdateRefused, match=r"not in this round's fragment: round 1 syncs fragment 1 of 2"):
        await rounds.submit(CAROL, 1, random_delta(everything, 9), samples=1)
    # and alice and bob send fragment 0; carol never sends a good one (the round times out on her)
    a, b = random_delta(own, 1), random_delta(own, 2)
    await rounds.submit(ALICE, 1, a, samples=1)
    rounds.expect(1, [ALICE, BOB], None)  # the control plane: carol no longer trains
    await rounds.submit(BOB, 1, b, samples=1)
    result = await next_published(rounds)

    # then: the round closed with the good updates alone, and says why carol's were refused
    assert result.participants == (ALICE, BOB)
    assert "fragment 1 of 2" in result.refused[CAROL]
    assert_close(
        result.update,
        {n: LR * (1 + MU) * (a[n] + b[n]) / 2 if n not in TOY_BUFFERS else (a[n] + b[n]) / 2 for n in own},
    )


async def test_a_coordinator_resumed_mid_cycle_syncs_the_next_fragment_from_its_saved_momentum():
    # given: rounds 1 and 2 of a 3-fragment cycle done by one coordinator
    count = 3
    parts = toy_fragments(count)
    first = toy_coordinator(count, expected=[ALICE])
    deltas = {r: random_delta(floating_names(parts[(r - 1) % count]), r) for r in range(1, 6)}
    for round_number in (1, 2):
        await first.submit(ALICE, round_number, deltas[round_number], samples=1)
        await next_published(first)
    saved_weights = {name: tensor.clone() for name, tensor in first.weights.items()}
    saved_momentum = {name: tensor.clone() for name, tensor in first.momentum.items()}
    assert sorted(saved_momentum) == sorted(
        name for name in floating_names([*parts[0], *parts[1]]) if name not in TOY_BUFFERS
    )

    # when: a new coordinator resumes from them (as from a checkpoint) and runs rounds 3 to 5
    resumed = toy_coordinator(
        count, expected=[ALICE], weights=saved_weights, momentum=saved_momentum, rounds_completed=2
    )
    for round_number in (3, 4, 5):
        await first.submit(ALICE, round_number, deltas[round_number], samples=1)
        await resumed.submit(ALICE, round_number, deltas[round_number], samples=1)
        expected, got = await next_published(first), await next_published(resumed)

        # then: the same fragment, the same step as the coordinator that never stopped
        assert got.fragment == fragment_of_round(round_number, count) == expected.fragment
        assert_close(got.update, expected.update, rtol=0, atol=0)
    assert_close(resumed.weights, first.weights, rtol=0, atol=0)
    assert_close(resumed.momentum, first.momentum, rtol=0, atol=0)


async def test_an_encoded_streaming_result_merges_into_the_full_weights_bit_for_bit():
    # given: int8 results with error feedback, 2 fragments, 4 rounds
    count = 2
    parts = toy_fragments(count)
    rounds = toy_coordinator(count, expected=[ALICE], encoding=Encoding("int8", 16))
    trainer = toy_weights()
    for round_number in range(1, 2 * count + 1):
        names = floating_names(parts[(round_number - 1) % count])
        await rounds.submit(ALICE, round_number, random_delta(names, round_number), samples=1)
        result = await next_published(rounds)

        # when: a trainer merges the result file's fragment into its full copy
        u = decode(result.file_tensors(), result.encoding)
        assert sorted(u) == names
        trainer = trainer | {name: trainer[name] + u[name] for name in u}

        # then: it holds θ_r bit for bit (the digest a trainer checks is of the full θ_r)
        assert weights_io.digest(trainer) == weights_io.digest(rounds.weights)
    # the residual of each fragment is kept for its next round, not dropped by the other's
    assert set(rounds._residual) == set(floating_names(toy_weights()))


@pytest.mark.parametrize("update_rounds", [4, 2])
async def test_the_jobs_last_round_syncs_every_fragment_each_with_its_own_momentum(update_rounds):
    # given: 3 fragments; the job's rounds before its last sync one fragment each (with 2 rounds, fragments
    # 1 and 2 have no momentum yet when the last round comes)
    count = 3
    parts = toy_fragments(count)
    rounds = toy_coordinator(count, expected=[ALICE, BOB], update_rounds=update_rounds)
    everything = floating_names(toy_weights())
    theta = {name: tensor.double() for name, tensor in toy_weights().items()}
    momentum: dict[str, torch.Tensor] = {}

    def step(names, a, b):
        update = {}
        for name in names:
            g = (a[name].double() + b[name].double()) / 2
            if name in TOY_BUFFERS:
                update[name] = g
            else:
                momentum[name] = g if name not in momentum else MU * momentum[name] + g
                update[name] = LR * (g + MU * momentum[name])
            theta[name] = theta[name] + update[name]
        return update

    for round_number in range(1, update_rounds):
        names = floating_names(parts[(round_number - 1) % count])
        a, b = random_delta(names, 2 * round_number), random_delta(names, 2 * round_number + 1)
        await rounds.submit(ALICE, round_number, a, samples=1)
        await rounds.submit(BOB, round_number, b, samples=1)
        await next_published(rounds)
        step(names, a, b)

    # when: the last round; a fragment alone is refused, saying the round syncs every fragment
    last = update_rounds
    assert rounds.round_names(last) == tuple(everything)
    fragment = floating_names(parts[(last - 1) % count])
    with pytest.raises(UpdateRefused, match=rf"missing: round {last} syncs every fragment \(the job's last"):
        await rounds.submit(ALICE, last, random_delta(fragment, 99), samples=1)
    a, b = random_delta(everything, 50), random_delta(everything, 51)
    await rounds.submit(ALICE, last, a, samples=1)
    await rounds.submit(BOB, last, b, samples=1)
    result = await next_published(rounds)

    # then: every tensor stepped, each from its own fragment's momentum (m ← g where it has none yet)
    expected = step(everything, a, b)
    assert (result.round_number, result.fragment, result.stepped) == (last, count, True)
    assert sorted(result.update) == sorted(result.file_tensors()) == everything
    assert_close(result.update, {name: u.float() for name, u in expected.items()})
    assert_close(rounds.weights, {name: t.to(toy_weights()[name].dtype) for name, t in theta.items()})
    assert_close(rounds.momentum, {name: m.float() for name, m in momentum.items()})
    assert rounds.finished


async def test_without_fragments_every_round_syncs_every_tensor():
    rounds = toy_coordinator(2, fragments=None, expected=[ALICE])
    everything = floating_names(toy_weights())
    assert rounds.fragment_count == 1
    assert rounds.round_names(1) == rounds.round_names(2) == tuple(everything)
    await rounds.submit(ALICE, 1, random_delta(everything, 1), samples=1)
    assert sorted((await next_published(rounds)).update) == everything


def test_fragments_must_cover_every_floating_point_tensor_once():
    parts = toy_fragments(2)
    with pytest.raises(ValueError, match="in no fragment"):
        toy_coordinator(2, fragments=[parts[0]])
    with pytest.raises(ValueError, match="in two fragments"):
        toy_coordinator(2, fragments=[parts[0], parts[1] | {"emb.weight"}])


# --- the job --------------------------------------------------------------------------------------------------


def job_with(**rounds) -> dict:
    job = aggregate_job(peers=[ALICE])
    job["executor"]["config"]["rounds"].update(rounds)
    return job


def test_the_job_says_how_many_fragments():
    assert parse_job(job_with()).fragments == 1
    assert parse_job(job_with(overlap="none")).fragments == 1
    assert parse_job(job_with(overlap="eager")).fragments == 1
    assert parse_job(job_with(overlap="something-newer", fragments="x")).fragments == 1  # unknown: ignored
    assert parse_job(job_with(overlap="streaming")).fragments == 4
    assert parse_job(job_with(overlap="streaming", fragments=2)).fragments == 2
    assert parse_job(job_with(overlap="streaming", fragments=64)).fragments == 64


@pytest.mark.parametrize(
    ("rounds", "message"),
    [
        ({"overlap": "streaming", "fragments": 1}, "rounds.fragments must be an integer from 2 to 64"),
        ({"overlap": "streaming", "fragments": 65}, "rounds.fragments"),
        ({"overlap": "streaming", "fragments": 2.0}, "rounds.fragments"),
        ({"overlap": "streaming", "fragments": True}, "rounds.fragments"),
        ({"overlap": 3}, "rounds.overlap must be a string"),
    ],
)
def test_bad_streaming_options_are_refused(rounds, message):
    with pytest.raises(JobConfigError, match=message):
        parse_job(job_with(**rounds))


# --- the service ----------------------------------------------------------------------------------------------


def streaming_job(count: int, update_rounds: int, peers=(ALICE,)) -> dict:
    job = aggregate_job(peers=list(peers), update_rounds=update_rounds, learning_rate=LR, momentum=MU)
    job["executor"]["config"]["rounds"].update(overlap="streaming", fragments=count)
    return job


def gpt2_fragments(theta: dict[str, torch.Tensor], count: int) -> list[list[str]]:
    """What a trainer computes (worker_daemon's own functions, on the model built from the job's config):
    per fragment, the names of the parameter server's model file in it."""
    import transformers

    from hypha_tensors.fragments import partition_state
    from worker_daemon.executors.pseudo_gradient import float_state, tied_groups

    config = dict(TINY_GPT2)
    model_type = config.pop("model_type")
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **config)
    )
    state = float_state(model)
    return [
        sorted(name for name in part if name in theta)
        for part in partition_state(state, tied_groups(state), count)
    ]


def small_delta(theta: dict[str, torch.Tensor], names, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(theta[name].shape, generator=generator) * 0.01 for name in names}


async def send(trainer: Trainer, round_number: int, body: bytes) -> tuple[int, dict]:
    """PUT an update; (status, JSON body)."""
    headers = {**auth(trainer.peer), "X-Samples": "1"}
    async with trainer.session.put(
        f"{trainer.url}/rounds/{round_number}/update", data=body, headers=headers
    ) as r:
        return r.status, await r.json()


async def test_a_streaming_job_serves_the_fragment_and_the_full_digest_and_resumes_mid_cycle(
    tmp_path, bridge, status_backend, receiver
):
    # given: a streaming job of 2 fragments and 3 rounds, one trainer
    count = 2
    job = parse_job(streaming_job(count, update_rounds=3))
    stop = asyncio.Event()
    work_dir = tmp_path / "work"
    service = asyncio.create_task(run(job, settings(work_dir, bridge, receiver), stop))
    (ready,) = await status_backend.wait_for("ready", timeout=60)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice = Trainer(session, ready["url"], ALICE)
        theta_0 = from_bytes(tmp_path, (await alice.get("model/model.safetensors"))[2])
        parts = gpt2_fragments(theta_0, count)
        assert "transformer.wte.weight" in parts[0]  # the tied pair: sent under its alias below

        # when: alice sends the whole model for round 1, then fragment 1's tensors (round 1 syncs fragment 0)
        whole = small_delta(theta_0, [n for n in theta_0 if theta_0[n].dtype.is_floating_point], 5)
        status, body = await send(alice, 1, to_bytes(tmp_path, whole))
        assert status == 422 and body["error"] == "refused_tensor", body
        assert "not in this round's fragment: round 1 syncs fragment 1 of 2" in body["detail"]
        status, body = await send(alice, 1, to_bytes(tmp_path, small_delta(theta_0, parts[1], 6)))
        assert status == 422 and "missing: round 1 syncs fragment 1 of 2" in body["detail"], body
        # then fragment 0's, the tied embedding under its alias (as a trainer's state dict may name it)
        d_1 = small_delta(theta_0, parts[0], 1)
        sent = dict(d_1)
        if "transformer.wte.weight" in sent:
            sent["lm_head.weight"] = sent.pop("transformer.wte.weight")
        assert await alice.send(1, to_bytes(tmp_path, sent), samples=1) == 200
        status, headers, data = await alice.get("rounds/1/result?wait=20")
        assert status == 200
        (tmp_path / "u_1.safetensors").write_bytes(data)
        u_1 = weights_io.load(tmp_path / "u_1.safetensors")

        # then: the result holds fragment 0 alone: u = lr(1 + μ)g on the first step
        assert sorted(u_1) == parts[0]
        assert_close(u_1, {name: LR * (1 + MU) * d_1[name] for name in parts[0]})
        theta_1 = theta_0 | {name: theta_0[name] + u_1[name] for name in u_1}
        digest_1 = headers["X-Weights-Digest"]
        assert weights_io.publication(tmp_path / "u_1.safetensors") == (1, digest_1)
        assert weights_io.digest(theta_1) == digest_1  # the full θ_1's digest: a trainer's merge checks
        status, headers, data = await alice.get("model/model.safetensors")
        assert headers["X-Round"] == "1"
        assert_close(from_bytes(tmp_path, data), theta_1, rtol=0, atol=0)  # late joiners get the full θ_1
        (report_1,) = await status_backend.wait_for("round")
        # alice's refusals are forgotten once her update is accepted, as for any refused update
        assert (report_1["participants"], report_1["refused"]) == ([ALICE], {})
    stop.set()
    with pytest.raises(Stopped):
        await asyncio.wait_for(service, 10)

    # when: the server restarts on its work dir, mid-cycle
    stop = asyncio.Event()
    service = asyncio.create_task(run(job, settings(work_dir, bridge, receiver), stop))
    ready = (await status_backend.wait_for("ready", 2, timeout=60))[1]
    assert ready["round"] == 1
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice = Trainer(session, ready["url"], ALICE)
        # then: round 2 syncs fragment 1 (fragment 0's names are refused), with a fresh momentum
        assert await alice.send(2, to_bytes(tmp_path, small_delta(theta_0, parts[0], 7)), samples=1) == 422
        d_2 = small_delta(theta_0, parts[1], 2)
        assert await alice.send(2, to_bytes(tmp_path, d_2), samples=1) == 200
        status, headers, data = await alice.get("rounds/2/result?wait=20")
        u_2 = from_bytes(tmp_path, data)
        assert sorted(u_2) == parts[1]
        assert_close(u_2, {name: LR * (1 + MU) * d_2[name] for name in parts[1]})
        theta_2 = theta_1 | {name: theta_1[name] + u_2[name] for name in u_2}
        assert weights_io.digest(theta_2) == headers["X-Weights-Digest"]

        # and round 3, the job's last, syncs every fragment: fragment 0 alone is refused; the whole model is
        # stepped, fragment 0 from round 1's momentum (m = g_1, restored from the checkpoint), fragment 1 from
        # round 2's: m ← μ·g_f + g_3, u = lr(g_3 + μm)
        status, body = await send(alice, 3, to_bytes(tmp_path, small_delta(theta_0, parts[0], 8)))
        assert (
            status == 422 and "missing: round 3 syncs every fragment (the job's last round" in body["detail"]
        )
        d_3 = small_delta(theta_0, [*parts[0], *parts[1]], 3)
        assert await alice.send(3, to_bytes(tmp_path, d_3), samples=1) == 200
        status, headers, data = await alice.get("rounds/3/result?wait=20")
        u_3 = from_bytes(tmp_path, data)
        assert sorted(u_3) == sorted([*parts[0], *parts[1]])
        expected_u_3 = {
            name: LR * (d_3[name] + MU * (MU * d[name] + d_3[name]))
            for d, part in ((d_1, parts[0]), (d_2, parts[1]))
            for name in part
        }
        assert_close(u_3, expected_u_3)
        theta_3 = theta_2 | {name: theta_2[name] + u_3[name] for name in u_3}
        assert weights_io.digest(theta_3) == headers["X-Weights-Digest"]
        assert await asyncio.wait_for(service, 30) == 0
    final = from_bytes(tmp_path, receiver.uploads["model.safetensors"])  # the full θ_3
    assert_close({name: final[name] for name in theta_3}, theta_3, rtol=0, atol=0)


async def test_a_model_with_too_few_blocks_for_the_fragments_fails_the_start_as_a_bad_job(
    tmp_path, bridge, status_backend, receiver
):
    job = parse_job(streaming_job(64, update_rounds=1))
    with pytest.raises(JobConfigError, match="rounds.fragments: the model has .* too few for 64 fragments"):
        await asyncio.wait_for(run(job, settings(tmp_path / "work", bridge, receiver), asyncio.Event()), 60)


async def test_a_server_started_elsewhere_replays_fragment_results_from_the_control_planes_copy(
    tmp_path, bridge, status_backend, receiver
):
    # given: a streaming server (2 fragments) that closed rounds 1 and 2, then is lost; the control plane
    # holds round 0's weights and the fragment results of rounds 1 and 2
    count = 2
    job_json = streaming_job(count, update_rounds=3)
    stop = asyncio.Event()
    lost = asyncio.create_task(run(parse_job(job_json), settings(tmp_path / "lost", bridge, receiver), stop))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice = Trainer(session, (await status_backend.wait_for("ready", timeout=60))[0]["url"], ALICE)
        theta_0 = from_bytes(tmp_path, (await alice.get("model/model.safetensors"))[2])
        parts = gpt2_fragments(theta_0, count)
        d_1, d_2 = small_delta(theta_0, parts[0], 1), small_delta(theta_0, parts[1], 2)
        assert await alice.send(1, to_bytes(tmp_path, d_1), samples=1) == 200
        assert (await alice.get("rounds/1/result?wait=20"))[0] == 200
        assert await alice.send(2, to_bytes(tmp_path, d_2), samples=1) == 200
        _, headers, _ = await alice.get("rounds/2/result?wait=20")
        digest_2 = headers["X-Weights-Digest"]
        await status_backend.wait_for("round", 2)
    stop.set()
    with pytest.raises(Stopped):
        await asyncio.wait_for(lost, 10)
    assert sorted(receiver.checkpoints[2]) == ["momentum.safetensors", "result.safetensors", "round.json"]

    # when: a new server starts on an empty work dir from the control plane's copy
    resumed = asyncio.create_task(
        run(
            parse_job({**job_json, "checkpoint": receiver.resume_entry()}),
            settings(tmp_path / "resumed", bridge, receiver),
            asyncio.Event(),
        )
    )
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        alice = Trainer(session, (await status_backend.wait_for("ready", 2, timeout=60))[1]["url"], ALICE)

        # then: it serves θ_2 (θ_0 + u_1 + u_2, each of its fragment), the lost server's bit for bit
        _, headers, data = await alice.get("model/model.safetensors")
        assert headers["X-Round"] == "2"
        (tmp_path / "theta_2.safetensors").write_bytes(data)
        assert weights_io.publication(tmp_path / "theta_2.safetensors") == (2, digest_2)
        # and round 3 (the job's last: every fragment) steps fragment 0 from round 1's momentum and fragment 1
        # from round 2's
        d_3 = small_delta(theta_0, [*parts[0], *parts[1]], 3)
        assert await alice.send(3, to_bytes(tmp_path, d_3), samples=1) == 200
        u_3 = from_bytes(tmp_path, (await alice.get("rounds/3/result?wait=20"))[2])
        assert sorted(u_3) == sorted([*parts[0], *parts[1]])
        assert_close(
            u_3,
            {
                name: LR * (d_3[name] + MU * (MU * d[name] + d_3[name]))
                for d, part in ((d_1, parts[0]), (d_2, parts[1]))
                for name in part
            },
        )
        assert await asyncio.wait_for(resumed, 30) == 0
