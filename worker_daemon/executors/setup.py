"""The trainer's setup (docs/training.md): the model, the preprocessor, the data loader, the optimizer and the LR
schedule of a job, as :mod:`worker_daemon.executors.training` makes them before its first round. Split out of
``training.py``; the names are re-exported there."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from worker_daemon.executors.bridge_client import BridgeClient
    from worker_daemon.executors.job import PreprocessorSpec, TrainConfig

#: The trainer's logger: the daemon's failure reports (worker_daemon/failures.py) and tests match its name.
logger = logging.getLogger("worker_daemon.executors.training")


# --- model, data, optimizer ------------------------------------------------------------------------------------


def load_model(
    *, client: BridgeClient, config: TrainConfig, work_dir: Path, trust_remote_code: bool
) -> torch.nn.Module:
    """Fetch the model artifact (the reference verbatim) and load it with the task's Auto class, in float32
    whatever dtype it was saved in: the master weights, AdamW's state and the pseudo-gradient are float32
    (transformers 5 keeps a checkpoint's dtype by default; a float16 model then diverges at its first AdamW
    step and a bfloat16 one rounds small steps away)."""
    return load_model_from(
        fetch_model(client=client, config=config, work_dir=work_dir),
        config=config,
        trust_remote_code=trust_remote_code,
    )


def fetch_model(*, client: BridgeClient, config: TrainConfig, work_dir: Path) -> Path:
    """Fetch the model artifact (the reference verbatim); the directory to load it from."""
    files = client.fetch(config.model.artifact)
    configs = [file for file in files if Path(file.path).name == "config.json"]
    return (work_dir / configs[0].path).parent if configs else work_dir / "artifacts"


def load_model_from(directory: Path, *, config: TrainConfig, trust_remote_code: bool) -> torch.nn.Module:
    """The model in ``directory`` (fetched by :func:`fetch_model`), as :func:`load_model` loads it."""
    import torch
    import transformers

    from worker_daemon.executors.exceptions import JobConfigError
    from worker_daemon.executors.job import MODEL_CLASSES, set_loss_type

    names = MODEL_CLASSES[config.model.task]
    auto_class = next((getattr(transformers, name) for name in names if hasattr(transformers, name)), None)
    if auto_class is None:
        raise JobConfigError(f"this transformers has none of {names} for task {config.model.task!r}")
    try:
        model = auto_class.from_pretrained(
            directory, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError) as error:
        raise JobConfigError(f"cannot load the model from {directory}: {error}") from error
    _own_memory(model)
    set_loss_type(model, auto_class.__name__)
    return model


def _own_memory(model: torch.nn.Module) -> None:
    """Give every parameter and buffer memory of its own. ``from_pretrained`` may leave them in a private memory
    map of ``artifacts/model.safetensors``, and a private map is not private enough: when that file is
    rewritten in place (a bridge that fetches the full weights again without writing a new file), truncating
    it throws away even the pages training already wrote, and the live weights silently become the file's
    new contents. Tied parameters stay one object; shared buffers stay shared."""
    for parameter in model.parameters():
        parameter.data = parameter.data.clone()
    copies: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                if id(buffer) not in copies:
                    copies[id(buffer)] = buffer.clone()
                module._buffers[name] = copies[id(buffer)]


def load_preprocessor(
    *, client: BridgeClient, spec: PreprocessorSpec, work_dir: Path, trust_remote_code: bool
) -> Callable[[dict[str, torch.Tensor]], dict[str, Any]]:
    """Fetch the preprocessor artifact and load it from ``artifacts/<first filename>`` as Hypha does (falling
    back to that file's directory, which is what a tokenizer needs). Best effort: untested on real data."""
    import transformers

    from worker_daemon.executors.exceptions import JobConfigError
    from worker_daemon.executors.job import PREPROCESSOR_CLASSES

    files = client.fetch(spec.artifact)
    filenames = spec.artifact.get("filenames") or []
    if filenames:
        first = work_dir / "artifacts" / filenames[0]
    elif files:
        first = work_dir / files[0].path
    else:
        raise JobConfigError("the preprocessor artifact yielded no file")
    auto_class = getattr(transformers, PREPROCESSOR_CLASSES[spec.task])
    try:
        processor = auto_class.from_pretrained(str(first), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError):
        try:
            processor = auto_class.from_pretrained(str(first.parent), trust_remote_code=trust_remote_code)
        # ImportError: transformers 5's image processors need torchvision, which a host may lack.
        except (OSError, ValueError, ImportError) as error:
            raise JobConfigError(f"cannot load the {spec.task} preprocessor from {first}: {error}") from error

    return Preprocessor(processor)


class Preprocessor:
    """A loaded preprocessor applied to a whole slice (name → tensor): its outputs as tensors. A class, not a
    closure, so that it pickles into spawned DataLoader workers (``training.dataloader_workers``)."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return dict(self.processor(**tensors, return_tensors="pt"))


def get_dataloaders(
    *,
    client: BridgeClient,
    config: TrainConfig,
    work_dir: Path,
    preprocess: Callable[[dict[str, torch.Tensor]], dict[str, Any]] | None = None,
) -> torch.utils.data.DataLoader:
    """The training DataLoader: batches of ``batch_size`` samples from an endless stream of data slices.

    With ``training.dataloader_workers`` N > 0, N worker processes read the slices (decode, preprocess) while
    this process fetches them and makes the batches (:mod:`worker_daemon.executors.slice_workers`): the same
    batches in the same order as with 0, pinned on CUDA. There is no evaluation loader: the parameter server
    evaluates the global model."""
    import torch
    from torch.utils.data import DataLoader

    from worker_daemon.executors.data import SliceStream
    from worker_daemon.executors.slice_workers import WorkerSliceStream

    options: dict[str, Any] = dict(
        fetch=client.fetch,
        reference=config.data,
        work_dir=work_dir,
        input_names=config.model.input_names,
        preprocess=preprocess,
        preprocess_inputs=config.preprocessor.input_names if config.preprocessor else None,
    )
    workers = config.training.dataloader_workers
    if workers == 0:
        return DataLoader(SliceStream(**options), batch_size=config.batch_size, num_workers=0)
    # The batches are cut and collated here (num_workers=0 on this loader): the slice stream calls the
    # bridge, whose client lives in this process; its own inner loader's workers read the slices.
    return DataLoader(
        WorkerSliceStream(workers=workers, **options),
        batch_size=config.batch_size,
        num_workers=0,
        pin_memory=torch.cuda.is_available(),
    )


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    import torch

    from worker_daemon.executors import knobs

    options: dict[str, Any] = {"lr": config.optimizer.learning_rate}
    if config.optimizer.betas is not None:
        options["betas"] = tuple(config.optimizer.betas)
    if config.optimizer.epsilon is not None:
        options["eps"] = config.optimizer.epsilon
    options.update(knobs.optimizer_options(config))  # weight decay, when the job sets it
    return torch.optim.AdamW(model.parameters(), **options)


def job_step(config: TrainConfig, *, rounds_completed: int | None) -> int:
    """The job's step this trainer starts at (its LR schedule's first step): the dispatch's ``progress.steps``,
    plus ``steps_per_round`` for each round the fetched weights (``rounds_completed`` of them) are past the
    rounds it was dispatched with (a round may close between the dispatch and the fetch). 0 without
    ``progress`` (a control plane that does not send it)."""
    progress = config.progress
    if progress is None:
        return 0
    later = 0 if rounds_completed is None else rounds_completed - progress.rounds
    return max(0, progress.steps + round(later * progress.steps_per_round))


def make_lr_schedule(
    optimizer: torch.optim.Optimizer, config: TrainConfig, *, start_step: int = 0
) -> Any | None:
    """The LR schedule the job asks for, stepped once per optimizer step, starting at ``start_step`` (the job's
    step: :func:`job_step`): the first optimizer step gets the lr the schedule gives at ``start_step``, exactly
    as a schedule started at 0 and stepped ``start_step`` times would. ``None`` keeps the lr constant."""
    import transformers

    schedule = config.scheduler
    if schedule is None:
        return None
    if start_step > 0:
        # A scheduler resumed at last_epoch = n − 1 takes its base lr from initial_lr and steps once to n.
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
    last_epoch = start_step - 1
    if schedule.type == "cosine-with-warmup":
        return transformers.get_cosine_schedule_with_warmup(
            optimizer,
            num_warmup_steps=schedule.warmup_steps,
            num_training_steps=schedule.training_steps,
            last_epoch=last_epoch,
        )
    if schedule.type == "linear-with-warmup":
        return transformers.get_linear_schedule_with_warmup(
            optimizer,
            num_warmup_steps=schedule.warmup_steps,
            num_training_steps=schedule.training_steps,
            last_epoch=last_epoch,
        )
    stable_steps = schedule.stable_steps
    if stable_steps is None and schedule.training_steps is None:
        # Hypha's wsd config has no length: the job's length in steps is unknown up front, so rather than
        # decaying right after the warmup (lr 0 for the rest of the job) the stable phase lasts until the end.
        stable_steps = 2**31
        logger.warning("wsd schedule without stable_steps or training_steps: the lr never decays")
    return transformers.get_wsd_schedule(
        optimizer,
        num_warmup_steps=schedule.warmup_steps,
        num_decay_steps=schedule.decay_steps,
        num_training_steps=schedule.training_steps,
        num_stable_steps=stable_steps,
        last_epoch=last_epoch,
    )


#: Set to 1, true or yes: transformers may run model code shipped with the artifact.
TRUST_REMOTE_CODE_ENV = "HYPHA_TRUST_REMOTE_CODE"


def launch_arguments(
    argv: list[str] | None, *, prog: str, description: str, log_help: str
) -> argparse.Namespace:
    """A built-in executor's command line: ``--socket``, ``--work-dir`` and ``--job`` default to the
    environment variables ``SOCKET_PATH``, ``WORK_DIR`` and ``JOB_JSON`` (Hypha's launch contract sets both)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--socket", default=os.environ.get("SOCKET_PATH"), help="bridge socket [$SOCKET_PATH]"
    )
    parser.add_argument("--work-dir", default=os.environ.get("WORK_DIR"), help="job work dir [$WORK_DIR]")
    parser.add_argument("--job", default=os.environ.get("JOB_JSON"), help="the job JSON [$JOB_JSON]")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        default=os.environ.get(TRUST_REMOTE_CODE_ENV, "").lower() in {"1", "true", "yes"},
        help=f"let transformers run model code shipped with the artifact [${TRUST_REMOTE_CODE_ENV}=1]",
    )
    parser.add_argument("--log-level", default="INFO", help=log_help)
    arguments = parser.parse_args(argv)
    for option, value in (
        ("--socket", arguments.socket),
        ("--work-dir", arguments.work_dir),
        ("--job", arguments.job),
    ):
        if not value:
            parser.error(f"{option} is required (or its environment variable)")
    return arguments
