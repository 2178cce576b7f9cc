"""A training job's ``max_cost`` stops it cleanly: once the next round would take its cost past the limit, the
round in progress becomes its last, so the parameter server is told ``Done`` after it, saves the final model, and
the job completes (docs/architecture.md, "Accounting"). The hard stop (cancel at the limit) stays the backstop."""

from __future__ import annotations

import pytest

from apps.jobs import tasks
from apps.jobs.models import Job
from apps.jobs.training.plans import plan
from tests.apps.accounting.test_accruals import clock  # noqa: F401
from tests.apps.jobs.test_training import SPEC, create_running_job, ready, status, task_of


@pytest.fixture
def priced_job(job_owner, online_rigs, data_node, sent, django_capture_on_commit_callbacks, settings, clock):  # noqa: F811
    """The test SPEC with 5 rounds and a max_cost of 150 credits; its leases cost 120 + 125 + 100 = 345
    credits an hour (a 600 s round costs 57.5)."""
    settings.HYPHA_OFFER_WINDOW = 60.0
    spec = {**SPEC, "rounds": {**SPEC["rounds"], "update_rounds": 5}, "max_cost": 150}
    return create_running_job(spec, job_owner, online_rigs, django_capture_on_commit_callbacks)


@pytest.mark.django_db
def test_a_job_whose_next_round_would_pass_its_max_cost_makes_the_round_in_progress_its_last(
    priced_job,
    online_rigs,
    clock,  # noqa: F811
):
    rig_a, _rig_b, rig_c = online_rigs
    ready(priced_job, rig_c)
    server = task_of(priced_job, rig_c)
    clock.advance(600)
    assert status(rig_c, server, {"round": {"round": 1, "participants": [str(rig_a.pk)]}}) == {"type": "Ok"}

    # when: the clock ticks 100 s into round 2 (cost 67.08; one more 600 s round: 124.58 < 150)
    clock.advance(100)
    tasks.tick_leases()
    # then: nothing changes
    job = Job.objects.get(pk=priced_job.pk)
    assert (job.status, job.stop_after_round, plan(job).update_rounds) == (Job.Status.RUNNING, None, 5)

    # when: 400 s into round 2 (cost 95.83; one more round: 153.33 >= 150)
    clock.advance(300)
    tasks.tick_leases()
    # then: round 2 is the job's last, and it says so
    job = Job.objects.get(pk=priced_job.pk)
    assert (job.status, job.stop_after_round, plan(job).update_rounds) == (Job.Status.RUNNING, 2, 2)
    assert job.status_reason.startswith("RUNNING: round 2 is the last: the next round would take the cost"), (
        job.status_reason
    )
    # when: round 2 closes: the parameter server is told Done (it saves the final model), not cancelled
    clock.advance(150)
    assert status(rig_c, server, {"round": {"round": 2, "participants": [str(rig_a.pk)]}}) == {"type": "Done"}
    # and the trainer that merged round 2 is told it is done
    trainer = task_of(priced_job, rig_a)
    assert status(rig_a, trainer, "update-received") == {"type": "Done"}
    job = Job.objects.get(pk=priced_job.pk)
    assert job.status == Job.Status.RUNNING
    from apps.jobs.training.dispatch import completion_reason

    assert completion_reason(job).startswith("COMPLETED: 2 of 5 rounds (stopped by max_cost)"), (
        completion_reason(job)
    )
    # a further tick does not cancel it: its cost (109.25) is under the limit
    tasks.tick_leases()
    assert Job.objects.get(pk=priced_job.pk).status == Job.Status.RUNNING
