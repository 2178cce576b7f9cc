"""Robustness benchmark: DiLoCo with one byzantine trainer, under each aggregation rule (issue 18).

One cluster (``bench.cluster.training_cluster``): a parameter-server-only daemon, ``--trainers - 1`` honest
trainer daemons and one more daemon, ``worker-<trainers + 1>``, that is honest for the clean baseline and is
then restarted with ``byzantine = MODE`` in its config (``worker_daemon/executors/byzantine.py``: an
experiment knob; its trainers send a corrupted pseudo-gradient every round) for each mode. Every daemon
offers its whole capacity, so each holds one task and every job has that daemon as one of its trainers.

Jobs (one after the other, same spec: ``bench.cluster.SMALL_GPT2`` at batch 8 on the standard library's
sources, ``--rounds`` rounds of ``--inner-steps`` (H) steps, plain averaging (outer learning rate 1, no
momentum), the last 2 slices held out for the parameter server's eval loss, ``--round-timeout`` 30 s (an
update refused at arrival counts as its trainer's answer: a ``scale:100`` round closes once the others arrived)):

* the **clean** baseline, every trainer honest, ``aggregation = mean``;
* for each ``--modes`` mode × ``--rules`` rule: ``mean`` without verification, or a robust rule
  (``clipped_mean``, ``trimmed_mean``, ``median``) with ``rounds.verification`` at its defaults (on; norm
  ratio 10, cosine −0.5) except ``max_rejections``, raised past the rounds so that the byzantine trainer keeps
  its lease and is judged in every round (at the default 3 its lease ends and a fresh one, on the same
  daemon, starts the count again: the same verdicts with a restart in between).

For each it prints the final eval loss, its ratio to the clean run's, the byzantine trainer's updates
rejected / sent (a verdict ``rejected``, or refused at arrival by the parameter server's bound on update
norms, ``update_norm_ratio`` 10 × the reference: listed in the round's ``refused``), and the honest
trainers' updates wrongly rejected (the goal is 0).

Usage::

    python bench/robustness.py                  # 4 modes × 4 rules, 4 trainers, 3 × H=10: ≈ 8 min on 2 cores
    python bench/robustness.py --modes sign_flip,random,zero,scale:-5,scale:100   # docs/benchmarks.md: 10 min
    python bench/robustness.py --modes sign_flip --rules mean,trimmed_mean   # a quick run: ≈ 3 min

Results and how to read them: docs/benchmarks.md, "Robustness: byzantine trainers".
"""

from __future__ import annotations

import argparse
import copy
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python bench/robustness.py`: the repo root is not on the path
    sys.path.insert(0, str(REPO_ROOT))

from bench.cluster import (  # noqa: E402
    SMALL_GPT2,
    Cluster,
    diloco_spec,
    prepare_stdlib_text,
    training_cluster,
    worker_toml,
)
from bench.harness import (  # noqa: E402
    exit_on_sigterm,
    load_average,
    print_start,
    resolve_mode,
    run_directory,
)

MODES = ("sign_flip", "random", "zero", "scale:100")
RULES = ("mean", "clipped_mean", "trimmed_mean", "median")
#: The small job of the end-to-end tests (``tests/e2e/conftest.small_training_job``).
MAX_BYTES = 250_000
SAMPLES_PER_SLICE = 32
BATCH_SIZE = 8


@dataclass
class Outcome:
    """One job's result, as read from ``GET /api/jobs/{id}/``."""

    label: str
    status: str
    eval_loss: float | None
    seconds: float
    sent: int = 0
    rejected: int = 0
    honest_rejected: int = 0
    reasons: list[str] = field(default_factory=list)
    job: dict = field(default_factory=dict, repr=False)


def job_spec(
    dataset: str, *, trainers: int, rounds: int, inner_steps: int, round_timeout: float = 120.0
) -> dict:
    """The benchmark's (and the end-to-end test's) job: a dedicated parameter server, a fixed H, plain
    averaging, 2 slices held out for the eval loss. A round closes when every trainer's update arrived, or
    ``round_timeout`` after the first (an update refused at arrival counts as its trainer's answer)."""
    return diloco_spec(
        dataset=dataset,
        trainers=trainers,
        rounds=rounds,
        inner_steps=inner_steps,
        batch_size=BATCH_SIZE,
        model=SMALL_GPT2,
        holdout=2,
        round_timeout=round_timeout,
        # Plain averaging (outer SGD at 1, no momentum): at a few rounds, momentum 0.9 overshoots and the final
        # eval loss moves ±5 % from round to round, more than the differences this benchmark looks for.
        outer_learning_rate=1.0,
        outer_momentum=0.0,
        dedicated_parameter_server=True,
    )


def with_rule(spec: dict, rule: str, *, max_rejections: int, verification: dict | None = None) -> dict:
    """``spec`` aggregated by ``rule``: ``mean`` without verification, a robust rule with verification at its
    defaults (or ``verification``'s thresholds) but ``max_rejections`` (see the module docstring)."""
    spec = copy.deepcopy(spec)
    spec["rounds"]["aggregation"] = rule
    if rule != "mean":
        spec["rounds"]["verification"] = {**(verification or {}), "max_rejections": max_rejections}
    return spec


def cluster_tomls(trainers: int) -> list[str]:
    """The daemons' configs: the parameter-server-only daemon first, then ``trainers`` trainer daemons (all
    honest at start; the last is the one :func:`set_byzantine` restarts)."""
    return [worker_toml(parameter_server_only=True, benchmark=False)] + [
        worker_toml(benchmark=False)
    ] * trainers


def worker_ids(cluster: Cluster) -> dict[str, str]:
    """Worker name → id."""
    with cluster.api() as client:
        return {worker["name"]: str(worker["id"]) for worker in client.get("/api/workers/").json()["results"]}


def set_byzantine(cluster: Cluster, name: str, mode: str, *, root: Path, timeout: float = 60.0) -> None:
    """Restart daemon ``name`` with ``byzantine = mode`` in its config (``""``: honest), and wait until the
    control plane sees it offline in between and online again (its token and work directory are kept)."""
    child = cluster.daemons[name]
    child.signal(signal.SIGTERM)
    child.popen.wait(timeout)
    _wait_for_status(cluster, name, online=False, timeout=timeout)
    config = root / "workers" / f"{name}.toml"
    work_dir = root / "workers" / name
    config.write_text(worker_toml(benchmark=False, byzantine=mode).format(work_dir=work_dir))
    since = child.log.stat().st_size  # a restarted daemon's log goes on in the same file
    cluster.restart_daemon(name)
    _wait_for_status(cluster, name, online=True, timeout=timeout)
    wait_for_spares(cluster, [name], since=since, timeout=timeout)


def wait_for_spares(cluster: Cluster, names: list[str], *, since: int = 0, timeout: float = 180.0) -> None:
    """Wait until each named daemon's warm spare (an executor process with torch imported, ``worker_daemon/
    spares.py``) is ready, as its log says after byte ``since``: on two shared cores five of them importing
    torch at once starve everything else, a job submitted meanwhile only waits longer."""
    deadline = time.monotonic() + timeout

    def ready(name: str) -> bool:
        with cluster.daemons[name].log.open("rb") as log:
            log.seek(since)
            return b"warm spare ready" in log.read()

    while not all(ready(name) for name in names):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the warm spares of {names} were not ready within {timeout:g}s")
        time.sleep(0.5)


def _wait_for_status(cluster: Cluster, name: str, *, online: bool, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with cluster.api() as client:
        while True:
            workers = {worker["name"]: worker for worker in client.get("/api/workers/").json()["results"]}
            if (workers[name]["status"] == "online") == online:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} is not {'online' if online else 'offline'} after {timeout:g}s")
            time.sleep(0.2)


def run_job(cluster: Cluster, spec: dict, *, label: str, byzantine_id: str | None, timeout: float) -> Outcome:
    """Submit ``spec``, follow it to its end and count the verdicts on ``byzantine_id``'s updates and on the
    others' (a ``rejected`` verdict, or refused at arrival)."""
    started = time.monotonic()
    job = cluster.follow(cluster.submit(spec, name=f"robustness-{label}"), timeout=timeout)
    rounds = [round_ for round_ in job["rounds"] if round_["closed"]]
    outcome = Outcome(
        label=label,
        status=job["status"],
        eval_loss=rounds[-1]["eval_loss"] if rounds else None,
        seconds=time.monotonic() - started,
        job=job,
    )
    for round_ in rounds:
        verdicts, refused = round_["verdicts"] or {}, round_["refused"] or {}
        peers = set(round_["participants"]) | set(verdicts) | set(refused)
        for peer in peers:
            verdict = verdicts.get(peer, {})
            if verdict.get("verdict") == "rejected":
                reason = verdict.get("reason") or "no reason given"
            elif peer in refused:
                reason = f"refused at arrival: {refused[peer]}"
            else:
                reason = None
            if peer == byzantine_id:
                outcome.sent += 1
                if reason is not None:
                    outcome.rejected += 1
                    outcome.reasons.append(f"round {round_['number']}: {reason}")
            elif reason is not None:
                outcome.honest_rejected += 1
                outcome.reasons.append(f"round {round_['number']}, honest {peer}: {reason}")
    return outcome


def print_table(clean: Outcome, results: list[tuple[str, str, Outcome]]) -> None:
    print(
        f"\nClean run (no byzantine trainer, mean): final eval loss {_loss(clean.eval_loss)}, {clean.seconds:.0f} s"
    )
    print()
    print(
        "| byzantine mode | aggregation | final eval loss | vs clean | byzantine rejected / sent | honest rejected | job |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, rule, outcome in results:
        rule_label = "mean (no verification)" if rule == "mean" else f"{rule} (verified)"
        ratio = (
            f"{outcome.eval_loss / clean.eval_loss:.3f}×"
            if outcome.eval_loss is not None and clean.eval_loss and math.isfinite(outcome.eval_loss)
            else "—"
        )
        print(
            f"| `{mode}` | {rule_label} | {_loss(outcome.eval_loss)} | {ratio} | "
            f"{outcome.rejected} / {outcome.sent} | {outcome.honest_rejected} | {outcome.status}, "
            f"{outcome.seconds:.0f} s |"
        )
    reasons = [(mode, rule, reason) for mode, rule, outcome in results for reason in outcome.reasons[:1]]
    if reasons:
        print("\nA reason of each (first rejection):")
        for mode, rule, reason in reasons:
            print(f"* `{mode}`, {rule}: {reason}")


def _loss(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trainers", type=int, default=4, help="trainers per job, one byzantine (default: 4)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="outer rounds (default: 3)")
    parser.add_argument("--inner-steps", type=int, default=10, help="H: steps per round (default: 10)")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"byzantine modes, comma-separated (default: {','.join(MODES)})",
    )
    parser.add_argument(
        "--rules",
        default=",".join(RULES),
        help=f"aggregation rules, comma-separated (default: {','.join(RULES)})",
    )
    parser.add_argument(
        "--round-timeout",
        type=float,
        default=30.0,
        help="seconds a round waits after its first update (default: 30; each scale:100 round waits it out)",
    )
    parser.add_argument("--mode", choices=("auto", "embedded", "services"), default="auto")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job (default: 600)")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory and print its path")
    arguments = parser.parse_args(argv)
    arguments.modes = [mode.strip() for mode in arguments.modes.split(",") if mode.strip()]
    arguments.rules = [rule.strip() for rule in arguments.rules.split(",") if rule.strip()]
    unknown = [rule for rule in arguments.rules if rule not in RULES]
    if unknown:
        parser.error(f"unknown rules {unknown}: choose from {', '.join(RULES)}")
    if arguments.trainers < 3:
        parser.error("--trainers must be at least 3 (verification's norm and cosine rules need 3 updates)")
    return arguments


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    mode = resolve_mode(arguments.mode)
    exit_on_sigterm()
    print_start()
    print(
        f"Jobs: {arguments.trainers} trainers (one byzantine), {arguments.rounds} rounds × H={arguments.inner_steps}, "
        f"SMALL_GPT2 at batch {BATCH_SIZE}; modes {arguments.modes}; rules {arguments.rules}",
        flush=True,
    )
    results: list[tuple[str, str, Outcome]] = []
    with run_directory("hypha-robustness-", keep=arguments.keep) as root:
        dataset = prepare_stdlib_text(
            root / "stdlib", max_bytes=MAX_BYTES, samples_per_slice=SAMPLES_PER_SLICE
        )
        spec = job_spec(
            dataset.name,
            trainers=arguments.trainers,
            rounds=arguments.rounds,
            inner_steps=arguments.inner_steps,
            round_timeout=arguments.round_timeout,
        )
        cluster_root = root / "cluster"
        byzantine = f"worker-{arguments.trainers + 1}"
        started = time.monotonic()
        with training_cluster(
            root=cluster_root,
            dataset_dir=dataset,
            workers=arguments.trainers + 1,
            mode=mode,
            worker_tomls=cluster_tomls(arguments.trainers),
        ) as cluster:
            wait_for_spares(cluster, list(cluster.daemons))
            byzantine_id = worker_ids(cluster)[byzantine]
            clean = run_job(cluster, spec, label="clean", byzantine_id=None, timeout=arguments.timeout)
            print(
                f"clean: {clean.status}, eval loss {_loss(clean.eval_loss)}, {clean.seconds:.0f} s",
                flush=True,
            )
            for byzantine_mode in arguments.modes:
                set_byzantine(cluster, byzantine, byzantine_mode, root=cluster_root)
                for rule in arguments.rules:
                    outcome = run_job(
                        cluster,
                        with_rule(spec, rule, max_rejections=arguments.rounds + 1),
                        label=f"{byzantine_mode}-{rule}".replace(":", ""),
                        byzantine_id=byzantine_id,
                        timeout=arguments.timeout,
                    )
                    results.append((byzantine_mode, rule, outcome))
                    print(
                        f"{byzantine_mode} × {rule}: {outcome.status}, eval loss {_loss(outcome.eval_loss)}, "
                        f"rejected {outcome.rejected}/{outcome.sent}, honest rejected {outcome.honest_rejected}, "
                        f"{outcome.seconds:.0f} s",
                        flush=True,
                    )
        print_table(clean, results)
        print(f"\nTotal {time.monotonic() - started:.0f} s; load average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
