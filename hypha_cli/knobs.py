"""``hypha submit``'s training-knob options (docs/configuration.md, "Training knobs"): each sets one key of a
JSON spec (``inner_optimizer.weight_decay`` or ``training.<knob>``); the server checks their ranges and answers
a bad one with a field error. A TOML spec takes them as keys instead (its comments and layout are kept)."""

from __future__ import annotations

import argparse
from typing import Any

from hypha_cli.exceptions import RefusedError, UsageError

#: option destination → (the spec's section, its key).
KNOBS: dict[str, tuple[str, str]] = {
    "weight_decay": ("inner_optimizer", "weight_decay"),
    "max_grad_norm": ("training", "max_grad_norm"),
    "gradient_accumulation_steps": ("training", "gradient_accumulation_steps"),
    "mixed_precision": ("training", "mixed_precision"),
    "gradient_checkpointing": ("training", "gradient_checkpointing"),
    "dataloader_workers": ("training", "dataloader_workers"),
}


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training knobs (set keys of a JSON spec; the server checks them)")
    group.add_argument(
        "--weight-decay",
        type=_number,
        metavar="W",
        help="AdamW's weight decay (inner_optimizer.weight_decay)",
    )
    group.add_argument(
        "--max-grad-norm",
        type=_number,
        metavar="N",
        help="clip the gradients' global L2 norm to N (training.max_grad_norm; > 0)",
    )
    group.add_argument(
        "--gradient-accumulation-steps",
        type=_whole,
        metavar="K",
        help="K micro-batches of batch_size / K per step (training.gradient_accumulation_steps; 1 to 1024)",
    )
    group.add_argument(
        "--mixed-precision",
        choices=("no", "bf16", "fp16"),
        help="autocast the forward pass (training.mixed_precision); fp16 needs trainers with a CUDA GPU",
    )
    group.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        default=None,
        help="recompute activations in the backward pass (training.gradient_checkpointing)",
    )
    group.add_argument(
        "--dataloader-workers",
        type=_whole,
        metavar="N",
        help="processes reading the data slices (training.dataloader_workers; 0: in the trainer's process)",
    )


def given(arguments: argparse.Namespace) -> dict[str, Any]:
    """The knob options given on the command line, by destination."""
    return {key: getattr(arguments, key, None) for key in KNOBS if getattr(arguments, key, None) is not None}


def apply(spec: dict, knobs: dict[str, Any], *, file: str) -> None:
    """Set ``knobs`` in the JSON ``spec``; its sections must be objects."""
    for key, value in knobs.items():
        section_name, spec_key = KNOBS[key]
        section = spec.setdefault(section_name, {})
        if not isinstance(section, dict):
            raise RefusedError(
                f"{file}: {section_name} must be a JSON object for --{key.replace('_', '-')}", status=0
            )
        section[spec_key] = value


def refuse_for_toml(knobs: dict[str, Any]) -> None:
    if knobs:
        options = ", ".join(f"--{key.replace('_', '-')}" for key in knobs)
        raise UsageError(
            f"{options} set a JSON spec's keys; in a TOML spec write them under [scheduler.job.training] "
            "(weight_decay under [scheduler.job.inner_optimizer])"
        )


__all__ = ["KNOBS", "add_arguments", "apply", "given", "refuse_for_toml"]
