"""The daemon's summary of the steps it answered itself (``covered_points``, docs/dashboard.md)."""

from __future__ import annotations

import pytest

from worker_daemon.bridge.remote.step_summary import MAX_POINTS, StepSummary


def test_each_step_is_a_bucket_until_the_buckets_run_out():
    now = [100.0]
    summary = StepSummary(clock=lambda: now[0])
    for step in range(3):
        summary.add({"loss": 3.0 - step, "lr": 0.01, "step_time": 0.5, "tokens": 64}, batch_size=4)
        now[0] += 1.0

    assert summary.take() == [
        {"steps": 1, "seconds": 0.5, "samples": 4, "age": 3.0, "loss": 3.0, "loss_min": 3.0, "loss_max": 3.0,
         "lr": 0.01, "tokens": 64},
        {"steps": 1, "seconds": 0.5, "samples": 4, "age": 2.0, "loss": 2.0, "loss_min": 2.0, "loss_max": 2.0,
         "lr": 0.01, "tokens": 64},
        {"steps": 1, "seconds": 0.5, "samples": 4, "age": 1.0, "loss": 1.0, "loss_min": 1.0, "loss_max": 1.0,
         "lr": 0.01, "tokens": 64},
    ]  # fmt: skip
    assert summary.take() == []  # taken: forgotten


def test_ten_thousand_steps_fit_in_the_bound_and_keep_their_totals():
    summary = StepSummary(clock=lambda: 0.0)
    for step in range(10_000):
        summary.add({"loss": float(step % 10), "step_time": 0.25, "lr": 0.5}, batch_size=2)

    points = summary.take()

    assert len(points) <= MAX_POINTS
    assert sum(point["steps"] for point in points) == 10_000
    assert sum(point["samples"] for point in points) == 20_000
    assert sum(point["seconds"] for point in points) == pytest.approx(2500.0)
    assert {point["steps"] for point in points[:-1]} == {256}  # uniform buckets
    assert all(point["loss_min"] == 0.0 and point["loss_max"] == 9.0 for point in points[:-1])
    assert points[0]["loss"] == (25 * 45 + 15) / 256  # steps 0..255: 25 cycles of 0..9, then 0..5
    assert all("tokens" not in point for point in points)  # no step said


@pytest.mark.parametrize(
    "status",
    [
        {"loss": float("nan"), "step_time": float("inf"), "lr": "x", "tokens": -1},
        {"loss": 10**400, "tokens": True},
    ],
)
def test_values_that_are_not_numbers_are_left_out(status):
    summary = StepSummary(clock=lambda: 0.0)
    summary.add(status, batch_size=1)

    assert summary.take() == [{"steps": 1, "seconds": 0.0, "samples": 1, "age": 0.0}]
