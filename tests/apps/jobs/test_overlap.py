"""Overlap of communication with computation (``rounds.overlap``; docs/training.md, "Overlap: eager updates",
"Overlap: streaming"): the spec through the REST API and the TOML, what the trainer's and the parameter server's
job JSON say, and the sync protocol with an eager or streaming trainer that trains the next round while its
update is out (UPDATING)."""

from __future__ import annotations

import copy
import json
import uuid

import pytest
from channels.db import database_sync_to_async
from rest_framework.test import APIClient

from apps.jobs import services as job_services
from apps.jobs import training
from apps.jobs.models import Job, Task
from apps.jobs.spec import OVERLAPS_TRAINING_AHEAD, parse_json, parse_toml
from apps.jobs.spec_checks import size_problem
from tests.apps.jobs.test_api_diloco import SPEC as API_SPEC
from tests.apps.jobs.test_api_diloco import URL
from tests.apps.jobs.test_spec import HYPHA_DEFAULT_TOML, errors_of, lenet_json
from tests.apps.jobs.test_training import SPEC, create_running_job, dispatches, ready, status, task_of
from tests.apps.workers.test_transfer_problems import TIMEOUT, daemon_of  # noqa: F401 (a fixture)
from worker_daemon import protocol

CONTINUE = {"type": "Continue"}
STOP = {"type": "ScheduleUpdate", "counter": 0}
OK = {"type": "Ok"}
DONE = {"type": "Done"}
ERROR = {"type": "Error"}
STEP = {"status": {"batch_size": 4, "loss": 2.0, "step_time": 0.1}}


def covering(steps: int) -> dict:
    """A step report its daemon forwards after answering ``steps - 1`` granted ones itself."""
    return {"status": {"batch_size": 4, "loss": 1.5, "covered_steps": steps, "covered_samples": 4 * steps}}


def report(worker, task: Task, progress) -> tuple[dict, int]:
    """A status frame's reply as the gateway sends it back: (the reply, its ``continue_for``)."""
    message = protocol.StatusReport(request_id=uuid.uuid4(), task_id=task.pk, progress=progress)
    reply = job_services.status_reported(worker=worker, message=message)
    return reply.reply, reply.continue_for


def eager_spec(**rounds) -> dict:
    """Two rounds of H = 3, eager unless ``rounds`` say another overlap."""
    spec = copy.deepcopy(SPEC)
    spec["rounds"] = {
        "update_rounds": 2,
        "inner_steps": 3,
        "round_timeout": 30.0,
        "overlap": "eager",
        **rounds,
    }
    return spec


@pytest.fixture
def make_job(job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings):
    """A running job of a spec, its parameter server (rig-c) listening: rig-a and rig-b train."""
    settings.HYPHA_OFFER_WINDOW = 60.0

    def make(spec: dict) -> Job:
        job = create_running_job(spec, job_owner, online_rigs, django_capture_on_commit_callbacks)
        ready(job, online_rigs[2])
        return job

    return make


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


# --- the spec -------------------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)  # the allocation is queued on commit
def test_a_job_submitted_with_eager_overlap_keeps_it_in_its_spec(alice, data_node):
    spec = {
        **API_SPEC,
        "dataset": {"name": "tiny-text"},
        "rounds": {**API_SPEC["rounds"], "overlap": "eager"},
    }

    response = alice.client.post(URL, spec, format="json")

    assert response.status_code == 201, response.content
    assert response.json()["spec"]["rounds"]["overlap"] == "eager"
    assert Job.objects.get(pk=response.json()["id"]).spec["rounds"]["overlap"] == "eager"


def api_spec(**rounds) -> dict:
    """The API tests' spec on the registered dataset, with ``rounds`` set in its rounds."""
    return {**API_SPEC, "dataset": {"name": "tiny-text"}, "rounds": {**API_SPEC["rounds"], **rounds}}


@pytest.mark.django_db(transaction=True)  # the allocation is queued on commit
@pytest.mark.parametrize(
    ("rounds", "stored"),
    [
        ({"overlap": "streaming"}, {"overlap": "streaming", "fragments": None, "mix": None}),
        (
            {"overlap": "streaming", "fragments": 8, "mix": 0.25},
            {"overlap": "streaming", "fragments": 8, "mix": 0.25},
        ),
        (
            {"overlap": "streaming", "fragments": 2, "mix": 0},
            {"overlap": "streaming", "fragments": 2, "mix": 0},
        ),
        ({"overlap": "streaming", "fragments": 64}, {"overlap": "streaming", "fragments": 64, "mix": None}),
    ],
)
def test_a_job_submitted_with_streaming_overlap_keeps_it_and_its_options_in_its_spec(
    alice, data_node, rounds, stored
):
    response = alice.client.post(URL, api_spec(**rounds), format="json")

    assert response.status_code == 201, response.content
    shown = response.json()["spec"]["rounds"]
    assert {key: shown.get(key) for key in stored} == stored
    kept = Job.objects.get(pk=response.json()["id"]).spec["rounds"]
    assert {key: kept.get(key) for key in stored} == stored


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("overlap", "message"),
    [
        ("lazy", "Input should be 'none', 'eager' or 'streaming'"),
        (True, "Input should be 'none', 'eager' or 'streaming'"),
    ],
)
def test_an_overlap_that_is_not_built_is_a_400_at_its_field(alice, data_node, overlap, message):
    response = alice.client.post(URL, api_spec(overlap=overlap), format="json")

    assert response.status_code == 400
    assert response.json() == {"rounds.overlap": [message]}
    assert Job.objects.count() == 0


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("rounds", "errors"),
    [
        (
            {"overlap": "streaming", "fragments": 1, "mix": 1},
            {
                "rounds.fragments": ["Input should be greater than or equal to 2"],
                "rounds.mix": ["Input should be less than 1"],
            },
        ),
        (
            {"overlap": "streaming", "fragments": 65, "mix": -0.1},
            {
                "rounds.fragments": ["Input should be less than or equal to 64"],
                "rounds.mix": ["Input should be greater than or equal to 0"],
            },
        ),
        (
            {"overlap": "streaming", "fragments": 2.5, "mix": "half"},
            {
                "rounds.fragments": ["Input should be a valid integer"],
                "rounds.mix": ["Input should be a valid number"],
            },
        ),
        (
            {"overlap": "eager", "fragments": 8, "mix": 0.25},
            {
                "rounds.fragments": [
                    "fragments is an option of overlap = 'streaming' (this job's is eager)."
                ],
                "rounds.mix": ["mix is an option of overlap = 'streaming' (this job's is eager)."],
            },
        ),
        (
            {"overlap": "none", "fragments": 4},
            {"rounds.fragments": ["fragments is an option of overlap = 'streaming' (this job's is none)."]},
        ),
        (
            {"mix": 0.5},  # no overlap: none
            {"rounds.mix": ["mix is an option of overlap = 'streaming' (this job's is none)."]},
        ),
    ],
)
def test_streaming_options_out_of_range_or_without_streaming_are_a_400_at_their_fields(
    alice, data_node, rounds, errors
):
    response = alice.client.post(URL, api_spec(**rounds), format="json")

    assert response.status_code == 400
    assert response.json() == errors
    assert Job.objects.count() == 0


def test_the_toml_takes_the_overlap_in_its_rounds_table():
    text = HYPHA_DEFAULT_TOML.replace("[scheduler.job.rounds]", '[scheduler.job.rounds]\noverlap = "eager"')

    assert parse_toml(text).rounds.overlap == "eager"
    assert parse_toml(HYPHA_DEFAULT_TOML).rounds.overlap == "none"
    assert errors_of(parse_toml, text.replace('"eager"', '"lazy"')) == [
        {
            "field": "scheduler.job.rounds.overlap",
            "message": "Input should be 'none', 'eager' or 'streaming'",
        }
    ]


def test_the_toml_takes_streaming_and_its_fragments_and_mix_in_its_rounds_table():
    def rounds(lines: str) -> str:
        return HYPHA_DEFAULT_TOML.replace("[scheduler.job.rounds]", f"[scheduler.job.rounds]\n{lines}")

    defaults = parse_toml(rounds('overlap = "streaming"')).rounds
    given = parse_toml(rounds('overlap = "streaming"\nfragments = 8\nmix = 0.25')).rounds

    assert (defaults.overlap, defaults.fragments, defaults.mix) == ("streaming", None, None)
    assert (defaults.fragment_count, defaults.streaming_mix) == (4, 0.5)
    assert (given.overlap, given.fragments, given.mix, given.fragment_count, given.streaming_mix) == (
        "streaming",
        8,
        0.25,
        8,
        0.25,
    )


@pytest.mark.parametrize(
    ("lines", "errors"),
    [
        (
            'overlap = "streaming"\nfragments = 1\nmix = 1.0',
            [
                ("scheduler.job.rounds.fragments", "Input should be greater than or equal to 2"),
                ("scheduler.job.rounds.mix", "Input should be less than 1"),
            ],
        ),
        (
            'overlap = "eager"\nfragments = 8\nmix = 0.25',
            [
                (
                    "scheduler.job.rounds.fragments",
                    "fragments is an option of overlap = 'streaming' (this job's is eager).",
                ),
                (
                    "scheduler.job.rounds.mix",
                    "mix is an option of overlap = 'streaming' (this job's is eager).",
                ),
            ],
        ),
        (
            "fragments = 8",
            [
                (
                    "scheduler.job.rounds.fragments",
                    "fragments is an option of overlap = 'streaming' (this job's is none).",
                )
            ],
        ),
    ],
)
def test_the_tomls_streaming_options_are_checked_at_their_keys(lines, errors):
    text = HYPHA_DEFAULT_TOML.replace("[scheduler.job.rounds]", f"[scheduler.job.rounds]\n{lines}")

    found = errors_of(parse_toml, text)

    assert [(error["field"], error["message"]) for error in found] == errors


def test_a_json_spec_without_overlap_waits_for_each_round():
    assert parse_json(lenet_json()).rounds.overlap == "none"


@pytest.mark.django_db
def test_an_eager_trainer_is_told_the_mode_and_the_outer_optimizer_and_the_server_nothing(make_job, sent):
    # when
    eager = make_job(eager_spec())

    # then
    trainer, server = dispatches(sent)["trainer"], dispatches(sent)["parameter_server"]
    assert trainer.spec["executor"]["config"]["overlap"] == {
        "mode": "eager",
        "outer_learning_rate": 0.7,
        "outer_momentum": 0.9,
    }
    assert "overlap" not in json.dumps(server.spec)
    assert eager.spec["rounds"]["overlap"] == "eager"


@pytest.mark.django_db
def test_a_streaming_trainer_is_told_the_fragments_and_mix_and_the_server_the_fragments(make_job, sent):
    # when
    streaming = make_job(eager_spec(overlap="streaming", fragments=8, mix=0.25))

    # then
    trainer, server = dispatches(sent)["trainer"], dispatches(sent)["parameter_server"]
    assert trainer.spec["executor"]["config"]["overlap"] == {
        "mode": "streaming",
        "fragments": 8,
        "mix": 0.25,
        "rounds": 2,  # the last syncs every fragment
    }
    assert server.spec["executor"]["config"]["rounds"] == {
        "update_rounds": 2,
        "round_timeout": 30.0,
        "weighted": True,
        "max_samples_per_update": 12,
        "overlap": "streaming",
        "fragments": 8,
    }
    assert streaming.spec["rounds"]["overlap"] == "streaming"


@pytest.mark.django_db
def test_a_streaming_job_without_its_options_sends_the_defaults(make_job, sent):
    make_job(eager_spec(overlap="streaming"))

    trainer, server = dispatches(sent)["trainer"], dispatches(sent)["parameter_server"]
    assert trainer.spec["executor"]["config"]["overlap"] == {
        "mode": "streaming",
        "fragments": 4,
        "mix": 0.5,
        "rounds": 2,
    }
    assert server.spec["executor"]["config"]["rounds"]["fragments"] == 4


@pytest.mark.django_db
@pytest.mark.parametrize("overlap", ["none", "eager"])
def test_a_job_without_streaming_tells_the_server_nothing_of_fragments(make_job, sent, overlap):
    make_job(eager_spec(overlap=overlap))

    server = dispatches(sent)["parameter_server"]
    assert server.spec["executor"]["config"]["rounds"] == {
        "update_rounds": 2,
        "round_timeout": 30.0,
        "weighted": True,
        "max_samples_per_update": 12,
    }
    assert "fragments" not in json.dumps(dispatches(sent)["trainer"].spec)
    assert "mix" not in json.dumps(dispatches(sent)["trainer"].spec["executor"]["config"])


@pytest.mark.django_db
def test_a_job_without_overlap_tells_its_trainers_nothing_so_its_json_stays_hyphas(make_job, sent):
    make_job(eager_spec(overlap="none"))

    assert "overlap" not in dispatches(sent)["trainer"].spec["executor"]["config"]


# --- the sync protocol, fixed H -------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("overlap", OVERLAPS_TRAINING_AHEAD)
def test_steps_while_the_update_is_out_count_as_the_next_rounds_and_carry_over(
    make_job, online_rigs, overlap
):
    """H = 3. rig-a sends round 1's update and trains on: its steps count ahead, not in round 1 (whose samples
    bound its update), and become round 2's at its update-received — the merge coming between two steps of a
    run its daemon answers itself."""
    job = make_job(eager_spec(overlap=overlap))
    rig_a, _rig_b, rig_c = online_rigs
    task = task_of(job, rig_a)
    assert report(rig_a, task, STEP) == (CONTINUE, 1)
    assert report(rig_a, task, covering(2)) == (STOP, 0)
    assert report(rig_a, task, "update") == (OK, 0)

    # when: a step of round 2 before round 1's result arrived
    assert report(rig_a, task, STEP) == (CONTINUE, 1)  # the daemon answers the next one, not the H-th

    # then
    task.refresh_from_db()
    assert (task.sync_state, task.round, task.steps_in_round, task.samples_in_round) == ("updating", 0, 3, 12)
    assert (task.ahead_steps, task.ahead_samples, task.steps_total, task.samples_total) == (1, 4, 4, 16)
    assert task.last_loss == 2.0
    waiting = status(rig_c, task_of(job, rig_c), {"waiting": {"round": 1}})
    assert waiting["samples"][str(rig_a.pk)] == 12  # round 1's, not the steps ahead

    # when: round 1's result is merged, with one granted step answered by the daemon since the last report
    assert report(rig_a, task, "update-received") == (CONTINUE, 0)

    # then: round 2 has the step ahead; the grant stays for the step the daemon answered
    task.refresh_from_db()
    assert (task.sync_state, task.round, task.steps_in_round, task.samples_in_round) == ("training", 1, 1, 4)
    assert (task.ahead_steps, task.ahead_samples, task.ahead_due, task.continue_granted) == (0, 0, None, 1)
    # and the report after it stands for both: round 2's H-th step
    assert report(rig_a, task, covering(2)) == (STOP, 0)
    task.refresh_from_db()
    assert (task.steps_in_round, task.samples_in_round, task.update_due, task.steps_total) == (3, 12, 3, 6)


@pytest.mark.django_db
@pytest.mark.parametrize("overlap", OVERLAPS_TRAINING_AHEAD)
def test_h_steps_ahead_stop_the_trainer_until_it_merged_then_its_update_is_due(
    make_job, online_rigs, overlap
):
    job = make_job(eager_spec(overlap=overlap))
    rig_a = online_rigs[0]
    task = task_of(job, rig_a)
    report(rig_a, task, STEP)
    report(rig_a, task, covering(2))
    report(rig_a, task, "update")

    # when: round 1's result is slow: rig-a runs all of round 2's H steps ahead
    assert report(rig_a, task, STEP) == (CONTINUE, 1)
    assert report(rig_a, task, covering(2)) == (STOP, 0)  # stop after this step, send once merged
    assert report(rig_a, task, STEP) == (CONTINUE, 0)  # a step that was in flight: counted, no second stop
    task.refresh_from_db()
    assert (task.sync_state, task.ahead_steps, task.ahead_due, task.steps_in_round) == ("updating", 4, 3, 3)

    # then: once merged its update is due at once
    assert report(rig_a, task, "update-received") == (CONTINUE, 0)
    task.refresh_from_db()
    assert (task.sync_state, task.round, task.steps_in_round, task.update_due) == ("scheduled", 1, 4, 3)
    assert (task.ahead_steps, task.ahead_samples, task.ahead_due) == (0, 0, None)
    assert report(rig_a, task, "update") == (OK, 0)
    assert task_of(job, rig_a).sync_state == "updating"


@pytest.mark.django_db
@pytest.mark.parametrize("overlap", OVERLAPS_TRAINING_AHEAD)
def test_a_trainer_that_does_not_train_ahead_runs_an_eager_job_as_before_and_is_done_at_the_end(
    make_job, online_rigs, clock, overlap
):
    """Hypha's executor ignores the overlap key: it waits for each result. And past the last round's update
    an eager trainer has nothing to train: its first step ahead is told to stop, its merge is answered Done."""
    job = make_job(eager_spec(overlap=overlap))
    rig_a = online_rigs[0]
    task = task_of(job, rig_a)
    report(rig_a, task, STEP)
    report(rig_a, task, covering(2))
    report(rig_a, task, "update")

    # round 1's result before any step ahead: as without overlap
    clock.now += 5
    assert report(rig_a, task, "update-received") == (CONTINUE, 0)
    task.refresh_from_db()
    assert (task.sync_state, task.round, task.steps_in_round, task.continue_granted) == ("training", 1, 0, 0)
    assert task.last_status_at == clock.now  # round 2 starts now for it

    # round 2, the last
    assert report(rig_a, task, STEP) == (CONTINUE, 1)
    assert report(rig_a, task, covering(2)) == (STOP, 0)
    assert report(rig_a, task, "update") == (OK, 0)
    assert report(rig_a, task, STEP) == (STOP, 0)  # there is no round 3
    assert report(rig_a, task, "update-received") == (DONE, 0)
    task.refresh_from_db()
    assert (task.sync_state, task.round, task.steps_total) == ("done", 2, 7)
    assert report(rig_a, task, STEP) == (ERROR, 0)


@pytest.mark.django_db
def test_a_trainer_of_a_job_without_overlap_may_not_report_steps_while_updating(make_job, online_rigs):
    job = make_job(eager_spec(overlap="none"))
    rig_a = online_rigs[0]
    task = task_of(job, rig_a)
    report(rig_a, task, STEP)
    report(rig_a, task, covering(2))
    report(rig_a, task, "update")

    assert report(rig_a, task, STEP) == (ERROR, 0)

    task.refresh_from_db()
    assert (task.sync_state, task.steps_in_round, task.steps_total, task.ahead_steps) == ("updating", 3, 3, 0)


# --- the sync protocol, a sample target -----------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("overlap", OVERLAPS_TRAINING_AHEAD)
def test_with_a_sample_target_far_from_it_a_trainer_ahead_may_run_on_unasked(
    make_job, online_rigs, clock, overlap
):
    """Target 400 samples of batch 4. rig-a trains round 2 (20 samples in); rig-b, 1 s a step, has just sent
    round 1's update, 10 s after its last step: its first step ahead may be followed by two more unasked
    (MAX_CONTINUE_SECONDS), and the 10 s of sending do not count as a step time."""
    job = make_job(eager_spec(inner_steps=None, avg_samples_between_updates=400, overlap=overlap))
    rig_a, rig_b, _rig_c = online_rigs
    fast, slow = task_of(job, rig_a), task_of(job, rig_b)
    Task.objects.filter(pk=fast.pk).update(
        round=1, steps_in_round=5, samples_in_round=20, step_interval=1.0, last_status_at=clock.now
    )
    Task.objects.filter(pk=slow.pk).update(
        sync_state=Task.Sync.UPDATING, samples_in_round=20, step_interval=1.0, last_status_at=clock.now
    )

    clock.now += 10
    assert report(rig_b, slow, STEP) == (CONTINUE, int(training.MAX_CONTINUE_SECONDS / 1.0))

    slow.refresh_from_db()
    assert (slow.ahead_steps, slow.ahead_samples, slow.step_interval) == (1, 4, 1.0)


@pytest.mark.django_db
@pytest.mark.parametrize("overlap", OVERLAPS_TRAINING_AHEAD)
def test_with_a_sample_target_the_samples_ahead_count_for_the_round_they_belong_to(
    make_job, online_rigs, clock, overlap
):
    """Target 40. rig-a trains round 2 (20 samples); rig-b, waiting for round 1's result, has 16 of round 2's
    samples ahead: rig-a's next step makes 40, so it stops; rig-b's next step ahead is past the target, so it
    stops too, and is SCHEDULED once it merged."""
    job = make_job(eager_spec(inner_steps=None, avg_samples_between_updates=40, overlap=overlap))
    rig_a, rig_b, _rig_c = online_rigs
    fast, slow = task_of(job, rig_a), task_of(job, rig_b)
    Task.objects.filter(pk=fast.pk).update(
        round=1, steps_in_round=5, samples_in_round=20, step_interval=1.0, last_status_at=clock.now
    )
    Task.objects.filter(pk=slow.pk).update(
        sync_state=Task.Sync.UPDATING,
        samples_in_round=20,
        ahead_steps=4,
        ahead_samples=16,
        step_interval=1.0,
        last_status_at=clock.now,
    )

    clock.now += 1
    assert report(rig_a, fast, STEP) == (STOP, 0)
    assert report(rig_b, slow, STEP) == (STOP, 0)
    assert report(rig_b, slow, "update-received") == (CONTINUE, 0)

    slow.refresh_from_db()
    assert (slow.sync_state, slow.round, slow.steps_in_round, slow.samples_in_round) == (
        "scheduled",
        1,
        5,
        20,
    )
    assert (slow.update_due, slow.last_status_at) == (5, None)


# --- through the gateway --------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("overlap", OVERLAPS_TRAINING_AHEAD)
async def test_a_step_ahead_through_the_gateway_shows_on_the_job(make_job, online_rigs, daemon_of, overlap):  # noqa: F811
    job = await database_sync_to_async(make_job)(eager_spec(overlap=overlap))
    rig_a = online_rigs[0]
    task = await database_sync_to_async(task_of)(job, rig_a)
    daemon = await daemon_of(rig_a)

    async def frame(progress) -> dict:
        message = protocol.StatusReport(request_id=uuid.uuid4(), task_id=task.pk, progress=progress)
        await daemon.send_to(text_data=protocol.encode(message))
        reply = await daemon.receive_json_from(timeout=TIMEOUT)
        assert reply["type"] == "status_reply" and reply["request_id"] == str(message.request_id)
        return {"reply": reply["reply"], "continue_for": reply["continue_for"]}

    # when: round 1's H steps, its update, and a step of round 2 before the result
    assert await frame(STEP) == {"reply": CONTINUE, "continue_for": 1}
    assert await frame(covering(2)) == {"reply": STOP, "continue_for": 0}
    assert await frame("update") == {"reply": OK, "continue_for": 0}
    assert await frame(STEP) == {"reply": CONTINUE, "continue_for": 1}

    # then: the job says where the trainer is
    def detail() -> dict:
        client = APIClient()
        client.force_authenticate(job.owner)
        return client.get(f"/api/jobs/{job.pk}/").json()

    [shown] = [
        entry for entry in (await database_sync_to_async(detail)())["tasks"] if entry["id"] == str(task.pk)
    ]
    assert (shown["sync_state"], shown["steps_in_round"], shown["ahead_steps"], shown["steps_total"]) == (
        "updating",
        3,
        1,
        4,
    )


# --- what a trainer needs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("overlap", "trainer_copies"), [("none", 5), ("eager", 7), ("streaming", 5)])
def test_an_eager_trainer_needs_two_more_copies_of_the_model_a_streaming_one_and_the_parameter_server_none(
    overlap, trainer_copies
):
    config = {
        "model_type": "gpt2",
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 2,
        "vocab_size": 256,
        "n_positions": 64,
    }
    data = lenet_json(
        preprocessor=None,
        model={
            "source": {"type": "config", "config": config},
            "type": "causal-lm",
            "input_names": ["input_ids"],
        },
        trainer={"resources": {"memory": 0.001}},
        parameter_server={"resources": {"memory": 0.001}},
        rounds={"update_rounds": 2, "inner_steps": 5, "overlap": overlap},
    )

    problem = size_problem(parse_json(data), max_parameters=10**9)

    assert f"({trainer_copies} float32 copies of them) but trainer" in problem
    assert "(4 float32 copies of them) but parameter_server" in problem
