"""Churn: an elastic trainer pool while trainer daemons are killed and come back at random.

In the spirit of Hypha's own flaky runner (a share of workers killed every 10–20 s, back after 10–30 s): one
real cluster (``bench.cluster.training_cluster``) with a daemon that only runs parameter servers and
``--daemons`` trainer daemons; a job of ``trainers = {min, target}`` (docs/training.md, "Elastic pools"). Every
10–20 s one live trainer daemon is killed (SIGKILL, its executor with it) as long as at least ``--min`` stay
up; each comes back 10–30 s after its death. Then it checks:

* the job completed every round;
* every slice was used at most once per epoch, and every slice of a finished epoch exactly once (``JobSlice``
  rows and their ``acknowledged`` events, read from the control plane's database);
* no round counts a trainer's update twice (its participants are distinct).

Usage::

    python bench/churn.py                       # min 2, target 4, 5 trainer daemons, 16 rounds of H = 10
    python bench/churn.py --rounds 12 --seed 3

Results: docs/benchmarks.md, "Churn".
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/churn.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

SLICE_CHECK = """
import json
from django.db.models import Count
from apps.datasets.models import JobSlice, SliceEvent
job = {job_id!r}
epochs = {{}}
for epoch, status, count in JobSlice.objects.filter(job_id=job).values_list("epoch", "status").annotate(
    n=Count("id")
).values_list("epoch", "status", "n"):
    epochs.setdefault(epoch, {{}})[status] = count
twice = (
    SliceEvent.objects.filter(job_slice__job_id=job, kind="acknowledged")
    .values("job_slice").annotate(n=Count("id")).filter(n__gt=1).count()
)
print(json.dumps({{"epochs": epochs, "acknowledged_twice": twice}}))
"""


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min", type=int, default=2)
    parser.add_argument("--target", type=int, default=4)
    parser.add_argument("--daemons", type=int, default=5, help="trainer daemons (default 5)")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from bench.cluster import SMALL_GPT2, diloco_spec, prepare_stdlib_text, training_cluster, worker_toml

    arguments = parse_arguments(argv)
    chance = random.Random(arguments.seed)
    with tempfile.TemporaryDirectory(prefix="hypha-churn-") as directory:
        root = Path(directory)
        dataset = prepare_stdlib_text(root / "stdlib", max_bytes=250_000, samples_per_slice=32)
        spec = diloco_spec(
            dataset="stdlib",
            batch_size=8,
            model=SMALL_GPT2,
            trainers=arguments.target,
            rounds=arguments.rounds,
            inner_steps=arguments.inner_steps,
            round_timeout=120.0,
            dedicated_parameter_server=True,
        )
        del spec["num_trainers"]
        spec["trainers"] = {"min": arguments.min, "target": arguments.target}
        with training_cluster(
            root=root / "cluster",
            dataset_dir=dataset,
            workers=arguments.daemons + 1,
            settings={"HYPHA_LEASE_TTL": "5", "HYPHA_READVERTISE_MAX": "2"},
            worker_tomls=[worker_toml(parameter_server_only=True, benchmark=False)]
            + [worker_toml(benchmark=False)] * arguments.daemons,
        ) as cluster:
            trainers = [f"worker-{index + 2}" for index in range(arguments.daemons)]
            started = time.monotonic()
            job_id = cluster.submit(spec, name="churn")
            down: dict[str, float] = {}  # daemon → when it comes back
            kills = []
            next_kill = started + chance.uniform(10, 20)
            job = cluster.job(job_id)
            while job["status"] not in ("completed", "failed", "cancelled"):
                now = time.monotonic()
                assert now - started < arguments.timeout, (job["status_reason"], cluster.logs())
                for name, back_at in list(down.items()):
                    if now >= back_at:
                        cluster.restart_daemon(name)
                        del down[name]
                if now >= next_kill:
                    alive = [name for name in trainers if name not in down]
                    if len(alive) > arguments.min:
                        victim = chance.choice(alive)
                        cluster.daemons[victim].signal(signal.SIGKILL)
                        down[victim] = now + chance.uniform(10, 30)
                        kills.append((round(now - started, 1), victim))
                    next_kill = now + chance.uniform(10, 20)
                time.sleep(0.5)
                job = cluster.job(job_id)
            elapsed = time.monotonic() - started
            print(f"job: {job['status']} — {job['status_reason']}", flush=True)
            # The last line: Django may print warnings before it.
            checked = cluster.plane.manage("shell", "-c", SLICE_CHECK.format(job_id=job_id))
            slices = json.loads(checked.splitlines()[-1])
    rounds = job["rounds"]
    tasks = [task for task in job["tasks"] if task["role"] == "trainer"]
    twice = [
        round_["number"]
        for round_ in rounds
        if len(round_["participants"]) != len(set(round_["participants"]))
    ]
    # An epoch is finished once a later one has handed out a slice (the next epoch's rows may exist unused).
    started_epochs = [
        int(epoch) for epoch, states in slices["epochs"].items() if set(states) != {"available"}
    ]
    finished_epochs = [epoch for epoch in started_epochs if epoch < max(started_epochs, default=0)]
    incomplete = [epoch for epoch in finished_epochs if set(slices["epochs"][str(epoch)]) != {"used"}]
    print(f"job: {job['status']} in {elapsed:.0f} s — {job['status_reason']}")
    print(f"kills: {len(kills)} {kills}")
    print(f"trainer tasks: {len(tasks)} ({sum(task['status'] == 'cancelled' for task in tasks)} lost)")
    print(f"participants per round: {[len(round_['participants']) for round_ in rounds]}")
    print(f"slices by epoch and state: {slices['epochs']}")
    print(f"slices acknowledged twice in one epoch: {slices['acknowledged_twice']}")
    print(f"finished epochs with a slice not used: {incomplete}; rounds counting an update twice: {twice}")
    ok = (
        job["status"] == "completed"
        and [round_["number"] for round_ in rounds] == list(range(1, arguments.rounds + 1))
        and not twice
        and not incomplete
        and slices["acknowledged_twice"] == 0
    )
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
