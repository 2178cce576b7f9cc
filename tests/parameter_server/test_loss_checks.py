"""The held-out loss checks of a closing round (parameter_server/rounds/validation.py; docs/training.md,
"Robust aggregation and verification"): the validation step rejects an update that, applied alone, makes the
model clearly worse, and ``discard_if_loss_rises`` rolls a round back to the previous weights and momentum.

A real tiny model (a linear regression whose loss is its forward's output) and the real
:class:`~parameter_server.evaluation.Evaluator` on a held-out slice file found in its cache (no download)."""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from hypha_tensors import weights as weights_io
from parameter_server.aggregation import MEAN, AggregationRule, Verification
from parameter_server.evaluation import Evaluator
from parameter_server.exceptions import JobConfigError
from parameter_server.job import EvalConfig, EvalSlice, parse_job
from parameter_server.rounds import RoundCoordinator
from parameter_server.rounds.validation import applied_alone
from tests.parameter_server.conftest import ALICE, aggregate_job

PEERS = ["alice", "bob", "carol", "dave", "erin"]
#: The global weights, and the truth the held-out data follows: its loss is |w − w*|² ≈ 0.5.
THETA = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
TRUE_W = torch.tensor([1.5, 2.5])
LEARNING_RATE = 0.5


class Line(torch.nn.Module):
    """y ≈ x·w + b; its forward is the mean squared error (the evaluator's loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))
        self.b = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((x @ self.w + self.b - y) ** 2).mean()


class Evaluations:
    """The coordinator's ``evaluate``: the real evaluator in a thread, counting calls and any overlap."""

    def __init__(self, tmp_path: Path) -> None:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(256, 2, generator=generator)
        data = {"x": x, "y": x @ TRUE_W + 0.5}
        cache = tmp_path / "eval"
        cache.mkdir()
        weights_io.save(cache / "0", data)
        raw = (cache / "0").read_bytes()
        config = EvalConfig(
            dataset="held-out",
            batch_size=64,
            slices=(EvalSlice(0, len(raw), hashlib.sha256(raw).hexdigest(), ("http://unused.invalid/0",)),),
        )
        self.evaluator = Evaluator(config=config, input_names=("x", "y"), cache_dir=cache)
        self.model = Line()
        self.calls = 0
        self.running = 0
        self.overlapped = False

    async def __call__(self, weights: Mapping[str, torch.Tensor]) -> float | None:
        self.calls += 1
        self.running += 1
        self.overlapped |= self.running > 1
        try:
            await self.evaluator.prepare(None)  # type: ignore[arg-type]  # the slice is in the cache
            return await asyncio.to_thread(self.evaluator.loss, self.model, weights)
        finally:
            self.running -= 1


def coordinator(evaluate: Evaluations, rule: AggregationRule, **overrides) -> RoundCoordinator:
    arguments = {
        "expected": PEERS,
        "weights": dict(THETA),
        "momentum": None,
        "rounds_completed": 0,
        "update_rounds": 3,
        "round_timeout": 30.0,
        "weighted": True,
        "learning_rate": LEARNING_RATE,
        "momentum_factor": 0.5,
        "update_norm_ratio": 1000.0,  # the bound at arrival is another test's
        "aggregation": rule,
        "evaluate": evaluate,
    }
    arguments.update(overrides)
    return RoundCoordinator(**arguments)


def update(w: list[float], b: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(w), "b": torch.tensor([b])}


# θ + 0.5·Δ moves w to about w* for the honest three; dave's × 100 overshoots, erin's goes the other way.
HONEST = [update([1.0, 1.0], 0.0), update([1.0, 0.9], 0.02), update([0.9, 1.0], 0.0)]
SCALED = update([100.0, 100.0], 0.0)
FLIPPED = update([-1.0, -0.9], -0.02)


async def run_round(rounds, number: int, updates, peers=PEERS, samples=None):
    samples = samples or [1] * len(updates)
    for peer, tensors, count in zip(peers, updates, samples, strict=True):
        await rounds.submit(peer, number, tensors, samples=count)
    return await asyncio.wait_for(rounds.published.get(), 30)


def test_an_update_applied_alone_is_the_outer_step_it_would_take_by_itself():
    candidate = applied_alone(THETA, HONEST[1], ["w", "b"], learning_rate=0.5, buffers={"b"})
    assert_close(candidate["w"], torch.tensor([1.5, 2.45]))
    assert_close(candidate["b"], torch.tensor([0.52]))  # a buffer takes the value as the step does: lr 1
    assert torch.equal(THETA["w"], torch.tensor([1.0, 2.0]))  # the global weights are not touched


async def test_validation_rejects_the_updates_that_make_the_model_worse_alone(tmp_path):
    # given: a plain mean without norm or cosine checks, validating every round
    evaluations = Evaluations(tmp_path)
    rule = AggregationRule(MEAN, verification=Verification(enabled=False, validation_every=1))
    rounds = coordinator(evaluations, rule)

    # when
    result = await run_round(rounds, 1, [*HONEST, SCALED, FLIPPED], samples=[1, 2, 1, 5, 5])

    # then: dave and erin are rejected by their held-out loss alone; the step is the honest mean's
    verdicts = result.verdicts
    assert {peer: verdict["verdict"] for peer, verdict in verdicts.items()} == {
        "alice": "accepted",
        "bob": "accepted",
        "carol": "accepted",
        "dave": "rejected",
        "erin": "rejected",
    }
    baseline = 0.5  # |w − w*|² for x ~ N(0, 1)
    assert verdicts["erin"]["reason"].startswith("its update alone raises the held-out loss from 0.")
    assert "(more than 1.5x)" in verdicts["erin"]["reason"]
    assert verdicts["dave"]["loss_ratio"] > 1000 and verdicts["erin"]["loss_ratio"] > 1.5
    assert verdicts["alice"]["loss_ratio"] < 0.1 and verdicts["alice"]["validation_loss"] < 0.05
    assert verdicts["erin"]["validation_loss"] == pytest.approx(
        verdicts["erin"]["loss_ratio"] * baseline, rel=0.3
    )
    g_w = (torch.tensor([1.0, 1.0]) + 2 * torch.tensor([1.0, 0.9]) + torch.tensor([0.9, 1.0])) / 4
    assert_close(result.update["w"], 0.75 * g_w)  # u = lr·(g + μ·g) in the first round
    assert result.participants == ("alice", "bob", "carol") and result.samples == 4
    # one eval of the global weights, one per update, never two at once
    assert evaluations.calls == 1 + 5 and not evaluations.overlapped


async def test_validation_runs_in_the_rounds_that_are_multiples_of_its_rate(tmp_path):
    evaluations = Evaluations(tmp_path)
    rule = AggregationRule(MEAN, verification=Verification(enabled=False, validation_every=2))
    rounds = coordinator(evaluations, rule, expected=PEERS[:3])

    first = await run_round(rounds, 1, HONEST, peers=PEERS[:3])
    # round 1 overshot w* by about 0.225 (u = 0.75·g): alice's and bob's updates of round 2 correct it
    back = update([-0.45, -0.45], 0.0)
    second = await run_round(rounds, 2, [back, back, SCALED], peers=PEERS[:3])

    assert all("validation_loss" not in verdict for verdict in first.verdicts.values())
    assert evaluations.calls == 1 + 3  # round 2 only: the new global weights, then each update
    assert [verdict["verdict"] for verdict in second.verdicts.values()] == [
        "accepted",
        "accepted",
        "rejected",
    ]
    assert all("validation_loss" in verdict for verdict in second.verdicts.values())


async def test_a_round_whose_loss_rises_is_discarded_and_the_previous_weights_and_momentum_stay(tmp_path):
    # given: the discard rule, and a first round that improves the model (it has a momentum then)
    evaluations = Evaluations(tmp_path)
    rule = AggregationRule(MEAN, discard_if_loss_rises=1.5)
    rounds = coordinator(evaluations, rule, expected=PEERS[:3])
    first = await run_round(rounds, 1, HONEST, peers=PEERS[:3])
    assert first.discarded is None and first.stepped
    assert first.eval_loss is not None and first.eval_loss < 0.5  # measured by the rule: the report's
    weights = {name: tensor.clone() for name, tensor in rounds.weights.items()}
    momentum = {name: tensor.clone() for name, tensor in (rounds.momentum or {}).items()}
    assert momentum

    # when: every trainer of round 2 sends an update that makes the model far worse
    second = await run_round(rounds, 2, [SCALED, SCALED, SCALED], peers=PEERS[:3])

    # then: the round is discarded, u = 0, and the weights and momentum are those of round 1
    assert second.discarded is not None
    assert second.discarded.startswith(f"its held-out loss rises from {first.eval_loss:.4g} to ")
    assert "(more than 1.5x): the previous weights and momentum are kept" in second.discarded
    assert not second.stepped
    assert all(not tensor.any() for tensor in second.update.values())
    assert all(torch.equal(rounds.weights[name], weights[name]) for name in weights)
    assert all(torch.equal(rounds.momentum[name], momentum[name]) for name in momentum)
    assert second.eval_loss == first.eval_loss  # the weights published are round 1's
    # and trainers continue: round 3 steps from them
    # (round 1 overshot w* by about 0.225, and its momentum still pushes on: these bring w back to it)
    back = update([-0.45, -0.45], 0.0)
    third = await run_round(rounds, 3, [back, back, back], peers=PEERS[:3])
    assert third.discarded is None and third.stepped
    assert_close(rounds.weights["w"], weights["w"] + third.update["w"])
    assert not evaluations.overlapped


async def test_a_round_whose_loss_stays_within_the_factor_is_kept(tmp_path):
    evaluations = Evaluations(tmp_path)
    rounds = coordinator(evaluations, AggregationRule(MEAN, discard_if_loss_rises=100.0), expected=PEERS[:3])
    result = await run_round(rounds, 1, [FLIPPED, FLIPPED, FLIPPED], peers=PEERS[:3])
    assert result.discarded is None and result.stepped
    assert result.eval_loss is not None and 0.5 < result.eval_loss < 50


def job_with(**rounds) -> dict:
    document = aggregate_job(peers=[ALICE])
    document["executor"]["config"]["rounds"].update(rounds)
    return document


def test_the_job_json_carries_the_loss_checks():
    eval_config = {
        "dataset": "d",
        "batch_size": 4,
        "slices": [{"index": 0, "size": 10, "sha256": "0" * 64, "urls": ["http://data/0"]}],
    }
    document = job_with(
        verification={"validation_every": 3, "max_validation_rise": 2.0}, discard_if_loss_rises=1.2
    )
    document["executor"]["config"]["eval"] = eval_config
    rule = parse_job(document).aggregation
    assert rule.verification.validation_every == 3 and rule.verification.max_validation_rise == 2.0
    assert rule.discard_if_loss_rises == 1.2 and rule.holds_updates and not rule.verifies
    assert [rule.verification.validates(number) for number in (1, 3, 6, 7)] == [False, True, True, False]
    assert (
        parse_job(job_with(verification={"validation_every": 0})).aggregation.verification.validation_every
        is None
    )


@pytest.mark.parametrize(
    ("rounds", "message"),
    [
        ({"verification": {"validation_every": 2}}, "need the held-out loss: the job has no eval data"),
        ({"discard_if_loss_rises": 2.0}, "need the held-out loss: the job has no eval data"),
        ({"discard_if_loss_rises": 1.0}, "rounds.discard_if_loss_rises must be > 1"),
        (
            {"verification": {"validation_every": -1}},
            "rounds.verification.validation_every must be an integer",
        ),
        ({"verification": {"max_validation_rise": 1}}, "rounds.verification.max_validation_rise must be > 1"),
    ],
)
def test_bad_loss_checks_in_the_job_json_are_refused(rounds, message):
    with pytest.raises(JobConfigError, match=message.replace(".", r"\.")):
        parse_job(job_with(**rounds))


def test_a_validated_verdict_reports_its_scores_and_an_unvalidated_one_as_before():
    from parameter_server.rounds.robust import Validation, Verdict

    assert set(Verdict("accepted", "", 1.0, 0.5).as_json()) == {"verdict", "reason", "norm_ratio", "cosine"}
    body = Verdict("rejected", "r", 1.0, None, Validation(3.0, 1.0)).as_json()
    assert (body["validation_loss"], body["loss_ratio"]) == (3.0, 3.0)
    assert Validation(math.inf, 1.0).ratio == math.inf and Validation(0.0, 0.0).ratio == 1.0
