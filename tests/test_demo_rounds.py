"""scripts/demo's round lines, from job objects as ``GET /api/jobs/<id>/`` sends them while a job runs: a round
is printed when it closes, its eval loss with it when it came with it, else on a line of its own when it
arrives; never "eval loss None". (The demo's whole run, minutes of training, is ``scripts/demo`` itself.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.hypha_cli.conftest import closed_round, job

REPO_ROOT = Path(__file__).resolve().parents[1]

spec = importlib.util.spec_from_file_location("_demo_training", REPO_ROOT / "scripts" / "_demo_training.py")
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)


def test_a_round_is_printed_when_it_closes_and_its_eval_when_it_arrives(capsys):
    # given: the API's answers while the job runs: round 1 closes before its eval is in, round 2 with it,
    # round 3's evaluation fails
    round_1 = closed_round(1, loss=3.9371, eval_loss=None)
    open_2 = {**closed_round(2, loss=3.5, eval_loss=None), "closed": False, "mean_loss": None}
    answers = iter(
        [
            job("running"),
            job("running", rounds=[round_1, open_2]),
            job("running", rounds=[round_1, open_2]),
            job(
                "running",
                rounds=[{**round_1, "eval_loss": 3.2494}, closed_round(2, loss=3.448, eval_loss=3.242)],
            ),
            job(
                "completed",
                rounds=[
                    {**round_1, "eval_loss": 3.2494},
                    closed_round(2, loss=3.448, eval_loss=3.242),
                    {
                        **closed_round(3, loss=3.02, eval_loss=None),
                        "eval_error": "no eval data: slice 3 gone",
                    },
                ],
            ),
        ]
    )
    clock = iter(range(60, 100, 5))
    printer = demo.RoundLines(3, elapsed=lambda: next(clock))

    # when
    final = demo.follow(lambda: next(answers), printer, timeout=60, interval=0)

    # then
    assert final["status"] == "completed"
    assert capsys.readouterr().out.splitlines() == [
        "==> round 1/3: 2 trainers, training loss 3.937 (65 s)",
        "==> round 1/3: eval loss 3.249 (75 s)",
        "==> round 2/3: 2 trainers, training loss 3.448, eval loss 3.242 (75 s)",
        "==> round 3/3: 2 trainers, training loss 3.020, no eval loss: no eval data: slice 3 gone (80 s)",
    ]


def test_a_job_that_never_ends_is_a_timeout():
    printer = demo.RoundLines(3, elapsed=lambda: 0.0)

    with pytest.raises(TimeoutError, match="did not end within 0s"):
        demo.follow(lambda: job("running"), printer, timeout=0, interval=0)
