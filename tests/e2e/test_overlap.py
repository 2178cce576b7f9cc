"""Eager updates end to end (docs/training.md, "Overlap: eager updates"): a DiLoCo job with
``rounds.overlap = "eager"`` on real processes — control plane, data node, parameter server, two trainers.

Each trainer sends round r's update and trains round r + 1 from its proxy at once, merging round r's result
between two steps. The job must complete with every round's update from both trainers, both trainers must have
merged every round's result into exactly the parameter server's θ_r (each merge line of their logs carries
the digest they checked, which must be the one the parameter server logged for that round), trained ahead of
the result at least once, and exited 0 at the last ``"update-received"`` (their partial last round dropped).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.e2e import overlap_logs
from tests.e2e.conftest import only_in_mode, services_mode, small_training_job

pytestmark = [
    pytest.mark.timeout(600),
    only_in_mode(
        "embedded", "the trainer's overlap is the executor's; the control plane's side has unit tests"
    ),
]

ROUNDS = 3
TRAINERS = 2
SENT = re.compile(r"round (\d+): \d+ steps, .*; round (\d+) starts from the proxy \(eager\)")


@pytest.mark.parametrize("sync", ["fixed", "performance-aware"])
def test_an_eager_job_completes_and_every_trainer_holds_the_parameter_servers_weights(
    sync: str, tmp_path: Path
) -> None:
    from bench.cluster import training_cluster

    # given: H = 8, or a target of as many samples per round (2 trainers × 8 steps × batch 8)
    rule = {"inner_steps": 8} if sync == "fixed" else {"sample_target": TRAINERS * 8 * 8}
    dataset, spec = small_training_job(tmp_path, trainers=TRAINERS, rounds=ROUNDS, round_timeout=60.0, **rule)
    spec["rounds"]["overlap"] = "eager"
    with training_cluster(
        root=tmp_path / "cluster",
        dataset_dir=dataset,
        workers=TRAINERS + 1,
        mode="services" if services_mode() else "embedded",
        benchmark=False,
    ) as cluster:
        # when
        job_id = cluster.submit(spec, name="e2e-eager")
        job = cluster.follow(job_id, timeout=420)
        logs = "\n".join(child.log.read_text(errors="replace") for child in cluster.daemons.values())

        # then: completed, both trainers in every round, learning visible
        assert job["status"] == "completed", f"{job['status_reason']}\n{cluster.logs()}"
        rounds = job["rounds"]
        assert [round_["number"] for round_ in rounds] == list(range(1, ROUNDS + 1))
        assert all(round_["closed"] and len(round_["participants"]) == TRAINERS for round_ in rounds)
        assert all(round_["eval_loss"] < 0.8 * math.log(256) for round_ in rounds), rounds
        trainers = [task for task in job["tasks"] if task["role"] == "trainer"]
        assert [(task["status"], task["exit_code"]) for task in trainers] == [("exited", 0)] * TRAINERS

        # the parameter server's digest of θ_r, and each trainer's merges: every round, each checked
        server = next(task for task in job["tasks"] if task["role"] == "parameter_server")
        events = overlap_logs.read(
            logs, server=str(server["id"]), trainers=[str(task["id"]) for task in trainers], sent=SENT
        )
        published, merges, order = events.published, events.merges, events.order
        assert sorted(published) == list(range(1, ROUNDS + 1)), published
        for task, merged in merges.items():
            assert [number for number, *_ in merged] == list(range(1, ROUNDS + 1)), (task, merged)
            assert all(digest == published[number] for number, _, _, digest in merged), (task, merged)
            # the round each result was merged in is the next one, and the trainer stepped ahead of it
            assert all(current == number + 1 for number, _, current, _ in merged), merged
            assert any(steps >= 1 for _, steps, _, _ in merged), merged
            # round r's update went out only after round r − 1's result was merged (its "update-received")
            expected = [(event, number) for number in range(1, ROUNDS + 1) for event in ("sent", "merged")]
            assert order[task] == expected, (task, order[task])
