"""The trainer's side of the DiLoCo outer step: pseudo-gradient out, the parameter server's update in.

Sign convention (hypha-protocols.md §4, ``docs/training.md``): after its inner steps a trainer sends
``delta = θ_local − θ_global_prev``; the parameter server answers with the Nesterov update ``u``; every trainer
sets ``θ_new = θ_global_prev + u``.

Contracts every function here keeps:

* **State dicts** are ``name → tensor`` over the model's *floating-point* entries (parameters and persistent
  buffers). Integer and bool buffers (step counters, index tables) are not synchronised: a mean of them has
  no meaning and the parameter server refuses them.
* **Tied weights** (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``): in a model's state dict the
  names are the very same view of one storage. In the dicts this module returns, every name is present and
  tied names map to *the same tensor object*, which is also what ``hypha_tensors.weights.load`` returns.
  ``hypha_tensors.weights.save`` stores such a tensor once (under the smallest name, the other names in
  the header's alias table), so the file's stored names are the deduplicated state dict.
* **The live model is never modified** except by :func:`load_into`, and only after everything it loads has
  been computed and checked: a refused update leaves the model and the previous global weights as they were
  (Hypha's executor subtracts in place and trains on from the delta when a merge fails, §9).
* **Encodings** (docs/training.md, "Encodings"): :func:`encode_update` sends ``Q(delta + e)`` in the job's
  encoding and keeps the new residual ``e`` in its :class:`~hypha_tensors.encoding.ErrorFeedback` — in the
  executor's memory, for the whole run: across rounds it was left out of, and across a fetch of the full
  global weights (the residual is what this trainer's own updates have not delivered yet, not a property of
  the weights it holds). It is lost when the executor exits (a replacement starts from zero).
* **Fragments** (Streaming DiLoCo, :mod:`~worker_daemon.executors.streaming`): a fragment is a set of names
  holding every name of each of its tied groups (:func:`hypha_tensors.fragments.partition`). Given one,
  :func:`compute_delta` computes the fragment's delta alone and :func:`merge` takes an update of exactly the
  fragment's groups, the other tensors staying what they were (the very same objects: no copy). Without one
  both are as strict as ever: every tensor, every time.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from hypha_tensors.encoding import ErrorFeedback
from hypha_tensors.weights import view_key
from worker_daemon.executors.exceptions import UpdateError

StateDict = dict[str, torch.Tensor]


def float_state(model: torch.nn.Module) -> StateDict:
    """The model's floating-point state dict entries: detached views that share memory with the model."""
    return {name: tensor for name, tensor in model.state_dict().items() if tensor.dtype.is_floating_point}


def tied_groups(state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names grouped by the tensor they denote, each group sorted, groups sorted by their first name.

    Names share a group when they are the same view of one storage (as in a model's state dict) or the very
    same tensor object (as in the dicts this module returns). Empty tensors are never grouped: their storage
    pointers may coincide by accident.
    """
    groups: dict[object, list[str]] = {}
    for name in sorted(state):
        tensor = state[name]
        key: object = (view_key(tensor), id(tensor)) if tensor.numel() == 0 else view_key(tensor)
        groups.setdefault(key, []).append(name)
    return sorted(groups.values())


def snapshot(state: Mapping[str, torch.Tensor]) -> StateDict:
    """A CPU copy of ``state`` that keeps tied names tied (one copy per group, shared by its names)."""
    copies: StateDict = {}
    for group in tied_groups(state):
        copy = state[group[0]].detach().to("cpu", copy=True)
        for name in group:
            copies[name] = copy
    return copies


def _check_names(names: set[str], expected: set[str], what: str) -> None:
    missing = sorted(expected - names)
    if missing:
        raise UpdateError(f"{what}: tensor {missing[0]!r} is missing")
    unknown = sorted(names - expected)
    if unknown:
        raise UpdateError(f"{what}: tensor {unknown[0]!r} is unknown")


def fragment_state(state: Mapping[str, torch.Tensor], fragment: Collection[str]) -> StateDict:
    """The entries of ``state`` whose tied group has a name in ``fragment`` (whole groups; the tensors
    themselves, not copies)."""
    return {
        name: state[name]
        for group in tied_groups(state)
        if any(name in fragment for name in group)
        for name in group
    }


def fragment_mismatch(
    global_previous: Mapping[str, torch.Tensor], names: Collection[str], fragment: Collection[str]
) -> str | None:
    """Why an update naming ``names`` is not one of exactly ``fragment``'s tied groups of
    ``global_previous`` (any name of a group will do, as in :func:`merge`), or None when it is."""
    unknown = sorted(set(names) - set(global_previous))
    if unknown:
        return f"names an unknown tensor {unknown[0]!r}"
    groups = [
        (group, any(name in fragment for name in group), any(name in names for name in group))
        for group in tied_groups(global_previous)
    ]
    # A name of another fragment first: it says the file is some other round's.
    for group, inside, given in groups:
        if given and not inside:
            return f"names {group[0]!r}, which is not in the round's fragment"
    for group, inside, given in groups:
        if inside and not given:
            return f"has no tensor {group[0]!r} of the round's fragment"
    return None


def compute_delta(
    local: Mapping[str, torch.Tensor],
    global_previous: Mapping[str, torch.Tensor],
    fragment: Collection[str] | None = None,
) -> StateDict:
    """``delta = local − global_previous`` as new CPU tensors in the global weights' dtypes; with
    ``fragment``, of the fragment's tied groups only (every name of each).

    ``global_previous`` comes from :func:`snapshot` or :func:`merge` (tied names share one object); the
    result is tied the same way. ``local`` (typically :func:`float_state` of the live model, on any device)
    is only read. Names and shapes must match, else ``UpdateError``.
    """
    _check_names(set(local), set(global_previous), "the local weights")
    if fragment is not None:
        global_previous = fragment_state(global_previous, fragment)
    deltas: StateDict = {}
    for group in tied_groups(global_previous):
        previous = global_previous[group[0]]
        current = local[group[0]]
        if current.shape != previous.shape:
            raise UpdateError(
                f"tensor {group[0]!r} has shape {tuple(current.shape)}, expected {tuple(previous.shape)}"
            )
        # .to() returns the live tensor itself when nothing changes; the subtraction makes the new one.
        delta = current.detach().to("cpu", previous.dtype) - previous
        for name in group:
            deltas[name] = delta
    return deltas


def encode_update(
    delta: Mapping[str, torch.Tensor], feedback: ErrorFeedback | None
) -> tuple[StateDict, dict[str, str]]:
    """The tensors and header metadata of the update file for ``delta`` (:func:`compute_delta`'s, tied names
    sharing one tensor): ``feedback``'s encoding of ``delta`` plus its residual (whose new value it keeps),
    tied names still sharing their encoded tensors, so the file stores them once; without ``feedback``,
    ``delta`` itself and no metadata (float32, as Hypha's executors write it). A delta that cannot be
    encoded (NaN, Inf, past float16's range) raises :class:`~hypha_tensors.formats.EncodingError` and
    leaves the residual as it was."""
    if feedback is None:
        return dict(delta), {}
    return feedback.encode(delta), feedback.metadata()


def merge(
    global_previous: Mapping[str, torch.Tensor],
    update: Mapping[str, torch.Tensor],
    fragment: Collection[str] | None = None,
) -> StateDict:
    """``θ_new = global_previous + update`` as new tensors, tied like ``global_previous``.

    ``update`` may name a tied group under all of its names (``weights.load`` of a file with aliases) or
    under any one of them (a file written without Hypha's alias table). It is refused with ``UpdateError``,
    before anything is computed, when a group is missing, a name is unknown, a tensor is not a floating-point
    tensor of the right shape, contains NaN or Inf, or a group's names carry different values. A dtype other
    than the global weights' is converted. Inputs are never modified.

    With ``fragment`` the update must name exactly the fragment's groups (:func:`fragment_mismatch`, else
    ``UpdateError``); every other entry of the result is ``global_previous``'s own tensor.
    """
    groups = tied_groups(global_previous)
    unknown = sorted(set(update) - set(global_previous))
    if unknown:
        raise UpdateError(f"the update has an unknown tensor {unknown[0]!r}")
    kept: StateDict = {}
    if fragment is not None:
        reason = fragment_mismatch(global_previous, set(update), fragment)
        if reason is not None:
            raise UpdateError(f"the update {reason}")
        inside = [group for group in groups if any(name in fragment for name in group)]
        outside = [group for group in groups if not any(name in fragment for name in group)]
        kept = {name: global_previous[name] for group in outside for name in group}
        groups = inside
    chosen: list[tuple[list[str], torch.Tensor]] = []
    for group in groups:
        present = [name for name in group if name in update]
        if not present:
            raise UpdateError(f"the update has no tensor {group[0]!r}")
        previous = global_previous[group[0]]
        for name in present:
            value = update[name]
            if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
                raise UpdateError(f"the update's {name!r} is not a floating-point tensor")
            if value.shape != previous.shape:
                raise UpdateError(
                    f"the update's {name!r} has shape {tuple(value.shape)}, expected {tuple(previous.shape)}"
                )
            if not bool(torch.isfinite(value).all()):
                raise UpdateError(f"the update's {name!r} contains NaN or Inf")
        first = update[present[0]]
        for name in present[1:]:
            if update[name] is not first and not torch.equal(update[name], first):
                raise UpdateError(f"the update's tied tensors {present[0]!r} and {name!r} differ")
        chosen.append((group, first))
    merged: StateDict = dict(kept)
    for group, value in chosen:
        previous = global_previous[group[0]]
        new = previous + value.to("cpu", previous.dtype)
        for name in group:
            merged[name] = new
    return merged


@torch.no_grad()
def load_into(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` into the model's floating-point entries *in place*.

    In place keeps every parameter object (the optimizer's state is keyed by them) and keeps tied
    parameters tied. ``weights`` must name exactly the model's floating-point entries (``UpdateError``
    otherwise, and nothing is copied); it is converted to each entry's device and dtype.
    """
    targets = float_state(model)
    _check_names(set(weights), set(targets), "the weights to load")
    for name, target in targets.items():
        if weights[name].shape != target.shape:
            raise UpdateError(
                f"tensor {name!r} has shape {tuple(weights[name].shape)}, expected {tuple(target.shape)}"
            )
    for name, target in targets.items():
        target.copy_(weights[name])  # tied names copy the same value twice: harmless
