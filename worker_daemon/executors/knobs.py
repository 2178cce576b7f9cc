"""The training knobs a trainer applies (``training`` and ``optimizer.weight-decay`` of its job JSON;
docs/configuration.md, "Training knobs"), each the way accelerate (or torch/transformers) documents it:

* ``mixed_precision`` and ``gradient_accumulation_steps`` → ``Accelerator(mixed_precision=…,
  gradient_accumulation_steps=…)``; bf16 autocasts on a CPU or on a CUDA GPU that supports it, fp16 needs CUDA:
  :func:`check_device` refuses what this machine cannot do, with the reason the task fails with;
* accumulation → ``with accelerator.accumulate(model):`` around each micro-batch: a batch of B samples is split
  into k micro-batches of B/k, ``accelerator.backward`` scales each loss by 1/k and the prepared optimizer (and
  LR schedule) step once, after the k-th, so that one step over k × B/k is one step over B;
* ``max_grad_norm`` → ``accelerator.clip_grad_norm_(model.parameters(), max_norm)`` when the gradients are
  synchronised (after the k-th micro-batch; with fp16 it unscales them first);
* ``weight_decay`` → ``torch.optim.AdamW(weight_decay=…)`` (absent: AdamW's own default, 0.01);
* ``gradient_checkpointing`` → ``model.gradient_checkpointing_enable()`` (transformers; non-reentrant; 5.x's
  ``activation_checkpointing_enable`` where it exists);
* ``dataloader_workers`` → ``torch.utils.data.DataLoader(num_workers=…)`` reading the data slices
  (:mod:`worker_daemon.executors.slice_workers`, made by ``setup.get_dataloaders``): the bridge client lives
  in the trainer's process, so that process still fetches (and acknowledges) every slice and cuts the
  batches, while the worker processes decode and preprocess the fetched slices; the batches, and so the
  training, are the same as with 0 (the default: everything in the trainer's process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from worker_daemon.executors.exceptions import JobConfigError

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from worker_daemon.executors.job import TrainConfig, TrainingKnobs


def check_device(training: TrainingKnobs, *, cuda: bool | None = None, cuda_bf16: bool | None = None) -> None:
    """Raise :class:`JobConfigError` when this machine cannot run ``training.mixed_precision``. ``cuda`` and
    ``cuda_bf16`` default to what torch says of this machine."""
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    if training.mixed_precision == "fp16" and not cuda:
        raise JobConfigError(
            "mixed_precision fp16 needs a CUDA GPU and this worker has none (use bf16 or no)"
        )
    if training.mixed_precision == "bf16" and cuda:
        if cuda_bf16 is None:
            cuda_bf16 = torch.cuda.is_bf16_supported()
        if not cuda_bf16:
            raise JobConfigError(
                "mixed_precision bf16 is not supported by this worker's GPU (use fp16 or no)"
            )


def accelerator_options(training: TrainingKnobs) -> dict[str, Any]:
    """The ``Accelerator(...)`` keyword arguments of the knobs (after :func:`check_device`)."""
    return {
        "mixed_precision": training.mixed_precision,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
    }


def optimizer_options(config: TrainConfig) -> dict[str, Any]:
    """AdamW's keyword arguments of the knobs: ``weight_decay`` when given."""
    if config.optimizer.weight_decay is None:
        return {}
    return {"weight_decay": config.optimizer.weight_decay}


def prepare_model(model: torch.nn.Module, training: TrainingKnobs) -> None:
    """Turn on gradient checkpointing when asked; a model that cannot is a job config error."""
    if not training.gradient_checkpointing:
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise JobConfigError(f"gradient_checkpointing: {type(model).__name__} does not support it")
    # Non-reentrant: works when no input requires grad (token ids) and is what torch recommends. transformers
    # 5.x renamed gradient_checkpointing_enable (deprecated, kept until v6) to activation_checkpointing_enable.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False  # a cache is useless in training and conflicts with checkpointing


def micro_batches(inputs: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """``inputs`` split along dimension 0 into ``count`` micro-batches of equal size (the batch must divide)."""
    size = int(next(iter(inputs.values())).shape[0])
    if size % count:
        raise JobConfigError(f"gradient_accumulation_steps ({count}) must divide the batch ({size} samples)")
    if count == 1:
        return [inputs]  # the default: no split on every step
    parts = {name: tensor.split(size // count) for name, tensor in inputs.items()}
    return [{name: parts[name][index] for name in inputs} for index in range(count)]


def train_step(
    *,
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_schedule: Any | None,
    inputs: dict[str, torch.Tensor],
    loss_of: Callable[[Any], torch.Tensor],
    max_grad_norm: float | None = None,
) -> torch.Tensor:
    """One optimizer step over ``inputs``, in ``accelerator.gradient_accumulation_steps`` micro-batches, as
    accelerate documents gradient accumulation; ``optimizer`` and ``lr_schedule`` must be prepared by
    ``accelerator``. Returns the step's loss (the mean of the micro-batches' losses, detached)."""
    import torch

    losses = []
    for micro in micro_batches(inputs, accelerator.gradient_accumulation_steps):
        with accelerator.accumulate(model):
            loss = loss_of(model(**micro))
            accelerator.backward(loss)
            if max_grad_norm is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            if lr_schedule is not None:
                lr_schedule.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    return losses[0] if len(losses) == 1 else torch.stack(losses).mean()
