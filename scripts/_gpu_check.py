"""The driver of ``scripts/gpu-check``: the demo's DiLoCo job on CUDA (or on the CPU with ``--device cpu``), one
JSON line.

Runs, in embedded mode (SQLite, no servers), the control plane, one data node and ``trainers + 1`` worker
daemons (``bench/cluster.py``, as ``scripts/demo`` does), every daemon declaring the GPU memory it may use, and a
job whose trainers ask for GPU memory, so the market gives the trainer roles to GPU daemons; the trainers'
``Accelerator`` picks CUDA by itself. Meanwhile it polls ``nvidia-smi`` for the GPU memory in use (the trainers
run in their own processes). Ends with one JSON line on stdout (progress goes to stderr)::

    {"ok": true, "device": "cuda", "devices": [{"index": 0, "name": ..., "memory_mib": ...}], "torch": ...,
     "cuda_available": true, "trainers": 2, "trainer_processes": 1, "trainer_devices": ["cuda:0", "cuda:0"],
     "samples_per_s": ..., "peak_memory_mib": ..., "peak_memory_source": ..., "peak_gpu_memory_mib": ...,
     "final_loss": ..., "rounds": ..., "wall_s": ..., ...}

Every line has the keys of :data:`CORE_FIELDS` (null where the check did not get that far). ``peak_memory_mib``
is the trainers' own ``torch.cuda.max_memory_allocated()`` when their round metrics carry ``peak_memory_bytes``
(apps/jobs/throughput.py), else nvidia-smi's peak above the baseline (``peak_gpu_memory_mib``);
``peak_memory_source`` says which.

``ok`` is true only when the job completed and, on CUDA, every trainer said it ran on a CUDA device. Exit code
0 when ok, 1 otherwise. ``--setup FILE``: a JSON object from ``scripts/gpu-check`` (how the environment was
installed) merged into the line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

#: The check's default model: a 4-layer, 256-wide GPT-2 over bytes (about 3.2 M parameters). ``tiny`` is the
#: demo's 2-layer, 128-wide one (0.45 M), which a 2-core CPU trains in reasonable time.
MODELS = {
    "tiny": {"n_embd": 128, "n_layer": 2, "n_head": 4},
    "small": {"n_embd": 256, "n_layer": 4, "n_head": 4},
}
#: What the check runs with on each device unless told otherwise: model, batch size, rounds, inner steps.
DEFAULTS = {
    "cuda": {"model": "small", "batch_size": 32, "rounds": 4, "inner_steps": 30},
    "cpu": {"model": "tiny", "batch_size": 16, "rounds": 3, "inner_steps": 10},
}
#: GPU memory each trainer asks for (GB); every daemon declares its share of the GPU's.
TRAINER_GPU_GB = 1
NOT_MULTI_PROCESS = (
    "multi-process trainers are not implemented (worker_daemon/executors/training.py refuses "
    "--num_processes other than 1): each trainer ran one process"
)
#: Fields every JSON line has (null where the check did not get that far, or the number is unknown).
CORE_FIELDS = (
    "devices",
    "trainers",
    "trainer_processes",
    "samples_per_s",
    "peak_memory_mib",
    "peak_memory_source",
    "final_loss",
)
LOADED = re.compile(
    r"model \S+ \((?P<cls>[\w.]+), (?P<parameters>\d+) parameters\) loaded on (?P<device>\S+?),"
)


def log(text: str) -> None:
    print(f"==> {text}", file=sys.stderr, flush=True)


def run_quiet(argv: list[str], timeout: float = 20.0) -> str | None:
    """A command's stdout, or None when it is missing, fails or takes longer than ``timeout``."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def nvidia_smi_devices() -> tuple[list[dict], str | None]:
    """The GPUs nvidia-smi lists (index, name, total memory in MiB) and the driver version."""
    out = run_quiet(
        [
            "nvidia-smi",
            "--query-gpu=index,name,memory.total,driver_version",
            "--format=csv,noheader,nounits",
        ]
    )
    devices, driver = [], None
    for line in (out or "").splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            devices.append({"index": int(parts[0]), "name": parts[1], "memory_mib": _number(parts[2])})
            driver = parts[3]
    return devices, driver


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


class MemoryPoller:
    """Polls nvidia-smi every ``interval`` seconds in a thread: the highest memory in use per GPU, and the
    highest any one process (compute app) held. Each call has its own timeout, so a hung nvidia-smi costs a
    missed sample, never the check."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.baseline: dict[int, float] = {}
        self.peak_used: dict[int, float] = {}
        self.peak_process = 0.0
        self.peak_processes_total = 0.0
        self.pids: set[str] = set()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvidia-smi-poller", daemon=True)

    def sample(self) -> None:
        used = run_quiet(
            ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"], timeout=10
        )
        for line in (used or "").splitlines():
            parts = [part.strip() for part in line.split(",")]
            if len(parts) == 2 and parts[0].isdigit() and (value := _number(parts[1])) is not None:
                index = int(parts[0])
                self.baseline.setdefault(index, value)
                self.peak_used[index] = max(self.peak_used.get(index, 0.0), value)
                self.samples += 1
        apps = run_quiet(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            timeout=10,
        )
        total = 0.0
        for line in (apps or "").splitlines():
            parts = [part.strip() for part in line.split(",")]
            if len(parts) == 2 and (value := _number(parts[1])) is not None:
                self.pids.add(parts[0])
                self.peak_process = max(self.peak_process, value)
                total += value
        self.peak_processes_total = max(self.peak_processes_total, total)

    def start(self) -> MemoryPoller:
        self.sample()  # the baseline, before anything of ours runs
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def report(self) -> dict:
        if not self.samples:
            return {"peak_gpu_memory_mib": None, "gpu_memory_note": "nvidia-smi gave no readings"}
        return {
            # Memory in use on the busiest GPU at its peak, less what was in use before the check started.
            "peak_gpu_memory_mib": max(
                self.peak_used[index] - self.baseline.get(index, 0.0) for index in self.peak_used
            ),
            "peak_process_gpu_memory_mib": self.peak_process or None,
            "peak_all_processes_gpu_memory_mib": self.peak_processes_total or None,
            "gpu_processes_seen": len(self.pids),
            "gpu_memory_samples": self.samples,
        }


def environment_report() -> dict:
    """Versions and devices as torch sees them (torch is imported here, in the check's own process)."""
    import accelerate
    import torch
    import transformers

    report: dict = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
    }
    devices, driver = nvidia_smi_devices()
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        torch_devices = []
        for index in range(count):
            properties = torch.cuda.get_device_properties(index)
            torch_devices.append(
                {
                    "index": index,
                    "name": properties.name,
                    "memory_mib": round(properties.total_memory / 2**20),
                    "capability": f"{properties.major}.{properties.minor}",
                }
            )
        devices = torch_devices
    report.update(devices=devices, device_count=len(devices), driver=driver)
    return report


def environment_in_child(timeout: float = 180.0) -> dict:
    """:func:`environment_report` in a child process: this one never holds a CUDA context (which would count
    in the GPU memory measured), and a CUDA initialisation that hangs costs ``timeout``, not the check."""
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--environment"],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"torch's CUDA initialisation did not finish within {timeout:g} s") from error
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"could not read torch's devices (exit {done.returncode}): {last}")
    return json.loads(done.stdout)


def check_server_imports() -> None:
    """Fail now, with the module's name, when the control plane's packages did not install."""
    import importlib

    for name in (
        "django",
        "rest_framework",
        "drf_spectacular",
        "channels",
        "daphne",
        "celery",
        "pydantic",
        "websockets",
        "aiohttp",
        "httpx",
        "opentelemetry.sdk",
    ):
        importlib.import_module(name)


def trainer_rates(job: dict) -> dict:
    """Samples per second from the trainers' own round metrics: per round, the sum over trainers (they run
    at the same time); the mean over rounds after the first (which pays CUDA's and the model's warm-up)."""
    per_round = []
    per_trainer = []
    for round_ in job["rounds"]:
        rates = [
            float(metrics["samples_per_second"])
            for metrics in (round_.get("trainer_metrics") or {}).values()
            if isinstance(metrics, dict) and metrics.get("samples_per_second")
        ]
        if rates:
            per_round.append(sum(rates))
            per_trainer.append(statistics.fmean(rates))
    steady = per_round[1:] or per_round
    steady_trainer = per_trainer[1:] or per_trainer
    return {
        "samples_per_s": round(statistics.fmean(steady), 1) if steady else None,
        "samples_per_s_per_trainer": round(statistics.fmean(steady_trainer), 1) if steady_trainer else None,
        "samples_per_s_first_round": round(per_round[0], 1) if per_round else None,
    }


def trainer_peak_memory(job: dict) -> float | None:
    """The highest ``peak_memory_bytes`` any trainer reported for any round (its
    ``torch.cuda.max_memory_allocated()``, apps/jobs/throughput.py), in MiB; None when none reported it."""
    peaks = [
        float(metrics["peak_memory_bytes"])
        for round_ in job["rounds"]
        for metrics in (round_.get("trainer_metrics") or {}).values()
        if isinstance(metrics, dict) and isinstance(metrics.get("peak_memory_bytes"), int | float)
    ]
    return round(max(peaks) / 2**20, 1) if peaks else None


def peak_memory(result: dict) -> tuple[float | None, str | None]:
    """The line's ``peak_memory_mib`` and where it came from: the trainers' own
    ``torch.cuda.max_memory_allocated()`` when they reported it, else nvidia-smi's peak above the baseline."""
    if result.get("peak_memory_mib_torch") is not None:
        return result["peak_memory_mib_torch"], "torch.cuda.max_memory_allocated (trainers' round metrics)"
    if result.get("peak_gpu_memory_mib") is not None:
        return result["peak_gpu_memory_mib"], "nvidia-smi (memory in use above the baseline, busiest GPU)"
    return None, None


def trainer_devices(log_dir: Path) -> tuple[list[str], int | None]:
    """Where each trainer said its model went (``… loaded on cuda:0``), from the daemons' logs."""
    devices, parameters = [], None
    for path in sorted(log_dir.glob("worker-*.log")):
        for match in LOADED.finditer(path.read_text(errors="replace")):
            devices.append(match["device"])
            parameters = int(match["parameters"])
    return devices, parameters


def worker_benchmarks(cluster) -> list[dict]:
    """Each daemon's start-up benchmark as the control plane has it (device, score)."""
    with cluster.api() as client:
        payload = client.get("/api/workers/").json()
    workers = payload["results"] if isinstance(payload, dict) and "results" in payload else payload
    found = []
    for worker in workers:
        details = worker.get("benchmark") or {}
        found.append(
            {
                "worker": worker.get("name"),
                "device": details.get("device"),
                "device_name": details.get("device_name") or None,
                "score": worker.get("benchmark_score"),
            }
        )
    return found


def run_check(args: argparse.Namespace, result: dict) -> None:
    """Fill ``result`` in as far as the check gets; raises on the first thing that makes it fail."""
    from bench.cluster import TINY_GPT2, diloco_spec, prepare_stdlib_text, training_cluster, worker_toml

    result.update(environment_in_child())
    if args.device == "cuda" and not result["cuda_available"]:
        raise RuntimeError("torch.cuda.is_available() is False: no CUDA for torch in this environment")
    check_server_imports()

    daemons = args.trainers + 1
    gpu_share = 0
    daemon_env = {
        # The PS evaluates and averages on the CPU: give each daemon its share of the cores.
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // daemons)),
        "MKL_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // daemons)),
    }
    if args.device == "cuda":
        memory_mib = result["devices"][0]["memory_mib"] if result["devices"] else 0
        gpu_share = max(TRAINER_GPU_GB, int(memory_mib / 1024 / daemons))
    else:
        daemon_env["CUDA_VISIBLE_DEVICES"] = ""  # --cpu on a GPU machine: the trainers must not see it
    result["trainer_processes"] = 1
    result["multi_process_trainer"] = NOT_MULTI_PROCESS
    if result.get("device_count", 0) >= 2:
        result["multi_process_trainer"] += f" on cuda:0, though {result['device_count']} devices are there"
    # Each daemon declares its share of the GPU (so its benchmark runs on CUDA and the market sees the GPU).
    template = worker_toml().replace("gpu = 0", f"gpu = {gpu_share}")
    model = {**TINY_GPT2, **MODELS[args.model]}
    result.update(
        model={"name": args.model, **MODELS[args.model], "vocab_size": 256, "context": 128},
        batch_size=args.batch_size,
        inner_steps=args.inner_steps,
        rounds_wanted=args.rounds,
        trainers=args.trainers,
    )

    root = Path(tempfile.mkdtemp(prefix="hypha-gpu-check-"))
    result["run_dir"] = str(root) if args.keep else None
    poller = MemoryPoller().start() if args.device == "cuda" else None
    try:
        dataset = prepare_stdlib_text(root / "stdlib")
        log(f"starting the control plane (embedded), a data node and {daemons} worker daemons")
        started = time.monotonic()
        with training_cluster(
            root=root,
            dataset_dir=dataset,
            workers=daemons,
            daemon_env=daemon_env,
            worker_tomls=[template] * daemons,
        ) as cluster:
            result["startup_s"] = round(time.monotonic() - started, 1)
            result["worker_benchmarks"] = worker_benchmarks(cluster)
            spec = diloco_spec(
                dataset="stdlib",
                trainers=args.trainers,
                rounds=args.rounds,
                inner_steps=args.inner_steps,
                batch_size=args.batch_size,
                model=model,
            )
            if args.device == "cuda":
                spec["trainer"]["resources"]["gpu"] = TRAINER_GPU_GB
            job_id = cluster.submit(spec, name=f"gpu-check-{args.device}")
            log(
                f"job {job_id}: {args.trainers} trainers on {args.device}, model {args.model}, "
                f"{args.rounds} rounds of {args.inner_steps} steps of {args.batch_size}"
            )
            job_started = time.monotonic()

            def show(round_: dict) -> None:
                loss = round_["mean_loss"]
                log(
                    f"round {round_['number']}/{args.rounds}: training loss "
                    f"{'-' if loss is None else f'{loss:.3f}'} ({time.monotonic() - job_started:.0f} s)"
                )

            try:
                job = cluster.follow(job_id, timeout=args.job_timeout, on_round=show)
            except (TimeoutError, RuntimeError) as error:
                result["logs_tail"] = cluster.logs()[-1500:]
                raise RuntimeError(str(error).splitlines()[0]) from error
            result["job_s"] = round(time.monotonic() - job_started, 1)
            closed = [round_ for round_ in job["rounds"] if round_["closed"]]
            result.update(
                job_status=job["status"],
                rounds=len(closed),
                first_round_loss=closed[0]["mean_loss"] if closed else None,
                final_loss=closed[-1]["mean_loss"] if closed else None,
                eval_loss=closed[-1]["eval_loss"] if closed else None,
                peak_memory_mib_torch=trainer_peak_memory(job),
                **trainer_rates(job),
            )
            devices, parameters = trainer_devices(root / "logs")
            result.update(trainer_devices=devices, parameters=parameters)
            if job["status"] != "completed":
                result["logs_tail"] = cluster.logs()[-1500:]
                raise RuntimeError(f"the job is {job['status']}: {job.get('status_reason')}")
            if args.device == "cuda" and (not devices or not all(d.startswith("cuda") for d in devices)):
                raise RuntimeError(f"the trainers did not all run on CUDA: {devices or 'no trainer said'}")
    finally:
        if poller is not None:
            poller.stop()
            result.update(poller.report())
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--trainers", type=int, default=2, help="trainer daemons (default 2)")
    parser.add_argument("--model", choices=sorted(MODELS), help="small (cuda default) or tiny (cpu default)")
    parser.add_argument("--batch-size", type=int, help="per trainer step (cuda 32, cpu 16)")
    parser.add_argument("--rounds", type=int, help="outer rounds (cuda 4, cpu 3)")
    parser.add_argument("--inner-steps", type=int, help="steps per trainer per round (cuda 30, cpu 10)")
    parser.add_argument("--job-timeout", type=float, default=240.0, help="give the job this long (s)")
    parser.add_argument("--setup", type=Path, help="a JSON object (from scripts/gpu-check) to merge in")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs, work dirs)")
    parser.add_argument("--environment", action="store_true", help=argparse.SUPPRESS)  # the child's job
    args = parser.parse_args(argv)
    if args.environment:
        print(json.dumps(environment_report()))
        return 0
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.trainers, args.rounds, args.inner_steps, args.batch_size) < 1:
        parser.error("--trainers, --rounds, --inner-steps and --batch-size must be at least 1")

    # SIGTERM (an outer timeout) → SystemExit, so the cluster is stopped and the line is still printed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    result: dict = {"ok": False, "error": None, "gpu": args.device == "cuda", "device": args.device}
    result.update(dict.fromkeys(CORE_FIELDS), trainers=args.trainers)
    if args.setup is not None:
        with contextlib.suppress(OSError, ValueError):
            result.update(json.loads(args.setup.read_text()))
    try:
        run_check(args, result)
        result["ok"] = True
    except SystemExit as stop:
        result["error"] = f"stopped (exit {stop.code}): timed out or terminated"
    except BaseException as error:  # the line must say what went wrong, whatever it was
        result["error"] = f"{type(error).__name__}: {error}"
        traceback.print_exc(file=sys.stderr)
    result["peak_memory_mib"], result["peak_memory_source"] = peak_memory(result)
    result["wall_s"] = round(time.monotonic() - started + float(result.get("setup_s") or 0), 1)
    print(json.dumps(result, separators=(", ", ": ")), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
