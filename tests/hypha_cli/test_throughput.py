"""``hypha show`` says each round's throughput and each trainer's (issue 17, part E), from the ``throughput``
fields of ``GET /api/jobs/{id}/`` (their shape is pinned in tests/apps/jobs/test_throughput.py)."""

from __future__ import annotations

from hypha_cli.exceptions import ExitCode
from tests.hypha_cli.conftest import JOB_ID, closed_round, job, json_response

GIB = 2**30


def test_show_gives_a_throughput_line_per_round_and_each_trainers_latest(api, hypha, capsys):
    first = {
        **closed_round(1, loss=2.5, eval_loss=None),
        "throughput": {
            "trainers": {"w1": {"samples_per_second": 40.0}, "w2": {"samples_per_second": 10.0}},
            "samples_per_second": 50.0,
            "tokens_per_second": None,
            "peak_memory_bytes": None,
            "mfu": None,
        },
    }
    second = {
        **closed_round(2, loss=2.0, eval_loss=None),
        "throughput": {
            "trainers": {
                "w1": {
                    "samples_per_second": 42.0,
                    "tokens_per_second": 5376.0,
                    "peak_memory_bytes": 3.0 * GIB,
                    "mfu": 0.42,
                },
                "w2": {"samples_per_second": 10.0, "tokens_per_second": 1280.0},
            },
            "samples_per_second": 52.0,
            "tokens_per_second": 6656.0,
            "peak_memory_bytes": 3.0 * GIB,
            "mfu": 0.42,
        },
    }
    tasks = [{"worker_id": "w1", "worker": "rig-a"}, {"worker_id": "w2", "worker": "rig-b"}]
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = json_response(200, job(rounds=[first, second], tasks=tasks))

    assert hypha("show", JOB_ID) == ExitCode.OK

    out = capsys.readouterr().out
    assert "round 1/2 throughput: 50.0 samples/s\n" in out
    assert "round 2/2 throughput: 52.0 samples/s · 6656.0 tokens/s · peak 3.0 GiB · MFU 42%\n" in out
    assert "trainer rig-a (round 2): 42.0 samples/s · 5376.0 tokens/s · peak 3.0 GiB · MFU 42%\n" in out
    assert "trainer rig-b (round 2): 10.0 samples/s · 1280.0 tokens/s\n" in out


def test_show_of_rounds_without_throughput_says_nothing_of_it(api, hypha, capsys):
    api.routes[("GET", f"/api/jobs/{JOB_ID}/")] = json_response(
        200, job(rounds=[closed_round(1, loss=2.5, eval_loss=None)])
    )

    assert hypha("show", JOB_ID) == ExitCode.OK

    assert "throughput" not in capsys.readouterr().out
