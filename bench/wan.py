"""WAN benchmark: DiLoCo rounds over emulated internet links, direct vs relay, float32 vs float16 vs int8, overlap.

One real cluster (``bench.cluster.training_cluster``, embedded control plane on the host) with every peer in a
network namespace of its own behind an emulated link (``tests/e2e/wan.py``: 50 Mbit/s, 40 ms RTT, 0.5 % loss
each way by default): a data node with a public address; ``worker-1``, a parameter-server-only daemon with a
public address that declares ``reachable = true`` (the **direct** path: trainers PUT updates to it and GET
results from it); ``worker-2``, a parameter-server-only daemon behind NAT that declares ``reachable = false``
(the **relay** path: every byte goes through the control plane's relay, docs/transfers.md); two trainer
daemons behind NAT. Each configuration is one DiLoCo job on a byte-level GPT-2 large enough for transfers to
matter (default ``384x6``: 10.8 M parameters, 43 MB in float32; ``512x6`` is 19.1 M), with ``rounds.encoding``
set; the market puts its parameter server on worker-1 (bid 40, ``reachable = "require"``) or worker-2 (bid 35,
which only its floor of 30 accepts). The jobs run one after the other, the paths interleaved per encoding, so
that a change in the machine's load hits both sides of a ratio alike. No held-out eval (it would compete for
the CPUs).

Per round (a trainer's round: from the start of its inner loop to the merge of the round's result; the slower
trainer counts), measured, not estimated:

* **wall**: ``max(merged) − min(start)``, where the executor logs each round's merge with its sync time
  (``round r: … sync S s``) and reports ``samples`` and ``samples_per_second`` (the inner loop's time) and
  ``train_seconds`` (its steps' compute) in the round's metrics; start = merged − S − inner loop.
* **compute**: the largest ``train_seconds``; **wall − compute** is everything else.
* Of that, from the processes' log timestamps (one machine, one clock): **update** — end of the inner loop to
  the parameter server accepting the update (delta, encoding and file write included; through the relay the
  trainer's upload, the server's download and its loopback PUT); **server** — the round closing to its result
  being published (the outer step, the per-round checkpoint upload to the control plane — weights and momentum
  in float32 whatever the encoding, and the result — and the result file); **result** — published to the last
  trainer's download done (through the relay: the server's upload, then the trainers' downloads); **merge** —
  download done to merged.
* **Bytes**: the parameter server's counts in ``GET /api/jobs/<id>/`` (``Round.bytes_in``: the updates;
  ``bytes_out``: served directly — the results, and in round 1 the trainers' initial model download;
  ``transfers``: by path, when the API has it), and what the emulated links carried on the wire in the round
  (IP packets, headers and retransmissions included; the link emulators count them, sampled every 0.5 s):
  the parameter server's link in and out (out: results, checkpoints, and in the last round the final model's
  upload to the control plane), the packets its link dropped at a full queue, and the trainers' links.

Ratios: relay ÷ direct mean round wall time (goal ≤ 1.15×), int8 ÷ float32 and float16 ÷ float32 update bytes
per round (``bytes_in``; goal int8 ≤ 0.27×) and wire bytes per round.

**Overlap** (a config's third part, ``PATH-ENCODING-OVERLAP``: ``none``, the default, or ``eager``: the job's
``rounds.overlap``, docs/training.md "Overlap: eager updates"; or ``streaming``, whose rounds of H steps each
sync one of ``--fragments`` fragments of the model, its trainers logging their rounds as eager ones do). An eager trainer's round r ends when it has sent
round r's update and starts round r + 1 from its proxy (its log line ``round r: … sent in S s; round r+1 starts
from the proxy``); it merges round r's result later, between two steps (``round r merged after k steps of round
r+1 (waited W s)``). Per round, **wall** is still start of round r → round r's result merged (for an eager
trainer that is in the middle of round r + 1), and **cycle** is round r's end → round r+1's end for both modes
(the end of a trainer that waits: its merge). **Utilisation** per trainer, over the steady rounds 2…R:
``Σ train_seconds`` of rounds 2…R ÷ (end of round R − end of round 1): time in steps ÷ wall time, as
``bench/utilisation.py`` counts it. Goal: ≥ 95 % with eager + int8 at ≥ 25 M parameters, where none + float32
is far below.

The logs are read by ``bench/wan_logs.py``.

Needs root, ``ip`` and ``/dev/net/tun`` (``tests/e2e/wan.py``'s ``wan_available``). Usage::

    python bench/wan.py                                    # 2 rounds × 4 steps, 6 jobs: ≈ 14 min on 2 cores
    python bench/wan.py --configs direct-float32,relay-float32 --rounds 3 --model-size 512x8
    python bench/wan.py --configs direct-float32,direct-int8-eager --model-size 512x8 --rounds 3 --steps 20

Run it under ``flock /tmp/hypha-e2e.lock`` where end-to-end tests run too. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/wan.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

from bench.cluster import (  # noqa: E402
    PARAMETER_SERVER_BID,
    TINY_GPT2,
    Cluster,
    diloco_spec,
    prepare_stdlib_text,
    training_cluster,
    worker_toml,
)
from bench.harness import exit_on_sigterm, load_average, print_start, run_directory  # noqa: E402
from bench.wan_logs import Timeline, parse_timeline, trainer_round, utilisation  # noqa: E402
from tests.e2e.wan import LinkShape, Wan, wan_available  # noqa: E402

RELAY_GOAL = 1.15
INT8_GOAL = 0.27
UTILISATION_GOAL = 0.95
#: The parameters the utilisation goal asks for at least.
UTILISATION_GOAL_PARAMETERS = 25_000_000
ENCODINGS = ("float32", "float16", "int8")
PATHS = ("direct", "relay")
OVERLAPS = ("none", "eager", "streaming")
#: The modes that overlap (the utilisation goal is theirs).
OVERLAPPING = ("eager", "streaming")
#: Interleaved per encoding: the two sides of a relay ÷ direct ratio run one after the other.
ALL_CONFIGS = tuple(f"{path}-{encoding}" for encoding in ENCODINGS for path in PATHS)


def split_config(config: str) -> tuple[str, str, str] | None:
    """``PATH-ENCODING[-OVERLAP]`` → (path, encoding, overlap), None when it is not one."""
    parts = config.split("-")
    if len(parts) == 2:
        parts.append("none")
    if len(parts) != 3 or parts[0] not in PATHS or parts[1] not in ENCODINGS or parts[2] not in OVERLAPS:
        return None
    return parts[0], parts[1], parts[2]


#: The daemons (``training_cluster`` names them worker-1…): the direct path's parameter server (public,
#: reachable), the relay path's (behind NAT), then the trainers.
DIRECT_SERVER, RELAY_SERVER = "worker-1", "worker-2"
#: The relay job's parameter-server bid: under the direct server's floor, at or over the relay server's.
RELAY_BID, RELAY_FLOOR, DIRECT_FLOOR = 35.0, 30.0, 38.0
#: Seconds between two samples of the links' counters (a round boundary falls between two of them).
SAMPLE_INTERVAL = 0.5
MB = 1e6


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python bench/wan.py",
        description=__doc__.split("\n\n")[0],
        epilog="Prints the machine and markdown tables. See docs/benchmarks.md for results.",
    )
    parser.add_argument("--rounds", type=int, default=2, help="outer rounds per job (default: 2)")
    parser.add_argument("--steps", type=int, default=4, help="inner steps per round, H (default: 4)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per step per trainer (default: 4)")
    parser.add_argument("--trainers", type=int, default=2, help="trainers per job (default: 2)")
    parser.add_argument(
        "--fragments",
        type=int,
        default=4,
        help="streaming jobs' fragments F: each round (of --steps steps) syncs 1/F of the model (default: 4)",
    )
    parser.add_argument(
        "--configs",
        default=",".join(ALL_CONFIGS),
        help=f"PATH-ENCODING[-OVERLAP] jobs to run, in order; OVERLAP none (default), eager or streaming "
        f"(default: {','.join(ALL_CONFIGS)})",
    )
    parser.add_argument(
        "--model-size",
        default="384x6",
        help="GPT-2 WIDTHxLAYERS on bytes, 64 wide per head (default: 384x6, 10.8 M parameters; 512x6: 19.1 M)",
    )
    parser.add_argument("--rate", type=float, default=50.0, help="every link's Mbit/s each way (default: 50)")
    parser.add_argument("--rtt", type=float, default=40.0, help="every link's round trip in ms (default: 40)")
    parser.add_argument("--loss", type=float, default=0.005, help="loss per packet each way (default: 0.005)")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up on a job after this many s")
    parser.add_argument("--json", type=Path, help="also write every job's detail and measurements here")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs)")
    arguments = parser.parse_args(argv)
    arguments.configs = [value.strip() for value in arguments.configs.split(",") if value.strip()]
    unknown = [value for value in arguments.configs if split_config(value) is None]
    if not arguments.configs or unknown:
        parser.error(
            f"--configs: {unknown or 'none'}; each PATH-ENCODING[-OVERLAP] of {', '.join(PATHS)} × "
            f"{', '.join(ENCODINGS)} × {', '.join(OVERLAPS)}"
        )
    match = re.fullmatch(r"(\d+)x(\d+)", arguments.model_size)
    if match is None or int(match[1]) % 64 or not 1 <= int(match[2]) <= 48:
        parser.error("--model-size: WIDTHxLAYERS, WIDTH a multiple of 64, 1..48 layers (e.g. 512x6)")
    arguments.width, arguments.layers = int(match[1]), int(match[2])
    if min(arguments.rounds, arguments.steps, arguments.batch_size, arguments.trainers) < 1:
        parser.error("--rounds, --steps, --batch-size and --trainers must be at least 1")
    return arguments


def model_config(width: int, layers: int) -> dict:
    return {**TINY_GPT2, "n_embd": width, "n_layer": layers, "n_head": width // 64}


def parameter_count(config: dict) -> int:
    """The model's parameters (tied embeddings once), counted on the meta device: nothing is allocated."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(**config))
    return sum(parameter.numel() for parameter in model.parameters())


def server_toml(*, reachable: bool, floor: float) -> str:
    """A parameter-server-only daemon (:func:`worker_toml`) with its floor and its ``reachable`` declaration."""
    template = worker_toml(parameter_server_only=True, benchmark=False)
    template = template.replace("floor = 0", f"floor = {floor:g}")
    if not reachable:
        template = template.replace(f"price = {PARAMETER_SERVER_BID:g}", f"price = {floor:g}")
    return template + f"\n[parameter_server]\nreachable = {str(reachable).lower()}\n"


def job_spec(arguments: argparse.Namespace, path: str, encoding: str, overlap: str = "none") -> dict:
    spec = diloco_spec(
        dataset="stdlib",
        trainers=arguments.trainers,
        rounds=arguments.rounds,
        inner_steps=arguments.steps,
        batch_size=arguments.batch_size,
        model=model_config(arguments.width, arguments.layers),
        # Generous: a round that timed out would leave a trainer out and measure something else.
        round_timeout=600.0,
        dedicated_parameter_server=True,
    )
    # No held-out eval: it would compete with the next round for the CPUs and is not what is measured.
    spec.pop("evaluation", None)
    spec["rounds"]["encoding"] = encoding
    if overlap != "none":
        spec["rounds"]["overlap"] = overlap
    if overlap == "streaming":
        spec["rounds"]["fragments"] = arguments.fragments
    server = spec["parameter_server"]
    if path == "direct":
        server["reachable"] = "require"
    else:
        server["reachable"] = "any"
        server["price"] = {"bid": RELAY_BID, "max": 100}
    return spec


# --- the links' counters over time -------------------------------------------------------------------------


class LinkSampler:
    """Samples every peer's link counters (:meth:`Wan.counters`) every :data:`SAMPLE_INTERVAL` s in a thread:
    ``samples`` is a list of ``(time.time(), {peer: counters})``."""

    def __init__(self, wan: Wan) -> None:
        self.wan = wan
        self.samples: list[tuple[float, dict[str, dict]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link sampler", daemon=True)

    def __enter__(self) -> LinkSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a link that just went: the next sample will say
                at = time.time()
                self.samples.append((at, {name: self.wan.counters(name) for name in list(self.wan.peers)}))
            self._stop.wait(SAMPLE_INTERVAL)

    def at(self, moment: float) -> dict[str, dict] | None:
        """The first sample taken at or after ``moment`` (the last one if none was)."""
        for at, counters in self.samples:
            if at >= moment:
                return counters
        return self.samples[-1][1] if self.samples else None

    def carried(self, peer: str, direction: str, start: float, end: float, counter: str = "bytes") -> int:
        """How much ``counter`` (bytes delivered; or packets dropped: "queue", "lost") of the link of ``peer``
        grew in ``direction`` ("up", "down") between two moments."""
        first, last = self.at(start), self.at(end)
        if first is None or last is None or peer not in first or peer not in last:
            return 0
        return last[peer][direction][counter] - first[peer][direction][counter]


# --- per round -----------------------------------------------------------------------------------------------


def _max(values: list[float]) -> float | None:
    return max(values) if values else None


def round_rows(
    job: dict, timeline: Timeline, sampler: LinkSampler, server_peer: str, trainer_peers: list[str]
) -> list[dict]:
    """One row per closed round: the phases (seconds) and the bytes (see the module docstring)."""
    trainers = [task for task in job["tasks"] if task["role"] == "trainer"]
    rows = []
    for round_ in sorted((r for r in job["rounds"] if r["closed"]), key=lambda r: r["number"]):
        number = round_["number"]
        starts, merges, computes, updates, results, merging, cycles = [], [], [], [], [], [], []
        for task in trainers:
            task_id, worker = str(task["id"]), str(task["worker_id"])
            metrics = round_["trainer_metrics"].get(worker) or {}
            ends = trainer_round(timeline, task_id, number)
            if ends is None or ends[2] is None or not metrics.get("samples_per_second"):
                continue
            inner_end, round_end, merged_at = ends
            inner = metrics["samples"] / metrics["samples_per_second"]
            starts.append(inner_end - inner)
            merges.append(merged_at)
            computes.append(float(metrics.get("train_seconds", 0.0)))
            previous = trainer_round(timeline, task_id, number - 1)
            if previous is not None:
                cycles.append(round_end - previous[1])
            accepted = timeline.accepted.get((worker, number), timeline.sent.get((task_id, number)))
            if accepted is not None:
                updates.append(accepted - inner_end)
            received = timeline.received.get((task_id, number))
            if received is not None:
                merging.append(merged_at - received)
                if number in timeline.published:
                    results.append(received - timeline.published[number])
        if not starts:
            rows.append({"round": number, "measured": False, "api": round_})
            continue
        start, end = min(starts), max(merges)
        closes, published = timeline.closes.get(number), timeline.published.get(number)
        transfers = round_.get("transfers") or {}
        rows.append(
            {
                "round": number,
                "measured": True,
                "start": start,
                "end": end,
                "wall": end - start,
                "cycle": _max(cycles),
                "compute": max(computes),
                "update": _max(updates),
                "server": None if closes is None or published is None else published - closes,
                "result": _max(results),
                "merge": _max(merging),
                "checkpoint_bytes": timeline.checkpoint_bytes.get(number, 0),
                "bytes_in": round_["bytes_in"],
                "bytes_out": round_["bytes_out"],
                "relay_out": (transfers.get("relay") or {}).get("out"),
                "encoding": round_.get("encoding", ""),
                "participants": len(round_["participants"]),
                "server_in": sampler.carried(server_peer, "down", start, end),
                "server_out": sampler.carried(server_peer, "up", start, end),
                "trainers_in": sum(sampler.carried(peer, "down", start, end) for peer in trainer_peers),
                "trainers_out": sum(sampler.carried(peer, "up", start, end) for peer in trainer_peers),
                # Packets the parameter server's link dropped at its full queue (both ways): several trainers'
                # uploads converging on it, which TCP then sends again.
                "server_queue_drops": sum(
                    sampler.carried(server_peer, direction, start, end, "queue")
                    for direction in ("up", "down")
                ),
                "mean_loss": round_.get("mean_loss"),
            }
        )
    return rows


@dataclass
class Outcome:
    config: str
    path: str
    encoding: str
    job: dict
    rows: list[dict]
    overlap: str
    utilisation: list[dict]
    path_seen: str
    startup: float | None
    total: float
    server_worker: str
    failure: str = ""

    @property
    def measured(self) -> list[dict]:
        return [row for row in self.rows if row.get("measured")]

    def mean(self, key: str, *, steady: bool = False) -> float | None:
        """The mean of ``key`` over the measured rounds (``steady``: rounds 2…R when there are two or more:
        round 1's bytes out hold the trainers' initial model download)."""
        rows = self.measured
        if steady and len(rows) > 1:
            rows = rows[1:]
        values = [row[key] for row in rows if row.get(key) is not None]
        return statistics.fmean(values) if values else None


def _time(value: str | None) -> float | None:
    if value is None:
        return None
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def run_config(cluster: Cluster, sampler: LinkSampler, arguments: argparse.Namespace, config: str) -> Outcome:
    """Run the job of ``config`` (``PATH-ENCODING[-OVERLAP]``) on ``cluster`` and measure it."""
    split = split_config(config)
    assert split is not None
    path, encoding, overlap = split
    offsets = {name: child.log.stat().st_size for name, child in cluster.daemons.items()}
    started = time.monotonic()
    job_id = cluster.submit(job_spec(arguments, path, encoding, overlap), name=f"wan-{config}")

    def show(round_: dict) -> None:
        print(
            f"  {config}: round {round_['number']}/{arguments.rounds} closed "
            f"({time.monotonic() - started:.0f} s after submission, {round_['bytes_in'] / MB:.1f} MB in)",
            flush=True,
        )

    try:
        job = cluster.follow(job_id, timeout=arguments.timeout, on_round=show)
    except TimeoutError:
        job = cluster.job(job_id)
        with contextlib.suppress(Exception), cluster.api() as client:
            client.post(f"/api/jobs/{job_id}/cancel/")
    total = time.monotonic() - started
    time.sleep(1.0)  # the daemons' last lines of the job reach their logs
    logs = {}
    for name, child in cluster.daemons.items():
        with child.log.open("rb") as handle:
            handle.seek(offsets[name])
            logs[name] = handle.read().decode(errors="replace")
    timeline = parse_timeline(logs, job)
    server = next((task for task in job["tasks"] if task["role"] == "parameter_server"), None)
    server_worker = server["worker"] if server else "?"
    trainer_workers = sorted(task["worker"] for task in job["tasks"] if task["role"] == "trainer")
    rows = round_rows(job, timeline, sampler, server_worker, trainer_workers)
    trainer_tasks = [str(task["id"]) for task in job["tasks"] if task["role"] == "trainer"]
    relayed_trainers = sum(task in timeline.through_relay for task in trainer_tasks)
    path_seen = (server or {}).get("transfer_path") or ("relay" if timeline.server_relayed else "direct")
    if relayed_trainers and relayed_trainers != len(trainer_tasks):
        path_seen += f" ({relayed_trainers}/{len(trainer_tasks)} trainers through the relay)"
    first_steps = [_time(task.get("first_step_at")) for task in job["tasks"] if task["role"] == "trainer"]
    created = _time(job.get("created_at"))
    startup = (
        max(first_steps) - created
        if created is not None and first_steps and None not in first_steps
        else None
    )
    failure = ""
    if job["status"] != "completed":
        failure = f"{job['status']}: {job['status_reason']}"
        print(f"  {config} {failure}\n{cluster.logs()}", file=sys.stderr, flush=True)
    elif server_worker != {"direct": DIRECT_SERVER, "relay": RELAY_SERVER}[path] or not path_seen.startswith(
        path
    ):
        failure = f"ran on {server_worker} via {path_seen}, not {path}"
    return Outcome(
        config=config, path=path, encoding=encoding, job=job, rows=rows, path_seen=path_seen,
        startup=startup, total=total, server_worker=server_worker, failure=failure, overlap=overlap,
        utilisation=utilisation(job, timeline),
    )  # fmt: skip


# --- the report ------------------------------------------------------------------------------------------------


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _mb(value: float | None) -> str:
    return "—" if value is None else f"{value / MB:.1f}"


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _x(value: float | None, goal: float | None = None) -> str:
    if value is None:
        return "—"
    text = f"{value:.2f}×"
    if goal is None:
        return text
    return f"**{text}** {'met' if value <= goal else 'MISSED'}"


def _steady(rows: list[dict]) -> list[dict]:
    """Rounds 2…R when there are two or more (round 1's bytes out hold the initial model download)."""
    return rows[1:] if len(rows) > 1 else rows


def _wire(outcome: Outcome | None, key: str) -> float | None:
    """The mean of a wire counter (``server_in``, ``server_out``) over the steady rounds."""
    rows = _steady(outcome.measured) if outcome is not None else []
    return statistics.fmean(row[key] for row in rows) if rows else None


def print_report(outcomes: list[Outcome]) -> None:
    print("\nPer round (seconds; the slower trainer; the phases as in the module docstring):\n")
    print(
        "| config | round | wall | cycle | compute | wall − compute | update | server | result | merge "
        "| bytes_in MB | bytes_out MB | relay out MB | checkpoint MB | PS link in / out MB | PS queue drops "
        "| trainer links in / out MB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for outcome in outcomes:
        for row in outcome.rows:
            if not row.get("measured"):
                print(f"| {outcome.config} | {row['round']} | (not in the logs) |||||||||||||||")
                continue
            print(
                f"| {outcome.config} | {row['round']} | {_s(row['wall'])} | {_s(row['cycle'])} "
                f"| {_s(row['compute'])} "
                f"| {_s(row['wall'] - row['compute'])} | {_s(row['update'])} | {_s(row['server'])} "
                f"| {_s(row['result'])} | {_s(row['merge'])} | {_mb(row['bytes_in'])} | {_mb(row['bytes_out'])} "
                f"| {_mb(row['relay_out'])} | {_mb(row['checkpoint_bytes'])} "
                f"| {_mb(row['server_in'])} / {_mb(row['server_out'])} | {row['server_queue_drops']} "
                f"| {_mb(row['trainers_in'])} / {_mb(row['trainers_out'])} |"
            )

    print("\nPer job (seconds: means over its rounds; MB per round: over rounds 2…R when R ≥ 2):\n")
    print(
        "| config | parameter server | path taken | status | submit → first steps | job "
        "| round wall | compute | wall − compute | update + result | server "
        "| updates MB | PS link in MB | PS link out MB | final loss |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for outcome in outcomes:
        measured = outcome.measured
        moving = [
            row["update"] + row["result"]
            for row in measured
            if row["update"] is not None and row["result"] is not None
        ]
        loss = measured[-1]["mean_loss"] if measured else None
        status = outcome.job["status"] + (f" ({outcome.failure})" if outcome.failure else "")
        wall, compute = outcome.mean("wall"), outcome.mean("compute")
        print(
            f"| {outcome.config} | {outcome.server_worker} | {outcome.path_seen} | {status} "
            f"| {_s(outcome.startup)} | {outcome.total:.0f} | {_s(wall)} | {_s(compute)} "
            f"| {_s(None if wall is None or compute is None else wall - compute)} "
            f"| {_s(statistics.fmean(moving) if moving else None)} | {_s(outcome.mean('server'))} "
            f"| {_mb(outcome.mean('bytes_in', steady=True))} | {_mb(_wire(outcome, 'server_in'))} "
            f"| {_mb(_wire(outcome, 'server_out'))} | {'—' if loss is None else f'{loss:.3f}'} |"
        )

    print_utilisation(outcomes)
    found = {
        (outcome.path, outcome.encoding): outcome
        for outcome in outcomes
        if not outcome.failure and outcome.overlap == "none"
    }
    print(f"\nRelay ÷ direct, mean round wall time (goal ≤ {RELAY_GOAL:g}×):\n")
    # wall − compute as well: the trainers' steps share the CPUs with everything else on the machine, and
    # their time varies between jobs by several seconds; the rest of the round is what the path changes.
    print(
        "| encoding | direct (s) | relay (s) | relay ÷ direct | wall − compute: direct (s) | relay (s) "
        "| relay ÷ direct |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for encoding in ENCODINGS:
        pair = (found.get(("direct", encoding)), found.get(("relay", encoding)))
        if pair == (None, None):
            continue
        walls = [outcome.mean("wall") if outcome else None for outcome in pair]
        computes = [outcome.mean("compute") if outcome else None for outcome in pair]
        overheads = [
            None if wall is None or compute is None else wall - compute
            for wall, compute in zip(walls, computes, strict=True)
        ]
        print(
            f"| {encoding} | {_s(walls[0])} | {_s(walls[1])} | {_x(_ratio(walls[1], walls[0]), RELAY_GOAL)} "
            f"| {_s(overheads[0])} | {_s(overheads[1])} | {_x(_ratio(overheads[1], overheads[0]))} |"
        )

    print(f"\nEncodings ÷ float32 per round (goal int8 ≤ {INT8_GOAL:g}× on the update bytes):\n")
    print("| path | encoding | updates (bytes_in) | PS link in | PS link out | round wall |")
    print("|---|---|---:|---:|---:|---:|")
    for path in PATHS:
        base = found.get((path, "float32"))
        if base is None:
            continue
        for encoding, goal in (("float16", None), ("int8", INT8_GOAL)):
            other = found.get((path, encoding))
            if other is None:
                continue
            print(
                f"| {path} | {encoding} ÷ float32 "
                f"| {_x(_ratio(other.mean('bytes_in', steady=True), base.mean('bytes_in', steady=True)), goal)} "
                f"| {_x(_ratio(_wire(other, 'server_in'), _wire(base, 'server_in')))} "
                f"| {_x(_ratio(_wire(other, 'server_out'), _wire(base, 'server_out')))} "
                f"| {_x(_ratio(other.mean('wall'), base.mean('wall')))} |"
            )


def print_utilisation(outcomes: list[Outcome]) -> None:
    """Per job: each trainer's utilisation over rounds 2…R, and the goal (eager + int8 ≥ 95 %)."""
    print(
        f"\nUtilisation: Σ train_seconds ÷ wall over rounds 2…R, per trainer (goal ≥ {UTILISATION_GOAL:.0%} "
        "with eager + int8; waited: an eager trainer's seconds waiting for a result at a round's end):\n"
    )
    print("| config | rounds | trainer utilisation | in steps (s) | wall (s) | waited (s) | mean cycle (s) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for outcome in outcomes:
        if not outcome.utilisation:
            print(f"| {outcome.config} | (not measured: fewer than 2 rounds in the logs) ||||||")
            continue
        cells = [
            " / ".join(_percent(trainer[key]) if key == "utilisation" else _s(trainer[key])
                       for trainer in outcome.utilisation)
            for key in ("utilisation", "train", "wall", "waited")
        ]  # fmt: skip
        print(
            f"| {outcome.config} | {outcome.utilisation[0]['rounds']} | {cells[0]} | {cells[1]} | {cells[2]} "
            f"| {cells[3]} | {_s(outcome.mean('cycle', steady=True))} |"
        )
    for outcome in outcomes:
        if outcome.overlap in OVERLAPPING and outcome.encoding == "int8" and outcome.utilisation:
            values = [trainer["utilisation"] for trainer in outcome.utilisation if trainer["utilisation"]]
            lowest = min(values) if values else None
            verdict = "met" if lowest is not None and lowest >= UTILISATION_GOAL else "MISSED"
            print(
                f"\n{outcome.config}: lowest trainer utilisation {_percent(lowest)} (goal ≥ "
                f"{UTILISATION_GOAL:.0%}): **{verdict}**"
            )


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f} %"


def congestion_control(wan: Wan, peer: str) -> str:
    """The TCP congestion control inside ``peer``'s namespace (BBR and CUBIC differ a lot on a lossy link)."""
    done = subprocess.run(
        wan.peers[peer].command(["cat", "/proc/sys/net/ipv4/tcp_congestion_control"]),
        capture_output=True, text=True, timeout=15,
    )  # fmt: skip
    return done.stdout.strip() or "?"


@contextlib.contextmanager
def wan_cluster(arguments: argparse.Namespace, root: Path, wan: Wan) -> Iterator[Cluster]:
    dataset = prepare_stdlib_text(root / "stdlib")
    tomls = [
        server_toml(reachable=True, floor=DIRECT_FLOOR),
        server_toml(reachable=False, floor=RELAY_FLOOR),
        *[worker_toml(benchmark=False)] * arguments.trainers,
    ]
    with training_cluster(
        root=root / "cluster",
        dataset_dir=dataset,
        workers=len(tomls),
        mode="embedded",
        worker_tomls=tomls,
        benchmark=False,
        wan=wan,
        public_workers={DIRECT_SERVER},
    ) as cluster:
        yield cluster


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    available, why = wan_available()
    if not available:
        print(f"no WAN on this machine: {why}", file=sys.stderr)
        return 2
    exit_on_sigterm()
    print_start()
    config = model_config(arguments.width, arguments.layers)
    parameters = parameter_count(config)
    print(
        f"Model: GPT-2 on bytes, {arguments.width} wide × {arguments.layers} layers, {parameters:,} parameters "
        f"({parameters * 4 / MB:.1f} MB in float32); {arguments.trainers} trainers, {arguments.rounds} rounds "
        f"of H = {arguments.steps} at batch {arguments.batch_size} × 128 tokens"
    )
    shape = LinkShape(rate_mbit=arguments.rate, rtt_ms=arguments.rtt, loss=arguments.loss)
    outcomes: list[Outcome] = []
    with run_directory("hypha-wan-", keep=arguments.keep) as root, Wan(shape, seed=14) as wan:
        print(
            f"Links: {shape.rate_mbit:g} Mbit/s each way, {shape.rtt_ms:g} ms RTT, {100 * shape.loss:g} % loss "
            f"each way, queue {shape.queue_packets} packets (tests/e2e/wan.py's userspace emulator)",
            flush=True,
        )
        with wan_cluster(arguments, root, wan) as cluster, LinkSampler(wan) as sampler:
            print(
                f"TCP congestion control: {congestion_control(wan, DIRECT_SERVER)} in the namespaces; "
                f"configs: {', '.join(arguments.configs)}",
                flush=True,
            )
            for name in arguments.configs:
                outcomes.append(run_config(cluster, sampler, arguments, name))
                if outcomes[-1].overlap in OVERLAPPING and parameters < UTILISATION_GOAL_PARAMETERS:
                    print(
                        f"  (the utilisation goal asks for ≥ {UTILISATION_GOAL_PARAMETERS:,} parameters; this "
                        f"model has {parameters:,})",
                        flush=True,
                    )
        print_report(outcomes)
        if arguments.json:
            arguments.json.write_text(
                json.dumps(
                    [
                        {
                            "config": o.config,
                            "failure": o.failure,
                            "rows": o.rows,
                            "job": o.job,
                            "utilisation": o.utilisation,
                        }
                        for o in outcomes
                    ],
                    indent=1,
                    default=str,
                )
            )
    print(f"\nLoad average at end: {load_average()}")
    return 0 if outcomes and not any(outcome.failure for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
