"""Batch inference throughput: the system with N = 1, 2, 4 workers against one plain in-process loop (issue 19).

One embedded cluster (``bench.cluster.training_cluster``) with as many daemons as the largest N, each offering
its whole capacity (so each holds at most one task). The dataset is the standard library's sources, byte-level
(``--slices`` slices of ``--samples-per-slice`` rows of 128 tokens). The model is a tiny GPT-2 with random
weights (a ``config`` model source: nothing to download), the task ``generate`` with a fixed
``--max-new-tokens`` (greedy) at ``--batch-size``.

**The loop** is the same computation in this process, over the same slice files: the executor's own functions
(``worker_daemon/executors/inference_tasks.py``: ``load_model``, ``slice_inputs``, ``generate``,
``write_result``), each slice read with ``safetensors`` and its result written to disk, as the executor does; the
model is built once, outside the timing. It runs with ``torch.set_num_threads(1)``: the cluster starts every
daemon (and so every executor, which inherits it) with ``OMP_NUM_THREADS=1``, so both sides use one intra-op
thread — like with like. It is measured twice, before and after the jobs, with the cluster up and idle (the
same background as the jobs); the table's reference is the mean.

**The system**, for each N: an ``inference`` job with ``workers = N`` submitted through the REST API. Three
times are reported:

* *first claim → last result* (the work window): from the first "slice i of d handed out" line in the
  daemons' logs (the bridge gives an executor its first slice; the control plane keeps no claim time) to the
  ``created_at`` of the job's last stored ``InferenceResult`` (read with ``manage.py shell``: the API does not
  show it);
* *submit → completed*: the job's ``created_at`` to its ``ended_at`` (adds allocation, dispatch, start-up);
* *executor start → first claim*: the earliest task ``started_at`` to the first claim (the executor process
  imports torch and transformers and builds the model: a cost per task, outside the window).

Beside them: the seconds each executor logged computing its slices (read, generate, write: the loop's work), and
the CPU seconds the control plane (with the data node) and the worker daemons used during the job
(``/proc/<pid>/stat``): on two cores, what the system spends per slice besides the computation.

Throughput is samples (the rows of the stored results) ÷ the work window; "vs loop" is that over the loop's samples/s, "÷ N" the
efficiency per worker. The goal (issue 19): ≥ 0.85 × N × the loop for N ≤ 2 on a 2-core machine.

Usage::

    python bench/inference.py               # 240 slices of 32 rows, N = 1, 2, 4: ≈ 4 min on 2 cores
    python bench/inference.py --quick       # 24 slices, N = 1, 2: ≈ 1 min (a smoke run, numbers are noise)

Results and how to read them: docs/benchmarks.md, "Batch inference: throughput with N workers".
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/inference.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

from bench.cluster import Cluster, prepare_stdlib_text, training_cluster, worker_toml  # noqa: E402
from bench.harness import (  # noqa: E402
    exit_on_sigterm,
    load_average,
    print_start,
    resolve_mode,
    run_directory,
)

#: The benchmark's model: ``bench.cluster.SMALL_GPT2`` (2 layers × 64) with room for 128 prompt tokens plus
#: the new ones.
MODEL = {
    "model_type": "gpt2",
    "vocab_size": 256,
    "n_positions": 256,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 2,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
SEQ_LEN = 128
#: Bytes of source per row asked of ``hypha-data prepare-text`` (more than it uses: the extra slices are removed).
BYTES_PER_ROW = 256


@dataclass
class Run:
    """One job's outcome."""

    workers: int
    status: str
    samples: int
    slices: int
    window_s: float
    submit_to_completed_s: float
    startup_s: float
    first_to_last_result_s: float
    per_worker: dict[str, int] = field(default_factory=dict)
    compute_s: dict[str, float] = field(default_factory=dict)
    plane_cpu_s: float = 0.0
    reported_samples: int = 0
    daemons_cpu_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.samples / self.window_s if self.window_s > 0 else 0.0


def job_spec(dataset: str, *, workers: int, max_new_tokens: int, batch_size: int) -> dict:
    return {
        "model": {"source": {"type": "config", "config": dict(MODEL)}, "input_names": ["input_ids"]},
        "dataset": {"name": dataset},
        "task": {"type": "generate", "max_new_tokens": max_new_tokens, "temperature": 0.0, "seed": 0},
        "batch_size": batch_size,
        "workers": workers,
        "worker": {"resources": {"cpu": 1, "memory": 1}, "price": {"bid": 100, "max": 100}},
    }


def executor_config(spec: dict) -> object:
    """The executor's parsed config for ``spec`` (what the control plane sends it, less the references)."""
    from worker_daemon.executors.inference_tasks import InferenceConfig

    return InferenceConfig.model_validate(
        {
            "model": {"task": "causal-lm", "artifact": spec["model"]["source"]},
            "data": {"type": "scheduler", "dataset": spec["dataset"]["name"]},
            "results": {"type": "peers"},
            "task": spec["task"],
            "batch_size": spec["batch_size"],
            "input_names": spec["model"]["input_names"],
        }
    )


def plain_loop(
    dataset: Path, spec: dict, output: Path, rows_of: dict[int, int] | None = None
) -> tuple[int, float]:
    """(rows, seconds) of the executor's computation over every slice of ``dataset``, in this process with one
    torch thread: read the slice, ``generate``, write the result file (the model built before the clock)."""
    import torch
    from safetensors.torch import load_file

    from worker_daemon.executors import inference_tasks as tasks

    torch.set_num_threads(1)
    config = executor_config(spec)
    model = tasks.load_model(None, config, device="cpu", trust_remote_code=False)  # type: ignore[arg-type]
    task = config.task  # type: ignore[attr-defined]
    rows = 0
    started = time.perf_counter()
    for path in sorted(dataset.glob("*.safetensors")):
        index = int(path.stem)
        inputs = tasks.slice_inputs(load_file(str(path)), config.input_names, path.name)  # type: ignore[attr-defined]
        with torch.inference_mode():
            result = tasks.generate(
                model,
                inputs,
                task,
                index=index,
                batch_size=config.batch_size,
                device="cpu",  # type: ignore[attr-defined]
            )
        tasks.write_result(result, output, index)
        rows += len(result)
        if rows_of is not None:
            rows_of[index] = len(result)
    return rows, time.perf_counter() - started


RESULT_TIMES = (
    "import json; from apps.jobs.models import InferenceResult as R; "
    "q = R.objects.filter(job_id='{job}').order_by('created_at'); "
    "print(json.dumps([[r.created_at.isoformat(), str(r.worker_id), r.index] for r in q]))"
)


def result_times(cluster: Cluster, job_id: str) -> list[tuple[datetime, str, int]]:
    """Each stored result's ``created_at``, worker and slice index, oldest first (from the database: not in the API)."""
    text = cluster.plane.manage("shell", "-c", RESULT_TIMES.format(job=job_id))
    return [
        (datetime.fromisoformat(stamp), worker, int(index))
        for stamp, worker, index in json.loads(text.splitlines()[-1])
    ]


SLICE_LINE = re.compile(r"slice \d+ of \S+: (\d+) rows in ([0-9.]+) s")
CLAIM_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*: slice \d+ of \S+ handed out", re.MULTILINE
)


def read_logs(root: Path, since: dict[Path, int]) -> dict[str, str]:
    """Each daemon log's text after its byte offset in ``since``."""
    texts = {}
    for log in sorted((root / "logs").glob("worker-*.log")):
        with log.open("rb") as handle:
            handle.seek(since.get(log, 0))
            texts[log.stem] = handle.read().decode(errors="replace")
    return texts


def compute_seconds(texts: dict[str, str]) -> dict[str, float]:
    """Seconds the executors logged computing slices (``slice i of d: r rows in s s``: read, compute, write
    the result), per daemon: what the rest of the window went to is the system's overhead."""
    found = {}
    for name, text in texts.items():
        total = sum(float(match.group(2)) for match in SLICE_LINE.finditer(text))
        if total:
            found[name] = total
    return found


def first_claim(texts: dict[str, str]) -> datetime | None:
    """When the first slice was handed out to an executor (the daemons' log lines, local time)."""
    stamps = [
        datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").astimezone()
        for text in texts.values()
        for match in CLAIM_LINE.finditer(text)
    ]
    return min(stamps) if stamps else None


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` used so far (``/proc/<pid>/stat``; 0 for one gone)."""
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def log_offsets(root: Path) -> dict[Path, int]:
    return {log: log.stat().st_size for log in (root / "logs").glob("worker-*.log")}


def run_job(cluster: Cluster, spec: dict, *, root: Path, rows_of: dict[int, int], timeout: float) -> Run:
    since = log_offsets(root)
    daemon_pids = [child.popen.pid for child in cluster.daemons.values()]
    # plane.children holds every process the cluster started (the daemons too, and the data node).
    plane_pids = [child.popen.pid for child in cluster.plane.children if child.popen.pid not in daemon_pids]
    plane_cpu, daemons_cpu = cpu_seconds(plane_pids), cpu_seconds(daemon_pids)
    with cluster.api() as client:
        response = client.post(
            "/api/jobs/inference/", json={"name": f"bench-inference-{spec['workers']}", **spec}
        )
        if response.status_code != 201:
            raise RuntimeError(f"submission refused ({response.status_code}): {response.text}")
        job_id = response.json()["id"]
        deadline = time.monotonic() + timeout
        while True:
            job = client.get(f"/api/jobs/{job_id}/").json()
            if job["status"] in ("completed", "failed", "cancelled"):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} did not end within {timeout:g}s")
            time.sleep(0.5)
    plane_cpu, daemons_cpu = cpu_seconds(plane_pids) - plane_cpu, cpu_seconds(daemon_pids) - daemons_cpu
    stamps = result_times(cluster, job_id)
    starts = [datetime.fromisoformat(task["started_at"]) for task in job["tasks"] if task.get("started_at")]
    per_worker: dict[str, int] = {}
    indexes = {index for _, _, index in stamps}
    for _, worker, _ in stamps:
        per_worker[worker] = per_worker.get(worker, 0) + 1
    # The tasks' samples_total (their progress reports) may miss a last report sent as the job completed:
    # count the rows of the stored results instead (the caller knows each slice's rows).
    samples = sum(rows_of.get(index, 0) for index in indexes)
    created, ended = datetime.fromisoformat(job["created_at"]), datetime.fromisoformat(job["ended_at"])
    time.sleep(1.0)  # the executors' last log lines
    texts = read_logs(root, since)
    claimed = first_claim(texts)
    return Run(
        workers=spec["workers"],
        status=job["status"],
        samples=samples,
        slices=len(stamps),
        window_s=(stamps[-1][0] - claimed).total_seconds() if stamps and claimed else 0.0,
        submit_to_completed_s=(ended - created).total_seconds(),
        startup_s=(claimed - min(starts)).total_seconds() if claimed and starts else 0.0,
        first_to_last_result_s=(stamps[-1][0] - stamps[0][0]).total_seconds() if stamps else 0.0,
        per_worker=per_worker,
        compute_s=compute_seconds(texts),
        plane_cpu_s=plane_cpu,
        daemons_cpu_s=daemons_cpu,
        reported_samples=sum(task.get("samples_total") or 0 for task in job["tasks"]),
    )


def print_table(loop_rate: float, loop_rows: int, runs: list[Run]) -> None:
    print()
    print(
        "| N | status | slices (per worker) | samples | first claim → last result (s) | submit → completed (s) "
        "| executor start → first claim (s) | samples/s | vs loop | ÷ N | executor compute (s, per worker) "
        "| control plane + data node CPU (s) | daemons CPU (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| loop | — | — | {loop_rows} | — | — | — | {loop_rate:.1f} | 1.00× | — | — | — | — |")
    for run in runs:
        ratio = run.rate / loop_rate if loop_rate else 0.0
        split = "+".join(str(count) for count in sorted(run.per_worker.values(), reverse=True))
        compute = " / ".join(f"{seconds:.1f}" for seconds in run.compute_s.values()) or "—"
        print(
            f"| {run.workers} | {run.status} | {run.slices} ({split}) | {run.samples} | {run.window_s:.1f} "
            f"| {run.submit_to_completed_s:.1f} | {run.startup_s:.1f} | {run.rate:.1f} | {ratio:.2f}× | {ratio / run.workers:.2f} "
            f"| {compute} | {run.plane_cpu_s:.1f} | {run.daemons_cpu_s:.1f} |"
        )
    print("\nGoal: ÷ N ≥ 0.85 for N ≤ 2.")


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4", help="values of N, comma-separated (default: 1,2,4)")
    parser.add_argument("--slices", type=int, default=240, help="slices in the dataset (default: 240)")
    parser.add_argument("--samples-per-slice", type=int, default=32, help="rows per slice (default: 32)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=16, help="tokens generated per row (default: 16)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward pass (default: 8)")
    parser.add_argument("--quick", action="store_true", help="24 slices, N = 1, 2: a smoke run")
    parser.add_argument("--mode", choices=("auto", "embedded", "services"), default="auto")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job (default: 600)")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory and print its path")
    arguments = parser.parse_args(argv)
    if arguments.quick:
        arguments.slices, arguments.workers = 24, "1,2"
    try:
        arguments.workers = [int(value) for value in arguments.workers.split(",") if value.strip()]
    except ValueError:
        parser.error("--workers takes integers, comma-separated")
    if not arguments.workers or min(arguments.workers) < 1:
        parser.error("--workers must name at least one N ≥ 1")
    if arguments.slices < 2 or arguments.samples_per_slice < 1 or arguments.max_new_tokens < 1:
        parser.error("--slices must be ≥ 2, --samples-per-slice and --max-new-tokens ≥ 1")
    if SEQ_LEN + arguments.max_new_tokens > MODEL["n_positions"]:
        parser.error(f"--max-new-tokens must be ≤ {MODEL['n_positions'] - SEQ_LEN}")
    return arguments


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    mode = resolve_mode(arguments.mode)
    exit_on_sigterm()
    print_start()
    import torch
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    with run_directory("hypha-inference-", keep=arguments.keep) as root:
        dataset = prepare_stdlib_text(
            root / "stdlib",
            max_bytes=arguments.slices * arguments.samples_per_slice * BYTES_PER_ROW,
            samples_per_slice=arguments.samples_per_slice,
        )
        for extra in sorted(dataset.glob("*.safetensors"))[arguments.slices :]:
            extra.unlink()  # the byte estimate errs on the side of more: exactly --slices, the first ones
        slices = len(list(dataset.glob("*.safetensors")))
        spec = job_spec(
            dataset.name, workers=1, max_new_tokens=arguments.max_new_tokens, batch_size=arguments.batch_size
        )
        print(
            f"Dataset: {slices} slices × {arguments.samples_per_slice} rows × {SEQ_LEN} tokens; generate "
            f"{arguments.max_new_tokens} new tokens (greedy), batch {arguments.batch_size}; "
            f"GPT-2 {MODEL['n_layer']} × {MODEL['n_embd']}; N = {arguments.workers}",
            flush=True,
        )
        runs: list[Run] = []
        loops: list[tuple[int, float]] = []
        started = time.monotonic()
        with training_cluster(
            root=root / "cluster",
            dataset_dir=dataset,
            workers=max(arguments.workers),
            mode=mode,
            worker_tomls=[worker_toml(benchmark=False)] * max(arguments.workers),
        ) as cluster:
            time.sleep(5.0)  # the daemons' warm spares import torch at start: let them settle
            rows_of: dict[int, int] = {}
            loops.append(plain_loop(dataset, spec, root / "loop-results", rows_of))
            print(f"loop: {loops[-1][0]} rows in {loops[-1][1]:.1f} s", flush=True)
            for workers in arguments.workers:
                run = run_job(
                    cluster,
                    {**spec, "workers": workers},
                    root=root / "cluster",
                    rows_of=rows_of,
                    timeout=arguments.timeout,
                )
                runs.append(run)
                print(
                    f"N={workers}: {run.status}, {run.slices} slices, {run.samples} rows "
                    f"(the tasks reported {run.reported_samples}), window {run.window_s:.1f} s, "
                    f"submit→completed {run.submit_to_completed_s:.1f} s, {run.rate:.1f} samples/s",
                    flush=True,
                )
            loops.append(plain_loop(dataset, spec, root / "loop-results"))
            print(f"loop again: {loops[-1][0]} rows in {loops[-1][1]:.1f} s", flush=True)
        rates = [rows / seconds for rows, seconds in loops]
        print(
            f"\nLoop: {' and '.join(f'{rate:.1f}' for rate in rates)} samples/s (mean {statistics.mean(rates):.1f})"
        )
        print_table(statistics.mean(rates), loops[0][0], runs)
        print(f"\nTotal {time.monotonic() - started:.0f} s; load average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
