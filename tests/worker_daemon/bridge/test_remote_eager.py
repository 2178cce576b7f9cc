"""The bridge backend with an eager trainer (docs/training.md, "Overlap: eager updates"): it merges the last
round's result between two steps of a run of steps the control plane allowed the daemon to answer."""

from __future__ import annotations

import pytest

from tests.worker_daemon.bridge.test_remote import JOB, backend, work  # noqa: F401 (fixtures)
from worker_daemon import protocol


async def test_a_merge_between_granted_steps_keeps_the_run_and_its_count(backend, answerer):  # noqa: F811
    # given: the control plane allows three step reports to be answered by the daemon
    answerer.status_replies = [
        {"type": "Continue", "continue_for": 3},
        {"type": "Continue"},  # the update-received
        {"type": "ScheduleUpdate", "counter": 0},
    ]
    step = {"status": {"batch_size": 4, "loss": 2.0}}

    # when: a step, one granted step, the merge, the two granted steps left and the next one
    replies = [await backend.status(job_id=JOB, progress=step) for _ in range(2)]
    merged = await backend.status(job_id=JOB, progress="update-received")
    replies += [await backend.status(job_id=JOB, progress=step) for _ in range(3)]

    # then: the merge is forwarded; the granted steps on either side of it are not, and the report after
    # them stands for all four steps
    assert merged == {"type": "Continue"}
    assert replies == [{"type": "Continue"}] * 4 + [{"type": "ScheduleUpdate", "counter": 0}]
    assert [report.progress for report in answerer.of_type(protocol.StatusReport)] == [
        step,
        "update-received",
        {
            "status": {
                "batch_size": 4,
                "loss": 2.0,
                "covered_steps": 4,
                "covered_samples": 16,
                # the three steps answered here, on either side of the merge (apps.jobs.metrics)
                "covered_points": [
                    {"steps": 1, "seconds": 0.0, "samples": 4, "age": pytest.approx(0.0, abs=5.0),
                     "loss": 2.0, "loss_min": 2.0, "loss_max": 2.0},
                ] * 3,
            }
        },
    ]  # fmt: skip
    assert backend.local_continues == 0


async def test_an_update_still_ends_a_granted_run(backend, answerer):  # noqa: F811
    answerer.status_replies = [{"type": "Continue", "continue_for": 5}]
    await backend.status(job_id=JOB, progress={"status": {"batch_size": 1}})
    await backend.status(job_id=JOB, progress={"status": {"batch_size": 1}})  # answered here

    await backend.status(job_id=JOB, progress="update")

    assert backend.local_continues == 0
    assert [report.progress for report in answerer.of_type(protocol.StatusReport)][-1] == "update"
