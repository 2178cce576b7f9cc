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
   sum of its steps' ``step_time``); wait for the parameter server's update ``u`` on the receive stream;
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

Exit codes: 0 the job is done; 1 unexpected error; 2 bad command line; 3 a bridge call failed; 4 the job JSON
or its model artifact is unusable; 5 training cannot go on (bad data slice, refused update, diverged loss);
143 terminated by SIGTERM.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from hypha_tensors.encoding import ErrorFeedback
    from worker_daemon.executors.bridge_client import BridgeClient, ReceiveStream
    from worker_daemon.executors.consistency import Merged, Published
    from worker_daemon.executors.job import PreprocessorSpec, TrainConfig, TrainJob

logger = logging.getLogger("worker_daemon.executors.training")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_TERMINATED = 128 + signal.SIGTERM

UPDATES_DIR = "updates"
INCOMING_DIR = "incoming"
TRUST_REMOTE_CODE_ENV = "HYPHA_TRUST_REMOTE_CODE"
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
    """The command line; ``--socket``, ``--work-dir`` and ``--job`` default to the environment variables
    ``SOCKET_PATH``, ``WORK_DIR`` and ``JOB_JSON`` (Hypha's launch contract sets both)."""
    parser = argparse.ArgumentParser(
        prog="python -m worker_daemon.executors.training",
        description="Hypha's built-in DiLoCo trainer: talks to the job bridge on --socket.",
    )
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
    parser.add_argument("--log-level", default="INFO", help="INFO (one line per round) or DEBUG (per step)")
    arguments = parser.parse_args(argv)
    for option, value in (
        ("--socket", arguments.socket),
        ("--work-dir", arguments.work_dir),
        ("--job", arguments.job),
    ):
        if not value:
            parser.error(f"{option} is required (or its environment variable)")
    return arguments


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
    # httpx logs every request at INFO: one line per training step would drown the round lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def _terminate(signal_number: int, frame: FrameType | None) -> None:
    raise SystemExit(EXIT_TERMINATED)


# --- model, data, optimizer ------------------------------------------------------------------------------------


def load_model(
    *, client: BridgeClient, config: TrainConfig, work_dir: Path, trust_remote_code: bool
) -> torch.nn.Module:
    """Fetch the model artifact (the reference verbatim) and load it with the task's Auto class, in float32
    whatever dtype it was saved in: the master weights, AdamW's state and the pseudo-gradient are float32
    (transformers 5 keeps a checkpoint's dtype by default; a float16 model then diverges at its first AdamW
    step and a bfloat16 one rounds small steps away)."""
    import torch
    import transformers

    from worker_daemon.executors.exceptions import JobConfigError
    from worker_daemon.executors.job import MODEL_CLASSES, set_loss_type

    files = client.fetch(config.model.artifact)
    configs = [file for file in files if Path(file.path).name == "config.json"]
    directory = (work_dir / configs[0].path).parent if configs else work_dir / "artifacts"
    names = MODEL_CLASSES[config.model.task]
    auto_class = next((getattr(transformers, name) for name in names if hasattr(transformers, name)), None)
    if auto_class is None:
        raise JobConfigError(f"this transformers has none of {names} for task {config.model.task!r}")
    try:
        model = auto_class.from_pretrained(
            directory, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError) as error:
        raise JobConfigError(f"cannot load the model from {[f.path for f in files]}: {error}") from error
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

    def preprocess(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return dict(processor(**tensors, return_tensors="pt"))

    return preprocess


def get_dataloaders(
    *,
    client: BridgeClient,
    config: TrainConfig,
    work_dir: Path,
    preprocess: Callable[[dict[str, torch.Tensor]], dict[str, Any]] | None = None,
) -> torch.utils.data.DataLoader:
    """The training DataLoader: batches of ``batch_size`` samples from an endless stream of data slices.

    There is no evaluation loader: the parameter server evaluates the global model."""
    from torch.utils.data import DataLoader

    from worker_daemon.executors.data import SliceStream

    dataset = SliceStream(
        fetch=client.fetch,
        reference=config.data,
        work_dir=work_dir,
        input_names=config.model.input_names,
        preprocess=preprocess,
        preprocess_inputs=config.preprocessor.input_names if config.preprocessor else None,
    )
    # num_workers=0: the slice stream calls the bridge, whose client lives in this process.
    return DataLoader(dataset, batch_size=config.batch_size, num_workers=0)


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    import torch

    options: dict[str, Any] = {"lr": config.optimizer.learning_rate}
    if config.optimizer.betas is not None:
        options["betas"] = tuple(config.optimizer.betas)
    if config.optimizer.epsilon is not None:
        options["eps"] = config.optimizer.epsilon
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


# --- the DiLoCo loop -------------------------------------------------------------------------------------------


@dataclass
class RoundStats:
    """What one round's inner loop did."""

    steps: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    seconds: float = 0.0
    #: The sum of the steps' ``step_time`` (batch, forward, backward, optimizer step): time spent training.
    train_seconds: float = 0.0
    #: The learning rate of the round's first optimizer step.
    lr: float | None = None

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.steps if self.steps else math.nan

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def _loss_of(outputs: Any) -> torch.Tensor:
    """The model's own loss (``outputs.loss``), or the output itself when the model returns a tensor."""
    import torch

    from worker_daemon.executors.exceptions import JobConfigError

    if isinstance(outputs, torch.Tensor):
        return outputs
    loss = outputs.get("loss") if isinstance(outputs, dict) else getattr(outputs, "loss", None)
    if loss is None:
        raise JobConfigError("the model returned no loss: model.input-names must include the labels")
    return loss


def run_round(
    *,
    accelerator: Accelerator,
    client: BridgeClient,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_schedule: Any | None,
    batches: Iterator[dict[str, torch.Tensor]],
    input_names: list[str],
    round_number: int | Callable[[], int],
    slowdown: float = 1.0,
    between_steps: Callable[[], None] | None = None,
) -> RoundStats:
    """The inner loop of one round: train and report each step until the scheduler's counter reaches 0.

    ``between_steps`` (an eager job's merge of the previous round, :mod:`~worker_daemon.executors.overlap`)
    runs before each step, outside its ``step_time``; it may renumber the round (``round_number`` is then a
    callable) but never touches the counter. Whatever it raises ends the loop."""
    from worker_daemon.executors.exceptions import DataError, DivergedError

    number = round_number if callable(round_number) else lambda: round_number
    stats = RoundStats()
    counter = -1
    started = time.perf_counter()
    model.train()
    while True:
        if between_steps is not None:
            between_steps()
        step_started = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            raise DataError("the data stream ended") from None
        inputs = {name: batch[name] for name in input_names}
        outputs = model(**inputs)
        loss = _loss_of(outputs)
        accelerator.backward(loss)
        # The lr this step uses, read before the schedule moves it.
        step_lr = float(optimizer.param_groups[0]["lr"])
        if stats.lr is None:
            stats.lr = step_lr
        optimizer.step()
        if lr_schedule is not None:
            lr_schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = float(loss.detach().item())
        if slowdown > 1.0:
            time.sleep((slowdown - 1.0) * (time.perf_counter() - step_started))
        step_time = time.perf_counter() - step_started
        if not math.isfinite(loss_value):
            raise DivergedError(f"round {number()}, step {stats.steps + 1}: the loss is {loss_value}")
        batch_size = int(inputs[input_names[0]].shape[0])
        stats.steps += 1
        stats.samples += batch_size
        stats.loss_sum += loss_value
        stats.train_seconds += step_time
        report = {"batch_size": batch_size, "loss": loss_value, "step_time": step_time, "lr": step_lr}
        first_input = inputs[input_names[0]]
        if first_input.dim() >= 2 and not first_input.is_floating_point():
            report["tokens"] = int(first_input.numel())  # token ids: the job page's tokens/s
        reply = client.status({"status": report})
        if reply["type"] == "ScheduleUpdate":
            counter = int(reply.get("counter", 0))
        else:
            counter -= 1
        logger.debug(
            "round %d step %d: loss %.4f, %d samples in %.3f s, reply %s, counter %d",
            number(),
            stats.steps,
            loss_value,
            batch_size,
            step_time,
            reply["type"],
            counter,
        )
        if counter == 0:
            break
    stats.seconds = time.perf_counter() - started
    return stats


def send_update(
    *,
    client: BridgeClient,
    model: torch.nn.Module,
    global_previous: dict[str, torch.Tensor],
    config: TrainConfig,
    work_dir: Path,
    round_number: int,
    stats: RoundStats,
    feedback: ErrorFeedback | None = None,
    fragment: Collection[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The first half of the outer step: send ``"update"``, write the pseudo-gradient
    ``delta = θ_local − θ_global_prev`` (in the job's encoding, with error feedback) and hand it to the bridge,
    report the round's metrics. Returns ``delta`` itself (float32, tied like ``global_previous``, before any
    encoding): an eager trainer's proxy is made of it. The model is only read. ``fragment`` (a streaming
    job): the delta of those tensors only (every name of each tied group in it)."""
    from hypha_tensors import weights
    from hypha_tensors.exceptions import TensorError
    from hypha_tensors.formats import EncodingError
    from worker_daemon.executors.exceptions import DivergedError
    from worker_daemon.executors.pseudo_gradient import compute_delta, encode_update, float_state

    client.status("update")
    delta = compute_delta(float_state(model), global_previous, fragment)
    relative = f"{UPDATES_DIR}/{round_number}.safetensors"
    (work_dir / UPDATES_DIR).mkdir(exist_ok=True)
    try:
        tensors, metadata = encode_update(delta, feedback)
        # Tied weights stored once, the others as aliases.
        weights.save(work_dir / relative, tensors, metadata=metadata)
    except (TensorError, EncodingError) as error:
        raise DivergedError(f"round {round_number}: the pseudo-gradient is unusable: {error}") from error
    del tensors
    client.send(config.updates, relative)
    # The bridge sends in the background: earlier rounds' files are surely sent by now (their results came back).
    for older in (work_dir / UPDATES_DIR).glob("*.safetensors"):
        if older.stem.isdigit() and int(older.stem) < round_number:
            older.unlink(missing_ok=True)
    client.status(
        {
            "metrics": {
                "round": round_number,
                "metrics": {
                    "loss": float(stats.mean_loss),
                    "samples": float(stats.samples),
                    "steps": float(stats.steps),
                    "samples_per_second": float(stats.samples_per_second),
                    "train_seconds": float(stats.train_seconds),
                    **({"lr": stats.lr} if stats.lr is not None else {}),
                },
            }
        }
    )
    return delta


def receive_result(
    *,
    client: BridgeClient,
    results: ReceiveStream,
    config: TrainConfig,
    work_dir: Path,
    round_number: int,
    global_previous: dict[str, torch.Tensor],
    published_dtypes: dict[str, torch.dtype] | None = None,
    fragment: Collection[str] | None = None,
) -> tuple[Merged, Published | None]:
    """The second half's reading: θ_r, the global weights after round ``round_number``, checked against the
    digest the parameter server published with its result (:mod:`~worker_daemon.executors.consistency`);
    when the result cannot give θ_r (a missed round, a file that is not the event's, a digest that differs),
    the full global weights fetched instead (their ``rounds_completed`` says which round they are) and, second,
    what their file says (its ``dtypes`` replace ``published_dtypes`` from then on; None when merged). Reads
    the stream and, on a refetch, ``client``; touches neither the model nor ``published_dtypes``.
    ``fragment`` (a streaming job): the round's fragment, the only tensors its result may hold."""
    from worker_daemon.executors import consistency

    try:
        merged = consistency.receive_round(
            results=results,
            work_dir=work_dir,
            round_number=round_number,
            global_previous=global_previous,
            dtypes=published_dtypes or {},
            fragment=fragment,
        )
    except consistency.OutOfSync as drift:
        logger.warning(
            "round %d: %s; fetching the full global weights instead of going on with these",
            round_number,
            drift,
        )
        merged, publication = consistency.refetch(
            client=client, artifact=config.model.artifact, work_dir=work_dir, global_previous=global_previous
        )
        logger.warning(
            "rejoined with the global weights after round %d (digest %s, checked)",
            merged.rounds_completed,
            merged.digest,
        )
        return dataclasses.replace(merged, refetched_because=str(drift)), publication
    return merged, None


def synchronise(
    *,
    client: BridgeClient,
    results: ReceiveStream,
    model: torch.nn.Module,
    global_previous: dict[str, torch.Tensor],
    config: TrainConfig,
    work_dir: Path,
    round_number: int,
    stats: RoundStats,
    published_dtypes: dict[str, torch.dtype] | None = None,
    feedback: ErrorFeedback | None = None,
) -> tuple[dict[str, Any], Merged]:
    """The outer step: send the pseudo-gradient and metrics, merge the parameter server's update.

    Returns the reply to ``"update-received"`` and the new global weights (already loaded into ``model``):
    θ_r, or the full global weights when the result cannot give θ_r (:func:`receive_result`). The model is
    modified only by the final in-place load, after the weights were read and checked. ``published_dtypes``:
    the names and dtypes of the parameter server's global weights (the digest is taken in them; updated after
    a refetch). ``feedback``: the job's encoding and this trainer's error-feedback residual (None: float32
    without metadata).
    """
    from worker_daemon.executors.pseudo_gradient import load_into

    send_update(
        client=client,
        model=model,
        global_previous=global_previous,
        config=config,
        work_dir=work_dir,
        round_number=round_number,
        stats=stats,
        feedback=feedback,
    )
    merged, publication = receive_result(
        client=client,
        results=results,
        config=config,
        work_dir=work_dir,
        round_number=round_number,
        global_previous=global_previous,
        published_dtypes=published_dtypes,
    )
    if publication is not None and published_dtypes is not None:
        published_dtypes.clear()
        published_dtypes.update(publication.dtypes)
    load_into(model, merged.weights)
    reply = client.status("update-received")
    return reply, merged


def training_function(arguments: argparse.Namespace, job: TrainJob) -> int:
    """Run ``job`` with the bridge and work dir of the parsed command line to its end; returns the exit code
    (0 when the scheduler said Done), raises :class:`ExecutorError` when the job cannot go on."""
    import torch
    import transformers
    from accelerate import Accelerator

    from hypha_tensors.encoding import ErrorFeedback
    from hypha_tensors.formats import Encoding
    from worker_daemon.executors import consistency
    from worker_daemon.executors.bridge_client import BridgeClient
    from worker_daemon.executors.exceptions import JobConfigError
    from worker_daemon.executors.pseudo_gradient import float_state, snapshot

    transformers.utils.logging.disable_progress_bar()
    config = job.config
    work_dir = Path(arguments.work_dir).resolve()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if accelerator.num_processes != 1:
        # Every process would run its own rounds against the one bridge; DiLoCo here is one process per job.
        raise JobConfigError(f"run one process per job (--num_processes 1), not {accelerator.num_processes}")

    with BridgeClient(arguments.socket) as client, client.receive(config.results, INCOMING_DIR) as results:
        model = load_model(
            client=client, config=config, work_dir=work_dir, trust_remote_code=arguments.trust_remote_code
        )
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
            logger.info(
                "round %d: %d steps, loss %.4f, %d samples, %.1f samples/s, sync %.2f s%s",
                round_number,
                stats.steps,
                stats.mean_loss,
                stats.samples,
                stats.samples_per_second,
                time.perf_counter() - sync_started,
                "" if merged.digest is None else f", weights {merged.digest} (checked)",
            )
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


if __name__ == "__main__":
    sys.exit(main())
