"""The built-in DiLoCo trainer: an executor for Hypha's job bridge (hypha-protocols.md §1–2, docs/training.md).

Launch (the daemon substitutes the three placeholders; the same values may come from the environment
variables ``SOCKET_PATH``, ``WORK_DIR`` and ``JOB_JSON``)::

    accelerate launch <worker_daemon.config.ACCELERATE_LAUNCH_OPTIONS> [--cpu] \\
        -m worker_daemon.executors.training --socket {SOCKET_PATH} --work-dir {WORK_DIR} --job {JOB_JSON}

``python -m worker_daemon.executors.training …`` works too. What it does, per the contract:

1. open one ``/resources/receive`` stream on the job's ``results`` reference for the whole job;
2. fetch the model artifact once, load it with ``AutoModelFor<task>.from_pretrained``, make AdamW (and the
   optional LR schedule); the data loader fetches a slice of the ``data`` reference whenever it needs one;
3. every round: train, reporting ``{"status": {"batch_size", "loss", "step_time", "lr", "tokens"}}`` after every
   optimizer step (``tokens``: the token ids in the batch, for token models), until the scheduler's counter
   says stop (below); send ``"update"``; write
   ``delta = θ_local − θ_global_prev`` to ``updates/<round>.safetensors`` (in the job's ``encoding``, with
   error feedback: docs/training.md, "Encodings") and send it to ``updates``; report
   the round's metrics (``loss``, ``samples``, ``steps``, ``samples_per_second``, and ``train_seconds``: the
   sum of its steps' ``step_time``; and, where known, ``tokens``, ``tokens_per_second``, ``peak_memory_bytes``
   (CUDA) and ``mfu``: :mod:`~worker_daemon.executors.throughput`); wait for the parameter server's update ``u``
   on the receive stream;
   load ``θ_global_prev + u`` into the model; send ``"update-received"``: ``Done`` ends the job (exit 0),
   anything else starts the next round. AdamW's state is kept across rounds.

An eager job (``overlap.mode = "eager"`` in the job JSON) does not wait in step 3: it sends round r's update
and trains round r+1 from a proxy of the parameter server's step at once, merging round r's result between
two steps when it arrives (:mod:`~worker_daemon.executors.overlap`, docs/training.md, "Overlap: eager
updates"). A streaming job (``overlap.mode = "streaming"``) sends one fragment of the model a round and trains
on, mixing the fragment's global weights in when they arrive (:mod:`~worker_daemon.executors.streaming`).

Counter (exactly Hypha's): it is -1 at the start of each round; a ``ScheduleUpdate`` reply sets it to the
reply's ``counter``, every other reply decrements it; the round's inner loop ends when it reaches 0. So
``ScheduleUpdate{0}`` means "this was the last step", ``ScheduleUpdate{k}`` "k more steps".

Unlike Hypha's executor (§9): tied weights are saved once (no crash), the delta is computed without touching
the live model (a failed merge leaves it intact), the status carries a real ``step_time`` instead of the
garbage ``round_time``, and ``wsd`` accepts ``decay_steps`` as well as ``decay_step``.

A job with ``training.processes`` N > 1 runs as N processes under DDP, rank 0 alone talking to the bridge
(:mod:`~worker_daemon.executors.ranks`, :mod:`~worker_daemon.executors.several`; docs/training.md, "One
trainer, several processes").

Modules: this one is the entry point (command line, logging, :func:`training_function`, exit codes);
:mod:`~worker_daemon.executors.setup` makes the model, data loader, optimizer and LR schedule, and
:mod:`~worker_daemon.executors.rounds` runs the rounds (inner loop, outer step). Their names are re-exported
here; every part logs as ``worker_daemon.executors.training``.

Exit codes: 0 the job is done; 1 unexpected error; 2 bad command line; 3 a bridge call failed; 4 the job JSON
or its model artifact is unusable; 5 training cannot go on (bad data slice, refused update, diverged loss);
143 terminated by SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

# The trainer's parts, split by concern (docs/training.md); re-exported here, where callers and tests import them.
from worker_daemon.executors.rounds import (
    UPDATES_DIR,
    RoundStats,
    _loss_of,
    log_round,
    receive_result,
    run_round,
    send_update,
    synchronise,
)
from worker_daemon.executors.setup import (
    _own_memory,
    get_dataloaders,
    job_step,
    launch_arguments,
    load_model,
    load_preprocessor,
    make_lr_schedule,
    make_optimizer,
)

if TYPE_CHECKING:
    from worker_daemon.executors.job import TrainJob

__all__ = [
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "INCOMING_DIR",
    "UPDATES_DIR",
    "RoundStats",
    "_loss_of",
    "_own_memory",
    "get_dataloaders",
    "job_step",
    "load_model",
    "load_preprocessor",
    "main",
    "make_lr_schedule",
    "make_optimizer",
    "parse_arguments",
    "receive_result",
    "run_round",
    "send_update",
    "slowdown_factor",
    "synchronise",
    "training_function",
]

logger = logging.getLogger("worker_daemon.executors.training")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_TERMINATED = 128 + signal.SIGTERM

INCOMING_DIR = "incoming"
#: Set by a daemon started with ``--slowdown F`` (an experiment knob): each step then takes F times as long
#: (the executor sleeps ``(F − 1) ×`` the step's compute time after it; ``step_time`` includes the sleep).
SLOWDOWN_ENV = "HYPHA_SLOWDOWN"


def slowdown_factor(environ: dict[str, str] | None = None) -> float:
    """The daemon's ``--slowdown`` factor (1.0 when unset or not a number ≥ 1)."""
    value = (os.environ if environ is None else environ).get(SLOWDOWN_ENV, "")
    try:
        factor = float(value)
    except ValueError:
        return 1.0
    return factor if math.isfinite(factor) and factor >= 1.0 else 1.0


# --- command line ----------------------------------------------------------------------------------------------


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (:func:`~worker_daemon.executors.setup.launch_arguments`)."""
    return launch_arguments(
        argv,
        prog="python -m worker_daemon.executors.training",
        description="Hypha's built-in DiLoCo trainer: talks to the job bridge on --socket.",
        log_help="INFO (one line per round) or DEBUG (per step)",
    )


def configure_logging(level: str) -> None:
    """Log lines to stdout, line-buffered: the daemon re-prints the executor's stdout line by line."""
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    logging.basicConfig(
        stream=sys.stdout,
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    ranks = os.environ.get("WORLD_SIZE", "1")
    if ranks not in ("", "1"):
        # One line format for every rank, its number where the daemon's failure reports still find the name.
        rank = os.environ.get("RANK", "?")
        for handler in logging.getLogger().handlers:
            handler.setFormatter(
                logging.Formatter(f"%(asctime)s %(levelname)s %(name)s[rank{rank}]: %(message)s")
            )
    # httpx logs every request at INFO: one line per training step would drown the round lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def _terminate(signal_number: int, frame: FrameType | None) -> None:
    raise SystemExit(EXIT_TERMINATED)


def training_function(arguments: argparse.Namespace, job: TrainJob) -> int:
    """Run ``job`` with the bridge and work dir of the parsed command line to its end; returns the exit code
    (0 when the scheduler said Done), raises :class:`ExecutorError` when the job cannot go on."""
    import torch
    import transformers
    from accelerate import Accelerator

    from hypha_tensors.encoding import ErrorFeedback
    from hypha_tensors.formats import Encoding
    from worker_daemon.executors import consistency, knobs
    from worker_daemon.executors.bridge_client import BridgeClient
    from worker_daemon.executors.pseudo_gradient import float_state, snapshot
    from worker_daemon.executors.ranks import world_size

    transformers.utils.logging.disable_progress_bar()
    if world_size() > 1:
        # One rank of a trainer of several processes (docs/training.md, "One trainer, several processes").
        from worker_daemon.executors.several import train_as_rank

        return train_as_rank(arguments, job)
    config = job.config
    work_dir = Path(arguments.work_dir).resolve()
    knobs.check_device(config.training)  # mixed precision this machine cannot do fails the task here
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), **knobs.accelerator_options(config.training))

    with BridgeClient(arguments.socket) as client, client.receive(config.results, INCOMING_DIR) as results:
        model = load_model(
            client=client, config=config, work_dir=work_dir, trust_remote_code=arguments.trust_remote_code
        )
        knobs.prepare_model(model, config.training)
        preprocess = None
        if config.preprocessor is not None:
            preprocess = load_preprocessor(
                client=client,
                spec=config.preprocessor,
                work_dir=work_dir,
                trust_remote_code=arguments.trust_remote_code,
            )
        # The parameter server's model file says which round its weights are (a trainer that joins late, or
        # replaces a lost one, starts after it: its LR schedule too) and their digest, which the loaded model
        # must match.
        start = consistency.starting_point(work_dir, config.model.artifact)
        optimizer = make_optimizer(model, config)
        lr_schedule = make_lr_schedule(
            optimizer, config, start_step=job_step(config, rounds_completed=start.round_number)
        )
        train_dataloader = get_dataloaders(
            client=client, config=config, work_dir=work_dir, preprocess=preprocess
        )
        if lr_schedule is None:
            model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
        else:
            model, optimizer, train_dataloader, lr_schedule = accelerator.prepare(
                model, optimizer, train_dataloader, lr_schedule
            )
        unwrapped = accelerator.unwrap_model(model)
        global_previous = snapshot(float_state(unwrapped))
        consistency.check_start(start, global_previous)
        published_dtypes = dict(start.dtypes)
        # The residual of the job's encoding: kept for the whole run, across full-weight fetches too.
        feedback = ErrorFeedback(Encoding(config.encoding, config.encoding_block_size))
        parameters = sum(parameter.numel() for parameter in unwrapped.parameters())
        logger.info(
            "job %s: model %s (%s, %d parameters) loaded on %s, batch size %d, lr %g",
            job.job_id,
            config.model.task,
            type(unwrapped).__name__,
            parameters,
            accelerator.device,
            config.batch_size,
            config.optimizer.learning_rate,
        )
        batches = iter(train_dataloader)
        slowdown = slowdown_factor()
        if slowdown > 1.0:
            logger.warning("slowed down %g× on purpose (%s)", slowdown, SLOWDOWN_ENV)
        round_number = (start.round_number or 0) + 1
        if start.digest is not None:
            logger.info(
                "starting from the global weights after round %d (digest %s, checked)",
                round_number - 1,
                start.digest,
            )
        if config.overlap is not None and config.overlap.mode != "none":
            from worker_daemon.executors.overlap import EagerRounds
            from worker_daemon.executors.streaming import StreamingRounds

            # The result of a round is read (and, when it cannot be merged, the full weights fetched) while
            # the next round trains: a second bridge connection for that thread.
            with BridgeClient(arguments.socket) as side_client:
                state: dict[str, Any] = dict(
                    client=client,
                    side_client=side_client,
                    results=results,
                    model=unwrapped,
                    config=config,
                    work_dir=work_dir,
                    global_previous=global_previous,
                    published_dtypes=published_dtypes,
                    feedback=feedback,
                    round_number=round_number,
                )
                loop: dict[str, Any] = dict(
                    accelerator=accelerator,
                    model=model,
                    optimizer=optimizer,
                    lr_schedule=lr_schedule,
                    batches=batches,
                    slowdown=slowdown,
                    job_id=job.job_id,
                )
                streaming = config.overlap.streaming
                rounds = StreamingRounds(**state) if streaming else EagerRounds(**state)
                # The rounds hold the global weights from here on: the starting ones must not outlive them.
                del state, global_previous
                return rounds.train(**loop)
        while True:
            stats = run_round(
                accelerator=accelerator,
                client=client,
                model=model,
                optimizer=optimizer,
                lr_schedule=lr_schedule,
                batches=batches,
                input_names=config.model.input_names,
                round_number=round_number,
                slowdown=slowdown,
                max_grad_norm=config.training.max_grad_norm,
            )
            sync_started = time.perf_counter()
            reply, merged = synchronise(
                client=client,
                results=results,
                model=unwrapped,
                global_previous=global_previous,
                config=config,
                work_dir=work_dir,
                round_number=round_number,
                stats=stats,
                published_dtypes=published_dtypes,
                feedback=feedback,
            )
            global_previous = merged.weights
            log_round(round_number, stats, merged, sync_started)
            if reply["type"] == "Done":
                logger.info("job %s: done after %d rounds", job.job_id, merged.rounds_completed)
                return EXIT_OK
            # After the full weights were fetched the next round is the one after theirs.
            round_number = merged.rounds_completed + 1


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the job, map the outcome to an exit code (see the module docstring)."""
    arguments = parse_arguments(argv)
    configure_logging(arguments.log_level)
    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
        signal.signal(signal.SIGTERM, _terminate)
    from worker_daemon.executors.exceptions import ExecutorError
    from worker_daemon.executors.job import parse_job

    try:
        # Before the heavy imports: a malformed job fails in well under a second.
        job = parse_job(arguments.job)
        training = job.config.training
        from worker_daemon.executors.ranks import world_size

        # A trainer of several processes started as one (by the daemon, or a launcher of one process).
        if training.processes != 1 and world_size() == 1:
            from worker_daemon.executors.ranks import launch, processes_wanted
            from worker_daemon.executors.several import check_several

            processes = processes_wanted(training.processes)
            if processes > 1:
                check_several(job.config, processes)
                logger.info("job %s: starting a trainer of %d processes", job.job_id, processes)
                return launch(
                    list(sys.argv[1:] if argv is None else argv),
                    processes=processes,
                    timeout=training.process_timeout,
                )
        logger.info(
            "job %s: starting the trainer (bridge %s, work dir %s)",
            job.job_id,
            arguments.socket,
            arguments.work_dir,
        )
        return training_function(arguments, job)
    except ExecutorError as error:
        logger.error("%s: %s", type(error).__name__, error)
        return error.exit_code
    except SystemExit as exit_request:
        if exit_request.code == EXIT_TERMINATED:
            logger.warning("terminated by SIGTERM")
        raise
    except Exception:
        logger.exception("the trainer failed unexpectedly")
        return EXIT_ERROR


def exit_now_if_a_group_is_left(code: int) -> None:
    """Exit with ``code`` at once when this process is a rank still in its process group: a rank that failed
    leaves its gloo group as is (``Ranks.close``), and tearing it down as the interpreter exits can abort the
    process (SIGABRT, "terminate called without an active exception": exit -6 instead of ``code``; a CI run
    saw it)."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as distributed

    if distributed.is_available() and distributed.is_initialized():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    exit_code = main()
    exit_now_if_a_group_is_left(exit_code)
    sys.exit(exit_code)
