"""The DiLoCo rounds (docs/training.md): one round's inner loop (:func:`run_round`) and the outer step
(:func:`send_update`, :func:`receive_result`, :func:`synchronise`), as :mod:`worker_daemon.executors.training`
and the overlapping trainers (:mod:`~worker_daemon.executors.overlap`, :mod:`~worker_daemon.executors.streaming`)
run them. Split out of ``training.py``; the names are re-exported there."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from hypha_tensors.encoding import ErrorFeedback
    from worker_daemon.executors.bridge_client import BridgeClient, ReceiveStream
    from worker_daemon.executors.consistency import Merged, Published
    from worker_daemon.executors.job import TrainConfig
    from worker_daemon.executors.ranks import Ranks

#: The trainer's logger: the daemon's failure reports (worker_daemon/failures.py) and tests match its name.
logger = logging.getLogger("worker_daemon.executors.training")

#: Where a trainer writes its pseudo-gradients in the job's work dir (``updates/<round>.safetensors``).
UPDATES_DIR = "updates"


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
    #: Token ids trained on (token models), and the round's device facts to report
    #: (:mod:`~worker_daemon.executors.throughput`: tokens, tokens/s, peak CUDA memory, MFU).
    tokens: int = 0
    facts: dict[str, float] = dataclasses.field(default_factory=dict)

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
    client: BridgeClient | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_schedule: Any | None,
    batches: Iterator[dict[str, torch.Tensor]] | None,
    input_names: list[str],
    round_number: int | Callable[[], int],
    slowdown: float = 1.0,
    between_steps: Callable[[], None] | None = None,
    max_grad_norm: float | None = None,
    ranks: Ranks | None = None,
) -> RoundStats:
    """The inner loop of one round: train and report each step until the scheduler's counter reaches 0.

    ``between_steps`` (an eager job's merge of the previous round, :mod:`~worker_daemon.executors.overlap`)
    runs before each step, outside its ``step_time``; it may renumber the round (``round_number`` is then a
    callable) but never touches the counter. Whatever it raises ends the loop. ``max_grad_norm``: the job's
    clipping (:mod:`~worker_daemon.executors.knobs`; its accumulation is the accelerator's).

    ``ranks`` (a trainer of several processes, :mod:`~worker_daemon.executors.ranks`): every rank runs this
    loop; rank 0 alone takes the batches (``client`` and ``batches`` may be None on the others) and talks to
    the bridge, and hands each step's batch and the scheduler's decision to the others; each rank trains its
    share of the batch, and the loss reported is the mean of the ranks'."""
    from worker_daemon.executors import knobs
    from worker_daemon.executors.exceptions import DivergedError
    from worker_daemon.executors.throughput import RoundDevice

    number = round_number if callable(round_number) else lambda: round_number
    stats = RoundStats()
    device = RoundDevice(accelerator.device)
    device.begin()
    counter = -1
    started = time.perf_counter()
    model.train()
    while True:
        if between_steps is not None:
            between_steps()
        step_started = time.perf_counter()
        if ranks is None:
            batch = _next_batch(batches)
            inputs = {name: batch[name] for name in input_names}
        else:
            # The whole batch, for the step's report; this rank trains on its share, on its device.
            batch = ranks.lead(lambda: _next_batch(batches))
            inputs = {name: tensor.to(accelerator.device) for name, tensor in ranks.share(batch).items()}
        # The lr this step uses, read before the schedule moves it.
        step_lr = float(optimizer.param_groups[0]["lr"])
        if stats.lr is None:
            stats.lr = step_lr
        # Forward, backward and the optimizer step, with the training knobs (accumulation, clipping).
        loss = knobs.train_step(
            accelerator=accelerator,
            model=model,
            optimizer=optimizer,
            lr_schedule=lr_schedule,
            inputs=inputs,
            loss_of=_loss_of,
            max_grad_norm=max_grad_norm,
        )
        if ranks is not None:
            loss = ranks.mean(loss)
        loss_value = float(loss.item())
        if slowdown > 1.0:
            time.sleep((slowdown - 1.0) * (time.perf_counter() - step_started))
        step_time = time.perf_counter() - step_started
        if not math.isfinite(loss_value):
            raise DivergedError(f"round {number()}, step {stats.steps + 1}: the loss is {loss_value}")
        whole = batch[input_names[0]]
        batch_size = int(whole.shape[0])
        stats.steps += 1
        stats.samples += batch_size
        stats.loss_sum += loss_value
        stats.train_seconds += step_time
        report = {"batch_size": batch_size, "loss": loss_value, "step_time": step_time, "lr": step_lr}
        if whole.dim() >= 2 and not whole.is_floating_point():
            report["tokens"] = int(whole.numel())  # token ids: the job page's tokens/s
            stats.tokens += report["tokens"]

        def send_status(report: dict[str, Any] = report, counter: int = counter) -> tuple[str, int]:
            assert client is not None
            reply = client.status({"status": report})
            if reply["type"] == "ScheduleUpdate":
                return reply["type"], int(reply.get("counter", 0))
            return reply["type"], counter - 1

        reply_type, counter = send_status() if ranks is None else ranks.lead(send_status)
        logger.debug(
            "round %d step %d: loss %.4f, %d samples in %.3f s, reply %s, counter %d",
            number(),
            stats.steps,
            loss_value,
            batch_size,
            step_time,
            reply_type,
            counter,
        )
        if counter == 0:
            break
    stats.seconds = time.perf_counter() - started
    parameters = sum(parameter.numel() for parameter in model.parameters())
    stats.facts = device.facts(
        tokens=stats.tokens,
        seconds=stats.train_seconds,
        parameters=parameters,
        devices=1 if ranks is None else ranks.world_size,
    )
    return stats


def _next_batch(batches: Iterator[dict[str, torch.Tensor]] | None) -> dict[str, torch.Tensor]:
    from worker_daemon.executors.exceptions import DataError

    assert batches is not None
    try:
        return next(batches)
    except StopIteration:
        raise DataError("the data stream ended") from None


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
    from worker_daemon.executors import byzantine
    from worker_daemon.executors.exceptions import DivergedError
    from worker_daemon.executors.pseudo_gradient import compute_delta, encode_update, float_state

    client.status("update")
    delta = compute_delta(float_state(model), global_previous, fragment)
    # The experiment knob (daemon --byzantine): send a corrupted delta; the trainer itself keeps the honest one.
    byzantine_mode = byzantine.mode_from_environment()
    sent = delta if byzantine_mode is None else byzantine.corrupt(delta, byzantine_mode, seed=round_number)
    relative = f"{UPDATES_DIR}/{round_number}.safetensors"
    (work_dir / UPDATES_DIR).mkdir(exist_ok=True)
    try:
        tensors, metadata = encode_update(sent, feedback)
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
                    **stats.facts,
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


def log_round(round_number: int, stats: RoundStats, merged: Merged, sync_started: float) -> None:
    """The trainer's line for a finished round (``sync_started``: ``time.perf_counter()`` before the sync)."""
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
