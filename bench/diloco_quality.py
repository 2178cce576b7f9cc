"""DiLoCo quality benchmark: the real system's DiLoCo against one worker and against data parallelism.

On one byte-level dataset (the standard library's sources, ``bench.cluster.prepare_stdlib_text``; the slices
of ``--eval-slices`` held out for evaluation, the job's ``evaluation.slices``) and one model
(``bench.cluster.TINY_GPT2``, built with ``torch.manual_seed(0)`` like the parameter server builds it), it
trains three ways and evaluates each on the same held-out slices with the parameter server's own evaluator
(``parameter_server.evaluation.Evaluator``: the sample-weighted mean of the model's loss over batches of 32):

* **(a) DiLoCo, the real system**: ``bench.cluster.training_cluster`` with ``--trainers + 1`` worker daemons
  (the market picks the parameter server), one job of ``--trainers`` trainers × ``--rounds`` rounds ×
  ``--inner-steps`` (H) AdamW steps of ``--batch-size`` samples, outer Nesterov ``--outer lr:momentum``
  (several settings: one job each, on the same cluster). Eval loss per round is the parameter server's; the
  final model is downloaded and evaluated here too, as a check. Bytes are the rounds' measured
  ``bytes_in + bytes_out``. With ``--encodings`` (docs/training.md, "Encodings") one job per outer setting and
  encoding; a last table puts each encoding's final eval loss next to float32's, as a ratio. With
  ``--overlaps`` (docs/training.md, "Overlap: eager updates") one job per outer setting, encoding and overlap
  mode — ``none``, ``eager``, or ``eager-local`` (eager with the trainer's own weights as the proxy, the
  daemons' ``HYPHA_EAGER_PROXY=local`` experiment knob: a second cluster); a mode may be given twice, to see
  the run-to-run noise — and a table puts each mode's final eval loss next to the first ``none``'s. Tokens
  are the rounds' samples (an eager trainer's steps of the round after the last are never part of a round).
* **(b) one worker**: in this process, plain torch + transformers: the same model, AdamW with the same
  learning rate (and torch's defaults, as the executor), H × rounds steps of the same batch size: the steps
  of one DiLoCo trainer with no one to average with. No communication.
* **(c) synchronous data parallelism**: one in-process model, batches of trainers × batch size (what N
  workers averaging their gradients every step compute), H × rounds steps: the same tokens as (a). Bytes are
  *computed*, not measured: 2 × model bytes × workers × steps (every worker sends its gradient and receives
  the average, each step).

Data order (all three): the training slices in index order, epoch after epoch, samples in slice order, no
shuffling: the control plane hands out the lowest-index free slice of the epoch and the executor reads a
slice front to back. In (a) the trainers interleave over that sequence; (c) reads one 64-sample slice per
step at the default sizes.

The in-process baselines run one after the other, before the cluster starts, on ``--threads`` torch threads
(default 1, like each trainer executor: the cluster runs executors with ``OMP_NUM_THREADS=1``).

Usage::

    python bench/diloco_quality.py                                 # 4 trainers, H=50, 4 rounds, outer 0.7:0.9
    python bench/diloco_quality.py --rounds 2 --inner-steps 10     # a quick run
    python bench/diloco_quality.py --outer 0.7:0.9,0.7:0.5,1.0:0 --skip-baselines   # outer-optimizer sweep
    python bench/diloco_quality.py --encodings float32,float16,bfloat16,int8 --skip-baselines   # encodings
    python bench/diloco_quality.py --overlaps none,eager,eager-local,none --skip-baselines       # overlap

Results and how to read them: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if (
    str(REPO_ROOT) not in sys.path
):  # run as `python bench/diloco_quality.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

from bench.cluster import TINY_GPT2, diloco_spec, prepare_stdlib_text, training_cluster  # noqa: E402
from bench.harness import load_average, print_start, resolve_mode, run_directory  # noqa: E402

SEQ_LEN = 128
SAMPLES_PER_SLICE = 64
EVAL_BATCH_SIZE = 32
SEED = 0  # the spec's default model.seed
OVERLAPS = ("none", "eager", "eager-local", "streaming")
#: The daemons' environment for ``eager-local`` (worker_daemon/executors/overlap.py's experiment knob).
LOCAL_PROXY_ENV = {"HYPHA_EAGER_PROXY": "local"}


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python bench/diloco_quality.py",
        description=__doc__.split("\n\n")[0],
        epilog="Prints the machine and markdown tables. See docs/benchmarks.md for results.",
    )
    parser.add_argument("--trainers", type=int, default=4, help="DiLoCo trainers (default: 4)")
    parser.add_argument("--inner-steps", type=int, default=50, help="H: AdamW steps per round (default: 50)")
    parser.add_argument("--rounds", type=int, default=4, help="outer rounds (default: 4)")
    parser.add_argument(
        "--batch-size", type=int, default=16, help="samples per step per trainer (default: 16)"
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate (default: 3e-3)")
    parser.add_argument(
        "--outer",
        default="0.7:0.9",
        help="outer Nesterov settings lr:momentum, comma-separated; one DiLoCo job each (default: 0.7:0.9, "
        "the spec's default)",
    )
    parser.add_argument(
        "--encodings",
        default="float32",
        help="encodings of pseudo-gradients and results, comma-separated; one DiLoCo job each per outer "
        "setting (float32, float16, bfloat16, int8; default: float32)",
    )
    parser.add_argument(
        "--overlaps",
        default="none",
        help="overlap modes, comma-separated, one DiLoCo job each per outer setting and encoding: none, eager, "
        "eager-local, streaming (a mode may repeat: a second job of it; default: none)",
    )
    parser.add_argument(
        "--fragments",
        type=int,
        default=4,
        help="streaming: fragments F; its job runs F × --rounds rounds of H / F steps (each fragment synced "
        "every H steps, the same tokens as the others; default: 4)",
    )
    parser.add_argument(
        "--mix", type=float, default=None, help="streaming: the mixing factor α (default: the spec's, 0.5)"
    )
    parser.add_argument(
        "--block-size", type=int, default=256, help="values per int8 scale (default: 256, the spec's default)"
    )
    parser.add_argument(
        "--eval-slices",
        default="spread:4",
        help="held-out eval slices: spread:N (N slices evenly spread over the dataset), last:N (the last N, "
        "the spec's holdout), or comma-separated indices (default: spread:4)",
    )
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=600_000,
        help="bytes of stdlib source in the dataset (default: 600000)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the baselines (default: 1)")
    parser.add_argument("--skip-baselines", action="store_true", help="run only the DiLoCo job(s)")
    parser.add_argument("--skip-diloco", action="store_true", help="run only the in-process baselines")
    parser.add_argument(
        "--mode",
        choices=["auto", "embedded", "services"],
        default="embedded",
        help="control plane mode (default: embedded; auto: services if DATABASE_URL and REDIS_URL are set)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="give up on a job after this many seconds"
    )
    parser.add_argument("--json", type=Path, help="also write the raw results (job details included) here")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory and print its path")
    arguments = parser.parse_args(argv)
    if min(arguments.trainers, arguments.inner_steps, arguments.rounds, arguments.batch_size) < 1:
        parser.error("--trainers, --inner-steps, --rounds and --batch-size must be at least 1")
    try:
        arguments.outer = [
            (float(item.split(":")[0]), float(item.split(":")[1]))
            for item in arguments.outer.split(",")
            if item.strip()
        ]
    except (ValueError, IndexError):
        parser.error(f"--outer must be comma-separated lr:momentum pairs, not {arguments.outer!r}")
    if not arguments.outer and not arguments.skip_diloco:
        parser.error("--outer needs at least one lr:momentum pair")
    from hypha_tensors.formats import ENCODINGS

    arguments.encodings = [item.strip() for item in arguments.encodings.split(",") if item.strip()]
    unknown = [item for item in arguments.encodings if item not in ENCODINGS]
    if unknown or not arguments.encodings:
        parser.error(f"--encodings takes {', '.join(ENCODINGS)}, not {arguments.encodings!r}")
    arguments.overlaps = [item.strip() for item in arguments.overlaps.split(",") if item.strip()]
    if not arguments.overlaps or any(item not in OVERLAPS for item in arguments.overlaps):
        parser.error(f"--overlaps takes {', '.join(OVERLAPS)}, not {arguments.overlaps!r}")
    if "streaming" in arguments.overlaps and (
        arguments.fragments < 2 or arguments.inner_steps % arguments.fragments
    ):
        parser.error(
            "streaming needs --fragments ≥ 2 that divides --inner-steps (each round runs H / F steps)"
        )
    return arguments


# --- model, data, evaluation ---------------------------------------------------------------------------------


def eval_slices(choice: str, count: int) -> list[int]:
    """The held-out slice indices ``--eval-slices`` names, for a dataset of ``count`` slices."""
    kind, _, number = choice.partition(":")
    try:
        if kind == "spread":
            wanted = int(number)
            indices = sorted({int((position + 0.5) * count / wanted) for position in range(wanted)})
        elif kind == "last":
            indices = list(range(max(0, count - int(number)), count))
        else:
            indices = sorted({int(index) for index in choice.split(",") if index.strip()})
    except (ValueError, ZeroDivisionError):
        raise SystemExit(f"--eval-slices {choice!r}: spread:N, last:N or comma-separated indices") from None
    if not indices or indices[-1] >= count or len(indices) >= count:
        raise SystemExit(f"--eval-slices {choice!r} does not fit a dataset of {count} slices")
    return indices


def build_model():
    """The job's initial model, exactly as the parameter server builds a ``config`` source."""
    import torch
    import transformers

    config = dict(TINY_GPT2)
    model_type = config.pop("model_type")
    torch.manual_seed(SEED)
    return transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **config)
    )


def model_bytes(model) -> int:
    """Bytes of the model's distinct floating-point tensors (tied weights once): one copy on the wire."""
    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict().values():
        if not tensor.is_floating_point() or tensor.untyped_storage().data_ptr() in seen:
            continue
        seen.add(tensor.untyped_storage().data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def make_evaluator(dataset: Path, held_out: list[int], cache_dir: Path):
    """The parameter server's evaluator on the held-out slices, loaded from local copies (its cache)."""
    import aiohttp

    from data_node.slices import sha256_of, slice_file_name
    from parameter_server.evaluation import Evaluator
    from parameter_server.job import EvalConfig, EvalSlice

    cache_dir.mkdir(parents=True, exist_ok=True)
    slices = []
    for index in held_out:
        source = dataset / slice_file_name(index)
        shutil.copyfile(source, cache_dir / str(index))  # the evaluator's cache: no download needed
        slices.append(EvalSlice(index=index, size=source.stat().st_size, sha256=sha256_of(source), urls=()))
    evaluator = Evaluator(
        config=EvalConfig(dataset=dataset.name, batch_size=EVAL_BATCH_SIZE, slices=tuple(slices)),
        input_names=("input_ids", "labels"),
        cache_dir=cache_dir,
    )

    async def prepare() -> None:
        async with aiohttp.ClientSession() as session:
            await evaluator.prepare(session)

    asyncio.run(prepare())
    return evaluator


def batches(dataset: Path, training: list[int], batch_size: int):
    """Endless batches of ``batch_size`` samples: training slices in index order, epoch after epoch."""
    import torch
    from safetensors.torch import load_file

    from data_node.slices import slice_file_name

    pending: list[dict[str, torch.Tensor]] = []
    have = 0
    while True:
        for index in training:
            tensors = load_file(str(dataset / slice_file_name(index)))
            pending.append({"input_ids": tensors["input_ids"], "labels": tensors["labels"]})
            have += len(tensors["input_ids"])
            while have >= batch_size:
                columns = {
                    name: torch.cat([part[name] for part in pending]) for name in ("input_ids", "labels")
                }
                yield {name: tensor[:batch_size] for name, tensor in columns.items()}
                rest = {name: tensor[batch_size:] for name, tensor in columns.items()}
                have -= batch_size
                pending = [rest] if have else []


# --- the three ways ----------------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    eval_losses: list[float | None]  # after round 0 (the initial model), 1, …, rounds
    tokens: int
    wall_seconds: float
    bytes_communicated: int
    bytes_note: str
    extra: dict = field(default_factory=dict)


def train_in_process(
    *,
    name: str,
    dataset: Path,
    training: list[int],
    evaluator,
    batch_size: int,
    steps_per_round: int,
    rounds: int,
    lr: float,
) -> Result:
    """AdamW on one model, evaluating after every ``steps_per_round`` steps; eval time is not counted."""
    import torch

    model = build_model()
    eval_model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    stream = batches(dataset, training, batch_size)
    losses = [evaluator.loss(eval_model, model.state_dict())]
    train_losses = []
    seconds = 0.0
    samples = 0
    for round_number in range(1, rounds + 1):
        model.train()
        started = time.perf_counter()
        total = 0.0
        for _ in range(steps_per_round):
            batch = next(stream)
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total += float(loss.detach())
            samples += len(batch["input_ids"])
        seconds += time.perf_counter() - started
        train_losses.append(total / steps_per_round)
        losses.append(evaluator.loss(eval_model, model.state_dict()))
        print(
            f"  {name}: round {round_number}/{rounds}: train loss {train_losses[-1]:.3f}, eval loss "
            f"{losses[-1]:.3f} ({seconds:.0f} s training)",
            flush=True,
        )
    return Result(
        name=name,
        eval_losses=losses,
        tokens=samples * SEQ_LEN,
        wall_seconds=seconds,
        bytes_communicated=0,
        bytes_note="",
        extra={"train_losses": train_losses},
    )


MERGED_AFTER = re.compile(r"\[task ([0-9a-f]{8})\] .*round \d+ merged after (\d+) steps of round")


def eager_merges(cluster, job: dict) -> list[int]:
    """How many steps of the next round each eager trainer of ``job`` had run when it merged a round's result
    (its log lines ``round r merged after k steps``); empty for a job that does not overlap."""
    tasks = {str(task["id"])[:8] for task in job["tasks"] if task["role"] == "trainer"}
    steps = []
    for child in cluster.daemons.values():
        for found in MERGED_AFTER.finditer(child.log.read_text(errors="replace")):
            if found[1] in tasks:
                steps.append(int(found[2]))
    return steps


def _time(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def run_diloco(
    cluster,
    *,
    arguments: argparse.Namespace,
    outer: tuple[float, float],
    evaluator,
    root: Path,
    encoding: str = "float32",
    overlap: str = "none",
    label: str = "",
):
    lr, momentum = outer
    # Streaming: F rounds of H / F steps per full sync, each syncing one fragment (equal tokens).
    fragments = arguments.fragments if overlap == "streaming" else 1
    spec = diloco_spec(
        dataset="stdlib",
        trainers=arguments.trainers,
        rounds=arguments.rounds * fragments,
        inner_steps=arguments.inner_steps // fragments,
        batch_size=arguments.batch_size,
        learning_rate=arguments.lr,
        outer_learning_rate=lr,
        outer_momentum=momentum,
    )
    spec["evaluation"] = {"slices": arguments.held_out, "batch_size": EVAL_BATCH_SIZE}
    spec["rounds"]["encoding"] = encoding
    if encoding == "int8":
        spec["rounds"]["encoding_block_size"] = arguments.block_size
    if overlap == "streaming":
        spec["rounds"].update({"overlap": "streaming", "fragments": fragments})
        if arguments.mix is not None:
            spec["rounds"]["mix"] = arguments.mix
    elif overlap != "none":
        spec["rounds"]["overlap"] = "eager"  # eager-local: the same job on daemons with the knob set
    label = label or overlap
    started = time.monotonic()
    job_id = cluster.submit(spec, name=f"quality-{lr:g}-{momentum:g}-{encoding}-{label.replace(' ', '')}")

    def show(round_: dict) -> None:
        print(
            f"  DiLoCo {lr:g}:{momentum:g} {encoding} {label}: round {round_['number']}/{arguments.rounds * fragments}: "
            f"{len(round_['participants'])} trainers, train loss {round_['mean_loss']}, "
            f"eval loss {round_['eval_loss']} ({time.monotonic() - started:.0f} s)",
            flush=True,
        )

    job = cluster.follow(job_id, timeout=arguments.timeout, on_round=show)
    merged_after = eager_merges(cluster, job)
    if job["status"] != "completed":
        raise RuntimeError(f"job {job_id} is {job['status']}: {job['status_reason']}\n{cluster.logs()}")
    # The final model, evaluated here with the same evaluator: must match the parameter server's last eval.
    archive = cluster.download_model(job_id, root / f"model-{job_id}.zip")
    unpacked = root / f"model-{job_id}"
    with zipfile.ZipFile(archive) as zipped:
        zipped.extractall(unpacked)
    from hypha_tensors import weights as weights_io

    final_weights = weights_io.load(next(unpacked.rglob("model.safetensors")))
    final_here = evaluator.loss(build_model(), final_weights)

    rounds = sorted((r for r in job["rounds"] if r["closed"]), key=lambda r: r["number"])
    trainers = [task for task in job["tasks"] if task["role"] == "trainer"]
    # The rounds' samples: an eager trainer's steps after its last update are never part of a round.
    samples = sum(r["samples"] for r in rounds)
    first_step = min(_time(task["first_step_at"]) for task in trainers)
    created = _time(job["created_at"])
    ended = _time(job["ended_at"]) if job.get("ended_at") else _time(rounds[-1]["closed_at"])
    training_seconds = (_time(rounds[-1]["closed_at"]) - first_step).total_seconds()
    return Result(
        name=f"(a) DiLoCo, outer {lr:g}:{momentum:g}"
        + ("" if arguments.encodings == ["float32"] else f", {encoding}")
        + ("" if arguments.overlaps == ["none"] else f", overlap {label}"),
        # Streaming: the eval after each full sync (every F-th round), to line up with the other modes.
        eval_losses=[None, *[r["eval_loss"] for r in rounds[fragments - 1 :: fragments]]],
        tokens=samples * SEQ_LEN,
        wall_seconds=training_seconds,
        bytes_communicated=sum(r["bytes_in"] + r["bytes_out"] for r in rounds),
        bytes_note="measured",
        extra={
            "job": job_id,
            "train_losses": [r["mean_loss"] for r in rounds],
            "final_eval_here": final_here,
            "submit_to_end_seconds": (ended - created).total_seconds(),
            "submit_to_first_step_seconds": (first_step - created).total_seconds(),
            "bytes_in": [r["bytes_in"] for r in rounds],
            "bytes_out": [r["bytes_out"] for r in rounds],
            "outer": outer,
            "encoding": encoding,
            "overlap": label,
            "merged_after": merged_after,
            "round_encodings": [r.get("encoding") for r in rounds],
            "detail": job,
        },
    )


# --- report ------------------------------------------------------------------------------------------------


def _loss(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def print_tables(
    results: list[Result], arguments: argparse.Namespace, model_size: int, initial: float | None
) -> None:
    steps = arguments.inner_steps * arguments.rounds
    print(
        f"\n{arguments.trainers} trainers, H = {arguments.inner_steps}, {arguments.rounds} rounds "
        f"({steps} steps per worker), batch {arguments.batch_size} × {SEQ_LEN} bytes, inner AdamW lr "
        f"{arguments.lr:g}; model {model_size / 1e6:.2f} MB (float32)\n"
    )
    print("| run | final eval loss | tokens | wall time (s) | bytes communicated |")
    print("|---|---:|---:|---:|---:|")
    for result in results:
        note = f" ({result.bytes_note})" if result.bytes_note else ""
        wall = f"{result.wall_seconds:.0f}"
        if "submit_to_end_seconds" in result.extra:
            wall += f" ({result.extra['submit_to_end_seconds']:.0f} submit → completed)"
        print(
            f"| {result.name} | {_loss(result.eval_losses[-1])} | {result.tokens:,} | {wall} | "
            f"{result.bytes_communicated / 1e6:,.1f} MB{note} |"
        )
    print("\nEval loss on the held-out slices after each round (round r = r × H steps per worker):\n")
    print("| run | " + " | ".join(f"r{number}" for number in range(arguments.rounds + 1)) + " |")
    print("|---|" + "---:|" * (arguments.rounds + 1))
    for result in results:
        losses = list(result.eval_losses)
        if losses[0] is None:
            losses[0] = initial
        print(f"| {result.name} | " + " | ".join(_loss(value) for value in losses) + " |")
    print("\nMean training loss per round (DiLoCo: the trainers' mean, before averaging):\n")
    print("| run | " + " | ".join(f"r{number}" for number in range(1, arguments.rounds + 1)) + " |")
    print("|---|" + "---:|" * arguments.rounds)
    for result in results:
        print(f"| {result.name} | " + " | ".join(_loss(v) for v in result.extra["train_losses"]) + " |")
    print_encodings(results, arguments)
    print_overlaps(results, arguments)
    checks = [r for r in results if "final_eval_here" in r.extra]
    if checks:
        print()
        for result in checks:
            print(
                f"{result.name}: final model downloaded and evaluated here: {_loss(result.extra['final_eval_here'])} "
                f"(parameter server: {_loss(result.eval_losses[-1])}); submit → first step "
                f"{result.extra['submit_to_first_step_seconds']:.1f} s; bytes in/out per round "
                f"{[round(b / 1e6, 2) for b in result.extra['bytes_in']]} / "
                f"{[round(b / 1e6, 2) for b in result.extra['bytes_out']]} MB"
                + (
                    f"; merged each result after {min(steps)}–{max(steps)} steps of the next round (mean "
                    f"{sum(steps) / len(steps):.1f})"
                    if (steps := result.extra.get("merged_after"))
                    else ""
                )
            )


def print_encodings(results: list[Result], arguments: argparse.Namespace) -> None:
    """Per outer setting, each encoding's final eval loss and bytes side by side, as a ratio to float32's."""
    if arguments.encodings == ["float32"]:
        return
    diloco = [r for r in results if "encoding" in r.extra and r.extra["overlap"] == "none"]
    print("\nFinal eval loss and bytes per encoding, as a ratio to float32 (same outer setting):\n")
    print("| outer | " + " | ".join(arguments.encodings) + " |")
    print("|---|" + "---:|" * len(arguments.encodings))
    for outer in arguments.outer:
        row = {r.extra["encoding"]: r for r in diloco if r.extra["outer"] == outer}
        reference = row.get("float32")
        cells = []
        for encoding in arguments.encodings:
            result = row.get(encoding)
            loss = None if result is None else result.eval_losses[-1]
            if result is None or loss is None:
                cells.append("—")
            elif reference is None or reference.eval_losses[-1] is None:
                cells.append(f"{loss:.3f}, {result.bytes_communicated / 1e6:.2f} MB")
            else:
                ratio = loss / reference.eval_losses[-1]
                size = result.bytes_communicated / max(1, reference.bytes_communicated)
                cells.append(f"{loss:.3f} (×{ratio:.4f}), bytes ×{size:.3f}")
        print(f"| {outer[0]:g}:{outer[1]:g} | " + " | ".join(cells) + " |")


def overlap_labels(overlaps: list[str]) -> list[str]:
    """Each mode's label: a mode given twice gets ``#2`` (``none, eager, none`` → ``none, eager, none #2``)."""
    labels, seen = [], {}
    for overlap in overlaps:
        seen[overlap] = seen.get(overlap, 0) + 1
        labels.append(overlap if seen[overlap] == 1 else f"{overlap} #{seen[overlap]}")
    return labels


def print_overlaps(results: list[Result], arguments: argparse.Namespace) -> None:
    """Per outer setting and encoding, each overlap mode's final eval loss (and tokens) next to the first
    ``none``'s, as a ratio (goal: within 1 %)."""
    if arguments.overlaps == ["none"]:
        return
    labels = overlap_labels(arguments.overlaps)
    diloco = [r for r in results if "overlap" in r.extra]
    print("\nFinal eval loss per overlap mode, as a ratio to none's (goal: within 1 % at equal tokens):\n")
    print("| outer | encoding | " + " | ".join(labels) + " |")
    print("|---|---|" + "---:|" * len(labels))
    for outer in arguments.outer:
        for encoding in arguments.encodings:
            row = {
                r.extra["overlap"]: r
                for r in diloco
                if r.extra["outer"] == outer and r.extra["encoding"] == encoding
            }
            reference = row.get("none")
            base = None if reference is None else reference.eval_losses[-1]
            cells = []
            for label in labels:
                result = row.get(label)
                loss = None if result is None else result.eval_losses[-1]
                if loss is None:
                    cells.append("—")
                elif base is None:
                    cells.append(f"{loss:.3f} ({result.tokens:,} tokens)")
                else:
                    ratio = loss / base
                    cells.append(
                        f"{loss:.3f} (×{ratio:.4f}{_verdict(label, ratio)}; {result.tokens:,} tokens)"
                    )
            print(f"| {outer[0]:g}:{outer[1]:g} | {encoding} | " + " | ".join(cells) + " |")
            print_repeats(row)


def _verdict(label: str, ratio: float) -> str:
    """Within 1 % of none's: met; more than 1 % lower: better (the goal is not to lose quality); higher: MISSED."""
    if label.startswith("none"):
        return ""
    if ratio > 1.01:
        return " MISSED"
    return " met" if ratio >= 0.99 else " better"


def print_repeats(row: dict[str, Result]) -> None:
    """When a mode ran more than once: each mode's mean final eval loss, its spread, and the ratio of the means
    (one run's difference can be within the run-to-run noise of this benchmark)."""
    modes: dict[str, list[float]] = {}
    for label, result in row.items():
        if result.eval_losses[-1] is not None:
            modes.setdefault(label.split(" #")[0], []).append(result.eval_losses[-1])
    if all(len(losses) < 2 for losses in modes.values()):
        return
    base = modes.get("none")
    for mode, losses in modes.items():
        average = sum(losses) / len(losses)
        ratio = (
            "" if not base or mode == "none" else f", ÷ none's mean ×{average / (sum(base) / len(base)):.4f}"
        )
        print(
            f"  {mode}: {len(losses)} run(s), mean {average:.3f}, {min(losses):.3f}–{max(losses):.3f}{ratio}"
        )


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    import torch

    torch.set_num_threads(arguments.threads)
    mode = resolve_mode(arguments.mode)
    print_start()
    results: list[Result] = []
    with run_directory("hypha-quality-", keep=arguments.keep) as root:
        dataset = prepare_stdlib_text(
            root / "stdlib", max_bytes=arguments.max_bytes, samples_per_slice=SAMPLES_PER_SLICE
        )
        count = len(list(dataset.glob("*.safetensors")))
        held_out = eval_slices(arguments.eval_slices, count)
        arguments.held_out = held_out
        training = [index for index in range(count) if index not in held_out]
        print(
            f"Dataset: {count} slices of {SAMPLES_PER_SLICE} × {SEQ_LEN} bytes; eval on slices {held_out} "
            f"({len(held_out) * SAMPLES_PER_SLICE} samples), training on the other {len(training)}"
        )
        evaluator = make_evaluator(dataset, held_out, root / "eval-cache")
        size = model_bytes(build_model())
        steps = arguments.inner_steps * arguments.rounds
        if not arguments.skip_baselines:
            print(f"Baselines in process ({arguments.threads} torch thread(s)):", flush=True)
            results.append(
                train_in_process(
                    name="(b) one worker",
                    dataset=dataset,
                    training=training,
                    evaluator=evaluator,
                    batch_size=arguments.batch_size,
                    steps_per_round=arguments.inner_steps,
                    rounds=arguments.rounds,
                    lr=arguments.lr,
                )
            )
            parallel = train_in_process(
                name=f"(c) data parallel, {arguments.trainers} × batch",
                dataset=dataset,
                training=training,
                evaluator=evaluator,
                batch_size=arguments.batch_size * arguments.trainers,
                steps_per_round=arguments.inner_steps,
                rounds=arguments.rounds,
                lr=arguments.lr,
            )
            parallel.bytes_communicated = 2 * size * arguments.trainers * steps
            parallel.bytes_note = "computed"
            results.append(parallel)
        if not arguments.skip_diloco:
            print(f"Load average before the cluster: {load_average()}", flush=True)
            print(
                f"Starting the cluster ({mode}): control plane, data node, {arguments.trainers + 1} daemons"
            )
            labels = overlap_labels(arguments.overlaps)
            # eager-local jobs need daemons with the experiment knob set: a second cluster, after the first.
            for local in (False, True):
                chosen = [
                    (overlap, label)
                    for overlap, label in zip(arguments.overlaps, labels, strict=True)
                    if (overlap == "eager-local") == local
                ]
                if not chosen:
                    continue
                with training_cluster(
                    root=root / ("cluster-local-proxy" if local else "cluster"),
                    dataset_dir=dataset,
                    workers=arguments.trainers + 1,
                    mode=mode,
                    daemon_env=LOCAL_PROXY_ENV if local else None,
                ) as cluster:
                    for outer in arguments.outer:
                        for encoding in arguments.encodings:
                            for overlap, label in chosen:
                                results.append(
                                    run_diloco(
                                        cluster,
                                        arguments=arguments,
                                        outer=outer,
                                        evaluator=evaluator,
                                        root=root,
                                        encoding=encoding,
                                        overlap=overlap,
                                        label=label,
                                    )
                                )
        results.sort(key=lambda result: result.name)
        print_tables(results, arguments, size, evaluator.loss(build_model(), build_model().state_dict()))
        print(f"\nLoad average at end: {load_average()}")
        if arguments.json:
            arguments.json.write_text(
                json.dumps(
                    [result.__dict__ for result in results],
                    indent=1,
                    default=str,
                )
            )
        return 0


if __name__ == "__main__":
    sys.exit(main())
