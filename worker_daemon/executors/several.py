"""The trainer of several processes: one rank's run of a job (docs/training.md, "One trainer, several
processes"). The process group, the launcher and the ranks' collective calls are
:mod:`~worker_daemon.executors.ranks`'; this is the DiLoCo loop of :mod:`~worker_daemon.executors.training` with
rank 0 leading:

1. rank 0 opens the bridge (the one client, the one receive stream), fetches the model and reads its starting
   point; every rank loads the model from the fetched directory, makes AdamW and the LR schedule at the same
   step, and ``accelerator.prepare`` wraps the model in DDP (which copies rank 0's weights to every rank);
2. every step (:func:`~worker_daemon.executors.rounds.run_round` with ``ranks``): rank 0 takes the batch and
   hands it out, each rank trains its share (``batch_size / N``; DDP averages the gradients, and the prepared LR
   schedule steps once a step: ``split_batches``), rank 0 reports the mean loss and hands out the scheduler's
   decision;
3. at the round's end rank 0 alone computes and sends the trainer's one pseudo-gradient, merges the parameter
   server's result, and copies the merged weights to the other ranks; ``Done`` ends every rank with exit 0.

Not with ``overlap`` (eager or streaming): refused with exit 4 (:func:`check_several`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker_daemon.executors.exceptions import JobConfigError

if TYPE_CHECKING:
    from worker_daemon.executors.job import TrainConfig, TrainJob

logger = logging.getLogger("worker_daemon.executors.training")


def check_several(config: TrainConfig, processes: int) -> None:
    """Raise :class:`JobConfigError` when ``config`` cannot run as ``processes`` processes."""
    if config.overlap is not None and config.overlap.mode != "none":
        raise JobConfigError(
            f"a trainer of {processes} processes cannot overlap ({config.overlap.mode}) yet: "
            "use training.processes 1 or overlap none"
        )
    steps = config.training.gradient_accumulation_steps
    if config.batch_size % (processes * steps):
        raise JobConfigError(
            f"batch_size ({config.batch_size}) does not split into {processes} processes × {steps} "
            "micro-batches"
        )


def train_as_rank(arguments: argparse.Namespace, job: TrainJob) -> int:
    """Run this process's rank of ``job`` to the end; every rank returns 0 when the scheduler said Done."""
    from worker_daemon.executors import knobs
    from worker_daemon.executors.ranks import PeerError, Ranks

    config = job.config
    ranks = Ranks(timeout=config.training.process_timeout)
    # Refused on every rank before the process group: no rank waits for a peer that refused.
    check_several(config, ranks.world_size)
    knobs.check_device(config.training)
    ranks.initialise()
    try:
        code = _train(arguments, job, ranks)
    except RuntimeError as error:
        # A collective of DDP's own (the gradients' all-reduce in backward) that lost or waited out a peer.
        if not _distributed_failure(error):
            raise
        raise PeerError(f"rank {ranks.rank}: a peer of this trainer is gone ({error})") from error
    ranks.close(finished=True)
    return code


def _distributed_failure(error: RuntimeError) -> bool:
    import torch.distributed as distributed

    if isinstance(error, getattr(distributed, "DistError", ())):
        return True
    text = str(error)
    return "gloo" in text or "NCCL" in text or "ProcessGroup" in text


def _train(arguments: argparse.Namespace, job: TrainJob, ranks: Any) -> int:
    import torch  # noqa: F401  (the process group and accelerate need it loaded)
    from accelerate import Accelerator, DataLoaderConfiguration

    from hypha_tensors.encoding import ErrorFeedback
    from hypha_tensors.formats import Encoding
    from worker_daemon.executors import consistency, knobs
    from worker_daemon.executors.bridge_client import BridgeClient
    from worker_daemon.executors.pseudo_gradient import float_state, snapshot
    from worker_daemon.executors.rounds import log_round, run_round, synchronise
    from worker_daemon.executors.setup import (
        fetch_model,
        get_dataloaders,
        job_step,
        load_model_from,
        load_preprocessor,
        make_lr_schedule,
        make_optimizer,
    )
    from worker_daemon.executors.training import EXIT_OK, INCOMING_DIR, slowdown_factor

    config = job.config
    work_dir = Path(arguments.work_dir).resolve()
    # split_batches: the job's batch is the trainer's, split between the ranks, so the prepared LR schedule
    # steps once per optimizer step (not once per rank). The data loader is not prepared: rank 0 hands out.
    accelerator = Accelerator(
        cpu=not ranks.cuda,
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        **knobs.accelerator_options(config.training),
    )
    main: dict[str, Any] = {}  # rank 0's own state: the bridge, the global weights, the data
    with contextlib.ExitStack() as stack:
        if ranks.is_main:
            client = stack.enter_context(BridgeClient(arguments.socket))
            main["client"] = client
            main["results"] = stack.enter_context(client.receive(config.results, INCOMING_DIR))

        def fetch() -> tuple[str, int | None]:
            client = main["client"]
            directory = fetch_model(client=client, config=config, work_dir=work_dir)
            if config.preprocessor is not None:
                main["preprocess"] = load_preprocessor(
                    client=client,
                    spec=config.preprocessor,
                    work_dir=work_dir,
                    trust_remote_code=arguments.trust_remote_code,
                )
            main["start"] = consistency.starting_point(work_dir, config.model.artifact)
            return str(directory), main["start"].round_number

        directory, start_round = ranks.lead(fetch)
        model = load_model_from(Path(directory), config=config, trust_remote_code=arguments.trust_remote_code)
        knobs.prepare_model(model, config.training)
        optimizer = make_optimizer(model, config)
        lr_schedule = make_lr_schedule(
            optimizer, config, start_step=job_step(config, rounds_completed=start_round)
        )
        if lr_schedule is None:
            model, optimizer = accelerator.prepare(model, optimizer)
        else:
            model, optimizer, lr_schedule = accelerator.prepare(model, optimizer, lr_schedule)
        unwrapped = accelerator.unwrap_model(model)

        def begin() -> None:
            main["global_previous"] = snapshot(float_state(unwrapped))
            consistency.check_start(main["start"], main["global_previous"])
            main["published_dtypes"] = dict(main["start"].dtypes)
            main["feedback"] = ErrorFeedback(Encoding(config.encoding, config.encoding_block_size))
            loader = get_dataloaders(
                client=main["client"], config=config, work_dir=work_dir, preprocess=main.get("preprocess")
            )
            main["batches"] = iter(loader)
            logger.info(
                "job %s: model %s (%s, %d parameters) on %d processes (%s), batch size %d (%d a process), lr %g",
                job.job_id,
                config.model.task,
                type(unwrapped).__name__,
                sum(parameter.numel() for parameter in unwrapped.parameters()),
                ranks.world_size,
                "cuda" if ranks.cuda else "cpu",
                config.batch_size,
                config.batch_size // ranks.world_size,
                config.optimizer.learning_rate,
            )

        ranks.lead(begin)
        slowdown = slowdown_factor()
        round_number = (start_round or 0) + 1
        while True:
            stats = run_round(
                accelerator=accelerator,
                client=main.get("client"),
                model=model,
                optimizer=optimizer,
                lr_schedule=lr_schedule,
                batches=main.get("batches"),
                input_names=config.model.input_names,
                round_number=round_number,
                slowdown=slowdown,
                max_grad_norm=config.training.max_grad_norm,
                ranks=ranks,
            )

            def outer_step(round_number: int = round_number, stats: Any = stats) -> tuple[bool, int]:
                # The trainer's one pseudo-gradient: the ranks' weights are identical (DDP).
                sync_started = time.perf_counter()
                reply, merged = synchronise(
                    client=main["client"],
                    results=main["results"],
                    model=unwrapped,
                    global_previous=main["global_previous"],
                    config=config,
                    work_dir=work_dir,
                    round_number=round_number,
                    stats=stats,
                    published_dtypes=main["published_dtypes"],
                    feedback=main["feedback"],
                )
                main["global_previous"] = merged.weights
                log_round(round_number, stats, merged, sync_started)
                return reply["type"] == "Done", merged.rounds_completed

            done, rounds_completed = ranks.lead(outer_step)
            ranks.copy_weights(unwrapped)  # the merged global weights, from rank 0 to every rank
            if done:
                if ranks.is_main:
                    logger.info("job %s: done after %d rounds", job.job_id, rounds_completed)
                return EXIT_OK
            round_number = rounds_completed + 1
