"""A job that outlives its tokens several times over (issue: every job stalled once its first transfer token
expired, because daemons dropped the ``transfer_token`` frames that refresh them).

Real processes on loopback, with the control plane's token lifetimes cut to 10 s (and the lease TTL to 5 s, so
tokens are refreshed every renewal): the trainers' updates and result fetches, the parameter server's
checkpoint and model uploads, and the trainers' slice downloads all happen long after the tokens they were
dispatched with expired. The job must complete, every round with both trainers.
"""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path

import pytest

from tests.e2e.conftest import only_in_mode, services_mode, small_training_job

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

pytestmark = [
    pytest.mark.timeout(600),
    only_in_mode(
        "services", "the lease renewals and token refreshes it soaks run on Celery beat and Redis there"
    ),
]

TRAINERS = 2
ROUNDS = 10
#: Seconds every transfer and slice token lives (the control plane uses at least two lease TTLs).
LIFETIME = 10


def test_a_job_runs_for_several_token_lifetimes_and_completes(tmp_path: Path) -> None:
    from bench.cluster import training_cluster

    # given: tokens that live 10 s, and a job that takes several times that
    dataset, spec = small_training_job(
        tmp_path, trainers=TRAINERS, rounds=ROUNDS, inner_steps=60, round_timeout=120.0
    )
    with training_cluster(
        root=tmp_path / "cluster",
        dataset_dir=dataset,
        workers=TRAINERS + 1,
        mode="services" if services_mode() else "embedded",
        settings={
            "HYPHA_LEASE_TTL": "5",
            "HYPHA_TRANSFER_TOKEN_LIFETIME": str(LIFETIME),
            "HYPHA_SLICE_TOKEN_LIFETIME": str(LIFETIME),
        },
        benchmark=False,
    ) as cluster:
        # when
        job_id = cluster.submit(spec, name="e2e-soak")
        job = cluster.follow(job_id, timeout=480)

        # then: it completed, every round with both trainers
        assert job["status"] == "completed", f"{job['status_reason']}\n{cluster.logs()}"
        rounds = job["rounds"]
        assert [round_["number"] for round_ in rounds] == list(range(1, ROUNDS + 1))
        assert all(round_["closed"] and len(round_["participants"]) == TRAINERS for round_ in rounds), rounds
        # and it really outlived its tokens: the tasks were dispatched (right after the allocation) with tokens
        # that expired two lifetimes or more before the final model's upload (a shorter run would prove nothing)
        allocated, ended = (datetime.fromisoformat(job[key]) for key in ("allocated_at", "ended_at"))
        assert (ended - allocated).total_seconds() >= 3 * LIFETIME, (allocated, ended)
        logs = "\n".join(child.tail(2_000_000) for child in cluster.daemons.values())
        assert "unknown message type" not in logs
        assert "transfer token expired" not in logs
