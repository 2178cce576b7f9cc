"""Parameter server aggregation benchmark: our streaming mean + Nesterov step against plain in-place torch.

For each model size (a GPT-2-shaped state dict of float32 tensors: embeddings, per-layer attention and MLP
matrices, biases and layer norms) and each number of updates M, one process builds M pseudo-gradients, the
global weights and an outer momentum once, then times, interleaved (the order alternates every repetition,
after one unmeasured warm-up of each) and reported as medians:

* **ours** — exactly what the parameter server does with a round (``parameter_server/rounds.py``): a
  ``StreamingMean``, ``add(update, weight)`` per update with ``weight = float(X-Samples)`` (a weighted round;
  the samples differ per update), then ``RoundCoordinator._step``: ``mean.result()``,
  ``nesterov_step(gradient=…, momentum=…, learning_rate=…, momentum_factor=…)`` with a momentum from an
  earlier round (the steady state), and the new weights ``θ + u`` as new tensors.
* **baseline** — the same arithmetic with plain in-place torch ops: ``accumulator.add_(update, alpha=w)``
  per tensor, ``div_(Σw)``, ``m.mul_(μ).add_(g)``, ``u = g.add_(m, alpha=μ).mul_(lr)``, ``θ.add_(u)``.
  (Its momentum and weights are fresh copies each repetition, made outside the timing.)

The two results are compared once per configuration (``torch.testing.assert_close``); a mismatch exits 1.
Goal: baseline/ours ≥ 0.8 (ours at most 25 % slower).

**Peak memory**: per size and M, a fresh subprocess holds the global weights and the momentum (the state a
parameter server keeps anyway), resets its peak RSS (``/proc/self/clear_refs``), then runs the streaming path
with each update created just before it is added and dropped after (as the server loads one request body at
a time), and reads ``VmHWM``. The growth over the RSS before the round, divided by the model's size in bytes,
should be a small constant independent of M. The in-place baseline is measured the same way for reference.

Usage::

    python bench/aggregation.py                          # 1M, 25M, 124M parameters; M = 2, 4, 8
    python bench/aggregation.py --sizes 25M --updates 2,16 --repeats 9 --no-memory

Results and how to read them: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
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
RATIO_GOAL = 0.8
MEMORY_PROBE_TIMEOUT = 600.0

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


def ours(updates, samples, weights, momentum):
    """What ``RoundCoordinator.submit`` (per update) and ``RoundCoordinator._step`` do; (θ_new, m_new, add s,
    step s)."""
    from parameter_server.math import StreamingMean, nesterov_step

    started = time.perf_counter()
    streaming = StreamingMean()
    for update, count in zip(updates, samples, strict=True):
        streaming.add(update, float(count))  # submit(): weight = float(samples) in a weighted round
    added = time.perf_counter()
    gradient = streaming.result()
    update, new_momentum = nesterov_step(
        gradient=gradient,
        momentum=momentum,
        learning_rate=LEARNING_RATE,
        momentum_factor=MOMENTUM_FACTOR,
    )
    new_weights = {
        name: tensor + update[name] if name in update else tensor for name, tensor in weights.items()
    }
    done = time.perf_counter()
    return new_weights, new_momentum, added - started, done - added


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
    """Interleaved repetitions of both paths on the same tensors; medians in ms. Raises AssertionError if the
    two disagree."""
    import torch

    samples = [samples_of(index) for index in range(len(updates))]

    def run_ours() -> tuple[float, float]:
        _, _, add, step = ours(updates, samples, weights, momentum)
        return add, step

    def run_baseline() -> tuple[float, float]:
        weights_copy = {name: tensor.clone() for name, tensor in weights.items()}
        momentum_copy = {name: tensor.clone() for name, tensor in momentum.items()}
        _, _, add, step = baseline(updates, samples, weights_copy, momentum_copy)
        return add, step

    # Correctness first (and the warm-up): both must compute the same round.
    expected_weights, expected_momentum, _, _ = ours(updates, samples, weights, momentum)
    actual_weights, actual_momentum, _, _ = baseline(
        updates,
        samples,
        {name: tensor.clone() for name, tensor in weights.items()},
        {name: tensor.clone() for name, tensor in momentum.items()},
    )
    for name in shapes:
        torch.testing.assert_close(actual_weights[name], expected_weights[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(actual_momentum[name], expected_momentum[name], rtol=1e-5, atol=1e-6)
    del expected_weights, expected_momentum, actual_weights, actual_momentum

    timings: dict[str, list[tuple[float, float]]] = {"ours": [], "baseline": []}
    runners: dict[str, Callable[[], tuple[float, float]]] = {"ours": run_ours, "baseline": run_baseline}
    for repeat in range(repeats):
        order = ["ours", "baseline"] if repeat % 2 == 0 else ["baseline", "ours"]
        for name in order:
            timings[name].append(runners[name]())
    result = {}
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
        from parameter_server.math import StreamingMean, nesterov_step

        streaming = StreamingMean()
        for index in range(count):
            update = random_state(shapes, seed=100 + index, scale=0.001)  # the request body, loaded
            streaming.add(update, float(samples[index]))
            del update
        gradient = streaming.result()
        update, new_momentum = nesterov_step(
            gradient=gradient, momentum=momentum, learning_rate=LEARNING_RATE, momentum_factor=MOMENTUM_FACTOR
        )
        new_weights = {name: tensor + update[name] for name, tensor in weights.items()}
    else:
        accumulators = {name: torch.zeros(shape) for name, shape in shapes.items()}
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
    peak = _proc_status_kib("VmHWM") * 1024
    assert len(new_weights) == len(shapes)
    return {"model_bytes": model_bytes, "rss_before": rss_before, "peak": peak, "reset": reset}


def measure_memory(size: str, count: int, path: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--memory-probe", size, str(count), path],
        capture_output=True,
        text=True,
        timeout=MEMORY_PROBE_TIMEOUT,
        cwd=REPO_ROOT,
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
        "| baseline: sum / step | baseline/ours | ≥ 0.8 | ratio of the fastest runs |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|")
    below_goal = 0
    for size, parameters, tensors, count, timing in rows:
        ratio = timing["baseline_total"] / timing["ours_total"]
        below_goal += ratio < RATIO_GOAL
        print(
            f"| {size} | {parameters:,} | {tensors} | {count} | {timing['ours_total']:.1f} "
            f"| {timing['ours_add']:.1f} / {timing['ours_step']:.1f} | {timing['baseline_total']:.1f} "
            f"| {timing['baseline_add']:.1f} / {timing['baseline_step']:.1f} | {ratio:.2f} "
            f"| {'yes' if ratio >= RATIO_GOAL else 'no'} | {timing['baseline_best'] / timing['ours_best']:.2f} |"
        )

    if not arguments.no_memory:
        print(
            "\nPeak RSS growth during one round (fresh subprocess each; weights and momentum already held), "
            "÷ model size:\n"
        )
        print(
            "| model | model MB | M | ours peak growth MB | ours ÷ model | in-place baseline MB | baseline ÷ model |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for size in arguments.size_names:
            for count in arguments.counts:
                print(f"… memory {size} M={count}", file=sys.stderr, flush=True)
                try:
                    measured = {path: measure_memory(size, count, path) for path in ("ours", "baseline")}
                except (RuntimeError, subprocess.TimeoutExpired, ValueError) as error:
                    print(f"  {error}", file=sys.stderr)
                    failures += 1
                    continue
                model_bytes = measured["ours"]["model_bytes"]
                growth = {path: value["peak"] - value["rss_before"] for path, value in measured.items()}
                not_reset = [path for path, value in measured.items() if not value["reset"]]
                if not_reset:
                    print(f"  warning: VmHWM was not reset for {not_reset}", file=sys.stderr)
                print(
                    f"| {size} | {model_bytes / 1e6:.1f} | {count} | {growth['ours'] / 1e6:.1f} "
                    f"| {growth['ours'] / model_bytes:.2f} | {growth['baseline'] / 1e6:.1f} "
                    f"| {growth['baseline'] / model_bytes:.2f} |",
                    flush=True,
                )

    print(
        f"\n{len(rows) - below_goal} of {len(rows)} configurations meet baseline/ours ≥ {RATIO_GOAL}; "
        f"load average at the end: {load_average()}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
