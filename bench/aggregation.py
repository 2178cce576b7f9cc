"""Parameter server aggregation benchmark: our streaming mean + Nesterov step against plain in-place torch.

For each model size (a GPT-2-shaped state dict of float32 tensors: embeddings, per-layer attention and MLP
matrices, biases and layer norms) and each number of updates M, one process builds M pseudo-gradients, the
global weights and an outer momentum once, then times, interleaved (the order alternates every repetition,
after one unmeasured warm-up of each) and reported as medians:

* **ours** — the parameter server's own code for a round (``parameter_server/rounds.py``), on one
  ``RoundCoordinator`` that lives across the repetitions, as it lives across a job's rounds: per update
  ``StreamingMean.add(update, weight, peaks=…)`` on the open round's mean (what ``submit`` does once it has
  checked the update; ``weight = float(X-Samples)``, different per update), then
  ``RoundCoordinator._close_round``: the outer step (``_step``: the mean, ``nesterov_step_``, the finiteness
  proof or checks, the new weights ``θ + u``), the record, the publication and the buffer pool's trim. No
  persist hook (no files), and the published result is dropped as soon as it is taken, as the service does
  once it has reported the round. The first round starts from a momentum of an earlier round; two rounds
  run unmeasured (the correctness check and a warm-up), so the timings are of the pool's steady state.
* **baseline** — the same arithmetic with plain in-place torch ops: ``accumulator.add_(update, alpha=w)``
  per tensor into ``zeros_like``, ``div_(Σw)``, ``m.mul_(μ).add_(g)``, ``u = g.add_(m, alpha=μ).mul_(lr)``,
  ``θ.add_(u)``. (Its momentum and weights are fresh copies each repetition, made outside the timing; it
  mutates the weights, which the parameter server must never do to weights it published.)

The two are compared once per configuration on the same first round (``torch.testing.assert_close``); a
mismatch exits 1. Goal (issue 15): baseline/ours ≥ 0.9.

**The update check** (``measure``: the L2 norm in float64 and the largest value of each tensor, which the
server checks against the round's bounds before it adds an update, and which the add is then given) has no
counterpart in the baseline: it is run once per update outside the timed rounds and reported in its own
column, per update. (Before issue 15 the add measured the largest values itself, inside "mean".)

**Peak memory**: per size and M, a fresh subprocess holds the global weights and the momentum (the state a
parameter server keeps anyway), resets its peak RSS (``/proc/self/clear_refs``), then runs
:data:`MEMORY_ROUNDS` rounds with each update created just before it is added and dropped after (as the
server loads one request body at a time; ours checks it first, as the server does), and reads ``VmHWM``. The growth over the RSS before the first
round, divided by the model's size in bytes, should be a small constant independent of M; goal ≤ 4. Ours
hands the coordinator the weights and momentum and keeps no reference to them (the coordinator drops them
after its first round, as a server drops its initial model). The in-place baseline is measured the same way.

Usage::

    python bench/aggregation.py                          # 1M, 25M, 124M parameters; M = 2, 4, 8
    python bench/aggregation.py --sizes 25M --updates 2,16 --repeats 9 --no-memory

Results and how to read them: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/aggregation.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

from bench.harness import load_average, machine_details  # noqa: E402

#: name → GPT-2 (n_layer, n_embd, vocab_size, n_positions). 124M is GPT-2 small itself.
SIZES: dict[str, tuple[int, int, int, int]] = {
    "1M": (2, 128, 4096, 256),
    "25M": (4, 640, 8192, 1024),
    "124M": (12, 768, 50257, 1024),
}
LEARNING_RATE = 0.7
MOMENTUM_FACTOR = 0.9
RATIO_GOAL = 0.9
MEMORY_GOAL = 4.0
MEMORY_PROBE_TIMEOUT = 600.0
#: Rounds a memory probe runs: the first one allocates the buffer pool, the later ones reuse it.
MEMORY_ROUNDS = 3
#: glibc's mmap threshold in the "returned" memory probes (bytes; glibc reads ``MALLOC_MMAP_THRESHOLD_``).
RETURNED_THRESHOLD = 1 << 20

Shapes = dict[str, tuple[int, ...]]


def gpt2_shapes(n_layer: int, n_embd: int, vocab_size: int, n_positions: int) -> Shapes:
    """The floating-point tensors of a GPT-2 ``model.safetensors`` (canonical names, tied head omitted)."""
    shapes: Shapes = {
        "transformer.wte.weight": (vocab_size, n_embd),
        "transformer.wpe.weight": (n_positions, n_embd),
        "transformer.ln_f.weight": (n_embd,),
        "transformer.ln_f.bias": (n_embd,),
    }
    for layer in range(n_layer):
        prefix = f"transformer.h.{layer}"
        shapes.update(
            {
                f"{prefix}.ln_1.weight": (n_embd,),
                f"{prefix}.ln_1.bias": (n_embd,),
                f"{prefix}.attn.c_attn.weight": (n_embd, 3 * n_embd),
                f"{prefix}.attn.c_attn.bias": (3 * n_embd,),
                f"{prefix}.attn.c_proj.weight": (n_embd, n_embd),
                f"{prefix}.attn.c_proj.bias": (n_embd,),
                f"{prefix}.ln_2.weight": (n_embd,),
                f"{prefix}.ln_2.bias": (n_embd,),
                f"{prefix}.mlp.c_fc.weight": (n_embd, 4 * n_embd),
                f"{prefix}.mlp.c_fc.bias": (4 * n_embd,),
                f"{prefix}.mlp.c_proj.weight": (4 * n_embd, n_embd),
                f"{prefix}.mlp.c_proj.bias": (n_embd,),
            }
        )
    return shapes


def parameter_count(shapes: Shapes) -> int:
    return sum(_numel(shape) for shape in shapes.values())


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dimension in shape:
        count *= dimension
    return count


def samples_of(index: int) -> int:
    """The ``X-Samples`` of update ``index``: different per update, so the weighted mean is exercised."""
    return 1024 + 96 * index


def random_state(shapes: Shapes, seed: int, scale: float):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) * scale for name, shape in shapes.items()}


# --- the two paths ---------------------------------------------------------------------------------------------


class Ours:
    """A ``RoundCoordinator`` driven the way the server drives it, minus HTTP, files and the norm check; it
    keeps its state (weights, momentum, buffer pool) from round to round. Holds an event loop."""

    def __init__(self, weights, momentum) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()
        self.rounds = self.loop.run_until_complete(self._start(dict(weights), dict(momentum)))

    @staticmethod
    async def _start(weights, momentum):
        from parameter_server.rounds import RoundCoordinator

        return RoundCoordinator(
            expected=["trainer"],
            weights=weights,
            momentum=momentum,
            rounds_completed=0,
            update_rounds=1_000_000,
            round_timeout=3600.0,
            weighted=True,
            learning_rate=LEARNING_RATE,
            momentum_factor=MOMENTUM_FACTOR,
        )

    @staticmethod
    def check(update) -> dict[str, float]:
        """``submit``'s check of an update (``_measure_and_add``: ``measure``, its L2 norm in float64 and its
        largest values, against the round's bounds); the largest values, which the add is given."""
        from parameter_server.math import measure

        _, peaks = measure(update)
        return peaks

    def add(self, update, count: int, peaks: dict[str, float]) -> None:
        """``submit``'s work on an update once checked: add it to the open round's mean."""
        current = self.rounds._round
        current.mean.add(update, float(count), peaks=peaks)  # weight = float(samples) in a weighted round
        current.participants.append(f"trainer-{current.mean.count}")

    def close(self) -> None:
        """Close the open round (the step, publication, trim) and drop the published result."""
        current = self.rounds._round
        current.closing = True
        closed = self.loop.run_until_complete(self.rounds._close_round(current))
        if closed is None:
            raise RuntimeError(f"the round failed: {self.rounds.failure.result()!r}")
        self.rounds.published.get_nowait()

    def round(self, updates, samples, peaks) -> tuple[float, float]:
        """One round of ``updates`` (checked already: ``peaks``); (add s, step s)."""
        started = time.perf_counter()
        for update, count, largest in zip(updates, samples, peaks, strict=True):
            self.add(update, count, largest)
        added = time.perf_counter()
        self.close()
        return added - started, time.perf_counter() - added

    def aclose(self) -> None:
        self.loop.run_until_complete(self.rounds.aclose())
        self.loop.close()


def baseline(updates, samples, weights, momentum):
    """Plain in-place torch: sum into an accumulator, divide, Nesterov in place. Mutates ``weights`` and
    ``momentum`` (the caller passes copies); (θ_new, m_new, add s, step s)."""
    import torch

    started = time.perf_counter()
    accumulators = {name: torch.zeros_like(tensor) for name, tensor in updates[0].items()}
    for update, count in zip(updates, samples, strict=True):
        for name, accumulator in accumulators.items():
            accumulator.add_(update[name], alpha=float(count))
    added = time.perf_counter()
    total = float(sum(samples))
    for name, gradient in accumulators.items():
        gradient.div_(total)
        momentum[name].mul_(MOMENTUM_FACTOR).add_(gradient)  # m ← μ·m + g
        step = gradient.add_(momentum[name], alpha=MOMENTUM_FACTOR).mul_(LEARNING_RATE)  # u = lr·(g + μ·m)
        weights[name].add_(step)
    done = time.perf_counter()
    return weights, momentum, added - started, done - added


# --- timing ----------------------------------------------------------------------------------------------------


def time_configuration(shapes: Shapes, updates: list, weights, momentum, repeats: int) -> dict[str, float]:
    """Interleaved repetitions of both paths on the same updates; medians in ms. Raises AssertionError if the
    two disagree on the first round."""
    import torch

    samples = [samples_of(index) for index in range(len(updates))]
    # The check of each update, once (the server runs it before the add; the baseline has none): timed apart.
    peaks, checks = [], []
    for update in updates:
        started = time.perf_counter()
        peaks.append(Ours.check(update))
        checks.append(time.perf_counter() - started)
    ours = Ours(weights, momentum)

    def run_baseline() -> tuple[float, float]:
        weights_copy = {name: tensor.clone() for name, tensor in weights.items()}
        momentum_copy = {name: tensor.clone() for name, tensor in momentum.items()}
        _, _, add, step = baseline(updates, samples, weights_copy, momentum_copy)
        return add, step

    try:
        # Correctness first (and the warm-up): both must compute the same round from the same state.
        ours.round(updates, samples, peaks)
        actual_weights, actual_momentum, _, _ = baseline(
            updates,
            samples,
            {name: tensor.clone() for name, tensor in weights.items()},
            {name: tensor.clone() for name, tensor in momentum.items()},
        )
        expected_momentum = ours.rounds.momentum
        for name in shapes:
            torch.testing.assert_close(actual_weights[name], ours.rounds.weights[name], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(actual_momentum[name], expected_momentum[name], rtol=1e-5, atol=1e-6)
        del actual_weights, actual_momentum, expected_momentum
        # A second unmeasured round: the pool has its steady number of sets from the third round of a job on
        # (the first round's new weights and momentum replace ones the pool did not make).
        ours.round(updates, samples, peaks)

        timings: dict[str, list[tuple[float, float]]] = {"ours": [], "baseline": []}
        runners: dict[str, Callable[[], tuple[float, float]]] = {
            "ours": lambda: ours.round(updates, samples, peaks),
            "baseline": run_baseline,
        }
        for repeat in range(repeats):
            order = ["ours", "baseline"] if repeat % 2 == 0 else ["baseline", "ours"]
            for name in order:
                timings[name].append(runners[name]())
        pool = ours.rounds.pool
        sets, allocated = pool.sets, pool.allocated
    finally:
        ours.aclose()
    result = {"pool_sets": sets, "pool_allocated": allocated, "check": statistics.median(checks) * 1000}
    for name, values in timings.items():
        result[f"{name}_add"] = statistics.median(add for add, _ in values) * 1000
        result[f"{name}_step"] = statistics.median(step for _, step in values) * 1000
        result[f"{name}_total"] = statistics.median(add + step for add, step in values) * 1000
        result[f"{name}_best"] = min(add + step for add, step in values) * 1000
    return result


# --- memory (one subprocess per size, M and path) ---------------------------------------------------------------


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_probe(size: str, count: int, path: str) -> dict[str, float]:
    """Run in a fresh process: peak RSS growth of one round of ``count`` updates through ``path``."""
    import torch

    shapes = gpt2_shapes(*SIZES[size])
    model_bytes = parameter_count(shapes) * 4
    weights = random_state(shapes, seed=1, scale=0.02)
    momentum = random_state(shapes, seed=2, scale=0.001)
    rss_before = _proc_status_kib("VmRSS") * 1024
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    reset = _proc_status_kib("VmHWM") * 1024 <= rss_before + (1 << 20)
    samples = [samples_of(index) for index in range(count)]
    if path == "ours":
        ours = Ours(weights, momentum)
        del weights, momentum  # the coordinator holds them until its first round replaces them
        for _ in range(MEMORY_ROUNDS):
            for index in range(count):
                update = random_state(shapes, seed=100 + index, scale=0.001)  # the request body, loaded
                ours.add(update, samples[index], Ours.check(update))
                del update
            ours.close()
        new_weights = ours.rounds.weights
        sets = ours.rounds.pool.sets
    else:
        accumulators = {name: torch.zeros(shape) for name, shape in shapes.items()}
        for _ in range(MEMORY_ROUNDS):
            for accumulator in accumulators.values():
                accumulator.zero_()
            for index in range(count):
                update = random_state(shapes, seed=100 + index, scale=0.001)
                for name, accumulator in accumulators.items():
                    accumulator.add_(update[name], alpha=float(samples[index]))
                del update
            total = float(sum(samples))
            for name, gradient in accumulators.items():
                gradient.div_(total)
                momentum[name].mul_(MOMENTUM_FACTOR).add_(gradient)
                weights[name].add_(gradient.add_(momentum[name], alpha=MOMENTUM_FACTOR).mul_(LEARNING_RATE))
        new_weights = weights
        sets = 0
    peak = _proc_status_kib("VmHWM") * 1024
    assert len(new_weights) == len(shapes)
    return {"model_bytes": model_bytes, "rss_before": rss_before, "peak": peak, "reset": reset, "sets": sets}


def measure_memory(size: str, count: int, path: str, allocator: str) -> dict[str, float]:
    """One probe in a fresh process; ``allocator`` "default" (glibc as it comes) or "returned" (glibc's mmap
    threshold fixed at :data:`RETURNED_THRESHOLD`: every tensor of 1 MiB or more is its own mapping and goes
    back to the system when freed, so the peak counts live tensors only)."""
    environment = dict(os.environ)
    environment.pop("MALLOC_MMAP_THRESHOLD_", None)
    if allocator == "returned":
        environment["MALLOC_MMAP_THRESHOLD_"] = str(RETURNED_THRESHOLD)
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--memory-probe", size, str(count), path],
        capture_output=True,
        text=True,
        timeout=MEMORY_PROBE_TIMEOUT,
        cwd=REPO_ROOT,
        env=environment,
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory probe {size} M={count} {path} exited {done.returncode}:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- report ----------------------------------------------------------------------------------------------------


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python bench/aggregation.py",
        description=__doc__.split("\n\n")[0],
        epilog="Prints the machine and markdown tables; exits 1 if a configuration fails. "
        "See docs/benchmarks.md for results.",
    )
    parser.add_argument(
        "--sizes",
        default=",".join(SIZES),
        help=f"comma-separated model sizes among {', '.join(SIZES)} (default: all)",
    )
    parser.add_argument("--updates", default="2,4,8", help="comma-separated M values (default: 2,4,8)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="measured repetitions of each path, median reported (default: 5)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--memory-probe", nargs=3, metavar=("SIZE", "M", "PATH"), help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.memory_probe:
        return arguments
    arguments.size_names = [name.strip() for name in arguments.sizes.split(",") if name.strip()]
    unknown = [name for name in arguments.size_names if name not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {', '.join(unknown)}; choose among {', '.join(SIZES)}")
    try:
        arguments.counts = sorted({int(value) for value in arguments.updates.split(",") if value.strip()})
    except ValueError:
        parser.error(f"--updates must be comma-separated integers, got {arguments.updates!r}")
    if not arguments.counts or arguments.counts[0] < 1:
        parser.error("--updates needs values >= 1")
    if arguments.repeats < 1:
        parser.error("--repeats must be >= 1")
    return arguments


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    if arguments.memory_probe:
        size, count, path = arguments.memory_probe
        print(json.dumps(memory_probe(size, int(count), path)))
        return 0

    import torch

    print(f"# Aggregation benchmark — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n")
    for key, value in machine_details().items():
        print(f"- {key}: {value}")
    print(f"- torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    print(f"- load average (1/5/15 min) at start: {load_average()}")
    print(
        f"- lr {LEARNING_RATE}, μ {MOMENTUM_FACTOR}, weighted (X-Samples 1024 + 96·i), momentum from an earlier "
        f"round; {arguments.repeats} interleaved repetitions after a warm-up, medians\n",
        flush=True,
    )

    failures = 0
    rows = []
    for size in arguments.size_names:
        shapes = gpt2_shapes(*SIZES[size])
        parameters = parameter_count(shapes)
        print(f"… {size}: {parameters:,} parameters in {len(shapes)} tensors", file=sys.stderr, flush=True)
        weights = random_state(shapes, seed=1, scale=0.02)
        momentum = random_state(shapes, seed=2, scale=0.001)
        all_updates = [
            random_state(shapes, seed=100 + index, scale=0.001) for index in range(max(arguments.counts))
        ]
        for count in arguments.counts:
            try:
                timing = time_configuration(shapes, all_updates[:count], weights, momentum, arguments.repeats)
            except AssertionError as error:
                print(f"  {size} M={count}: ours and the baseline disagree: {error}", file=sys.stderr)
                failures += 1
                continue
            rows.append((size, parameters, len(shapes), count, timing))
            print(
                f"  M={count}: ours {timing['ours_total']:.1f} ms, baseline {timing['baseline_total']:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
        del weights, momentum, all_updates

    print(f"load average (1/5/15 min) after the timings: {load_average()}\n")
    print(
        "| model | parameters | tensors | M | ours ms | ours: mean / step | baseline ms "
        f"| baseline: sum / step | baseline/ours | ≥ {RATIO_GOAL} | ratio of the fastest runs | pool sets "
        "| update check ms, each (not in ours) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|---:|")
    below_goal = 0
    for size, parameters, tensors, count, timing in rows:
        ratio = timing["baseline_total"] / timing["ours_total"]
        below_goal += ratio < RATIO_GOAL
        print(
            f"| {size} | {parameters:,} | {tensors} | {count} | {timing['ours_total']:.1f} "
            f"| {timing['ours_add']:.1f} / {timing['ours_step']:.1f} | {timing['baseline_total']:.1f} "
            f"| {timing['baseline_add']:.1f} / {timing['baseline_step']:.1f} | {ratio:.2f} "
            f"| {'yes' if ratio >= RATIO_GOAL else 'no'} | {timing['baseline_best'] / timing['ours_best']:.2f} "
            f"| {timing['pool_sets']} ({timing['pool_allocated']} allocated) | {timing['check']:.1f} |"
        )

    memory_missed = 0
    if not arguments.no_memory:
        print(
            f"\nPeak RSS growth during {MEMORY_ROUNDS} rounds (fresh subprocess each; weights and momentum "
            "already held), ÷ model size; glibc as it comes, and with freed memory returned to the system "
            f"(MALLOC_MMAP_THRESHOLD_={RETURNED_THRESHOLD}):\n"
        )
        print(
            "| model | model MB | M | ours peak growth MB | ours ÷ model | ours ÷ model, freed returned "
            f"| ≤ {MEMORY_GOAL:g} | ours pool sets | in-place baseline ÷ model | baseline, freed returned |"
        )
        print("|---|---:|---:|---:|---:|---:|:---:|---:|---:|---:|")
        for size in arguments.size_names:
            for count in arguments.counts:
                print(f"… memory {size} M={count}", file=sys.stderr, flush=True)
                try:
                    measured = {
                        (path, allocator): measure_memory(size, count, path, allocator)
                        for path in ("ours", "baseline")
                        for allocator in ("default", "returned")
                    }
                except (RuntimeError, subprocess.TimeoutExpired, ValueError) as error:
                    print(f"  {error}", file=sys.stderr)
                    failures += 1
                    continue
                model_bytes = measured["ours", "default"]["model_bytes"]
                growth = {key: value["peak"] - value["rss_before"] for key, value in measured.items()}
                share = {key: value / model_bytes for key, value in growth.items()}
                not_reset = [key for key, value in measured.items() if not value["reset"]]
                if not_reset:
                    print(f"  warning: VmHWM was not reset for {not_reset}", file=sys.stderr)
                met = [share["ours", allocator] <= MEMORY_GOAL for allocator in ("default", "returned")]
                memory_missed += not met[0]
                print(
                    f"| {size} | {model_bytes / 1e6:.1f} | {count} | {growth['ours', 'default'] / 1e6:.1f} "
                    f"| {share['ours', 'default']:.2f} | {share['ours', 'returned']:.2f} "
                    f"| {' / '.join('yes' if value else 'no' for value in met)} "
                    f"| {measured['ours', 'default']['sets']} | {share['baseline', 'default']:.2f} "
                    f"| {share['baseline', 'returned']:.2f} |",
                    flush=True,
                )

    print(
        f"\n{len(rows) - below_goal} of {len(rows)} configurations meet baseline/ours ≥ {RATIO_GOAL}"
        + (
            ""
            if arguments.no_memory
            else f"; {memory_missed} miss peak memory ≤ {MEMORY_GOAL:g}× the model (glibc as it comes)"
        )
        + f"; load average at the end: {load_average()}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
