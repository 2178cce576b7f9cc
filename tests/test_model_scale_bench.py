"""bench/model_scale.py: its arguments, its goal and how it reads the parameter server's log and samples.

The benchmark itself starts a real parameter server per size (minutes; results in docs/benchmarks.md); here:
the pieces that turn what it sees into the table.
"""

from __future__ import annotations

import datetime

import pytest

from bench import model_scale


def test_sizes_are_checked_and_the_defaults_are_the_three_of_the_issue():
    assert model_scale.parse_arguments([]).sizes == ["10M", "50M", "124M"]
    assert model_scale.parse_arguments(["--sizes", "10M, 50M"]).sizes == ["10M", "50M"]
    with pytest.raises(SystemExit):
        model_scale.parse_arguments(["--sizes", "7B"])
    with pytest.raises(SystemExit):
        model_scale.parse_arguments(["--rounds", "0"])


def test_124m_is_gpt2_smalls_shape_and_every_width_splits_into_its_heads():
    assert model_scale.SIZES["124M"] == {
        "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024,
    }  # fmt: skip
    for config in model_scale.SIZES.values():
        assert config["n_embd"] % config["n_head"] == 0


def test_the_goal_is_four_model_sizes_and_300_mb():
    assert model_scale.goal_bytes(500 * model_scale.MB) == 2300 * model_scale.MB


def test_the_servers_digest_lines_give_the_end_of_each_rounds_aggregate(tmp_path):
    log = tmp_path / "parameter-server.log"
    log.write_text(
        "2026-11-26 14:22:40,100 INFO parameter_server.rounds.coordinator: round 1 closes: all expected\n"
        "2026-11-26 14:22:41,250 INFO parameter_server.service: round 1: the global weights' digest is ab12\n"
        "2026-11-26 14:22:45,007 INFO parameter_server.service: round 2: the global weights' digest is cd34\n"
    )
    found = model_scale._digest_times(log)
    assert sorted(found) == [1, 2]
    expected = datetime.datetime(2026, 11, 26, 14, 22, 41, 250000).timestamp()
    assert found[1] == pytest.approx(expected)
    assert found[2] - found[1] == pytest.approx(3.757)


def test_the_report_shows_the_ratio_to_the_goal_and_the_peak_phase():
    mb = model_scale.MB
    rounds = [
        {"round": 1, "receive_s": 3.0, "aggregate_s": 9.0, "publish_s": 1.0, "receive_max_rss": 4900 * mb,
         "aggregate_max_rss": 3900 * mb, "publish_max_rss": 3900 * mb},
        {"round": 2, "receive_s": 2.0, "aggregate_s": 6.0, "publish_s": 0.5, "receive_max_rss": 4800 * mb,
         "aggregate_max_rss": 3900 * mb, "publish_max_rss": 3800 * mb},
    ]  # fmt: skip
    result = {
        "size": "124M", "parameters": 124_400_000, "model_bytes": 500 * mb, "ready_rss": 1400 * mb,
        "peak_rss": 4600 * mb, "rounds": rounds, "load": "1.00 / 1.00 / 1.00",
    }  # fmt: skip
    arguments = model_scale.parse_arguments(["--sizes", "124M", "--rounds", "2"])
    text = model_scale.report([result], arguments)
    assert "| 124M | 124.4 M | 500 MB | 1400 MB | 4600 MB | 2300 MB | **2.00** | 9.20 | 6.40 |" in text
    assert "| 2.00 | 6.00 | 0.50 | 3.00 / 9.00 / 1.00 |" in text  # round 2's medians, round 1 apart
    assert (
        "| 124M | 1400 MB (2.8×) | 4900 MB (9.8×) | 3900 MB (7.8×) | 3900 MB (7.8×) | 4600 MB (9.2×) |"
        in text
    )
