"""``hypha watch`` as a user sees it, against the fake control plane answering job objects as the API sends
them: the bar fits the terminal (80 columns included) with the round, the bar, the job's elapsed time and the
loss; the bar's loss is the summary's; an eval that arrives after its round is printed when it arrives; a
finished job shows how long it ran, not 0:00:00."""

from __future__ import annotations

import io
import re
import sys
from datetime import UTC, datetime, timedelta

import pytest

from hypha_cli.exceptions import ExitCode
from tests.hypha_cli.conftest import JOB_ID, closed_round, job, json_response

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
CREATED, ENDED = "2025-01-02T03:04:05Z", "2025-01-02T04:05:06Z"  # 1:01:01 apart


class Terminal(io.StringIO):
    """A stdout that says it is a terminal: the CLI draws its live bar (with cursor codes) into it."""

    def isatty(self) -> bool:
        return True

    def screen_lines(self) -> list[str]:
        """Every line drawn, cursor and colour codes removed (each redraw of the bar is a line of its own)."""
        return [line for line in re.split(r"[\r\n]", ANSI.sub("", self.getvalue())) if line.strip()]


@pytest.fixture
def no_waiting(monkeypatch):
    monkeypatch.setattr("hypha_cli.watch.MIN_INTERVAL", 0.0)
    monkeypatch.setattr("hypha_cli.watch.MAX_INTERVAL", 0.0)


def on_terminal(monkeypatch, columns: int) -> Terminal:
    """Make stdout a terminal of ``columns`` (``$COLUMNS``). Called in the test's body: pytest's capture puts
    its own stdout back between a fixture's setup and the test."""
    monkeypatch.setenv("COLUMNS", str(columns))
    screen = Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    return screen


def trainers(*losses: float) -> list[dict]:
    """Trainer tasks as the job detail lists them, each with its live (last step's) loss."""
    return [{"role": "trainer", "status": "running", "steps_total": 10, "last_loss": loss} for loss in losses]


def many_rounds(count: int, *, total: int) -> dict:
    rounds = [closed_round(n, loss=12.3456, eval_loss=11.9876) for n in range(1, count + 1)]
    return job(
        "running",
        reason="RUNNING: round 37 of 100 applied (3 trainers, eval loss 11.9876); " + "x" * 80,
        rounds=rounds,
        spec={"rounds": {"update_rounds": total, "inner_steps": 5}},
        tasks=trainers(12.5, 12.6, 12.7),
    )


@pytest.mark.parametrize("columns", [80, 64])
def test_the_bar_fits_a_narrow_terminal_with_round_bar_elapsed_and_loss(
    api, hypha, no_waiting, monkeypatch, columns
):
    # given: a terminal of COLUMNS, a job with a long reason and three-digit rounds
    running = many_rounds(37, total=100)
    running["created_at"] = (datetime.now(UTC) - timedelta(seconds=95)).isoformat()
    finished = {
        **many_rounds(100, total=100),
        "status": "completed",
        "ended_at": ENDED,
        "created_at": CREATED,
    }
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = [json_response(200, running), json_response(200, finished)]

    # when
    terminal = on_terminal(monkeypatch, columns)
    assert hypha("watch", JOB_ID) == ExitCode.OK

    # then: the bar never collapses ("r… …") and the live lines fit; printed lines may wrap, the bar may not
    bars = [line for line in terminal.screen_lines() if "━" in line]
    assert bars, terminal.getvalue()
    for bar in bars:
        assert len(bar.rstrip()) <= columns, bar
        assert "…" not in bar and re.search(r"━{8,}", bar), bar
    assert any(re.search(r"running .*━ round 37/100 0:01:[3-5]\d loss 12\.3456", bar) for bar in bars), bars
    assert re.search(r"completed .*━ round 100/100 1:01:01 loss 12\.3456", bars[-1]), bars[-1]


def test_the_bars_loss_is_the_summarys_loss(api, hypha, no_waiting, monkeypatch):
    # given: the trainers' live losses (3.9) differ from the last closed round's mean loss (4.5)
    rounds = [closed_round(1, loss=5.0, eval_loss=5.1), closed_round(2, loss=4.5, eval_loss=4.6)]
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = [
        json_response(200, job("running", rounds=rounds[:1], tasks=trainers(4.8, 4.9))),
        json_response(200, job("completed", rounds=rounds, tasks=trainers(3.8, 4.0), ended_at=ENDED)),
    ]

    # when
    terminal = on_terminal(monkeypatch, 80)
    assert hypha("watch", JOB_ID) == ExitCode.OK

    # then
    lines = terminal.screen_lines()
    final_bar = [line for line in lines if "━" in line][-1]
    assert "loss 4.5000 · eval 4.6000" in final_bar and "3.9" not in final_bar
    assert (
        lines[-1]
        == f"job {JOB_ID} completed · rounds 2/2 · loss 5.0000 → 4.5000 · eval 4.6000 · took 1:01:01"
    )


def test_a_finished_job_shows_how_long_it_ran_not_how_long_the_watch_did(api, hypha, monkeypatch):
    # given: a job that ended before the watch began
    done = job("completed", rounds=[closed_round(1, loss=5.0, eval_loss=None)], ended_at=ENDED)
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = json_response(200, done)

    # when
    terminal = on_terminal(monkeypatch, 80)
    assert hypha("watch", JOB_ID) == ExitCode.OK

    # then
    bars = [line for line in terminal.screen_lines() if "━" in line]
    assert "1:01:01" in bars[-1] and "0:00:00" not in bars[-1]
    assert terminal.screen_lines()[-1].endswith("· took 1:01:01")


def test_an_eval_that_arrives_after_its_round_is_printed_when_it_arrives(api, hypha, capsys, no_waiting):
    # given: each round closes before its eval is reported; round 2's eval fails
    round_1 = closed_round(1, loss=5.0, eval_loss=None)
    round_2 = closed_round(2, loss=4.5, eval_loss=None)
    no_data = {"eval_error": "no eval data: slice 3 unavailable"}
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = [
        json_response(200, job("running", reason="RUNNING: 2 trainers", rounds=[round_1])),
        json_response(200, job("running", reason="RUNNING: 2 trainers", rounds=[round_1])),
        json_response(
            200, job("running", reason="RUNNING: 2 trainers", rounds=[{**round_1, "eval_loss": 5.1}, round_2])
        ),
        json_response(
            200,
            job(
                "completed",
                reason="COMPLETED: done",
                rounds=[{**round_1, "eval_loss": 5.1}, {**round_2, **no_data}],
                ended_at=ENDED,
            ),
        ),
    ]

    # when
    assert hypha("watch", JOB_ID) == ExitCode.OK

    # then: no "eval -" placeholder; each eval once, when it came
    assert capsys.readouterr().out.splitlines() == [
        "running: RUNNING: 2 trainers",
        "round 1/2: loss 5.0000 · 2 trainers · 3.5s",
        "round 1/2: eval 5.1000",
        "round 2/2: loss 4.5000 · 2 trainers · 3.5s",
        "completed: COMPLETED: done",
        "round 2/2: no eval loss: no eval data: slice 3 unavailable",
        f"job {JOB_ID} completed · rounds 2/2 · loss 5.0000 → 4.5000 · eval 5.1000 · took 1:01:01",
    ]


def test_a_round_with_its_eval_and_one_whose_eval_failed_say_so_on_their_line():
    from hypha_cli.output import round_line

    evaluated = closed_round(1, loss=5.0, eval_loss=5.1)
    failed = {**closed_round(2, loss=4.5, eval_loss=None), "eval_error": "the model gives no loss"}

    assert round_line(evaluated, 2) == "round 1/2: loss 5.0000 · eval 5.1000 · 2 trainers · 3.5s"
    assert (
        round_line(failed, 2)
        == "round 2/2: loss 4.5000 · 2 trainers · 3.5s · no eval loss: the model gives no loss"
    )


def test_elapsed_runs_from_creation_to_the_end_or_to_now():
    from hypha_cli.output import duration_text, elapsed_seconds

    now = datetime(2025, 1, 2, 3, 5, 35, tzinfo=UTC)
    assert duration_text(elapsed_seconds(job("running"), now=now)) == "0:01:30"
    assert duration_text(elapsed_seconds(job("completed", ended_at=ENDED), now=now)) == "1:01:01"
    assert duration_text(elapsed_seconds({**job("running"), "created_at": None})) == "-:--:--"
    assert duration_text(26 * 3600 + 61) == "26:01:01"
