"""Streaming DiLoCo end to end (docs/training.md, "Overlap: streaming"): a DiLoCo job with
``rounds.overlap = "streaming"`` on real processes — control plane, data node, parameter server, two trainers.

Round r syncs fragment (r − 1) mod F of the model only, the job's last round every fragment. The job must
complete with every round's update from both trainers; each round's update bytes must be those of its fragment
alone (computed here from the model the parameter server builds, with the same partition rule), not of the
whole model, and the last round's those of the whole model; both trainers must have merged
every round's result into exactly the parameter server's θ_r (each merge line carries the digest they checked,
which must be the one the parameter server logged for that round), sending round r's fragment only after
merging round r − 1's result, and exited 0 at the last ``"update-received"``.
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
        "embedded",
        "the fragments are the trainers' and the parameter server's; the control plane sees rounds",
    ),
]

FRAGMENTS = 2
ROUNDS = 2 * FRAGMENTS
TRAINERS = 2
SENT = re.compile(r"round (\d+): \d+ steps, .*; round (\d+) starts")


def fragment_bytes() -> list[int]:
    """float32 bytes of each fragment of the job's model (tied tensors once), by the shared partition rule."""
    import torch
    import transformers

    from bench.cluster import SMALL_GPT2
    from hypha_tensors.fragments import partition_state
    from worker_daemon.executors.pseudo_gradient import float_state, tied_groups

    config = dict(SMALL_GPT2)
    model_type = config.pop("model_type")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **config)
    )
    state = float_state(model)
    groups = tied_groups(state)
    parts = partition_state(state, groups, FRAGMENTS)
    return [sum(state[group[0]].numel() * 4 for group in groups if group[0] in part) for part in parts]


def test_a_streaming_job_syncs_one_fragment_a_round_and_every_trainer_holds_the_parameter_servers_weights(
    tmp_path: Path,
) -> None:
    from bench.cluster import training_cluster

    # given: F = 2 fragments, H = 4 steps between fragment syncs, 4 rounds (each fragment synced twice)
    dataset, spec = small_training_job(
        tmp_path, trainers=TRAINERS, rounds=ROUNDS, round_timeout=60.0, inner_steps=4
    )
    spec["rounds"].update({"overlap": "streaming", "fragments": FRAGMENTS, "mix": 0.5})
    sizes = fragment_bytes()
    with training_cluster(
        root=tmp_path / "cluster",
        dataset_dir=dataset,
        workers=TRAINERS + 1,
        mode="services" if services_mode() else "embedded",
        benchmark=False,
    ) as cluster:
        # when
        job_id = cluster.submit(spec, name="e2e-streaming")
        job = cluster.follow(job_id, timeout=420)
        logs = "\n".join(child.log.read_text(errors="replace") for child in cluster.daemons.values())

        # then: completed, both trainers in every round, learning visible
        assert job["status"] == "completed", f"{job['status_reason']}\n{cluster.logs()}"
        rounds = job["rounds"]
        assert [round_["number"] for round_ in rounds] == list(range(1, ROUNDS + 1))
        assert all(round_["closed"] and len(round_["participants"]) == TRAINERS for round_ in rounds)
        assert rounds[-1]["eval_loss"] < 0.9 * math.log(256), rounds
        trainers = [task for task in job["tasks"] if task["role"] == "trainer"]
        assert [(task["status"], task["exit_code"]) for task in trainers] == [("exited", 0)] * TRAINERS

        # each round's updates carry its fragment alone: TRAINERS × its float32 bytes plus the files' headers;
        # the job's last round carries every fragment (the whole model)
        for round_ in rounds:
            if round_["number"] == ROUNDS:
                expected = TRAINERS * sum(sizes)
            else:
                expected = TRAINERS * sizes[(round_["number"] - 1) % FRAGMENTS]
                assert round_["bytes_in"] < 0.8 * TRAINERS * sum(sizes), (round_, sizes)
            assert expected <= round_["bytes_in"] <= expected + TRAINERS * 64 * 1024, (round_, sizes)

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
            expected = [(event, number) for number in range(1, ROUNDS + 1) for event in ("sent", "merged")]
            assert order[task] == expected, (task, order[task])
