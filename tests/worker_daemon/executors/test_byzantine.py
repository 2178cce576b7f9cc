"""A byzantine trainer (``--byzantine MODE``, issue 18): what it sends against the honest pseudo-gradient.

``send_update`` is the one path every trainer (plain, eager, streaming) writes its update file through; the
file it hands the bridge is read back here. One real trainer subprocess against the real bridge checks the
environment reaches it.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hypha_tensors import weights
from worker_daemon.executors import byzantine
from worker_daemon.executors.pseudo_gradient import compute_delta, float_state, snapshot
from worker_daemon.executors.rounds import RoundStats, send_update

from .conftest import (
    ScriptedTrainerBackend,
    TinyModel,
    make_update,
    run_executor,
    running_bridge,
    train_job,
    update_bytes,
)
from .test_training import replay


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=True)
        self.head.weight = self.embed.weight


class RecordingClient:
    """What ``send_update`` says to the bridge, recorded (the bridge itself is exercised by the subprocess test)."""

    def __init__(self) -> None:
        self.said: list[Any] = []
        self.sent: list[tuple[Any, str]] = []

    def status(self, progress: Any) -> dict[str, Any]:
        self.said.append(progress)
        return {"type": "Ok"}

    def send(self, reference: Any, relative: str) -> None:
        self.sent.append((reference, relative))


def sent_and_honest(tmp_path: Path, monkeypatch, mode: str | None) -> tuple[dict, dict]:
    if mode is None:
        monkeypatch.delenv(byzantine.BYZANTINE_ENV, raising=False)
    else:
        monkeypatch.setenv(byzantine.BYZANTINE_ENV, mode)
    torch.manual_seed(0)
    model = Tied()
    global_previous = snapshot(float_state(model))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))
    honest = compute_delta(float_state(model), global_previous)
    client = RecordingClient()
    stats = RoundStats()
    returned = send_update(
        client=client,  # type: ignore[arg-type]
        model=model,
        global_previous=global_previous,
        config=SimpleNamespace(updates={"to": "ps"}),  # type: ignore[arg-type]
        work_dir=tmp_path,
        round_number=3,
        stats=stats,
    )
    # the trainer itself goes on with the honest delta (an eager trainer's proxy is made of it)
    for name in honest:
        torch.testing.assert_close(returned[name], honest[name], rtol=0, atol=0)
    assert client.sent == [({"to": "ps"}, "updates/3.safetensors")]
    return weights.load(tmp_path / "updates/3.safetensors"), honest


def norm(tensors: dict[str, torch.Tensor]) -> float:
    unique = {id(tensor): tensor for tensor in tensors.values()}
    return math.sqrt(sum(float(tensor.double().pow(2).sum()) for tensor in unique.values()))


def test_honest_sends_the_delta(tmp_path, monkeypatch):
    sent, honest = sent_and_honest(tmp_path, monkeypatch, None)

    assert sorted(sent) == sorted(honest)
    for name in honest:
        torch.testing.assert_close(sent[name], honest[name], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("mode", "factor"), [("scale:100", 100.0), ("scale:-2.5", -2.5), ("sign_flip", -1.0), ("zero", 0.0)]
)
def test_scaled_flipped_and_zero_updates(tmp_path, monkeypatch, mode, factor):
    sent, honest = sent_and_honest(tmp_path, monkeypatch, mode)

    assert sorted(sent) == sorted(honest)
    for name in honest:
        torch.testing.assert_close(sent[name], honest[name] * factor, rtol=1e-6, atol=0)
    # tied names stay tied: one tensor for both names
    assert sent["embed.weight"] is sent["head.weight"]


def test_random_has_the_honest_norm_and_no_relation_to_it(tmp_path, monkeypatch):
    sent, honest = sent_and_honest(tmp_path, monkeypatch, "random")

    assert sorted(sent) == sorted(honest)
    assert norm(sent) == pytest.approx(norm(honest), rel=1e-5)
    flat_sent = torch.cat([sent[name].flatten() for name in sorted(sent) if name != "head.weight"])
    flat_honest = torch.cat([honest[name].flatten() for name in sorted(honest) if name != "head.weight"])
    cosine = float(torch.nn.functional.cosine_similarity(flat_sent, flat_honest, dim=0))
    assert abs(cosine) < 0.9
    assert sent["embed.weight"] is sent["head.weight"]


def test_the_warning_is_loud_and_said_once(monkeypatch, caplog):
    monkeypatch.setattr(byzantine, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="worker_daemon.executors.byzantine"):
        assert byzantine.mode_from_environment({"HYPHA_BYZANTINE": "zero"}) == "zero"
        assert byzantine.mode_from_environment({"HYPHA_BYZANTINE": "zero"}) == "zero"
    assert [record.getMessage() for record in caplog.records] == [
        "BYZANTINE TRAINER (HYPHA_BYZANTINE=zero): every pseudo-gradient this trainer sends is deliberately "
        "corrupted; an experiment and test knob, never for production"
    ]


@pytest.mark.parametrize("value", ["", "  ", "nonsense", "scale:nan"])
def test_unset_or_invalid_in_the_environment_is_honest(value):
    assert byzantine.mode_from_environment({"HYPHA_BYZANTINE": value}) is None


async def test_a_real_trainer_sends_a_hundredfold_update(
    tiny_model: TinyModel, short_dir: Path, monkeypatch
) -> None:
    # given: the daemon's variable, as it exports it to the task
    monkeypatch.setenv("HYPHA_BYZANTINE", "scale:100")
    updates = [make_update(tiny_model.state, seed=1), make_update(tiny_model.state, seed=2)]
    backend = ScriptedTrainerBackend(
        model_dir=tiny_model.directory, updates=[update_bytes(u) for u in updates]
    )

    # when
    async with running_bridge(short_dir, backend):
        run = await run_executor(work_dir=short_dir, job=train_job())

    # then: 100 × the honest pseudo-gradients of a correct trainer, and it said so
    assert run.returncode == 0, run.stdout + run.stderr
    _, expected_deltas = replay(tiny_model, updates)
    assert len(backend.sent) == 2
    for sent, expected in zip(backend.sent, expected_deltas, strict=True):
        for name in expected:
            torch.testing.assert_close(sent.tensors[name], expected[name] * 100, rtol=0, atol=1e-4)
    assert "BYZANTINE TRAINER (HYPHA_BYZANTINE=scale:100)" in run.stdout + run.stderr
