"""The built-in batch inference executor: an executor for Hypha's job bridge (docs/inference.md, "The executor").

Launch (the daemon substitutes the three placeholders; the same values may come from the environment
variables ``SOCKET_PATH``, ``WORK_DIR`` and ``JOB_JSON``, which is how the daemon's ``inference`` runtime
starts it: a job JSON on the command line would show in ``ps``)::

    python -m worker_daemon.executors.inference --socket {SOCKET_PATH} --work-dir {WORK_DIR} --job {JOB_JSON}

It speaks only the bridge's documented endpoints, so any Hypha-compatible bridge can run it:

1. ``POST /resources/fetch`` with ``config.model.artifact``: the model files in ``artifacts/`` (a zip or tar
   archive, as an uploaded model is, unpacked into ``artifacts/model``; a ``{"type": "config"}`` artifact is
   not fetched but built with random weights); the model is loaded with the task's Auto class in float32, on
   CUDA when this machine has it (the daemon shows a task only its lease's devices), else on the CPU;
2. ``POST /resources/fetch`` with ``config.data``: the next slice this worker is given
   (``[{"path": "artifacts/<index>"}]``), or ``[]`` once the job has none left for it — then exit 0;
3. the job's computation over the slice's tensors, ``batch_size`` rows at a time (``generate``, ``classify``
   or ``embed``: :mod:`~worker_daemon.executors.inference_tasks`), written to ``results/<index>.jsonl`` or
   ``results/<index>.safetensors``;
4. ``POST /resources/send`` of that file to ``config.results`` with ``resource = {dataset, index}`` (the
   daemon's bridge uploads it to the control plane, in the background, in order), then ``POST /status/send``
   ``{"metrics": {"round": k, "metrics": {"slices_done": k, "samples": rows, "seconds": s}}}``; a status the
   bridge refuses is logged and the work goes on (progress is informative here, the results are the work);
5. back to 2.

The result file stays in ``results/`` until the task ends: the bridge reads it after ``send`` has answered.

Test knob: ``HYPHA_INFERENCE_WRONG_RESULTS=1`` in the environment makes this executor perturb every result it
writes (+1.0 on every float, +1 on every token id) — like ``--slowdown`` and ``--byzantine``, an experiment and
test knob for a dishonest worker, never for production.

Exit codes: 0 no slice left; 1 unexpected error; 2 bad command line; 3 a bridge call failed; 4 the job JSON or
its model artifact is unusable; 5 a data slice is unusable; 143 terminated by SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker_daemon.executors.setup import launch_arguments
from worker_daemon.executors.training import EXIT_ERROR, EXIT_OK, EXIT_TERMINATED, configure_logging

if TYPE_CHECKING:
    from worker_daemon.executors.bridge_client import BridgeClient
    from worker_daemon.executors.inference_tasks import InferenceJob

logger = logging.getLogger("worker_daemon.executors.inference")

RESULTS_DIR = "results"


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (:func:`~worker_daemon.executors.setup.launch_arguments`)."""
    return launch_arguments(
        argv,
        prog="python -m worker_daemon.executors.inference",
        description="Hypha's built-in batch inference executor: talks to the job bridge on --socket.",
        log_help="INFO (one line per slice) or DEBUG",
    )


def _terminate(signal_number: int, frame: Any) -> None:
    raise SystemExit(EXIT_TERMINATED)


def fetch_model(client: BridgeClient, artifact: dict[str, Any], work_dir: Path) -> Path | None:
    """Fetch the model artifact (the reference verbatim) and return the directory to load it from (an archive
    unpacked); None for a ``config`` artifact, which is built here, not fetched."""
    from worker_daemon.executors.inference_tasks import unpack_model

    if artifact.get("type") == "config":
        return None
    files = client.fetch(artifact)
    return unpack_model([work_dir / file.path for file in files], work_dir / "artifacts")


def slice_index(path: str) -> int:
    """The slice index of a fetched slice: the bridge names it ``artifacts/<index>``."""
    from worker_daemon.executors.exceptions import DataError

    name = Path(path).name
    if not name.isdigit():
        raise DataError(f"a data fetch yielded {path!r}, which is not named by a slice index")
    return int(name)


def compute(
    model: Any, job: InferenceJob, tensors: dict[str, Any], *, index: int, device: str, where: str
) -> Any:
    """The job's computation over one slice's tensors: token lists (generate) or tensors (classify, embed)."""
    from worker_daemon.executors import inference_tasks as tasks

    config = job.config
    inputs = tasks.slice_inputs(tensors, config.input_names, where)
    options = {"batch_size": config.batch_size, "device": device}
    task = config.task
    if isinstance(task, tasks.GenerateTask):
        return tasks.generate(model, inputs, task, index=index, **options)
    if isinstance(task, tasks.ClassifyTask):
        return tasks.classify(model, inputs, task, **options)
    return tasks.embed(model, inputs, **options)


def run(arguments: argparse.Namespace, job: InferenceJob) -> int:
    """Process slices until the bridge says there is none left (exit 0); raises :class:`ExecutorError`."""
    import torch
    import transformers
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from worker_daemon.executors import inference_tasks as tasks
    from worker_daemon.executors.bridge_client import BridgeClient
    from worker_daemon.executors.exceptions import BridgeCallError, DataError

    transformers.utils.logging.disable_progress_bar()
    config = job.config
    work_dir = Path(arguments.work_dir).resolve()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wrong = tasks.wrong_results()
    if wrong:
        logger.warning(
            "WRONG RESULTS (%s=1): every result this executor sends is deliberately perturbed; an experiment "
            "and test knob, never for production",
            tasks.WRONG_RESULTS_ENV,
        )
    dataset = config.data["dataset"]
    with BridgeClient(arguments.socket) as client:
        directory = fetch_model(client, config.model.artifact, work_dir)
        model = tasks.load_model(
            directory, config, device=device, trust_remote_code=arguments.trust_remote_code
        )
        logger.info(
            "job %s: model %s (%s) loaded on %s; task %s, batch size %d",
            job.job_id,
            config.model.task,
            type(model).__name__,
            device,
            config.task.type,
            config.batch_size,
        )
        done = samples_total = 0
        while True:
            files = client.fetch(config.data)
            if not files:
                logger.info(
                    "job %s: no slice left; %d slices (%d rows) done", job.job_id, done, samples_total
                )
                return EXIT_OK
            if len(files) != 1:
                raise DataError(f"a data fetch must yield exactly one file, got {[f.path for f in files]}")
            index = slice_index(files[0].path)
            path = work_dir / files[0].path
            try:
                tensors = load_file(str(path))
            except (SafetensorError, OSError) as error:
                raise DataError(f"data slice {files[0].path} is not readable safetensors: {error}") from error
            path.unlink(missing_ok=True)
            started = time.perf_counter()
            with torch.inference_mode():
                result = compute(model, job, tensors, index=index, device=device, where=files[0].path)
            rows = len(result) if isinstance(result, list) else int(next(iter(result.values())).shape[0])
            written = tasks.write_result(result, work_dir / RESULTS_DIR, index, wrong=wrong)
            seconds = time.perf_counter() - started
            reference = {**config.results, "resource": {"dataset": dataset, "index": index}}
            client.send(reference, written.relative_to(work_dir).as_posix())
            done += 1
            samples_total += rows
            logger.info(
                "slice %d of %s: %d rows in %.2f s, result %s sent",
                index,
                dataset,
                rows,
                seconds,
                written.name,
            )
            metrics = {"slices_done": float(done), "samples": float(rows), "seconds": round(seconds, 6)}
            try:
                client.status({"metrics": {"round": done, "metrics": metrics}})
            except BridgeCallError as error:
                logger.warning("progress not reported (the work goes on): %s", error)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the job, map the outcome to an exit code (see the module docstring)."""
    arguments = parse_arguments(argv)
    configure_logging(arguments.log_level)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    from worker_daemon.executors.exceptions import ExecutorError
    from worker_daemon.executors.inference_tasks import parse_job

    try:
        job = parse_job(arguments.job)  # before the heavy imports: a malformed job fails at once
        logger.info("job %s: starting batch inference (bridge %s)", job.job_id, arguments.socket)
        return run(arguments, job)
    except ExecutorError as error:
        logger.error("%s: %s", type(error).__name__, error)
        return error.exit_code
    except SystemExit as exit_request:
        if exit_request.code == EXIT_TERMINATED:
            logger.warning("terminated by SIGTERM")
        raise
    except Exception:
        logger.exception("the inference executor failed unexpectedly")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
