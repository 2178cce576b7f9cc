"""Performance-aware sync: the projection against hand-worked cases (reference §6.3), and the control plane
using it for a job with a sample target."""

from __future__ import annotations

import copy
import uuid

import pytest

from apps.jobs import services as job_services
from apps.jobs import sync, training
from apps.jobs.models import Task
from tests.apps.jobs.test_training import (
    SPEC,
    create_running_job,
    ready,
    status,
    task_of,
)
from worker_daemon import protocol

# --- the projection ------------------------------------------------------------------------------------------


class Tracker:
    """What the control plane keeps per trainer, on a millisecond clock, for hand-worked examples: each
    report updates the interval estimate as :mod:`apps.jobs.training` does and runs the projection."""

    def __init__(self, batch_sizes: dict[str, int], target: int) -> None:
        self.batch_sizes = batch_sizes
        self.counter = target
        self.last = dict.fromkeys(batch_sizes, 0.0)
        self.interval: dict[str, float | None] = dict.fromkeys(batch_sizes)
        self.steps = dict.fromkeys(batch_sizes, 0)
        self.scheduled: set[str] = set()

    def report(self, key: str, now: float) -> dict:
        first = self.steps[key] == 0
        self.interval[key] = sync.next_interval(
            self.interval[key], now - self.last[key], first_of_round=first
        )
        self.last[key] = now
        self.steps[key] += 1
        self.counter = max(0, self.counter - self.batch_sizes[key])
        if key in self.scheduled:
            return {"type": "Continue"}
        trainers = [
            sync.Trainer(key=name, batch_size=size, last_report=self.last[name], interval=self.interval[name])
            for name, size in self.batch_sizes.items()
        ]
        projection = sync.project(trainers, to_go=self.counter, now=now, horizon=10_000.0)
        if not projection.reaches_target:
            return {"type": "Continue"}
        self.scheduled.add(key)
        return {"type": "ScheduleUpdate", "counter": projection.steps[key]}


def test_the_worked_example_of_the_original():
    """Reference §6.3: target 800; batch sizes 150, 100, 50; the replies of the original's test."""
    tracker = Tracker({"w1": 150, "w2": 100, "w3": 50}, target=800)
    table = [
        (500, "w3", 750, {"type": "Continue"}),
        (800, "w2", 650, {"type": "Continue"}),
        (950, "w1", 500, {"type": "Continue"}),
        (1000, "w3", 450, {"type": "ScheduleUpdate", "counter": 2}),
        (1500, "w3", 400, {"type": "Continue"}),
        (1600, "w2", 300, {"type": "ScheduleUpdate", "counter": 1}),
        (1900, "w1", 150, {"type": "ScheduleUpdate", "counter": 0}),
    ]
    for now, key, counter, reply in table:
        assert tracker.report(key, now) == reply, (now, key)
        assert tracker.counter == counter


def test_the_projection_at_the_fourth_report_of_the_worked_example():
    trainers = [
        sync.Trainer("w1", 150, last_report=950, interval=950),
        sync.Trainer("w2", 100, last_report=800, interval=800),
        sync.Trainer("w3", 50, last_report=1000, interval=500),
    ]
    projection = sync.project(trainers, to_go=450, now=1000, horizon=10_000)
    assert projection == sync.Projection(time=1400, to_go=0, steps={"w1": 1, "w2": 2, "w3": 2}, capped=False)


def test_the_step_cap_holds_even_when_the_target_is_reached_by_the_same_reports():
    trainers = [sync.Trainer("a", 10, last_report=0, interval=100)]
    projection = sync.project(trainers, to_go=30, now=0, steps_cap=3)
    assert projection.to_go == 0 and projection.capped and not projection.reaches_target


def test_reports_due_at_the_same_time_fire_together():
    trainers = [
        sync.Trainer("a", 10, last_report=0, interval=100),
        sync.Trainer("b", 10, last_report=0, interval=100),
    ]
    projection = sync.project(trainers, to_go=20, now=0)
    assert projection.steps == {"a": 1, "b": 1} and projection.reaches_target


def test_a_round_that_runs_longer_than_the_original_cap_still_schedules():
    """The original compares its 10 s cap with the time since the round started: once a round is older than
    that, no update is ever scheduled. Here the horizon counts from now."""
    trainers = [
        sync.Trainer("a", 8, last_report=3_600.0, interval=2.0),
        sync.Trainer("b", 8, last_report=3_599.0, interval=2.0),
    ]
    projection = sync.project(trainers, to_go=16, now=3_600.0, horizon=10.0)
    assert projection.reaches_target and projection.steps == {"a": 1, "b": 1}


def test_the_horizon_caps_a_projection_whose_steps_are_far_ahead():
    trainers = [sync.Trainer("slow", 8, last_report=0.0, interval=400.0)]
    assert sync.project(trainers, to_go=8, now=0.0, horizon=300.0).capped
    assert sync.project(trainers, to_go=8, now=0.0, horizon=500.0).reaches_target


def test_a_trainer_that_has_not_reported_never_fires_unless_its_interval_is_seeded():
    silent = sync.Trainer("new", 8, last_report=0.0, interval=None)
    busy = sync.Trainer("busy", 8, last_report=0.0, interval=1.0)
    projection = sync.project([silent, busy], to_go=16, now=0.0)
    assert projection.steps == {"new": 0, "busy": 2} and projection.reaches_target
    assert sync.project([silent], to_go=8, now=0.0).capped  # nobody can fire: nothing is known

    seeded = sync.seed_intervals(
        {"new": None, "busy": 1.0}, scores={"new": 50.0, "busy": 100.0}, batch_sizes={"new": 8, "busy": 8}
    )
    assert seeded == {"new": 2.0, "busy": 1.0}  # half the benchmark score: twice the step time
    trainers = [sync.Trainer("new", 8, 0.0, seeded["new"]), busy]
    assert sync.project(trainers, to_go=24, now=0.0).steps == {"new": 1, "busy": 2}


def test_seeding_scales_by_batch_size_and_needs_scores():
    intervals = {"a": 1.0, "b": None, "c": None}
    seeded = sync.seed_intervals(
        intervals, scores={"a": 100.0, "b": 100.0, "c": None}, batch_sizes={"a": 4, "b": 8, "c": 4}
    )
    assert seeded == {"a": 1.0, "b": 2.0, "c": None}
    assert sync.seed_intervals({"a": None}, scores={"a": 1.0}, batch_sizes={"a": 1}) == {"a": None}


def test_the_interval_estimate_ignores_the_merge_once_it_knows_the_step_time():
    assert sync.next_interval(None, 5.0, first_of_round=True) == 5.0  # nothing better known yet
    assert sync.next_interval(1.0, 30.0, first_of_round=True) == 1.0  # includes the merge: ignored
    assert sync.next_interval(1.0, 2.0, first_of_round=False) == pytest.approx(1.0 + sync.SMOOTHING)
    assert sync.next_interval(1.0, float("nan"), first_of_round=False) == 1.0
    assert sync.next_interval(1.0, -3.0, first_of_round=False) == 1.0


def test_due_in_is_the_last_trainers_projected_finish():
    trainers = [sync.Trainer("a", 4, last_report=10.0, interval=1.0), sync.Trainer("b", 4, 9.0, 3.0)]
    assert sync.due_in(trainers, remaining_steps={"a": 2, "b": 1}, now=10.5, default=2) == pytest.approx(1.5)
    assert sync.due_in(trainers, remaining_steps={"a": 2}, now=10.5, default=2) == pytest.approx(4.5)
    unknown = [*trainers, sync.Trainer("c", 4, 10.0, None)]
    assert sync.due_in(unknown, remaining_steps={}, now=10.5, default=2) is None


def test_steps_before_the_end_game_fit_the_fleets_pace_and_the_limit():
    fast = sync.Trainer("fast", 4, last_report=0.0, interval=1.0)
    slow = sync.Trainer("slow", 4, last_report=0.0, interval=2.0)
    # the fleet reports 4/1 + 4/2 = 6 samples/s: 30 samples of slack last 5 s
    assert sync.steps_before([fast, slow], key="fast", slack=30, limit=60) == 5
    assert sync.steps_before([fast, slow], key="slow", slack=30, limit=60) == 2
    assert sync.steps_before([fast, slow], key="fast", slack=30, limit=2) == 2
    assert sync.steps_before([fast, slow], key="fast", slack=0, limit=60) == 0
    unknown = sync.Trainer("new", 4, last_report=0.0, interval=None)
    assert sync.steps_before([fast, unknown], key="fast", slack=40, limit=60) == 5  # new counted as fast
    assert sync.steps_before([fast, unknown], key="new", slack=40, limit=60) == 0


# --- the control plane with a sample target ----------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(training.status, "sync_clock", fake)
    return fake


@pytest.fixture
def adaptive_job(job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings):
    settings.HYPHA_OFFER_WINDOW = 60.0  # the offers settle the adverts; a busy machine must not close it
    spec = copy.deepcopy(SPEC)
    spec["rounds"] = {"update_rounds": 2, "avg_samples_between_updates": 40, "round_timeout": 30.0}
    return create_running_job(spec, job_owner, online_rigs, django_capture_on_commit_callbacks)


STEP = {"status": {"batch_size": 4, "loss": 2.0, "step_time": 0.5}}


@pytest.mark.django_db
def test_a_fast_and_a_slow_trainer_are_told_to_finish_together(adaptive_job, online_rigs, clock):
    """Hand-worked: target 40 samples, batch 4; rig-a steps every 1 s, rig-b every 2 s. Fixed H would be 5
    steps each (rig-a done at 5 s, rig-b at 10 s); here rig-a runs 7 steps and rig-b 3, done at 7 s and 6 s."""
    rig_a, rig_b, rig_c = online_rigs
    ready(adaptive_job, rig_c)
    fast, slow = task_of(adaptive_job, rig_a), task_of(adaptive_job, rig_b)
    start = clock.now
    training.task_started(rig_a, fast.pk)
    training.task_started(rig_b, slow.pk)

    def at(seconds: float, rig, task) -> dict:
        clock.now = start + seconds
        return status(rig, task, STEP)

    continue_ = {"type": "Continue"}
    assert at(1, rig_a, fast) == continue_
    assert at(2, rig_a, fast) == continue_
    assert at(2, rig_b, slow) == continue_
    assert at(3, rig_a, fast) == continue_
    assert at(4, rig_a, fast) == continue_
    assert at(4, rig_b, slow) == continue_  # 16 to go: projected, but rig-a would need a third step
    assert at(5, rig_a, fast) == {"type": "ScheduleUpdate", "counter": 2}  # 12 to go: a at 6 and 7, b at 6
    assert at(6, rig_a, fast) == continue_
    assert at(6, rig_b, slow) == {"type": "ScheduleUpdate", "counter": 0}
    assert at(7, rig_a, fast) == continue_  # rig-a's counter: 2 → 1 → 0, its last step
    fast.refresh_from_db()
    slow.refresh_from_db()
    assert (fast.steps_in_round, fast.update_due, fast.samples_in_round) == (7, 7, 28)
    assert (slow.steps_in_round, slow.update_due, slow.samples_in_round) == (3, 3, 12)
    assert fast.step_interval == pytest.approx(1.0) and slow.step_interval == pytest.approx(2.0)


@pytest.mark.django_db
def test_the_samples_of_a_trainer_that_sent_its_update_still_count(adaptive_job, online_rigs, clock):
    """rig-a has sent its update (28 of the 40 samples); rig-b must stop once it brings the last 12, not run
    on as if the round had only its own samples."""
    rig_a, rig_b, rig_c = online_rigs
    ready(adaptive_job, rig_c)
    fast, slow = task_of(adaptive_job, rig_a), task_of(adaptive_job, rig_b)
    training.task_started(rig_b, slow.pk)
    Task.objects.filter(pk=fast.pk).update(
        sync_state=Task.Sync.UPDATING, samples_in_round=28, steps_in_round=7
    )
    replies = []
    for seconds in (2, 4, 6):
        clock.now += seconds
        replies.append(status(rig_b, slow, STEP))
    # 28 + 4 = 32: two more steps of 4 (every 2 s) bring the last 8 (counting only its own 4, it would run on)
    assert replies == [{"type": "ScheduleUpdate", "counter": 2}, {"type": "Continue"}, {"type": "Continue"}]


@pytest.mark.django_db
def test_the_parameter_server_is_told_whom_to_expect_and_when(adaptive_job, online_rigs, clock):
    rig_a, rig_b, rig_c = online_rigs
    ready(adaptive_job, rig_c)
    fast, slow = task_of(adaptive_job, rig_a), task_of(adaptive_job, rig_b)
    server = task_of(adaptive_job, rig_c)
    start = clock.now
    training.task_started(rig_a, fast.pk)
    training.task_started(rig_b, slow.pk)
    for seconds, rig, task in [(1, rig_a, fast), (2, rig_a, fast), (2, rig_b, slow), (3, rig_a, fast)]:
        clock.now = start + seconds
        status(rig, task, STEP)
    # Nobody is scheduled yet: rig-a 3 s, rig-b 1 step later... due when each ran STEPS_CAP - 1 more steps.
    clock.now = start + 3.5
    reply = status(rig_c, server, {"waiting": {"round": 1}})
    assert reply["type"] == "Expect"
    assert reply["peers"] == sorted([str(rig_a.pk), str(rig_b.pk)])
    assert reply["due_in"] == pytest.approx(2 + 2 * 2.0 - 3.5)  # rig-b: last at 2 s, two steps of 2 s
    # and what each trainer's update may claim: the samples counted for it this round (3 and 1 steps of 4)
    assert reply["samples"] == {str(rig_a.pk): 12, str(rig_b.pk): 4}

    slow.finish(Task.Status.FAILED, exit_code=1)  # a trainer that died is not waited for
    reply = status(rig_c, server, {"waiting": {"round": 1}})
    assert reply["peers"] == [str(rig_a.pk)] and reply["due_in"] == pytest.approx(3 + 2 * 1.0 - 3.5)

    # a trainer a round behind (left out of the last one): nobody can say when it will be done
    Task.objects.filter(pk=fast.pk).update(round=0)
    reply = status(rig_c, server, {"waiting": {"round": 2}})
    assert reply["peers"] == [str(rig_a.pk)] and reply["due_in"] is None

    assert status(rig_c, server, {"waiting": {"round": 0}}) == {"type": "Error"}
    assert status(rig_c, server, {"waiting": "soon"}) == {"type": "Error"}


@pytest.mark.django_db
def test_without_any_step_time_the_parameter_server_keeps_its_timeout(adaptive_job, online_rigs, clock):
    _rig_a, _rig_b, rig_c = online_rigs
    ready(adaptive_job, rig_c)
    reply = status(rig_c, task_of(adaptive_job, rig_c), {"waiting": {"round": 1}})
    assert reply["type"] == "Expect" and reply["due_in"] is None and len(reply["peers"]) == 2


@pytest.mark.django_db
def test_a_slow_workers_benchmark_score_counts_before_it_reports(adaptive_job, online_rigs, clock):
    """rig-b has not reported yet, but its benchmark says it is 4x slower than rig-a: its first step is
    projected 4 s out, and rig-a is told to run on rather than stop at once."""
    rig_a, rig_b, rig_c = online_rigs
    type(rig_a).objects.filter(pk=rig_a.pk).update(benchmark_score=400.0)
    type(rig_b).objects.filter(pk=rig_b.pk).update(benchmark_score=100.0)
    ready(adaptive_job, rig_c)
    fast, slow = task_of(adaptive_job, rig_a), task_of(adaptive_job, rig_b)
    start = clock.now
    training.task_started(rig_a, fast.pk)
    training.task_started(rig_b, slow.pk)
    replies = []
    for seconds in range(1, 9):
        clock.now = start + seconds
        replies.append(status(rig_a, fast, STEP))
    # 32 samples from rig-a alone; rig-b's first step is due at 4 s (seeded), its second at 8 s.
    assert {"type": "ScheduleUpdate", "counter": 0} not in replies[:6]
    scheduled = [reply for reply in replies if reply["type"] == "ScheduleUpdate"]
    assert len(scheduled) == 1


# --- steps the daemon answers itself -------------------------------------------------------------------------


def report(worker, task: Task, progress) -> protocol.StatusReply:
    message = protocol.StatusReport(request_id=uuid.uuid4(), task_id=task.pk, progress=progress)
    return job_services.status_reported(worker=worker, message=message)


@pytest.mark.django_db
def test_with_fixed_h_every_step_but_the_last_is_answered_by_the_daemon(
    job_owner,
    online_rigs,
    data_node,
    sent,
    django_capture_on_commit_callbacks,
    settings,
):
    settings.HYPHA_OFFER_WINDOW = 60.0  # the offers settle the adverts; a busy machine must not close it
    spec = copy.deepcopy(SPEC)
    spec["rounds"] = {"update_rounds": 2, "inner_steps": 10, "round_timeout": 30.0}
    job = create_running_job(spec, job_owner, online_rigs, django_capture_on_commit_callbacks)
    rig_a, _rig_b, rig_c = online_rigs
    ready(job, rig_c)
    task = task_of(job, rig_a)

    first = report(rig_a, task, STEP)
    assert (first.reply, first.continue_for) == ({"type": "Continue"}, 8)  # steps 2…9 need no answer
    # the daemon claims more covered steps than it was granted: only the grant counts
    covering = {"status": {"batch_size": 4, "covered_steps": 50, "covered_samples": 10_000}}
    last = report(rig_a, task, covering)
    assert (last.reply, last.continue_for) == ({"type": "ScheduleUpdate", "counter": 0}, 0)
    task.refresh_from_db()
    assert (task.steps_in_round, task.samples_in_round, task.steps_total) == (10, 40, 10)


@pytest.mark.django_db
def test_with_a_sample_target_the_grant_shrinks_to_nothing_near_the_end(adaptive_job, online_rigs, clock):
    """Target 40 samples of batch 4: far from it the fast trainer may run on unasked for as long as the
    fleet cannot get within two steps each of the end; near it, every step is reported again."""
    rig_a, rig_b, rig_c = online_rigs
    job = adaptive_job
    spec = dict(job.spec)
    spec["rounds"] = {**spec["rounds"], "avg_samples_between_updates": 400}
    type(job).objects.filter(pk=job.pk).update(spec=spec)
    training.plans._plans.clear()
    ready(job, rig_c)
    fast, slow = task_of(job, rig_a), task_of(job, rig_b)
    start = clock.now
    training.task_started(rig_a, fast.pk)
    training.task_started(rig_b, slow.pk)
    clock.now = start + 1
    # rig-b's pace is unknown: counted as fast as rig-a's (1 s), the fleet reports 8 samples/s
    assert report(rig_a, fast, STEP).continue_for == int(training.MAX_CONTINUE_SECONDS / 1.0)
    clock.now = start + 2
    report(rig_b, slow, STEP)  # rig-b: 2 s a step
    clock.now = start + 2
    granted = report(rig_a, fast, STEP)
    # 400 - 12 reported = 388 to go, 16 kept as margin; the fleet reports 4/1 + 4/2 = 6 samples/s, so the
    # round is 62 s from its end game, capped at MAX_CONTINUE_SECONDS: two steps of 1 s.
    assert granted.continue_for == int(training.MAX_CONTINUE_SECONDS / 1.0)
    fast.refresh_from_db()
    assert fast.continue_granted == granted.continue_for

    # near the end: this report (the 3 granted steps) leaves 8 samples to go: rig-a (now 0.8 s a step) does
    # one more at 3.8 s and rig-b one at 4 s; the last step of rig-a needs its answer
    Task.objects.filter(pk=fast.pk).update(samples_in_round=320)
    Task.objects.filter(pk=slow.pk).update(samples_in_round=60)
    clock.now = start + 3
    near = report(rig_a, fast, {"status": {"batch_size": 4, "covered_steps": 3, "covered_samples": 12}})
    assert (near.reply, near.continue_for) == ({"type": "ScheduleUpdate", "counter": 1}, 0)
