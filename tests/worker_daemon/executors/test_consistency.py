"""A trainer that cannot merge a round into exactly θ_r fetches the full global weights (issue 13, finding 1).

The real ``training_function`` runs in process against the real bridge and :class:`PublishingBackend`, which
plays the parameter server as ours publishes: the model file and each round's result carry ``hypha.round`` and
``hypha.digest`` (the digest of θ_r), each result comes in its own file announced with its round. A test
scripts what the trainer is served: a result corrupted by one value, a round whose result never comes (the
bridge skips a result the parameter server pruned: 410), an event whose size is not its file's. Each time the
trainer must say why, fetch the full weights (which the parameter server has moved on to round 2 by then), go
on from round 3 and end with exactly θ_3.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from hypha_tensors import weights
from worker_daemon.executors.exceptions import UpdateError

from .conftest import (
    PS_PEER,
    ScriptedTrainerBackend,
    SentUpdate,
    TinyModel,
    make_update,
    running_bridge,
    train_job,
)

TIED_ALIAS = "lm_head.weight"
"""Tied to ``transformer.wte.weight``; the parameter server's files hold the tensor once, under the other."""

Announcement = tuple[int, bytes, int | None]
"""A result the bridge announces: (its round, the file's bytes, the size its event says; None: the file's)."""


def published_file(
    tensors: dict[str, torch.Tensor], *, round_number: int | None, digest: str | None
) -> bytes:
    """``tensors`` saved as our parameter server publishes them (``hypha.round``, ``hypha.digest``)."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "w.safetensors"
        weights.save(
            path, tensors, metadata={"format": "pt"}, round_number=round_number, weights_digest=digest
        )
        return path.read_bytes()


class PublishingBackend(ScriptedTrainerBackend):
    """The scripted trainer backend (two rounds, then ``Done``), serving what our parameter server publishes.

    ``global_weights[k]`` is θ_k; the model fetches serve θ_k for the successive ``model_rounds``; the n-th
    update sent is answered with the announcements ``answers[n]``; ``start_digest`` replaces the digest the
    first model file says.
    """

    def __init__(
        self,
        *,
        directory: Path,
        config_file: Path,
        global_weights: list[dict[str, torch.Tensor]],
        model_rounds: list[int],
        answers: list[list[Announcement]],
        start_digest: str | None = None,
    ) -> None:
        super().__init__(model_dir=directory, updates=[], rounds=2)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_bytes(config_file.read_bytes())
        self.global_weights = global_weights
        self.model_rounds = list(model_rounds)
        self.served_rounds: list[int] = []
        self.answers = list(answers)
        self.start_digest = start_digest
        self._announced: asyncio.Queue[Announcement] = asyncio.Queue()

    async def fetch(self, *, reference: Any, artifacts_dir: Path) -> list[tuple[str, int]]:
        if reference.type != "scheduler":
            rounds = self.model_rounds.pop(0)
            self.served_rounds.append(rounds)
            theta = self.global_weights[rounds]
            digest = weights.digest(theta)
            if self.start_digest is not None and len(self.served_rounds) == 1:
                digest = self.start_digest
            (self.model_dir / "model.safetensors").write_bytes(
                published_file(theta, round_number=rounds, digest=digest)
            )
        return await super().fetch(reference=reference, artifacts_dir=artifacts_dir)

    async def send(self, *, reference: Any, path: Path) -> None:
        with safe_open(str(path), framework="pt") as file:
            stored_names = sorted(file.keys())
            metadata = dict(file.metadata() or {})
        self.sent.append(
            SentUpdate(path=path, stored_names=stored_names, metadata=metadata, tensors=weights.load(path))
        )
        for announcement in self.answers.pop(0) if self.answers else []:
            await self._announced.put(announcement)

    async def receive(self, *, reference: Any, directory: Path) -> AsyncIterator[tuple[Any, ...]]:
        self.receive_calls += 1
        while True:
            round_number, data, size = await self._announced.get()
            name = f"{PS_PEER}.round-{round_number}"  # one file per round, as our bridge saves them
            (directory / name).write_bytes(data)
            yield name, len(data) if size is None else size, PS_PEER, {"round": round_number}


def canonical(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The floating-point tensors under the parameter server's names (the tied alias left out)."""
    return {
        name: tensor.clone()
        for name, tensor in state.items()
        if tensor.dtype.is_floating_point and name != TIED_ALIAS
    }


def global_rounds(
    tiny_model: TinyModel,
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """θ_0 … θ_3 and u_1 … u_3 (index r for round r; u_0 unused) with θ_r = θ_{r-1} + u_r."""
    thetas = [canonical(tiny_model.state)]
    updates: list[dict[str, torch.Tensor]] = [{}]
    for round_number in (1, 2, 3):
        update = canonical(make_update(tiny_model.state, seed=round_number))
        updates.append(update)
        thetas.append({name: thetas[-1][name] + update[name] for name in thetas[-1]})
    return thetas, updates


def result_file(
    thetas: list[dict[str, torch.Tensor]], updates: list[dict[str, torch.Tensor]], r: int
) -> bytes:
    """Round ``r``'s result as our parameter server publishes it: u_r, round r, the digest of θ_r."""
    return published_file(updates[r], round_number=r, digest=weights.digest(thetas[r]))


async def run_trainer(backend: PublishingBackend, short_dir: Path, monkeypatch) -> list[str]:
    """Run ``training_function`` to its end (exit 0 asserted); the digest, in the parameter server's names and
    dtypes, of the model's weights after each load of global weights into it."""
    from worker_daemon.executors import consistency, pseudo_gradient
    from worker_daemon.executors.job import parse_job
    from worker_daemon.executors.training import EXIT_OK, parse_arguments, training_function

    names = {name: tensor.dtype for name, tensor in backend.global_weights[0].items()}
    loaded: list[str] = []
    real_load_into = pseudo_gradient.load_into

    def observed_load_into(model: torch.nn.Module, state: Any) -> None:
        real_load_into(model, state)
        loaded.append(consistency.state_digest(pseudo_gradient.float_state(model), names))

    monkeypatch.setattr(pseudo_gradient, "load_into", observed_load_into)
    job_json = json.dumps(train_job())
    arguments = parse_arguments(
        ["--socket", str(short_dir / "bridge.sock"), "--work-dir", str(short_dir), "--job", job_json]
    )
    async with running_bridge(short_dir, backend):
        code = await asyncio.to_thread(training_function, arguments, parse_job(job_json))
    assert code == EXIT_OK
    return loaded


def metrics_rounds(backend: PublishingBackend) -> list[int]:
    return [progress["metrics"]["round"] for progress in backend.progress if "metrics" in progress]


def corrupted(update: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``update`` with one value changed."""
    changed = {name: tensor.clone() for name, tensor in update.items()}
    changed["transformer.h.0.attn.c_attn.weight"][0, 0] += 0.25
    return changed


def scenario(kind: str, tiny_model: TinyModel) -> tuple[list[list[Announcement]], str]:
    """What the bridge announces after each update sent, and the reason the trainer must log, for ``kind``."""
    thetas, updates = global_rounds(tiny_model)
    later = [(2, result_file(thetas, updates, 2), None), (3, result_file(thetas, updates, 3), None)]
    if kind == "digest":
        # round 1's result is u_1 with one value changed; its metadata says θ_1's true digest
        bad = published_file(corrupted(updates[1]), round_number=1, digest=weights.digest(thetas[1]))
        return [[(1, bad, None)], later], "the merged weights of round 1 are not the parameter server's"
    if kind == "missing-round":
        # round 1's result never comes (pruned: the bridge got 410 and went on): the next event is round 2's
        return [[later[0]], [later[1]]], "round 1's result never came (the next one is round 2)"
    if kind == "missing-round-undigested":
        # the same with results that carry no digest (only the event's round): nothing but the round order
        # tells the trainer that merging round 2's u into θ_0 would not give θ_1
        plain = [published_file(updates[r], round_number=None, digest=None) for r in (2, 3)]
        return [[(2, plain[0], None)], [(3, plain[1], None)]], "round 1's result never came"
    if kind == "size":
        # the event says another size than its file's; the file carries no round or digest to check against
        # (merging it would give θ_0 + u_1 + 0.25 at one place, and nothing would notice)
        bad = published_file(corrupted(updates[1]), round_number=None, digest=None)
        return [[(1, bad, len(bad) + 8)], later], f"holds {len(bad)} bytes, its event said {len(bad) + 8}"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["digest", "missing-round", "missing-round-undigested", "size"])
async def test_a_round_that_cannot_give_the_global_weights_makes_the_trainer_fetch_them(
    kind: str, tiny_model: TinyModel, short_dir: Path, tmp_path: Path, monkeypatch, caplog
) -> None:
    # given: θ_0 served first; round 1's result unusable (``kind``); by the time the trainer fetches the
    # full weights the parameter server has closed round 2 without it; then round 3's result as published
    thetas, _ = global_rounds(tiny_model)
    answers, reason = scenario(kind, tiny_model)
    backend = PublishingBackend(
        directory=tmp_path / "served",
        config_file=tiny_model.directory / "config.json",
        global_weights=thetas,
        model_rounds=[0, 2],
        answers=answers,
    )
    caplog.set_level(logging.INFO, logger="worker_daemon.executors.training")

    # when
    loaded = await run_trainer(backend, short_dir, monkeypatch)

    # then: it said why and fetched the full weights, θ_2, instead of merging round 1's result
    warnings = [
        record.getMessage()
        for record in caplog.records
        if record.name == "worker_daemon.executors.training" and record.levelno == logging.WARNING
    ]
    assert any(reason in message and "fetching the full global weights" in message for message in warnings), (
        warnings
    )
    assert backend.served_rounds == [0, 2]
    assert loaded[0] == weights.digest(thetas[2])
    # it went on from round 3 (the round after the fetched weights'), skipping round 2's result (θ_2 has it)
    assert metrics_rounds(backend) == [1, 3]
    # and it ends holding exactly the parameter server's θ_3
    assert loaded == [weights.digest(thetas[2]), weights.digest(thetas[3])]


async def test_results_that_give_the_global_weights_are_merged_without_a_fetch(
    tiny_model: TinyModel, short_dir: Path, tmp_path: Path, monkeypatch, caplog
) -> None:
    # given: every round's result as published, in order
    thetas, updates = global_rounds(tiny_model)
    backend = PublishingBackend(
        directory=tmp_path / "served",
        config_file=tiny_model.directory / "config.json",
        global_weights=thetas,
        model_rounds=[0],
        answers=[[(1, result_file(thetas, updates, 1), None)], [(2, result_file(thetas, updates, 2), None)]],
    )
    caplog.set_level(logging.INFO, logger="worker_daemon.executors.training")

    # when
    loaded = await run_trainer(backend, short_dir, monkeypatch)

    # then: merged, checked, never fetched again
    assert backend.served_rounds == [0]
    assert metrics_rounds(backend) == [1, 2]
    assert loaded == [weights.digest(thetas[1]), weights.digest(thetas[2])]
    trainer = "worker_daemon.executors.training"
    assert not [r for r in caplog.records if r.name == trainer and r.levelno >= logging.WARNING]


async def test_a_model_file_whose_weights_are_not_its_digests_is_refused(
    tiny_model: TinyModel, short_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    # given: the model file says round 0 and θ_1's digest, but holds θ_0
    thetas, updates = global_rounds(tiny_model)
    backend = PublishingBackend(
        directory=tmp_path / "served",
        config_file=tiny_model.directory / "config.json",
        global_weights=thetas,
        model_rounds=[0],
        # (both rounds answered: a trainer that went on anyway would finish instead of waiting)
        answers=[[(1, result_file(thetas, updates, 1), None)], [(2, result_file(thetas, updates, 2), None)]],
        start_digest=weights.digest(thetas[1]),
    )

    # when: it stops before training (UpdateError: exit 5, training cannot go on)
    with pytest.raises(UpdateError) as refusal:
        await run_trainer(backend, short_dir, monkeypatch)

    # then: nothing was trained, sent or merged
    assert "the loaded model is not the parameter server's global weights after round 0" in str(refusal.value)
    assert refusal.value.exit_code == 5
    assert backend.sent == [] and backend.progress == []
