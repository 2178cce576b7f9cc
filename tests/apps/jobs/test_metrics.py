"""Per-step metrics: trainers' step reports land in a bounded series per trainer, served by
``GET /api/jobs/{id}/metrics/`` (docs/dashboard.md, "Per-step metrics and the run charts")."""

from __future__ import annotations

import math

import pytest
from rest_framework.test import APIClient

from apps.jobs import metrics
from apps.jobs.models import MetricSeries, Task
from apps.jobs.training import status as training_status
from tests.apps.jobs.test_training import SPEC, create_running_job, ready, status, task_of
from worker_daemon.bridge.remote.step_summary import StepSummary


@pytest.fixture
def running_job(job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings):
    """A DiLoCo job (fixed H = 3, two trainers) whose leases are all ACTIVE."""
    settings.HYPHA_OFFER_WINDOW = 60.0
    return create_running_job(SPEC, job_owner, online_rigs, django_capture_on_commit_callbacks)


def client_of(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user=user)
    return client


def series_of(task) -> list[tuple]:
    return metrics.stored_points(MetricSeries.objects.get(task=task))


@pytest.fixture
def clock(monkeypatch):
    """The sync protocol's clock, driven by the test: 1000.0, then 1 s more per report."""
    now = [1000.0]

    def tick() -> float:
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(training_status, "sync_clock", tick)
    return now


# --- the status path -----------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_each_step_report_becomes_a_point_of_its_trainers_series(running_job, online_rigs, clock):
    # given
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    task = task_of(running_job, rig_a)

    # when: three steps, as the executor reports them (with lr and tokens)
    for loss in (3.0, 2.5, 2.0):
        status(
            rig_a,
            task,
            {"status": {"batch_size": 4, "loss": loss, "step_time": 0.5, "lr": 0.001, "tokens": 256}},
        )

    # then
    points = series_of(task)
    assert [point[0] for point in points] == [1, 2, 3]
    assert [point[2] for point in points] == [1, 1, 1]
    assert [point[3] for point in points] == [3.0, 2.5, 2.0]
    assert [round(point[6], 6) for point in points] == [0.001] * 3
    assert [point[7] for point in points] == [8.0] * 3  # 4 samples in 0.5 s
    assert [point[8] for point in points] == [512.0] * 3  # 256 tokens in 0.5 s
    assert [point[1] for point in points] == [1001.0, 1002.0, 1003.0]  # the control plane's clock


@pytest.mark.django_db
def test_the_steps_a_daemon_answered_itself_arrive_as_its_summary(running_job, online_rigs, clock):
    # given: fixed H = 3; after the first step the daemon may answer one step itself
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    task = task_of(running_job, rig_a)
    status(rig_a, task, {"status": {"batch_size": 4, "loss": 3.0, "step_time": 0.5}})

    # when: the forwarded third step carries the second (answered locally) as covered_points
    summary = [
        {"steps": 1, "loss": 2.6, "loss_min": 2.6, "loss_max": 2.6, "lr": 0.002, "seconds": 0.25, "samples": 4,
         "tokens": 100, "age": 0.5}
    ]  # fmt: skip
    reply = status(
        rig_a,
        task,
        {"status": {"batch_size": 4, "loss": 2.2, "step_time": 0.5, "covered_steps": 2, "covered_samples": 8,
                    "covered_points": summary}},
    )  # fmt: skip

    # then
    assert reply == {"type": "ScheduleUpdate", "counter": 0}
    points = series_of(task)
    assert [point[0] for point in points] == [1, 2, 3]
    assert [round(point[3], 4) for point in points] == [3.0, 2.6, 2.2]
    assert points[1][1] == points[2][1] - 0.5  # timed by its age before the report
    assert points[1][7] == 16.0 and points[1][8] == 400.0


@pytest.mark.django_db
def test_a_daemons_summary_of_many_steps_is_taken_as_it_sends_it(running_job, online_rigs, clock):
    # given: a daemon that answered 1,000 steps itself (the real summary, worker_daemon's StepSummary)
    rig_a = online_rigs[0]
    task = task_of(running_job, rig_a)
    summary = StepSummary(clock=lambda: 0.0)
    for step in range(1, 1001):
        summary.add({"loss": 1000.0 / step, "lr": 0.01, "step_time": 0.5, "tokens": 32}, batch_size=4)
    body = {"batch_size": 4, "loss": 0.5, "step_time": 0.5, "covered_points": summary.take()}

    # when: the control plane counted them all (as status_reported does within the grant)
    metrics.record_step_report(task, body, first_step=1, last_step=1001, now=5000.0)

    # then
    points = series_of(task)
    assert len(points) <= 65 and sum(point[2] for point in points) == 1001
    assert points[-1][0] == 1001 and points[0][0] == 16
    assert points[0][4] == pytest.approx(1000.0 / 16) and points[0][5] == 1000.0
    assert {point[7] for point in points} == {8.0}
    assert {point[8] for point in points[:-1]} == {64.0}  # the report itself said no tokens


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body",
    [
        {"batch_size": 4, "loss": math.nan, "step_time": math.inf, "lr": -1},
        {"batch_size": 4, "loss": 1e300, "step_time": "fast", "lr": 1e300, "tokens": 10**40},
        {"batch_size": True, "loss": "low", "tokens": -5, "step_time": -1.0},
        {"batch_size": 10**400, "loss": -(10**400), "tokens": 10**400, "step_time": 0.5, "lr": 10**400},
        {"batch_size": 4, "loss": 2.0, "covered_steps": 10**12, "covered_points": [{"steps": 10**12}]},
        {"batch_size": 4, "loss": 2.0, "covered_points": [{"steps": 1, "loss": 1.0}] * 65},
        {"batch_size": 4, "loss": 2.0, "covered_points": ["x", None, {"steps": -3}]},
        {"batch_size": 4, "loss": 2.0, "covered_points": {"steps": 5}},
    ],
)
def test_garbage_in_a_step_report_is_stored_as_nothing_and_never_bends_the_series(
    running_job, online_rigs, clock, body
):
    # given: one good step
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    task = task_of(running_job, rig_a)
    status(rig_a, task, {"status": {"batch_size": 4, "loss": 3.0, "step_time": 0.5}})
    # Its daemon holds no grant (fixed H would give it one): a claimed covered_steps counts for nothing.
    Task.objects.filter(pk=task.pk).update(continue_granted=0)

    # when
    reply = status(rig_a, task, {"status": body})

    # then: the report counts as one step (no grant was given), and its values are missing or its own
    assert reply["type"] == "Continue"
    points = series_of(task)
    assert [point[0] for point in points] == [1, 2]
    assert points[0][3] == 3.0
    for value in points[1][3:]:
        assert math.isnan(value) or value in (2.0,)
    response = client_of(running_job.owner).get(f"/api/jobs/{running_job.pk}/metrics/")
    assert response.status_code == 200
    assert response.json()["trainers"][0]["points"]["step"] == [1, 2]


@pytest.mark.django_db
def test_a_status_that_is_not_an_object_counts_a_step_with_no_values(running_job, online_rigs, clock):
    rig_a, _rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    task = task_of(running_job, rig_a)

    assert status(rig_a, task, {"status": 7}) == {"type": "Continue"}

    (point,) = series_of(task)
    assert point[0] == 1 and all(math.isnan(value) for value in point[3:])


# --- the bound -----------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_100000_step_job_stores_at_most_80000_bytes_per_trainer(running_job, online_rigs, settings):
    # given: the default bound, and a trainer whose daemon summarises 99 steps per forwarded report
    assert settings.HYPHA_METRICS_MAX_POINTS == 2000
    task = task_of(running_job, online_rigs[0])
    summary = [{"steps": 1, "loss": 1.0, "seconds": 0.1, "samples": 4}] * 63 + [
        {"steps": 36, "loss": 1.0, "seconds": 3.6, "samples": 144}
    ]

    # when: 100,000 steps, 1,000 reports of 100
    for report in range(1000):
        metrics.record_step_report(
            task,
            {"batch_size": 4, "loss": 5.0 - report / 1000, "step_time": 0.1, "covered_points": summary},
            first_step=report * 100 + 1,
            last_step=report * 100 + 100,
            now=2000.0 + report,
        )

    # then
    series = MetricSeries.objects.get(task=task)
    stored = bytes(series.points) + bytes(series.tail)
    points = metrics.stored_points(series)
    assert len(stored) <= 80_000 and len(stored) == 40 * len(points)
    assert 1000 <= len(points) <= 2000
    assert series.steps == 100_000
    assert points[-1][0] == 100_000
    assert sum(point[2] for point in points) == 100_000  # every step counted once
    assert [point[0] for point in points] == sorted({point[0] for point in points})  # strictly increasing
    # merged buckets keep the extremes: the reports' own losses (5.0 down to 4.001) and the summaries' 1.0
    assert min(point[4] for point in points) == 1.0 and max(point[5] for point in points) == 5.0
    assert all(point[4] == 1.0 for point in points[:-1])


@pytest.mark.django_db
def test_a_step_report_writes_only_the_tail_until_it_is_full(running_job, online_rigs):
    task = task_of(running_job, online_rigs[0])

    def report(step: int) -> MetricSeries:
        body = {"batch_size": 4, "loss": 1.0, "step_time": 0.1}
        metrics.record_step_report(task, body, first_step=step, last_step=step, now=float(step))
        return MetricSeries.objects.get(task=task)

    for step in range(1, metrics.TAIL_POINTS):
        series = report(step)
    assert (len(bytes(series.points)), len(bytes(series.tail))) == (0, 40 * (metrics.TAIL_POINTS - 1))
    series = report(metrics.TAIL_POINTS)  # the tail is full: moved into the body
    assert (len(bytes(series.points)), len(bytes(series.tail))) == (40 * metrics.TAIL_POINTS, 0)
    series = report(metrics.TAIL_POINTS + 1)
    assert (len(bytes(series.points)), len(bytes(series.tail))) == (40 * metrics.TAIL_POINTS, 40)
    assert [point[0] for point in metrics.stored_points(series)] == list(range(1, metrics.TAIL_POINTS + 2))


def test_one_step_points_are_merged_into_uniform_buckets():
    # given/when: 100,000 one-step points, a bound of 2,000
    points: list = []
    stride = 1
    for step in range(1, 100_001):
        points, stride = metrics.append(
            points, [(step, float(step), 1, float(step), float(step), float(step), 0.1, 1.0, 2.0)],
            stride=stride, max_points=2000,
        )  # fmt: skip

    # then
    assert len(points) <= 2000 and len(metrics.pack(points)) <= 80_000
    assert stride == 64
    assert {point[2] for point in points[:-1]} == {64}  # uniform resolution
    assert points[0][0] == 64 and points[0][3] == pytest.approx(32.5)
    assert (points[0][4], points[0][5]) == (1.0, 64.0)
    assert sum(point[2] for point in points) == 100_000


# --- the API -------------------------------------------------------------------------------------------------


@pytest.fixture
def two_trainers_reported(running_job, online_rigs, clock):
    rig_a, rig_b, rig_c = online_rigs
    ready(running_job, rig_c)
    for rig, losses in ((rig_a, (4.0, 3.0)), (rig_b, (2.0, None))):
        for loss in losses:
            body = {"batch_size": 4, "step_time": 0.5, **({"loss": loss} if loss is not None else {})}
            status(rig, task_of(running_job, rig), {"status": body})
    return running_job


@pytest.mark.django_db
def test_the_owner_gets_each_trainers_series_and_their_mean(two_trainers_reported, online_rigs):
    job = two_trainers_reported
    rig_a, rig_b, _ = online_rigs

    response = client_of(job.owner).get(f"/api/jobs/{job.pk}/metrics/")

    assert response.status_code == 200
    body = response.json()
    assert (body["job"], body["status"], body["final"], body["max_points"]) == (
        str(job.pk),
        "running",
        False,
        2000,
    )
    by_worker = {trainer["worker"]: trainer for trainer in body["trainers"]}
    assert set(by_worker) == {rig_a.name, rig_b.name}
    assert by_worker[rig_a.name]["points"]["loss"] == [4.0, 3.0]
    assert by_worker[rig_b.name]["points"]["loss"] == [2.0, None]
    assert by_worker[rig_a.name]["points"]["samples_per_second"] == [8.0, 8.0]
    assert by_worker[rig_a.name]["points"]["tokens_per_second"] == [None, None]
    assert by_worker[rig_a.name]["task"] == str(task_of(job, rig_a).pk)
    assert body["mean"] == {"step": [1, 2], "loss": [3.0, 3.0], "trainers": [2, 1]}
    assert body["rounds"] == []


@pytest.mark.django_db
def test_one_trainer_and_fewer_points_on_request(two_trainers_reported, online_rigs):
    job = two_trainers_reported
    rig_a = online_rigs[0]
    client = client_of(job.owner)

    by_worker = client.get(f"/api/jobs/{job.pk}/metrics/?trainer={rig_a.pk}").json()
    by_task = client.get(f"/api/jobs/{job.pk}/metrics/?trainer={task_of(job, rig_a).pk}&max_points=10").json()

    assert [trainer["worker"] for trainer in by_worker["trainers"]] == [rig_a.name]
    assert by_task["trainers"] == by_worker["trainers"]
    assert by_worker["mean"]["loss"] == [4.0, 3.0]


@pytest.mark.django_db
def test_max_points_merges_each_series_down(running_job, online_rigs):
    task = task_of(running_job, online_rigs[0])
    for step in range(1, 101):
        metrics.record_step_report(
            task,
            {"batch_size": 4, "loss": float(step), "step_time": 1.0},
            first_step=step,
            last_step=step,
            now=1.0,
        )

    body = client_of(running_job.owner).get(f"/api/jobs/{running_job.pk}/metrics/?max_points=10").json()

    (trainer,) = body["trainers"]
    assert len(trainer["points"]["step"]) <= 10 and trainer["stride"] == 16
    assert trainer["points"]["step"][-1] == 100
    assert sum(trainer["points"]["count"]) == 100


@pytest.mark.django_db
@pytest.mark.parametrize(
    "query", ["max_points=9", "max_points=10001", "max_points=ten", "max_points=-5", "trainer=" + "x" * 65]
)
def test_bad_parameters_are_a_400(two_trainers_reported, query):
    response = client_of(two_trainers_reported.owner).get(
        f"/api/jobs/{two_trainers_reported.pk}/metrics/?{query}"
    )
    assert response.status_code == 400


@pytest.mark.django_db
def test_another_users_job_is_a_404_and_anonymous_is_refused(two_trainers_reported, bob, anonymous):
    url = f"/api/jobs/{two_trainers_reported.pk}/metrics/"
    assert bob.client.get(url).status_code == 404
    assert anonymous.get(url).status_code in (401, 403)


@pytest.mark.django_db
def test_rounds_carry_eval_loss_and_bytes(two_trainers_reported, online_rigs):
    job = two_trainers_reported
    rig_c = online_rigs[2]
    status(
        rig_c,
        task_of(job, rig_c),
        {"round": {"round": 1, "participants": [], "samples": 8, "bytes_in": 4096, "bytes_out": 2048,
                   "eval_loss": 2.75, "duration": 1.5}},
    )  # fmt: skip

    (round_,) = client_of(job.owner).get(f"/api/jobs/{job.pk}/metrics/").json()["rounds"]

    assert {
        key: round_[key] for key in ("number", "closed", "eval_loss", "bytes_in", "bytes_out", "samples")
    } == {
        "number": 1,
        "closed": True,
        "eval_loss": 2.75,
        "bytes_in": 4096,
        "bytes_out": 2048,
        "samples": 8,
    }
