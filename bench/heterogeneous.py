"""Heterogeneous trainers: fixed-H sync vs performance-aware sync on the same job and the same cluster.

Starts one real cluster (``bench.cluster.training_cluster``): the control plane, a data node serving the
standard library's sources byte-level, one daemon that only runs parameter servers, and one trainer daemon per
``--speeds`` entry, deliberately slowed down by that factor (the daemon's ``slowdown``: its executors sleep
``(factor − 1) ×`` each step's compute time, and its benchmark score drops to match). Then runs the same job
twice, one after the other: with fixed H = ``--inner-steps`` (every trainer runs H steps a round), and with
performance-aware sync (``avg_samples_between_updates`` = H × trainers × batch size: the same samples per
round over all trainers, split by speed).

Per trainer, over the steady-state rounds (round 1 excluded: it includes the executors' start-up):

* **idle**: time spent waiting for the other trainers ÷ wall time. A round's waiting time for trainer *i* is
  ``last arrival − arrival of i``: the parameter server records when each update was accepted
  (``Round.arrivals``); the wall time of round *r* is ``closed_at(r) − closed_at(r−1)``. The outer step, the
  eval and the downloads, which every trainer waits for alike, are not counted as idle.
* **samples/s**: the trainer's samples in those rounds ÷ their wall time; and the job's total.

Goal: idle ≤ 5 % for every trainer with performance-aware sync.

Usage::

    python bench/heterogeneous.py                          # speeds 1, 2, 4; H = 30; 5 rounds
    python bench/heterogeneous.py --speeds 1,3 --rounds 4

Results and how to read them: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/heterogeneous.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

from bench.cluster import (  # noqa: E402
    Cluster,
    diloco_spec,
    prepare_stdlib_text,
    training_cluster,
    worker_toml,
)
from bench.harness import exit_on_sigterm, load_average, print_start, resolve_mode, run_directory  # noqa: E402

IDLE_GOAL = 0.05


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python bench/heterogeneous.py",
        description=__doc__.split("\n\n")[0],
        epilog="Prints the machine and markdown tables. See docs/benchmarks.md for results.",
    )
    parser.add_argument(
        "--speeds",
        default="1,2,4",
        help="one trainer per entry, slowed down by that factor (default: 1,2,4)",
    )
    parser.add_argument("--inner-steps", type=int, default=30, help="H of the fixed-H job (default: 30)")
    parser.add_argument("--rounds", type=int, default=5, help="outer rounds, at least 2 (default: 5)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step (default: 16)")
    parser.add_argument(
        "--order",
        default="fixed,adaptive",
        help="the jobs to run, in order: fixed and/or adaptive (default: fixed,adaptive)",
    )
    parser.add_argument(
        "--mode",
        choices=["auto", "embedded", "services"],
        default="embedded",
        help="control plane mode (default: embedded; auto: services if DATABASE_URL and REDIS_URL are set)",
    )
    parser.add_argument("--timeout", type=float, default=1200.0, help="give up on a job after this many s")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs)")
    arguments = parser.parse_args(argv)
    try:
        arguments.speeds = [float(value) for value in arguments.speeds.split(",")]
    except ValueError:
        parser.error(f"--speeds must be numbers separated by commas, not {arguments.speeds!r}")
    if not arguments.speeds or any(speed < 1.0 for speed in arguments.speeds):
        parser.error("--speeds: each factor must be at least 1")
    arguments.order = [value.strip() for value in arguments.order.split(",")]
    if not arguments.order or any(value not in ("fixed", "adaptive") for value in arguments.order):
        parser.error("--order: a comma-separated list of fixed and adaptive")
    if arguments.rounds < 2:
        parser.error("--rounds must be at least 2 (round 1 is not steady state)")
    return arguments


def _time(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def trainer_rows(job: dict, speeds: dict[str, float]) -> list[dict]:
    """Per trainer over rounds 2…R: steps per round, samples/s, idle fraction (see the module docstring)."""
    rounds = sorted((r for r in job["rounds"] if r["closed"]), key=lambda r: r["number"])
    walls = [
        (_time(current["closed_at"]) - _time(previous["closed_at"])).total_seconds()
        for previous, current in zip(rounds, rounds[1:], strict=False)
    ]
    wall = sum(walls)
    rows = []
    for task in sorted(
        (t for t in job["tasks"] if t["role"] == "trainer"), key=lambda t: speeds[t["worker"]]
    ):
        worker = str(task["worker_id"])
        idle = samples = steps = 0.0
        for round_ in rounds[1:]:
            arrivals = round_["arrivals"]
            if worker in arrivals:
                idle += max(arrivals.values()) - arrivals[worker]
            metrics = round_["trainer_metrics"].get(worker, {})
            samples += metrics.get("samples", 0.0)
            steps += metrics.get("steps", 0.0)
        rows.append(
            {
                "worker": task["worker"],
                "speed": speeds[task["worker"]],
                "steps": steps / len(walls),
                "samples_per_second": samples / wall if wall > 0 else 0.0,
                "idle": idle / wall if wall > 0 else 0.0,
            }
        )
    return rows


def run_job(cluster: Cluster, arguments: argparse.Namespace, sync: str) -> dict:
    trainers = len(arguments.speeds)
    rule = (
        {"inner_steps": arguments.inner_steps}
        if sync == "fixed"
        else {"sample_target": arguments.inner_steps * trainers * arguments.batch_size}
    )
    # A long round timeout: a fixed-H round waits for its slowest trainer, however slow (that is the point).
    spec = diloco_spec(
        dataset="stdlib",
        trainers=trainers,
        rounds=arguments.rounds,
        batch_size=arguments.batch_size,
        round_timeout=900.0,
        dedicated_parameter_server=True,
        **rule,
    )
    started = time.monotonic()
    job_id = cluster.submit(spec, name=f"heterogeneous-{sync}")

    def show(round_: dict) -> None:
        print(
            f"  {sync}: round {round_['number']}/{arguments.rounds} closed "
            f"({time.monotonic() - started:.0f} s after submission, arrivals {round_['arrivals']})",
            flush=True,
        )

    job = cluster.follow(job_id, timeout=arguments.timeout, on_round=show)
    if job["status"] != "completed":
        raise RuntimeError(f"the {sync} job is {job['status']}: {job['status_reason']}\n{cluster.logs()}")
    return job


def print_report(jobs: dict[str, dict], speeds: dict[str, float], scores: dict[str, float | None]) -> bool:
    print("\n| sync | trainer | slowdown | benchmark samples/s | steps/round | samples/s | idle |")
    print("|---|---|---:|---:|---:|---:|---:|")
    met = True
    for sync, job in jobs.items():
        rows = trainer_rows(job, speeds)
        for row in rows:
            score = scores.get(row["worker"])
            print(
                f"| {sync} | {row['worker']} | {row['speed']:g}× | {score or 0:.1f} | {row['steps']:.1f} "
                f"| {row['samples_per_second']:.1f} | {100 * row['idle']:.1f} % |"
            )
            if sync == "adaptive" and row["idle"] > IDLE_GOAL:
                met = False
    print(
        "\n| sync | rounds 2…R wall s | job samples/s | mean round s | final eval loss | final training loss |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for sync, job in jobs.items():
        rows = trainer_rows(job, speeds)
        rounds = sorted((r for r in job["rounds"] if r["closed"]), key=lambda r: r["number"])
        wall = (_time(rounds[-1]["closed_at"]) - _time(rounds[0]["closed_at"])).total_seconds()
        total = sum(row["samples_per_second"] for row in rows)
        last = rounds[-1]
        print(
            f"| {sync} | {wall:.1f} | {total:.1f} | {wall / (len(rounds) - 1):.1f} "
            f"| {last['eval_loss'] or 0:.4f} | {last['mean_loss'] or 0:.4f} |"
        )
    if "adaptive" in jobs:
        verdict = "met" if met else "NOT met"
        print(f"\nGoal: idle ≤ {100 * IDLE_GOAL:.0f} % per trainer with performance-aware sync — {verdict}.")
    return met


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    exit_on_sigterm()
    mode = resolve_mode(arguments.mode)
    print_start()
    # worker-1 runs the parameter server; worker-2… train, slowed down by --speeds in order.
    speeds = {f"worker-{index + 2}": speed for index, speed in enumerate(arguments.speeds)}
    with run_directory("hypha-heterogeneous-", keep=arguments.keep) as root:
        dataset = prepare_stdlib_text(root / "stdlib")
        print(f"Starting the cluster ({mode}): a parameter-server daemon and trainers at {arguments.speeds}")
        with training_cluster(
            root=root / "cluster",
            dataset_dir=dataset,
            workers=len(speeds) + 1,
            mode=mode,
            worker_tomls=[
                worker_toml(parameter_server_only=True, benchmark=False),
                *(worker_toml(slowdown=speed) for speed in speeds.values()),
            ],
        ) as cluster:
            jobs = {sync: run_job(cluster, arguments, sync) for sync in arguments.order}
            with cluster.api() as client:
                workers = client.get("/api/workers/").json()["results"]
        scores = {worker["name"]: worker.get("benchmark_score") for worker in workers}
        print_report(jobs, speeds, scores)
        print(f"\nLoad average at end: {load_average()}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
