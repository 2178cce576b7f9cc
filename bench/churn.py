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
# A slice handed out (assigned or used) in epoch e > 0 while its own epoch e - 1 is not USED: overtaken, i.e.
# skipped in that epoch. (A slice released back at the job's end may stay AVAILABLE in its epoch: the job
# stopped claiming; that is not a skip.)
rows = {{(row["slice_id"], row["epoch"]): row["status"] for row in JobSlice.objects.filter(job_id=job).values(
    "slice_id", "epoch", "status"
)}}
overtaken = sum(
    1
    for (slice_id, epoch), status in rows.items()
    if epoch > 0 and status != "available" and rows.get((slice_id, epoch - 1)) != "used"
)
print(json.dumps({{"epochs": epochs, "acknowledged_twice": twice, "overtaken": overtaken}}))
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


def churn(
    root: Path,
    *,
    minimum: int = 2,
    target: int = 4,
    daemons: int = 5,
    rounds: int = 16,
    inner_steps: int = 10,
    seed: int = 1,
    timeout: float = 900.0,
    kill_every: tuple[float, float] = (10.0, 20.0),
    back_after: tuple[float, float] = (10.0, 30.0),
    mode: str = "embedded",
    max_kills: int | None = None,
) -> dict:
    """Run one churned job under ``root`` and return what the checks need: the job (as the API shows it),
    ``elapsed`` seconds, the ``kills`` ((seconds, daemon) each), the job's ``slices`` by epoch and state, and
    the ``checks`` (``twice``: rounds counting an update twice; ``overtaken``: slices handed out in an epoch before
    their previous epoch was used, i.e. skipped — the guarantee; ``incomplete``: finished epochs with a slice
    not used; ``acknowledged_twice``; ``ok``). Also the CI test's (tests/e2e/test_churn.py). ``max_kills``: stop
    killing after that many (None: until the job ends), so that a slow machine's longer run is not also a
    harsher one."""
    from bench.cluster import SMALL_GPT2, diloco_spec, prepare_stdlib_text, training_cluster, worker_toml

    chance = random.Random(seed)
    dataset = prepare_stdlib_text(root / "stdlib", max_bytes=250_000, samples_per_slice=32)
    spec = diloco_spec(
        dataset="stdlib",
        batch_size=8,
        model=SMALL_GPT2,
        trainers=target,
        rounds=rounds,
        inner_steps=inner_steps,
        round_timeout=120.0,
        dedicated_parameter_server=True,
    )
    del spec["num_trainers"]
    spec["trainers"] = {"min": minimum, "target": target}
    with training_cluster(
        root=root / "cluster",
        dataset_dir=dataset,
        workers=daemons + 1,
        mode=mode,
        settings={"HYPHA_LEASE_TTL": "5", "HYPHA_READVERTISE_MAX": "2"},
        worker_tomls=[worker_toml(parameter_server_only=True, benchmark=False)]
        + [worker_toml(benchmark=False)] * daemons,
    ) as cluster:
        trainers = [f"worker-{index + 2}" for index in range(daemons)]
        started = time.monotonic()
        job_id = cluster.submit(spec, name="churn")
        down: dict[str, float] = {}  # daemon → when it comes back
        kills = []
        next_kill = started + chance.uniform(*kill_every)
        job = cluster.job(job_id)
        while job["status"] not in ("completed", "failed", "cancelled"):
            now = time.monotonic()
            assert now - started < timeout, (job["status_reason"], cluster.logs())
            for name, back_at in list(down.items()):
                if now >= back_at:
                    cluster.restart_daemon(name)
                    del down[name]
            if now >= next_kill and (max_kills is None or len(kills) < max_kills):
                alive = [name for name in trainers if name not in down]
                if len(alive) > minimum:
                    victim = chance.choice(alive)
                    cluster.daemons[victim].signal(signal.SIGKILL)
                    down[victim] = now + chance.uniform(*back_after)
                    kills.append((round(now - started, 1), victim))
                next_kill = now + chance.uniform(*kill_every)
            time.sleep(0.5)
            job = cluster.job(job_id)
        elapsed = time.monotonic() - started
        # The last line: Django may print warnings before it.
        checked = cluster.plane.manage("shell", "-c", SLICE_CHECK.format(job_id=job_id))
        slices = json.loads(checked.splitlines()[-1])
        logs = cluster.logs() if job["status"] != "completed" else ""
    twice = [
        round_["number"]
        for round_ in job["rounds"]
        if len(round_["participants"]) != len(set(round_["participants"]))
    ]
    # An epoch is finished once a later one has handed out a slice (the next epoch's rows may exist unused).
    started_epochs = [
        int(epoch) for epoch, states in slices["epochs"].items() if set(states) != {"available"}
    ]
    finished_epochs = [epoch for epoch in started_epochs if epoch < max(started_epochs, default=0)]
    incomplete = [epoch for epoch in finished_epochs if set(slices["epochs"][str(epoch)]) != {"used"}]
    ok = (
        job["status"] == "completed"
        and [round_["number"] for round_ in job["rounds"]] == list(range(1, rounds + 1))
        and not twice
        and slices["overtaken"] == 0
        and slices["acknowledged_twice"] == 0
    )
    return {
        "job": job,
        "elapsed": elapsed,
        "kills": kills,
        "slices": slices,
        "logs": logs,
        "checks": {
            "twice": twice,
            "incomplete": incomplete,
            "overtaken": slices["overtaken"],
            "acknowledged_twice": slices["acknowledged_twice"],
            "ok": ok,
        },
    }


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    with tempfile.TemporaryDirectory(prefix="hypha-churn-") as directory:
        result = churn(
            Path(directory),
            minimum=arguments.min,
            target=arguments.target,
            daemons=arguments.daemons,
            rounds=arguments.rounds,
            inner_steps=arguments.inner_steps,
            seed=arguments.seed,
            timeout=arguments.timeout,
        )
    job, checks, slices, kills = result["job"], result["checks"], result["slices"], result["kills"]
    rounds = job["rounds"]
    tasks = [task for task in job["tasks"] if task["role"] == "trainer"]
    print(f"job: {job['status']} in {result['elapsed']:.0f} s — {job['status_reason']}")
    print(f"kills: {len(kills)} {kills}")
    print(f"trainer tasks: {len(tasks)} ({sum(task['status'] == 'cancelled' for task in tasks)} lost)")
    print(f"participants per round: {[len(round_['participants']) for round_ in rounds]}")
    print(f"slices by epoch and state: {slices['epochs']}")
    print(f"slices acknowledged twice in one epoch: {slices['acknowledged_twice']}")
    print(
        f"finished epochs with a slice not used: {checks['incomplete']}; rounds counting an update twice: "
        f"{checks['twice']}"
    )
    if result["logs"]:
        print(result["logs"][-4000:])
    print("OK" if checks["ok"] else "FAILED")
    return 0 if checks["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
