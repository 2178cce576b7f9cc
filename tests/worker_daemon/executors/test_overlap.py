"""An eager trainer (docs/training.md, "Overlap: eager updates") through the real bridge.

:class:`EagerBackend` plays the control plane and our parameter server for one trainer: fixed H = 3 (the third
step report after the last ``"update"`` is answered ``ScheduleUpdate{0}``), results published with their
round and θ_r's digest (:class:`~.test_consistency.PublishingBackend`), each held back until a chosen step of
the next round. The run is replayed here with plain formulas (the rule written out: proxy
p = θ_{r−1} + μ²·u_{r−1} + lr·(1 + μ)·Δ, correction θ_live += θ_r − p at the merge), following the order of
events the backend saw, so the test asserts the numbers — each loss and each pseudo-gradient — not only the
order.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from hypha_tensors import weights
from worker_daemon.executors.exceptions import JobConfigError
from worker_daemon.executors.job import parse_job

from .conftest import LEARNING_RATE, SentUpdate, TinyModel, run_executor, running_bridge, train_job
from .test_consistency import (
    TIED_ALIAS,
    Announcement,
    PublishingBackend,
    corrupted,
    global_rounds,
    published_file,
    result_file,
)
from .test_training import batches

H = 3
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
#: How long the backend holds its reply to the step after it released a result: time for the trainer's
#: background thread to read and merge a 0.1 M-parameter model's result (milliseconds), generously.
SETTLE_SECONDS = 2.0


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """The executor process runs with OMP_NUM_THREADS=1; the replay (and an in-process executor) the same:
    the same reduction order, so the numbers agree to float32's last bits rather than AdamW-amplified noise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def eager_job(*, learning_rate: float = OUTER_LR, momentum: float = OUTER_MOMENTUM) -> dict[str, Any]:
    job = train_job()
    job["executor"]["config"]["overlap"] = {
        "mode": "eager",
        "outer_learning_rate": learning_rate,
        "outer_momentum": momentum,
    }
    return job


def kind(progress: object) -> str:
    return next(iter(progress)) if isinstance(progress, dict) else str(progress)


class EagerBackend(PublishingBackend):
    """Fixed H = 3 after each ``"update"``; the results of the n-th update (``answers[n]``) held until the
    ``release_at``-th step report after it (then the reply to the next step waits :data:`SETTLE_SECONDS`);
    ``"update-received"`` answered ``Continue``, and ``Done`` the ``done_after``-th time."""

    def __init__(self, *, release_at: int, done_after: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.release_at = release_at
        self.done_after = done_after
        self.held: list[Announcement] = []
        self.steps_since_update = 0
        self.merges = 0

    async def send(self, *, reference: Any, path: Path) -> None:
        with safe_open(str(path), framework="pt") as file:
            stored_names = sorted(file.keys())
            metadata = dict(file.metadata() or {})
        self.sent.append(
            SentUpdate(path=path, stored_names=stored_names, metadata=metadata, tensors=weights.load(path))
        )
        self.held.extend(self.answers.pop(0) if self.answers else [])

    async def status(self, *, job_id: str | None, progress: Any) -> dict[str, Any]:
        self.progress.append(progress)
        if isinstance(progress, dict) and "status" in progress:
            self.steps_since_update += 1
            step = self.steps_since_update
            if step == self.release_at + 1 and self.release_at < H:
                await asyncio.sleep(SETTLE_SECONDS)
            if step == self.release_at and self.held:
                for announcement in self.held:
                    await self._announced.put(announcement)
                self.held = []
            return {"type": "ScheduleUpdate", "counter": 0} if step == H else {"type": "Continue"}
        if progress == "update":
            self.steps_since_update = 0
        if progress == "update-received":
            self.merges += 1
            return {"type": "Done" if self.merges >= self.done_after else "Continue"}
        return {"type": "Ok"}


def make_backend(
    tiny_model: TinyModel, directory: Path, *, release_at: int, answers: list, model_rounds: list[int]
) -> EagerBackend:
    thetas, _ = global_rounds(tiny_model)
    return EagerBackend(
        release_at=release_at,
        done_after=2,
        directory=directory,
        config_file=tiny_model.directory / "config.json",
        global_weights=thetas,
        model_rounds=model_rounds,
        answers=answers,
    )


def in_order(tiny_model: TinyModel) -> list[list[Announcement]]:
    thetas, updates = global_rounds(tiny_model)
    return [[(1, result_file(thetas, updates, 1), None)], [(2, result_file(thetas, updates, 2), None)]]


def replay(
    tiny_model: TinyModel,
    progress: list[Any],
    merged: list[tuple[dict[str, torch.Tensor], bool]],
    *,
    learning_rate: float = OUTER_LR,
    momentum: float = OUTER_MOMENTUM,
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """The losses and pseudo-gradients of a correct eager trainer that saw ``progress`` (the backend's record)
    and merged ``merged`` (θ, and whether it came from a fetch of the full weights) at its update-receiveds."""
    from transformers import AutoModelForCausalLM

    lr, mu = learning_rate, momentum
    model = AutoModelForCausalLM.from_pretrained(tiny_model.directory)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    stream = batches()
    live = {n: t for n, t in model.state_dict().items() if t.dtype.is_floating_point and n != TIED_ALIAS}
    theta = {name: tensor.detach().clone() for name, tensor in live.items()}  # θ_{r−1}
    last: dict[str, torch.Tensor] | None = None  # u_{r−1}
    proxy: dict[str, torch.Tensor] = {}
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
            delta = {name: live[name].detach() - theta[name] for name in live}
            deltas.append(delta)
            proxy = {
                name: theta[name] + (lr * (1 + mu) * delta[name] if last is None else
                                     mu**2 * last[name] + lr * (1 + mu) * delta[name])
                for name in live
            }  # fmt: skip
            with torch.no_grad():
                for name, tensor in live.items():
                    tensor.copy_(proxy[name])
        elif event == "update-received":
            new_theta, refetched = next(merges)
            with torch.no_grad():
                for name, tensor in live.items():
                    tensor.add_(new_theta[name] - proxy[name])
            last = None if refetched else {name: new_theta[name] - theta[name] for name in live}
            theta = new_theta
    return losses, deltas


def assert_numbers(backend: EagerBackend, expected_losses: list[float], expected_deltas: list[dict]) -> None:
    statuses = [progress["status"] for progress in backend.progress if kind(progress) == "status"]
    assert [status["loss"] for status in statuses] == pytest.approx(expected_losses, rel=1e-5)
    assert len(backend.sent) == len(expected_deltas)
    for sent, expected in zip(backend.sent, expected_deltas, strict=True):
        assert sent.tensors[TIED_ALIAS] is sent.tensors["transformer.wte.weight"]
        for name, value in expected.items():
            torch.testing.assert_close(sent.tensors[name], value, rtol=0, atol=2e-6)


def rounds_of(progress: list[Any]) -> list[list[str]]:
    """The kinds of events, cut after each ``"metrics"`` (a round's last report)."""
    cut: list[list[str]] = [[]]
    for event in progress:
        cut[-1].append(kind(event))
        if kind(event) == "metrics":
            cut.append([])
    return cut


async def run_in_process(backend: EagerBackend, short_dir: Path, job: dict[str, Any]) -> int:
    from worker_daemon.executors.training import parse_arguments, training_function

    job_json = json.dumps(job)
    arguments = parse_arguments(
        ["--socket", str(short_dir / "bridge.sock"), "--work-dir", str(short_dir), "--job", job_json]
    )
    async with running_bridge(short_dir, backend):
        return await asyncio.to_thread(training_function, arguments, parse_job(job_json))


async def test_an_eager_trainer_merges_mid_round_and_exits_on_done(
    tiny_model: TinyModel, short_dir: Path, tmp_path: Path
) -> None:
    """A real executor process: each result arrives at the first step of the next round."""
    # given
    thetas, _ = global_rounds(tiny_model)
    backend = make_backend(
        tiny_model, tmp_path / "served", release_at=1, answers=in_order(tiny_model), model_rounds=[0]
    )

    # when
    async with running_bridge(short_dir, backend):
        run = await run_executor(work_dir=short_dir, job=eager_job())

    # then: exit 0 at the second update-received (Done), in the middle of round 3, which sends nothing
    assert run.returncode == 0, run.stdout + run.stderr
    cut = rounds_of(backend.progress)
    assert cut[0] == ["status"] * H + ["update", "metrics"]
    # round 2: round 1's result merged between two of its steps, before its own update
    assert cut[1][-2:] == ["update", "metrics"]
    assert cut[1].count("update-received") == 1 and cut[1].count("status") == H
    merged_at = cut[1].index("update-received")
    assert 1 <= merged_at < H, cut[1]  # after its first step (the result came then), before its last
    # round 3: round 2's result merged mid-round, Done: nothing more
    assert cut[2][-1] == "update-received" and set(cut[2][:-1]) == {"status"} and len(cut[2]) <= H
    assert [p["metrics"]["round"] for p in backend.progress if kind(p) == "metrics"] == [1, 2]
    assert len(backend.sent) == 2
    assert backend.served_rounds == [0]  # every result merged and checked, no fetch of the full weights

    # the numbers
    losses, deltas = replay(tiny_model, backend.progress, [(thetas[1], False), (thetas[2], False)])
    assert_numbers(backend, losses, deltas)
    assert "round 1 merged after" in run.stdout and "(checked)" in run.stdout
    assert "round 2 starts from the proxy (eager)" in run.stdout
    assert "done after 2 rounds" in run.stdout


async def test_a_result_later_than_the_next_rounds_steps_is_waited_for(
    tiny_model: TinyModel, short_dir: Path, tmp_path: Path
) -> None:
    # given: each result held until the next round's H-th step (a fixed-H job's ScheduleUpdate{0})
    thetas, _ = global_rounds(tiny_model)
    backend = make_backend(
        tiny_model, tmp_path / "served", release_at=H, answers=in_order(tiny_model), model_rounds=[0]
    )

    # when
    code = await run_in_process(backend, short_dir, eager_job())

    # then: the trainer stopped after H steps, waited, merged, said so, and only then sent its update
    assert code == 0
    assert rounds_of(backend.progress) == [
        ["status"] * H + ["update", "metrics"],
        ["status"] * H + ["update-received", "update", "metrics"],
        ["status"] * H + ["update-received"],
    ]
    losses, deltas = replay(tiny_model, backend.progress, [(thetas[1], False), (thetas[2], False)])
    assert_numbers(backend, losses, deltas)


@pytest.mark.parametrize(("learning_rate", "momentum"), [(1.0, 0.0), (0.5, 0.3)])
async def test_other_outer_settings_follow_the_same_rule(
    learning_rate: float, momentum: float, tiny_model: TinyModel, short_dir: Path, tmp_path: Path
) -> None:
    thetas, _ = global_rounds(tiny_model)
    backend = make_backend(
        tiny_model, tmp_path / "served", release_at=H, answers=in_order(tiny_model), model_rounds=[0]
    )

    assert (
        await run_in_process(backend, short_dir, eager_job(learning_rate=learning_rate, momentum=momentum))
        == 0
    )

    losses, deltas = replay(
        tiny_model,
        backend.progress,
        [(thetas[1], False), (thetas[2], False)],
        learning_rate=learning_rate,
        momentum=momentum,
    )
    assert_numbers(backend, losses, deltas)


async def test_a_result_that_cannot_give_the_global_weights_is_replaced_by_them_mid_round(
    tiny_model: TinyModel, short_dir: Path, tmp_path: Path, caplog
) -> None:
    # given: round 1's result off by one value (its digest is θ_1's); by the time the trainer fetches the full
    # weights the parameter server has closed round 2 without it; then round 3's result
    thetas, updates = global_rounds(tiny_model)
    bad = published_file(corrupted(updates[1]), round_number=1, digest=weights.digest(thetas[1]))
    later = [(2, result_file(thetas, updates, 2), None), (3, result_file(thetas, updates, 3), None)]
    backend = make_backend(
        tiny_model, tmp_path / "served", release_at=1, answers=[[(1, bad, None)], later], model_rounds=[0, 2]
    )
    caplog.set_level(logging.INFO, logger="worker_daemon.executors.training")

    # when
    assert await run_in_process(backend, short_dir, eager_job()) == 0

    # then: it fetched θ_2 (in the background), corrected the live model by θ_2 − p_1, and the round it was
    # training became round 3; its next proxy has no momentum term (the fetch leaves no last update)
    messages = [record.getMessage() for record in caplog.records]
    assert any("the merged weights of round 1 are not the parameter server's" in m for m in messages)
    assert any("round 2 merged after" in m and "round 3" in m for m in messages), messages
    assert backend.served_rounds == [0, 2]
    assert [p["metrics"]["round"] for p in backend.progress if kind(p) == "metrics"] == [1, 3]
    losses, deltas = replay(tiny_model, backend.progress, [(thetas[2], True), (thetas[3], False)])
    assert_numbers(backend, losses, deltas)


def test_the_overlap_key_is_parsed() -> None:
    assert parse_job(json.dumps(train_job())).config.overlap is None
    job = eager_job()
    job["executor"]["config"]["overlap"]["future_key"] = 1  # unknown keys are ignored
    overlap = parse_job(json.dumps(job)).config.overlap
    assert overlap is not None and overlap.eager
    assert (overlap.outer_learning_rate, overlap.outer_momentum) == (OUTER_LR, OUTER_MOMENTUM)
    plain = copy.deepcopy(train_job())
    plain["executor"]["config"]["overlap"] = {"mode": "none"}
    assert not parse_job(json.dumps(plain)).config.overlap.eager


@pytest.mark.parametrize(
    ("overlap", "message"),
    [
        ({"mode": "lazy", "outer_learning_rate": 0.7, "outer_momentum": 0.9}, "overlap.mode"),
        ({"mode": "eager", "outer_momentum": 0.9}, "needs outer_learning_rate and outer_momentum"),
        ({"mode": "eager", "outer_learning_rate": 0, "outer_momentum": 0.9}, "outer_learning_rate"),
        ({"mode": "eager", "outer_learning_rate": 0.7, "outer_momentum": 1.0}, "outer_momentum"),
        ({"mode": "eager", "outer_learning_rate": "NaN", "outer_momentum": 0.9}, "outer_learning_rate"),
        ("eager", "executor.config.overlap"),
    ],
)
def test_a_bad_overlap_is_refused(overlap: Any, message: str) -> None:
    job = train_job()
    job["executor"]["config"]["overlap"] = overlap
    with pytest.raises(JobConfigError, match=message):
        parse_job(json.dumps(job))


async def test_the_local_proxy_experiment_trains_on_from_the_local_weights(
    tiny_model: TinyModel, short_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    from worker_daemon.executors.overlap import PROXY_ENV, proxy_kind

    # given: the experiment knob (bench/diloco_quality.py --overlaps eager-local)
    assert proxy_kind({}) == "nesterov" and proxy_kind({PROXY_ENV: "bogus"}) == "nesterov"
    monkeypatch.setenv(PROXY_ENV, "local")
    thetas, _ = global_rounds(tiny_model)
    backend = make_backend(
        tiny_model, tmp_path / "served", release_at=H, answers=in_order(tiny_model), model_rounds=[0]
    )

    # when
    assert await run_in_process(backend, short_dir, eager_job()) == 0

    # then: p = θ_{r−1} + Δ whatever the outer optimizer (the rule with lr 1, μ 0)
    losses, deltas = replay(
        tiny_model,
        backend.progress,
        [(thetas[1], False), (thetas[2], False)],
        learning_rate=1.0,
        momentum=0.0,
    )
    assert_numbers(backend, losses, deltas)
