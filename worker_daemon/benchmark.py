"""The worker benchmark: how fast this machine trains a fixed small model, as one number.

The standard workload: a 2-layer, 128-wide, 4-head causal transformer over a 256-token vocabulary and a
128-token context (the shape of the project's tiny GPT-2, ``bench/cluster.py`` ``TINY_GPT2``, about 0.45 M
parameters), built from seed 0 in plain torch, trained with AdamW on one fixed batch of 8 random sequences.
After :data:`WARMUP_STEPS` untimed steps it times steps for :data:`TIME_BUDGET` seconds (at least
:data:`MIN_STEPS`, at most :data:`MAX_STEPS`). The score is ``batch size / median step seconds``: training
samples per second on that workload, higher is faster. With a slowdown factor ``f`` every timed step is
followed by a sleep of ``(f − 1) × its compute time`` and the sleep counts, exactly as the training executor
applies ``HYPHA_SLOWDOWN``, so a 2× slowed daemon scores about half.

Plain torch rather than ``transformers``: importing transformers' GPT-2 costs ~5.7 s on a 2-core machine
against ~1.4 s for torch, and the benchmark should take a few seconds, not ten.

It runs in its own process (``python -m worker_daemon.benchmark``, one JSON line on stdout) so that torch's
memory and threads never touch the daemon's event loop; :func:`measure` starts that process and validates
what it prints. The device is ``cuda`` when the config declares GPU memory and CUDA is available, else the
CPU; CPU threads are ``OMP_NUM_THREADS`` when set (the executors inherit it too), else the configured cores.

This module imports nothing heavy at import time: torch only inside the child process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from worker_daemon.exceptions import BenchmarkError

if TYPE_CHECKING:
    from worker_daemon import protocol
    from worker_daemon.config import WorkerConfig

MODEL_NAME = "tiny-gpt-2x128"
VOCAB_SIZE = 256
CONTEXT = 128
WIDTH = 128
LAYERS = 2
HEADS = 4
BATCH_SIZE = 8
SEED = 0
WARMUP_STEPS = 2
MIN_STEPS = 5
MAX_STEPS = 500
#: Seconds of timed steps. With torch's import (~1.5 s) and the warm-up the whole run takes ~5 s on a
#: 2-core CPU.
TIME_BUDGET = 3.0
#: Timed steps stop after this many seconds even below MIN_STEPS (a very slow or very slowed device).
HARD_LIMIT = 30.0
#: The benchmark process is killed after this many seconds; the daemon then serves on without a score.
TIMEOUT = 60.0


# --- the workload (runs in the child process) ---------------------------------------------------------


def run_benchmark(
    *,
    device: str = "cpu",
    threads: int | None = None,
    slowdown: float = 1.0,
    time_budget: float = TIME_BUDGET,
) -> dict[str, Any]:
    """Run the standard workload here and now; return the result as a JSON-ready dict
    (the fields of :class:`worker_daemon.protocol.BenchmarkResult`)."""
    started = time.perf_counter()
    import torch
    from torch import nn

    if threads:
        torch.set_num_threads(threads)
    if device.startswith("cuda") and not torch.cuda.is_available():
        device = "cpu"
    torch.manual_seed(SEED)
    model = _build_model(torch, nn).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(SEED)
    batch = torch.randint(0, VOCAB_SIZE, (BATCH_SIZE, CONTEXT), generator=generator).to(device)

    def step() -> None:
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(WARMUP_STEPS):
        step()
    durations: list[float] = []
    timed_from = time.perf_counter()
    while len(durations) < MAX_STEPS:
        elapsed = time.perf_counter() - timed_from
        if len(durations) >= MIN_STEPS and elapsed >= time_budget:
            break
        if durations and elapsed >= HARD_LIMIT:
            break
        step_started = time.perf_counter()
        step()
        compute = time.perf_counter() - step_started
        if slowdown > 1.0:
            time.sleep((slowdown - 1.0) * compute)
        durations.append(time.perf_counter() - step_started)
    median = statistics.median(durations)
    device_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else ""
    return {
        "score": BATCH_SIZE / median,
        "device": device,
        "device_name": device_name,
        "model": MODEL_NAME,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "batch_size": BATCH_SIZE,
        "sequence_length": CONTEXT,
        "threads": torch.get_num_threads() if device == "cpu" else 0,
        "warmup_steps": WARMUP_STEPS,
        "steps": len(durations),
        "step_seconds": median,
        "duration_seconds": time.perf_counter() - started,
        "slowdown": slowdown,
        "torch_version": torch.__version__,
        "measured_at": datetime.now(UTC).isoformat(),
    }


def _build_model(torch, nn):
    class TinyGPT(nn.Module):
        """Token + position embeddings, pre-norm causal transformer blocks, a tied LM head (GPT-2's shape)."""

        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(VOCAB_SIZE, WIDTH)
            self.positions = nn.Embedding(CONTEXT, WIDTH)
            block = nn.TransformerEncoderLayer(
                WIDTH,
                HEADS,
                dim_feedforward=4 * WIDTH,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            self.blocks = nn.TransformerEncoder(block, LAYERS, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB_SIZE, bias=False)
            self.head.weight = self.tokens.weight

        def forward(self, ids):
            length = ids.shape[1]
            hidden = self.tokens(ids) + self.positions(torch.arange(length, device=ids.device))
            mask = nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
            hidden = self.blocks(hidden, mask=mask, is_causal=True)
            return self.head(self.norm(hidden))

    return TinyGPT()


# --- the daemon's side: run the child and validate its line -----------------------------------------------


def device_for(config: WorkerConfig) -> str:
    """``cuda`` when the config declares GPU memory (the child falls back to the CPU without CUDA), else
    ``cpu``."""
    return "cuda" if (config.resources.gpu or 0) > 0 else "cpu"


def threads_for(config: WorkerConfig, environ: Mapping[str, str] | None = None) -> int:
    """``OMP_NUM_THREADS`` when it is a positive integer (the executors run with it too), else the configured
    CPU cores (at least 1)."""
    environ = os.environ if environ is None else environ
    with contextlib.suppress(ValueError):
        threads = int(environ.get("OMP_NUM_THREADS", ""))
        if threads > 0:
            return threads
    return max(1, int(config.resources.cpu or 1))


def command(config: WorkerConfig, *, time_budget: float | None = None) -> list[str]:
    """The argv of the benchmark process for ``config``."""
    argv = [
        sys.executable,
        "-m",
        "worker_daemon.benchmark",
        "--device",
        device_for(config),
        "--threads",
        str(threads_for(config)),
        "--slowdown",
        repr(config.slowdown),
    ]
    if time_budget is not None:
        argv += ["--budget", repr(time_budget)]
    return argv


async def measure(
    config: WorkerConfig, *, timeout: float = TIMEOUT, time_budget: float | None = None
) -> protocol.BenchmarkResult:
    """Run the benchmark in a child process and return its validated result. Raises
    :class:`BenchmarkError` when it fails, prints nothing valid, or runs longer than ``timeout`` seconds
    (it is killed then). Cancelling the call kills the child too."""
    from pydantic import ValidationError

    from worker_daemon import protocol
    from worker_daemon.jobs import die_with_parent

    try:
        process = await asyncio.create_subprocess_exec(
            *command(config, time_budget=time_budget),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=die_with_parent,
        )
    except OSError as error:
        raise BenchmarkError(f"the benchmark could not start: {error.strerror or error}") from None
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        raise BenchmarkError(f"the benchmark ran longer than {timeout:g}s and was stopped") from None
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    if process.returncode != 0:
        last = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise BenchmarkError(f"the benchmark exited with status {process.returncode}: {last[0][:500]}")
    lines = stdout.decode(errors="replace").strip().splitlines()
    try:
        return protocol.BenchmarkResult.model_validate_json(lines[-1] if lines else "")
    except ValidationError as error:
        raise BenchmarkError(f"the benchmark printed no valid result: {error.errors()[0]['msg']}") from None


def describe(result: protocol.BenchmarkResult) -> str:
    """One line for logs and the CLI."""
    where = result.device + (f" ({result.device_name})" if result.device_name else "")
    threads = f", {result.threads} thread(s)" if result.threads else ""
    return (
        f"{result.score:.1f} samples/s ({result.model}, {where}{threads}, batch {result.batch_size}, "
        f"{result.steps} steps, median step {result.step_seconds * 1000:.1f} ms, "
        f"slowdown {result.slowdown:g}, {result.duration_seconds:.1f} s)"
    )


# --- python -m worker_daemon.benchmark ------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worker_daemon.benchmark",
        description="Run the worker benchmark here and print its result as one JSON line.",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--slowdown", type=float, default=1.0, help="sleep (F-1)×step after each step")
    parser.add_argument("--budget", type=float, default=TIME_BUDGET, help="seconds of timed steps")
    arguments = parser.parse_args(argv)
    if not 1.0 <= arguments.slowdown <= 100.0:
        parser.error("--slowdown must be between 1 and 100")
    if arguments.threads is not None and arguments.threads < 1:
        parser.error("--threads must be at least 1")
    result = run_benchmark(
        device=arguments.device,
        threads=arguments.threads,
        slowdown=arguments.slowdown,
        time_budget=max(0.0, arguments.budget),
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
