"""Utilisation benchmark: how much of a DiLoCo trainer's wall time is training, and how long a job takes to start.

Runs one real DiLoCo job on loopback (``bench.cluster.training_cluster``: the control plane, one data node
serving the standard library's sources byte-level, and ``--trainers + 1`` worker daemons; the market picks the
parameter server): ``--trainers`` trainers, H = ``--inner-steps``, ``--rounds`` rounds of the tiny GPT-2
(``bench.cluster.TINY_GPT2``). Everything comes from the job's detail (``GET /api/jobs/<id>/``):

* **Utilisation per trainer** over the steady-state rounds (round 1 excluded: it starts with the executor's
  start-up): ``Σ train_seconds`` of rounds 2…R ÷ the wall time of those rounds, ``closed_at(R) −
  closed_at(1)``. ``train_seconds`` is the executor's per-round metric: the sum of its steps' ``step_time``
  (next batch, forward, backward, optimizer step). A trainer's round r runs from receiving round r−1's update
  to receiving round r's, which follows the round's close by one download; the control plane's ``closed_at``
  stands for both boundaries. The rest is split into *reporting* (the inner loop's time outside steps: the
  per-step status round trip through the bridge to the control plane; inner-loop time is ``samples ÷
  samples_per_second``) and *sync* (everything after the inner loop: writing and sending the pseudo-gradient,
  waiting for the slowest trainer, the parameter server's outer step and eval, the download of the update).
* **Start-up**: from the job's ``created_at`` (the POST) to allocation (``allocated_at``), to the parameter
  server's dispatch, start (its task's ``dispatched_at``, ``started_at``) and listening (its "serving job"
  log line), the trainers' dispatch (with the parameter server's; they learn its address once it listens),
  the trainers' process start (``started_at``), their executor's ``main()`` and "model loaded" log lines,
  and their first optimizer step (``first_step_at``: the control plane's receipt of the first status); then
  the same as phases: market, trainer spawn → ``main()``, ``main()`` → model loaded, model loaded → first
  step, parameter server start → listening.

The daemons run the configuration ``--executors`` names: ``default`` (the daemon's own defaults: warm spares,
the built-in trainer without ``accelerate launch``), ``cold`` (the same without warm spares) or ``launcher``
(no warm spares, the trainer under ``accelerate launch --num_processes 1``: the defaults before issue 15).
With warm spares the job is submitted once every daemon's spare has said it is ready (daemons are started
ahead of jobs in real use); the wait is printed.

Goals: utilisation ≥ 97 %, submit → first step < 10 s. The run prints whether each was met.

Usage::

    python bench/utilisation.py                     # 4 trainers, H = 50, 5 rounds (4 steady-state)
    python bench/utilisation.py --rounds 3 --inner-steps 20
    python bench/utilisation.py --rounds 2 --executors launcher   # start-up as before issue 15

Results and how to read them: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/utilisation.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

from bench.cluster import diloco_spec, prepare_stdlib_text, training_cluster, worker_toml  # noqa: E402
from bench.harness import exit_on_sigterm, load_average, print_start, resolve_mode, run_directory  # noqa: E402

UTILISATION_GOAL = 0.97
STARTUP_GOAL = 10.0
#: Seconds to wait for the daemons' warm spares to be ready before submitting.
WARM_TIMEOUT = 180.0

#: Top-level daemon keys and executors per ``--executors`` choice (added to the cluster's worker config).
EXECUTOR_CHOICES = {
    "default": ("", ""),
    "cold": ("warm_start = false\n", ""),
    "launcher": (
        "warm_start = false\n",
        """
[[executors]]
class = "train"
name = "diloco-transformer"
runtime = "process"
cmd = "{python}"
args = ["-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1",
        "-m", "worker_daemon.executors.training",
        "--socket", "{{SOCKET_PATH}}", "--work-dir", "{{WORK_DIR}}"]

[[executors]]
class = "aggregate"
name = "parameter-server"
runtime = "parameter-server"
""",
    ),
}


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python bench/utilisation.py",
        description=__doc__.split("\n\n")[0],
        epilog="Prints the machine and markdown tables. See docs/benchmarks.md for results.",
    )
    parser.add_argument("--trainers", type=int, default=4, help="DiLoCo trainers (default: 4)")
    parser.add_argument("--inner-steps", type=int, default=50, help="H: AdamW steps per round (default: 50)")
    parser.add_argument("--rounds", type=int, default=5, help="outer rounds, at least 2 (default: 5)")
    parser.add_argument(
        "--batch-size", type=int, default=16, help="samples per step per trainer (default: 16)"
    )
    parser.add_argument(
        "--mode",
        choices=["auto", "embedded", "services"],
        default="embedded",
        help="control plane mode (default: embedded; auto: services if DATABASE_URL and REDIS_URL are set)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="give up on the job after this many seconds"
    )
    parser.add_argument(
        "--executors",
        choices=sorted(EXECUTOR_CHOICES),
        default="default",
        help="daemon executors: default (warm spares), cold (no spares), launcher (accelerate launch, no "
        "spares: as before issue 15)",
    )
    parser.add_argument("--json", type=Path, help="also write the job's detail JSON here")
    parser.add_argument(
        "--keep", action="store_true", help="keep the run's directory (logs) and print its path"
    )
    arguments = parser.parse_args(argv)
    if min(arguments.trainers, arguments.inner_steps, arguments.batch_size) < 1 or arguments.rounds < 2:
        parser.error("--trainers, --inner-steps and --batch-size must be at least 1, --rounds at least 2")
    return arguments


def _time(value: str | None) -> datetime.datetime | None:
    return None if value is None else datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f} %" if whole > 0 else "—"


def utilisation_rows(job: dict) -> list[dict]:
    """Per trainer, over rounds 2…R: train, reporting and sync seconds, wall seconds, steps."""
    rounds = sorted((r for r in job["rounds"] if r["closed"]), key=lambda r: r["number"])
    steady = rounds[1:]
    wall = (_time(rounds[-1]["closed_at"]) - _time(rounds[0]["closed_at"])).total_seconds()
    trainers = [task for task in job["tasks"] if task["role"] == "trainer"]
    rows = []
    for task in sorted(trainers, key=lambda task: task["worker"]):
        metrics = [r["trainer_metrics"].get(str(task["worker_id"]), {}) for r in steady]
        train = sum(m.get("train_seconds", 0.0) for m in metrics)
        inner = sum(m["samples"] / m["samples_per_second"] for m in metrics if m.get("samples_per_second"))
        steps = sum(m.get("steps", 0.0) for m in metrics)
        per_round = []
        for previous, current, m in zip(rounds, steady, metrics, strict=False):
            seconds = (_time(current["closed_at"]) - _time(previous["closed_at"])).total_seconds()
            per_round.append(m.get("train_seconds", 0.0) / seconds if seconds > 0 else 0.0)
        rows.append(
            {
                "worker": task["worker"],
                "train": train,
                "reporting": inner - train,
                "sync": wall - inner,
                "wall": wall,
                "steps": steps,
                "utilisation": train / wall if wall > 0 else 0.0,
                "per_round": per_round,
                "missing_metric": any("train_seconds" not in m for m in metrics),
            }
        )
    return rows


#: The executors' own log lines (re-logged by their daemon as ``[task <id prefix>] <line>``) that mark their
#: start-up: the trainer's main() and model loaded, the parameter server's listening.
EXECUTOR_LINE = re.compile(
    r"\[task (?P<task>[0-9a-f-]+)\] (?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO "
    r"(?:worker_daemon\.executors\.training: job \S+: (?P<what>starting the trainer|model .* loaded on)"
    r"|parameter_server: (?P<serving>serving job))"
)
#: A daemon's log lines about its warm spare (worker_daemon.jobs).
SPARE_STARTED = "warm spare started"
SPARE_READY = "warm spare ready"


def executor_milestones(logs: list[str]) -> dict[str, dict[str, datetime.datetime]]:
    """Task id prefix → {"main": the trainer's main() started, "loaded": model loaded, "listening": the parameter
    server listens}, from daemon logs."""
    found: dict[str, dict[str, datetime.datetime]] = {}
    for text in logs:
        for match in EXECUTOR_LINE.finditer(text):
            # The executor logs local time without a zone: make it aware in this machine's zone.
            at = datetime.datetime.strptime(match["at"], "%Y-%m-%d %H:%M:%S,%f").astimezone()
            if match["serving"]:
                key = "listening"
            else:
                key = "main" if match["what"] == "starting the trainer" else "loaded"
            found.setdefault(match["task"], {}).setdefault(key, at)
    return found


def wait_for_spares(daemons: dict, *, timeout: float = WARM_TIMEOUT) -> float | None:
    """Wait until every daemon that started a warm spare logged it ready; the seconds waited, or None when no
    daemon started one (warm start off, or a daemon without it)."""
    began = time.monotonic()
    while True:
        logs = {name: child.tail(10**8) for name, child in daemons.items()}
        warming = [name for name, text in logs.items() if SPARE_STARTED in text]
        if not warming:
            return None
        if all(SPARE_READY in logs[name] for name in warming):
            return time.monotonic() - began
        if time.monotonic() - began > timeout:
            raise RuntimeError(f"warm spares not ready within {timeout:g} s: {warming}")
        time.sleep(0.2)


def startup_rows(
    job: dict, milestones: dict[str, dict[str, datetime.datetime]]
) -> list[tuple[str, float, float]]:
    """(milestone, seconds after the job's created_at for the first and the last trainer) in order; the
    job-wide milestones have the same value twice."""
    created = _time(job["created_at"])
    server = next(task for task in job["tasks"] if task["role"] == "parameter_server")
    trainers = [task for task in job["tasks"] if task["role"] == "trainer"]

    def after(moment: datetime.datetime | None) -> float:
        return float("nan") if moment is None else (moment - created).total_seconds()

    def spread(moments: list[datetime.datetime | None]) -> tuple[float, float]:
        known = [moment for moment in moments if moment is not None]
        return (after(min(known)), after(max(known))) if known else (float("nan"), float("nan"))

    def of_tasks(key: str) -> tuple[float, float]:
        return spread([_time(task[key]) for task in trainers])

    def of_logs(key: str) -> tuple[float, float]:
        return spread([milestones.get(str(task["id"])[:8], {}).get(key) for task in trainers])

    allocated = after(_time(job["allocated_at"]))
    server_dispatched = after(_time(server["dispatched_at"]))
    server_started = after(_time(server["started_at"]))
    server_listening = after(milestones.get(str(server["id"])[:8], {}).get("listening"))
    rows = [
        ("allocated (all leases active)", allocated, allocated),
        ("parameter server dispatched", server_dispatched, server_dispatched),
        ("parameter server process started", server_started, server_started),
        ("trainers dispatched (with the parameter server)", *of_tasks("dispatched_at")),
        ("trainer process started", *of_tasks("started_at")),
        ("executor's main() running (after launcher / interpreter / hand-out)", *of_logs("main")),
        ("parameter server listening (imports, model build)", server_listening, server_listening),
        ("model loaded (imports, wait for the PS, fetch, from_pretrained, prepare)", *of_logs("loaded")),
        ("first optimizer step reported", *of_tasks("first_step_at")),
    ]
    rounds = sorted((r for r in job["rounds"] if r["closed"]), key=lambda r: r["number"])
    if rounds:
        closed = after(_time(rounds[0]["closed_at"]))
        rows.append(("round 1 closed", closed, closed))
    return rows


def phase_rows(
    job: dict, milestones: dict[str, dict[str, datetime.datetime]]
) -> list[tuple[str, float, float]]:
    """(phase, shortest and longest over the trainers, seconds): the start-up as durations (the parameter
    server's and the market's have one value)."""
    created = _time(job["created_at"])
    server = next(task for task in job["tasks"] if task["role"] == "parameter_server")
    trainers = [task for task in job["tasks"] if task["role"] == "trainer"]

    def between(start: datetime.datetime | None, end: datetime.datetime | None) -> float:
        return float("nan") if start is None or end is None else (end - start).total_seconds()

    def over_trainers(phase) -> tuple[float, float]:
        values = [value for value in (phase(task) for task in trainers) if value == value]
        return (min(values), max(values)) if values else (float("nan"), float("nan"))

    def logged(task: dict, key: str) -> datetime.datetime | None:
        return milestones.get(str(task["id"])[:8], {}).get(key)

    market = between(created, _time(job["allocated_at"]))
    server_up = between(_time(server["started_at"]), logged(server, "listening"))
    return [
        ("market: submit → all leases active", market, market),
        ("trainer dispatch → process started", *over_trainers(lambda t: between(_time(t["dispatched_at"]), _time(t["started_at"])))),
        ("trainer process started → main()", *over_trainers(lambda t: between(_time(t["started_at"]), logged(t, "main")))),
        ("main() → model loaded", *over_trainers(lambda t: between(logged(t, "main"), logged(t, "loaded")))),
        ("model loaded → first step reported", *over_trainers(lambda t: between(logged(t, "loaded"), _time(t["first_step_at"])))),
        ("parameter server process started → listening", server_up, server_up),
        ("submit → first step", *over_trainers(lambda t: between(created, _time(t["first_step_at"])))),
    ]  # fmt: skip


def print_report(job: dict, arguments: argparse.Namespace, milestones: dict) -> bool:
    rounds = sorted((r for r in job["rounds"] if r["closed"]), key=lambda r: r["number"])
    rows = utilisation_rows(job)
    print(
        f"\n{arguments.trainers} trainers, H = {arguments.inner_steps}, {len(rounds)} rounds, batch "
        f"{arguments.batch_size}; steady state = rounds 2–{len(rounds)}, "
        f"{rows[0]['wall']:.1f} s of wall time\n"
    )
    print(
        "| trainer | steps | train (s) | reporting (s) | sync (s) | wall (s) | mean step (s) | utilisation | "
        "per round |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        per_round = " / ".join(f"{100 * value:.0f}" for value in row["per_round"])
        print(
            f"| {row['worker']} | {row['steps']:.0f} | {row['train']:.1f} | {row['reporting']:.1f} | "
            f"{row['sync']:.1f} | {row['wall']:.1f} | {row['train'] / max(row['steps'], 1):.3f} | "
            f"**{_percent(row['train'], row['wall'])}** | {per_round} % |"
        )
    if any(row["missing_metric"] for row in rows):
        print("\n(some rounds lack train_seconds: an executor without the metric; they count as 0)")

    print("\nRounds (from the control plane and the parameter server's report):\n")
    print(
        "| round | closed after previous (s) | PS duration (s) | samples | bytes in (MB) | bytes out (MB) | eval loss |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    previous = None
    for round_ in rounds:
        closed = _time(round_["closed_at"])
        gap = "—" if previous is None else f"{(closed - previous).total_seconds():.1f}"
        previous = closed
        evaluation = round_["eval_loss"]
        print(
            f"| {round_['number']} | {gap} | {round_['duration']:.1f} | {round_['samples']} | "
            f"{round_['bytes_in'] / 1e6:.2f} | {round_['bytes_out'] / 1e6:.2f} | "
            f"{'—' if evaluation is None else f'{evaluation:.3f}'} |"
        )

    print("\nStart-up: seconds after the job was submitted (its created_at), first and last trainer:\n")
    print("| milestone | first (s) | last (s) | first: step (s) |")
    print("|---|---:|---:|---:|")
    last = 0.0
    rows_startup = startup_rows(job, milestones)
    for name, first, final in rows_startup:
        print(f"| {name} | {first:.2f} | {final:.2f} | {first - last:+.2f} |")
        last = first

    print("\nStart-up phases (seconds; shortest and longest over the trainers):\n")
    print("| phase | shortest (s) | longest (s) |")
    print("|---|---:|---:|")
    for name, shortest, longest in phase_rows(job, milestones):
        print(f"| {name} | {shortest:.2f} | {longest:.2f} |")

    utilisation = min(row["utilisation"] for row in rows)
    mean = statistics.fmean(row["utilisation"] for row in rows)
    first_step = next(first for name, first, _ in rows_startup if name == "first optimizer step reported")
    met_u = utilisation >= UTILISATION_GOAL
    met_s = first_step < STARTUP_GOAL
    print(
        f"\nGoal utilisation ≥ {100 * UTILISATION_GOAL:.0f} %: {'met' if met_u else 'MISSED'} "
        f"(lowest trainer {100 * utilisation:.1f} %, mean {100 * mean:.1f} %)"
    )
    print(
        f"Goal submit → first step < {STARTUP_GOAL:g} s: {'met' if met_s else 'MISSED'} ({first_step:.1f} s)"
    )
    return met_u and met_s


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    exit_on_sigterm()
    mode = resolve_mode(arguments.mode)
    print_start()
    with run_directory("hypha-utilisation-", keep=arguments.keep) as root:
        dataset = prepare_stdlib_text(root / "stdlib")
        print(
            f"Starting the cluster ({mode}): control plane, data node, {arguments.trainers + 1} daemons "
            f"(executors: {arguments.executors})"
        )
        top, executors = EXECUTOR_CHOICES[arguments.executors]
        template = worker_toml().replace(
            'work_dir = "{work_dir}"\n', 'work_dir = "{work_dir}"\n' + top
        ) + executors.replace("{python}", sys.executable)
        with training_cluster(
            root=root / "cluster",
            dataset_dir=dataset,
            workers=arguments.trainers + 1,
            mode=mode,
            worker_tomls=[template] * (arguments.trainers + 1),
        ) as cluster:
            waited = wait_for_spares(cluster.daemons)
            print(
                "No warm spares."
                if waited is None
                else f"Every daemon's warm spare ready {waited:.1f} s after the benchmarks."
            )
            spec = diloco_spec(
                dataset="stdlib",
                trainers=arguments.trainers,
                rounds=arguments.rounds,
                inner_steps=arguments.inner_steps,
                batch_size=arguments.batch_size,
            )
            started = time.monotonic()
            job_id = cluster.submit(spec, name="utilisation")

            def show(round_: dict) -> None:
                print(
                    f"  round {round_['number']}/{arguments.rounds} closed "
                    f"({time.monotonic() - started:.0f} s after submission)",
                    flush=True,
                )

            job = cluster.follow(job_id, timeout=arguments.timeout, on_round=show)
            milestones = executor_milestones([child.tail(10**8) for child in cluster.daemons.values()])
            if job["status"] != "completed":
                print(
                    f"the job is {job['status']}: {job['status_reason']}\n{cluster.logs()}", file=sys.stderr
                )
                return 1
        if arguments.json:
            arguments.json.write_text(json.dumps(job, indent=1))
        print_report(job, arguments, milestones)
        print(f"\nLoad average at end: {load_average()}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
