"""A streaming trainer (docs/training.md, "Overlap: streaming") through the real bridge.

:class:`~.test_overlap.EagerBackend` plays the control plane and our parameter server for one trainer: fixed
H = 3, each result held back until a chosen step of the next round. Here the results are a streaming parameter
server's: round r's file holds u_r for fragment (r − 1) mod F's tensors only (the tied pair under one name) and
the digest of the FULL θ_r, where θ_r = θ_{r−1} with that fragment stepped. The run is replayed with plain
formulas (the rule written out: send θ_live,f − θ_{r−1,f}; at the merge θ_live,f ← α·θ_live,f + (1 − α)·θ_r,f;
after a fetch of the full weights θ_live ← θ_k), following the order of events the backend saw, so the test
asserts the numbers — each loss and each pseudo-gradient — and the names of every file sent.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from hypha_tensors import weights
from worker_daemon.executors.exceptions import JobConfigError
from worker_daemon.executors.job import parse_job
from worker_daemon.executors.pseudo_gradient import float_state, snapshot
from worker_daemon.executors.streaming import fragments_of

from .conftest import LEARNING_RATE, TinyModel, make_update, run_executor, running_bridge, train_job
from .test_consistency import TIED_ALIAS, Announcement, canonical, corrupted, published_file
from .test_overlap import EagerBackend, H, kind, one_thread, rounds_of, run_in_process
from .test_training import batches

__all__ = ["one_thread"]  # the autouse fixture, imported to apply here too

FRAGMENTS = 2
MIX = 0.5


def streaming_job(
    *, fragments: int = FRAGMENTS, mix: float = MIX, rounds: int | None = None
) -> dict[str, Any]:
    job = train_job()
    job["executor"]["config"]["overlap"] = {"mode": "streaming", "fragments": fragments, "mix": mix}
    if rounds is not None:
        job["executor"]["config"]["overlap"]["rounds"] = rounds
    return job


def synced(parts: list[frozenset[str]], round_number: int, last: int | None) -> frozenset[str]:
    """The names round ``round_number`` syncs, written out: its fragment's, every name in the job's last."""
    return frozenset().union(*parts) if round_number == last else parts[(round_number - 1) % FRAGMENTS]


def parts_of(tiny_model: TinyModel) -> list[frozenset[str]]:
    """The fragments, by the executor's own call (their exact names are asserted below)."""
    return fragments_of(snapshot(float_state_of(tiny_model.state)), FRAGMENTS)


def float_state_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in state.items() if tensor.dtype.is_floating_point}


def streaming_rounds(
    tiny_model: TinyModel, last: int | None = None
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """θ_0 … θ_3 (full, canonical names) and u_1 … u_3 (round r's fragment only) with θ_r = θ_{r−1} + u_r
    on the fragment, θ_{r−1} elsewhere."""
    parts = parts_of(tiny_model)
    thetas = [canonical(tiny_model.state)]
    updates: list[dict[str, torch.Tensor]] = [{}]
    for round_number in (1, 2, 3):
        fragment = synced(parts, round_number, last)
        full = canonical(make_update(tiny_model.state, seed=round_number))
        update = {name: value for name, value in full.items() if name in fragment}
        updates.append(update)
        thetas.append({name: thetas[-1][name] + update.get(name, 0.0) for name in thetas[-1]})
    return thetas, updates


def result(thetas: list, updates: list, r: int) -> bytes:
    """Round ``r``'s result as a streaming parameter server publishes it: u_r,f, round r, digest of θ_r."""
    return published_file(updates[r], round_number=r, digest=weights.digest(thetas[r]))


def make_backend(
    tiny_model: TinyModel,
    directory: Path,
    *,
    release_at: int,
    answers: list,
    model_rounds: list[int],
    last: int | None = None,
) -> EagerBackend:
    thetas, _ = streaming_rounds(tiny_model, last)
    return EagerBackend(
        release_at=release_at,
        done_after=2,
        directory=directory,
        config_file=tiny_model.directory / "config.json",
        global_weights=thetas,
        model_rounds=model_rounds,
        answers=answers,
    )


def in_order(tiny_model: TinyModel, last: int | None = None) -> list[list[Announcement]]:
    thetas, updates = streaming_rounds(tiny_model, last)
    return [[(1, result(thetas, updates, 1), None)], [(2, result(thetas, updates, 2), None)]]


def replay(
    tiny_model: TinyModel,
    progress: list[Any],
    merged: list[tuple[dict[str, torch.Tensor], int | None]],
    *,
    mix: float = MIX,
    last: int | None = None,
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """The losses and pseudo-gradients of a correct streaming trainer that saw ``progress`` (the backend's
    record) and merged ``merged`` (θ, and the round whose fragment it mixes in; None: the full weights
    fetched, loaded whole) at its update-receiveds."""
    from transformers import AutoModelForCausalLM

    parts = parts_of(tiny_model)
    sent_rounds = iter(p["metrics"]["round"] for p in progress if kind(p) == "metrics")
    model = AutoModelForCausalLM.from_pretrained(tiny_model.directory)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    stream = batches()
    live = {n: t for n, t in model.state_dict().items() if t.dtype.is_floating_point and n != TIED_ALIAS}
    theta = {name: tensor.detach().clone() for name, tensor in live.items()}  # θ_{r−1}, full
    losses: list[float] = []
    deltas: list[dict[str, torch.Tensor]] = []
    merges = iter(merged)
    for event in progress:
        if kind(event) == "status":
            loss = model(**next(stream)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        elif event == "update":
            fragment = synced(parts, next(sent_rounds), last)
            deltas.append({name: live[name].detach() - theta[name] for name in live if name in fragment})
        elif event == "update-received":
            new_theta, round_number = next(merges)
            with torch.no_grad():
                for name, tensor in live.items():
                    if round_number is None:
                        tensor.copy_(new_theta[name])
                    elif name in synced(parts, round_number, last):
                        tensor.copy_(mix * tensor + (1 - mix) * new_theta[name])
            theta = new_theta
    return losses, deltas


def assert_numbers(
    backend: EagerBackend,
    tiny_model: TinyModel,
    expected_losses: list[float],
    expected_deltas: list[dict],
    last: int | None = None,
) -> None:
    """Every loss; every file sent holds its round's fragment alone (the tied pair stored once, aliased) and
    the replay's delta."""
    parts = parts_of(tiny_model)
    statuses = [progress["status"] for progress in backend.progress if kind(progress) == "status"]
    assert [status["loss"] for status in statuses] == pytest.approx(expected_losses, rel=1e-5)
    sent_rounds = [p["metrics"]["round"] for p in backend.progress if kind(p) == "metrics"]
    assert len(backend.sent) == len(expected_deltas) == len(sent_rounds)
    for sent, expected, round_number in zip(backend.sent, expected_deltas, sent_rounds, strict=True):
        fragment = synced(parts, round_number, last)
        assert sorted(sent.tensors) == sorted(fragment), round_number
        # the trainer's file stores the tied pair once, under its smaller name, the other as an alias
        assert sorted(sent.stored_names) == sorted(
            name for name in fragment if name != "transformer.wte.weight"
        )
        if TIED_ALIAS in fragment:
            assert sent.tensors[TIED_ALIAS] is sent.tensors["transformer.wte.weight"]
        assert sorted(expected) == sorted(name for name in fragment if name != TIED_ALIAS)
        for name, value in expected.items():
            torch.testing.assert_close(sent.tensors[name], value, rtol=0, atol=2e-6)


def test_the_tiny_models_fragments() -> None:
    """What the tests below rely on: the tied pair and block 0 in fragment 0, block 1 and the rest in 1."""
    from .conftest import make_tiny_gpt2

    parts = fragments_of(snapshot(float_state(make_tiny_gpt2())), FRAGMENTS)
    assert {"transformer.wte.weight", TIED_ALIAS, "transformer.h.0.attn.c_attn.weight"} <= parts[0]
    assert not any(name.startswith("transformer.h.1.") for name in parts[0])
    assert {"transformer.wpe.weight", "transformer.ln_f.weight", "transformer.h.1.mlp.c_fc.bias"} <= parts[1]
    assert not any(name.startswith("transformer.h.0.") for name in parts[1])


async def test_a_streaming_trainer_merges_mid_round_and_exits_on_done(
    tiny_model: TinyModel, short_dir: Path, tmp_path: Path
) -> None:
    """A real executor process: each result arrives at the first step of the next round."""
    # given
    thetas, _ = streaming_rounds(tiny_model)
    backend = make_backend(
        tiny_model, tmp_path / "served", release_at=1, answers=in_order(tiny_model), model_rounds=[0]
    )

    # when
    async with running_bridge(short_dir, backend):
        run = await run_executor(work_dir=short_dir, job=streaming_job())

    # then: exit 0 at the second update-received (Done), in the middle of round 3, which sends nothing
    assert run.returncode == 0, run.stdout + run.stderr
    cut = rounds_of(backend.progress)
    assert cut[0] == ["status"] * H + ["update", "metrics"]
    # round 2: round 1's result merged between two of its steps, before its own update
    assert cut[1][-2:] == ["update", "metrics"]
    assert cut[1].count("update-received") == 1 and cut[1].count("status") == H
    merged_at = cut[1].index("update-received")
    assert 1 <= merged_at < H, cut[1]
    assert cut[2][-1] == "update-received" and set(cut[2][:-1]) == {"status"} and len(cut[2]) <= H
    assert [p["metrics"]["round"] for p in backend.progress if kind(p) == "metrics"] == [1, 2]
    assert backend.served_rounds == [0]  # every result merged and checked, no fetch of the full weights

    # the numbers, and round 1 sent fragment 0 alone, round 2 fragment 1 alone
    losses, deltas = replay(tiny_model, backend.progress, [(thetas[1], 1), (thetas[2], 2)])
    assert_numbers(backend, tiny_model, losses, deltas)
    assert "streaming: 2 fragments of" in run.stdout
    assert "round 2 starts at once (streaming: fragment 0 of 2 in flight)" in run.stdout
    assert f"fragment 0 mixed in, weights {weights.digest(thetas[1])} (checked)" in run.stdout
    assert "done after 2 rounds" in run.stdout


async def test_the_jobs_last_round_sends_and_merges_the_whole_model(
    tiny_model: TinyModel, short_dir: Path, tmp_path: Path
) -> None:
    """A job of 2 rounds (the overlap says so): round 1 sends fragment 0, round 2, the last, every tensor;
    its result (every tensor) is merged whole."""
    # given
    thetas, _ = streaming_rounds(tiny_model, last=2)
    backend = make_backend(
        tiny_model,
        tmp_path / "served",
        release_at=1,
        answers=in_order(tiny_model, last=2),
        model_rounds=[0],
        last=2,
    )

    # when
    async with running_bridge(short_dir, backend):
        run = await run_executor(work_dir=short_dir, job=streaming_job(rounds=2))

    # then
    assert run.returncode == 0, run.stdout + run.stderr
    assert [p["metrics"]["round"] for p in backend.progress if kind(p) == "metrics"] == [1, 2]
    assert backend.served_rounds == [0]
    parts = parts_of(tiny_model)
    assert sorted(backend.sent[0].tensors) == sorted(parts[0])
    assert sorted(backend.sent[1].tensors) == sorted(parts[0] | parts[1])
    losses, deltas = replay(tiny_model, backend.progress, [(thetas[1], 1), (thetas[2], 2)], last=2)
    assert_numbers(backend, tiny_model, losses, deltas, last=2)
    assert "round 2, the last, syncs them all" in run.stdout
    assert (
        "round 3 starts at once (streaming: all 2 fragments (the job's last round) in flight)" in run.stdout
    )
    assert f"all 2 fragments mixed in, weights {weights.digest(thetas[2])} (checked)" in run.stdout


@pytest.mark.parametrize("mix", [0.0, 0.5])
async def test_a_result_later_than_the_next_rounds_steps_is_waited_for(
    mix: float, tiny_model: TinyModel, short_dir: Path, tmp_path: Path
) -> None:
    # given: each result held until the next round's H-th step (a fixed-H job's ScheduleUpdate{0})
    thetas, _ = streaming_rounds(tiny_model)
    backend = make_backend(
        tiny_model, tmp_path / "served", release_at=H, answers=in_order(tiny_model), model_rounds=[0]
    )

    # when
    code = await run_in_process(backend, short_dir, streaming_job(mix=mix))

    # then: the trainer stopped after H steps, waited, merged, and only then sent its update
    assert code == 0
    assert rounds_of(backend.progress) == [
        ["status"] * H + ["update", "metrics"],
        ["status"] * H + ["update-received", "update", "metrics"],
        ["status"] * H + ["update-received"],
    ]
    losses, deltas = replay(tiny_model, backend.progress, [(thetas[1], 1), (thetas[2], 2)], mix=mix)
    assert_numbers(backend, tiny_model, losses, deltas)


@pytest.mark.parametrize("fault", ["other-fragment", "digest"])
async def test_a_result_that_cannot_give_the_global_weights_is_replaced_by_them_loaded_whole(
    fault: str, tiny_model: TinyModel, short_dir: Path, tmp_path: Path, caplog
) -> None:
    # given: round 1's result names fragment 1's tensors (round 2's u), or is fragment 0's u off by one value;
    # its digest is θ_1's either way. By the time the trainer fetches the full weights the parameter server has
    # closed round 2 without it; then round 3's result
    thetas, updates = streaming_rounds(tiny_model)
    tensors = updates[2] if fault == "other-fragment" else corrupted(updates[1])
    bad = published_file(tensors, round_number=1, digest=weights.digest(thetas[1]))
    later = [(2, result(thetas, updates, 2), None), (3, result(thetas, updates, 3), None)]
    backend = make_backend(
        tiny_model, tmp_path / "served", release_at=1, answers=[[(1, bad, None)], later], model_rounds=[0, 2]
    )
    caplog.set_level(logging.INFO, logger="worker_daemon.executors.training")

    # when
    assert await run_in_process(backend, short_dir, streaming_job()) == 0

    # then: it fetched θ_2 (in the background) and loaded it whole; the round it was training became round 3,
    # which sent fragment 0 (round 3's); round 2's announced result was skipped, round 3's merged
    messages = [record.getMessage() for record in caplog.records]
    reason = (
        "round 1: the result names 'transformer.h.1."
        if fault == "other-fragment"
        else "the merged weights of round 1 are not the parameter server's"
    )
    assert any(reason in message for message in messages), messages
    assert any(
        "round 2 merged after" in m and "round 3, the full weights loaded whole" in m for m in messages
    )
    assert any("round 3 merged after" in m and "fragment 0 mixed in" in m for m in messages), messages
    assert backend.served_rounds == [0, 2]
    assert [p["metrics"]["round"] for p in backend.progress if kind(p) == "metrics"] == [1, 3]
    losses, deltas = replay(tiny_model, backend.progress, [(thetas[2], None), (thetas[3], 3)])
    assert_numbers(backend, tiny_model, losses, deltas)


async def test_a_model_with_fewer_units_than_fragments_is_refused_at_start(
    tiny_model: TinyModel, short_dir: Path, tmp_path: Path
) -> None:
    # given: the tiny GPT-2 has 6 units (the tied embedding, wpe, two blocks, ln_f's weight and bias)
    backend = make_backend(tiny_model, tmp_path / "served", release_at=1, answers=[], model_rounds=[0])

    # when / then: before any step
    with pytest.raises(JobConfigError, match="cannot be split into 7 fragments"):
        await run_in_process(backend, short_dir, streaming_job(fragments=7))
    assert backend.sent == [] and not any(kind(p) == "status" for p in backend.progress)


def test_the_streaming_overlap_is_parsed() -> None:
    overlap = parse_job(json.dumps(streaming_job(fragments=4, mix=0.25))).config.overlap
    assert overlap is not None and overlap.streaming and not overlap.eager
    assert (overlap.mode, overlap.fragments, overlap.mix) == ("streaming", 4, 0.25)
    assert parse_job(json.dumps(streaming_job(fragments=64, mix=0.0))).config.overlap.fragments == 64


@pytest.mark.parametrize(
    ("overlap", "message"),
    [
        ({"mode": "streaming", "mix": 0.5}, r"needs fragments \(2 to 64\) and mix"),
        ({"mode": "streaming", "fragments": 4}, r"needs fragments \(2 to 64\) and mix"),
        (
            {"mode": "streaming", "fragments": 1, "mix": 0.5},
            "overlap.fragments: .*greater than or equal to 2",
        ),
        ({"mode": "streaming", "fragments": 65, "mix": 0.5}, "overlap.fragments: .*less than or equal to 64"),
        ({"mode": "streaming", "fragments": 2.5, "mix": 0.5}, "overlap.fragments"),
        ({"mode": "streaming", "fragments": True, "mix": 0.5}, "overlap.fragments"),
        ({"mode": "streaming", "fragments": "4", "mix": 0.5}, "overlap.fragments"),
        ({"mode": "streaming", "fragments": 4, "mix": 1.0}, "overlap.mix: .*less than 1"),
        ({"mode": "streaming", "fragments": 4, "mix": -0.1}, "overlap.mix: .*greater than or equal to 0"),
        ({"mode": "streaming", "fragments": 4, "mix": "NaN"}, "overlap.mix"),
    ],
)
def test_a_bad_streaming_overlap_is_refused(overlap: Any, message: str) -> None:
    job = train_job()
    job["executor"]["config"]["overlap"] = overlap
    with pytest.raises(JobConfigError, match=message):
        parse_job(json.dumps(job))
