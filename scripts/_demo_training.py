"""The demo's driver (run by ``scripts/demo``): train a tiny GPT-2 with DiLoCo on loopback and print the result.

Prepares a byte-level dataset from the Python standard library's sources, starts the control plane (embedded:
SQLite, no servers), one data node and ``trainers + 1`` worker daemons (the market picks the parameter server),
submits the job, prints each round as it closes (its eval loss with it, or on a line of its own when the
eval arrives later), downloads the final model and ends with one JSON line::

    {"job": ..., "status": "completed", "rounds": ..., "first_round_loss": ..., "final_loss": ...,
     "eval_loss": ..., "model": "<path>"}

With ``--inference`` a batch inference job follows over the trained model (``scripts/_demo_inference.py``)
and the JSON line gains ``"inference": {"job", "status", "slices", "slices_total", "seconds", "results",
"workers"}``; ``--inference-only`` runs that job alone, over the demo's model built from its config.

Exit code 0 when the job (every job) completed, 1 otherwise (with the logs' tails on stderr).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.cluster import diloco_spec, dump, prepare_stdlib_text, summary, training_cluster  # noqa: E402
from scripts import _demo_inference  # noqa: E402


def log(text: str) -> None:
    print(f"==> {text}", flush=True)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


class RoundLines:
    """The demo's round lines from the job as ``GET /api/jobs/<id>/`` sends it, polled: a line for each round
    when it closes, with its eval loss when that came with it; an eval that comes later (or the reason there is
    none) gets a line of its own when it arrives, so that no line says "eval loss None"."""

    def __init__(self, rounds: int, *, elapsed: Callable[[], float]) -> None:
        self.rounds = rounds
        self.elapsed = elapsed
        self.printed: set[int] = set()
        self.eval_pending: set[int] = set()

    @staticmethod
    def _evaluation(round_: dict) -> str | None:
        if round_.get("eval_loss") is not None:
            return f"eval loss {_number(round_['eval_loss'])}"
        if round_.get("eval_error"):
            return f"no eval loss: {round_['eval_error']}"
        return None

    def lines(self, job: dict) -> list[str]:
        """What to print for this answer (nothing when nothing changed)."""
        lines = []
        closed = sorted((r for r in job.get("rounds") or [] if r.get("closed")), key=lambda r: r["number"])
        when = f"({self.elapsed():.0f} s)"
        for round_ in closed:
            number, evaluation = round_["number"], self._evaluation(round_)
            name = f"round {number}/{self.rounds}"
            if number not in self.printed:
                self.printed.add(number)
                parts = [
                    f"{len(round_.get('participants') or [])} trainers",
                    f"training loss {_number(round_.get('mean_loss'))}",
                ]
                if evaluation is None:
                    self.eval_pending.add(number)
                else:
                    parts.append(evaluation)
                lines.append(f"{name}: {', '.join(parts)} {when}")
            elif number in self.eval_pending and evaluation is not None:
                self.eval_pending.discard(number)
                lines.append(f"{name}: {evaluation} {when}")
        return lines


def follow(fetch: Callable[[], dict], printer: RoundLines, *, timeout: float, interval: float = 0.5) -> dict:
    """Poll the job (``fetch``) until it ends, logging ``printer``'s lines; the final job. Raises
    TimeoutError when it has not ended within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        job = fetch()
        for line in printer.lines(job):
            log(line)
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        if time.monotonic() >= deadline:
            raise TimeoutError(f"job {job['id']} did not end within {timeout:g}s")
        time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=3, help="trainer daemons (default 3)")
    parser.add_argument("--rounds", type=int, default=6, help="outer DiLoCo rounds (default 6)")
    parser.add_argument("--inner-steps", type=int, default=25, help="AdamW steps per trainer per round (H)")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "demo-output", help="where the model goes")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs, work dirs)")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    parser.add_argument(
        "--inference",
        action="store_true",
        help="then run a batch inference job (embed) over the trained model; its results zip goes to --output",
    )
    parser.add_argument(
        "--inference-only",
        action="store_true",
        help="no training: only the inference job, over the demo's model built from its config (untrained)",
    )
    args = parser.parse_args(argv)
    if args.trainers < 1 or args.rounds < 1 or args.inner_steps < 1:
        parser.error("--trainers, --rounds and --inner-steps must be at least 1")

    root = Path(tempfile.mkdtemp(prefix="hypha-demo-"))
    started = time.monotonic()
    dataset = prepare_stdlib_text(root / "stdlib")
    slices = len(list(dataset.glob("*.safetensors")))
    log(f"dataset 'stdlib': {slices} slices of 64 × 128 bytes of the standard library's sources ({dataset})")
    job = None
    try:
        log(f"starting the control plane (embedded), a data node and {args.trainers + 1} worker daemons")
        with training_cluster(root=root, dataset_dir=dataset, workers=args.trainers + 1) as cluster:
            log(f"control plane at {cluster.plane.base_url}; all daemons online")
            if args.inference_only:
                return _inference(cluster, args, model_zip=None, started=started, trained=None)
            spec = diloco_spec(
                dataset="stdlib", trainers=args.trainers, rounds=args.rounds, inner_steps=args.inner_steps
            )
            job_id = cluster.submit(spec, name="demo-tiny-gpt2")
            log(
                f"submitted job {job_id}: a 2-layer GPT-2 from a config, {args.trainers} trainers, "
                f"{args.rounds} rounds of {args.inner_steps} steps"
            )

            printer = RoundLines(args.rounds, elapsed=lambda: time.monotonic() - started)
            try:
                job = follow(lambda: cluster.job(job_id), printer, timeout=args.timeout)
            except (TimeoutError, RuntimeError) as error:
                print(f"demo: FAILED: {error}\n{cluster.logs()}", file=sys.stderr)
                return 1
            model = None
            if job["status"] == "completed":
                model = cluster.download_model(job_id, args.output / f"model-{job_id}.zip")
                log(f"job completed in {time.monotonic() - started:.0f} s; model saved to {model}")
            else:
                print(f"demo: FAILED: the job is {job['status']}: {job['status_reason']}", file=sys.stderr)
                print(cluster.logs(), file=sys.stderr)
            if args.inference and model is not None:
                return _inference(
                    cluster, args, model_zip=model, started=started, trained=summary(job, model=model)
                )
        print(dump(summary(job, model=model)), flush=True)
        return 0 if job["status"] == "completed" else 1
    finally:
        if args.keep:
            log(f"kept {root}")
        else:
            import shutil

            shutil.rmtree(root, ignore_errors=True)


def _inference(cluster, args, *, model_zip: Path | None, started: float, trained: dict | None) -> int:
    """Run the demo's inference job and print the JSON line (the training's, if any, with ``inference``)."""
    try:
        result = _demo_inference.run(
            cluster,
            model_zip=model_zip,
            dataset="stdlib",
            workers=args.trainers,
            output=args.output,
            log=log,
            timeout=args.timeout,
        )
    except (TimeoutError, RuntimeError) as error:
        print(f"demo: FAILED: {error}\n{cluster.logs()}", file=sys.stderr)
        return 1
    if result["status"] != "completed":
        print(
            f"demo: FAILED: the inference job is {result['status']}: {result.get('reason')}", file=sys.stderr
        )
        print(cluster.logs(), file=sys.stderr)
    log(f"demo done in {time.monotonic() - started:.0f} s")
    print(dump({**(trained or {}), "inference": result}), flush=True)
    ok = result["status"] == "completed" and (trained is None or trained["status"] == "completed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
