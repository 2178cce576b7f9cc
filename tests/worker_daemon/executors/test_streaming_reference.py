"""Streaming DiLoCo's trainer arithmetic against the rule of docs/training.md ("Overlap: streaming"), written out.

Two streaming trainers and a stand-in parameter server on a toy model (a tied pair of weights, two numbered
blocks, a floating-point buffer) for five rounds, with a deterministic, nonlinear "inner step". The
implementation's side runs the executor's own functions (``streaming.fragments_of`` and ``mix_into``;
``pseudo_gradient``'s ``compute_delta`` and ``merge`` with a fragment) on a real ``torch.nn.Module``. The
reference side is plain tensor formulas over the canonical names, with the fragments written out by hand:

    f = (r − 1) mod F;  trainer i sends Δ_i = θ_live,f − θ_{r−1,f}  (fragment f's names only)
    the job's last round (r = ROUNDS): f = every fragment, the whole model
    θ_r,f = θ_{r−1,f} + s·mean_i Δ_i;  θ_r = θ_{r−1} elsewhere        (the stand-in server's step)
    after j_i steps of round r + 1:  θ_live,f ← α·θ_live,f + (1 − α)·θ_r,f  (fragment f only)

The server's step is a stand-in (the parameter server's own rule is tested in tests/parameter_server): what is
checked here is the trainer's side — which names it sends, what it mixes, what it keeps.
"""

from __future__ import annotations

import pytest
import torch

from worker_daemon.executors.exceptions import JobConfigError, UpdateError
from worker_daemon.executors.pseudo_gradient import compute_delta, float_state, merge, snapshot
from worker_daemon.executors.streaming import fragments_of, mix_into, round_fragment

H = 3
ROUNDS = 5
SERVER_STEP = 0.8
#: After how many steps of round r+1 each trainer merges round r's result (H: it waited at the end).
MERGE_AFTER = {0: [1, 2, 3, 0, 1], 1: [2, 3, 1, 2, 3]}
#: The parameter server's canonical names: the tied pair once, under its smaller name.
CANONICAL = ("embed", "layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight", "running")
BUFFERS = {"running"}
#: The partition written out (hypha_tensors.fragments' rule: blocks ``layers.0`` and ``layers.1`` (6 elements
#: each), the tied ``embed``/``head`` (6), ``running`` (2), placed largest first on the lightest fragment).
FRAGMENTS = {
    2: [
        {"embed", "head", "layers.0.bias", "layers.0.weight"},
        {"layers.1.bias", "layers.1.weight", "running"},
    ],
    3: [
        {"layers.0.bias", "layers.0.weight", "running"},
        {"layers.1.bias", "layers.1.weight"},
        {"embed", "head"},
    ],
}


class Block(torch.nn.Module):
    def __init__(self, weight: list[list[float]], bias: list[float]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(weight))
        self.bias = torch.nn.Parameter(torch.tensor(bias))


class Toy(torch.nn.Module):
    """``embed`` and ``head`` are one parameter (as GPT-2's ``wte`` and ``lm_head``); ``layers.0``/``layers.1``
    two blocks; ``running`` a float buffer (as BatchNorm's running mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.tensor([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]]))
        self.head = self.embed
        self.layers = torch.nn.ModuleList(
            [Block([[1.0, 0.5], [-0.5, 0.25]], [0.1, -0.2]), Block([[0.3, -0.7], [0.9, 1.1]], [0.0, 0.4])]
        )
        self.register_buffer("running", torch.tensor([1.0, 2.0]))

    def entry(self, name: str) -> torch.Tensor:
        return self.get_parameter(name) if name not in BUFFERS else self.get_buffer(name)


def target(trainer: int, round_number: int, step: int, name: str, shape: torch.Size) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * trainer + 10 * round_number + step + 7 * len(name))
    return torch.randn(shape, generator=generator)


def step_value(value: torch.Tensor, name: str, trainer: int, round_number: int, step: int) -> torch.Tensor:
    """One inner step, nonlinear (so where the merge falls matters)."""
    goal = target(trainer, round_number, step, name, value.shape)
    if name in BUFFERS:
        return 0.8 * value + 0.2 * goal
    return value - 0.3 * torch.tanh(value - goal)


@torch.no_grad()
def train_module(model: Toy, trainer: int, round_number: int, steps: range) -> None:
    for step in steps:
        for name in CANONICAL:
            tensor = model.entry(name)
            tensor.copy_(step_value(tensor, name, trainer, round_number, step))


def train_reference(
    state: dict[str, torch.Tensor], trainer: int, round_number: int, steps: range
) -> dict[str, torch.Tensor]:
    for step in steps:
        state = {name: step_value(state[name], name, trainer, round_number, step) for name in CANONICAL}
    return state


def canonical(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: state[name].clone() for name in CANONICAL if name in state}


def run_implementation(fragments: int, mix: float) -> dict[str, list]:
    """Two streaming trainers through the executor's functions; the stand-in server on canonical names."""
    models = [Toy(), Toy()]
    global_previous = [snapshot(float_state(model)) for model in models]
    parts = fragments_of(global_previous[0], fragments)
    server_theta = canonical(global_previous[0])
    record: dict[str, list] = {
        "parts": parts,
        "sent": [],
        "deltas": [],
        "thetas": [],
        "globals": [],
        "live": [],
    }
    result: dict[str, torch.Tensor] | None = (
        None  # u_r,f under the canonical names, as the server publishes it
    )
    for round_number in range(1, ROUNDS + 1):
        fragment = round_fragment(parts, round_number, ROUNDS)
        deltas = []
        for trainer, model in enumerate(models):
            if result is None:
                train_module(model, trainer, round_number, range(H))
            else:
                merge_at = MERGE_AFTER[trainer][round_number - 1]
                train_module(model, trainer, round_number, range(merge_at))
                previous_fragment = round_fragment(parts, round_number - 1, ROUNDS)
                theta = merge(global_previous[trainer], result, previous_fragment)
                mix_into(model, theta, previous_fragment, mix)
                global_previous[trainer] = theta
                train_module(model, trainer, round_number, range(merge_at, H))
            delta = compute_delta(float_state(model), global_previous[trainer], fragment)
            deltas.append(delta)
            assert model.head is model.embed
        record["sent"].append([sorted(delta) for delta in deltas])
        record["deltas"].append([canonical(delta) for delta in deltas])
        names = sorted(name for name in deltas[0] if name in CANONICAL)
        result = {name: SERVER_STEP * (deltas[0][name] + deltas[1][name]) / 2 for name in names}
        server_theta = {name: server_theta[name] + result.get(name, 0) for name in CANONICAL}
        record["thetas"].append(server_theta)
        # θ_{r−1} as each trainer holds it when it sends round r (round r − 1 merged just before)
        record["globals"].append([canonical(state) for state in global_previous])
    last_fragment = round_fragment(parts, ROUNDS, ROUNDS)
    for trainer, model in enumerate(models):
        theta = merge(global_previous[trainer], result, last_fragment)
        mix_into(model, theta, last_fragment, mix)
        global_previous[trainer] = theta
        record["live"].append({name: model.entry(name).detach().clone() for name in CANONICAL})
        record["globals_after"] = [canonical(state) for state in global_previous]
        assert model.head is model.embed
    return record


def run_reference(fragments: int, mix: float, *, mix_everything: bool = False) -> dict[str, list]:
    """The rule, by hand. ``mix_everything``: the wrong rule that mixes every tensor at each merge (to show the
    test would catch it)."""
    parts = [{name for name in part if name in CANONICAL} for part in FRAGMENTS[fragments]]
    initial = {name: Toy().entry(name).detach().clone() for name in CANONICAL}
    theta = dict(initial)  # θ_{r−1}, the same for both trainers when they send
    new_theta: dict[str, torch.Tensor] | None = None
    live = [dict(initial), dict(initial)]
    record: dict[str, list] = {"sent": [], "deltas": [], "thetas": [], "globals": [], "live": []}

    def mixed(state: dict[str, torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
        assert new_theta is not None
        chosen = set(CANONICAL) if mix_everything else names
        return {
            name: mix * state[name] + (1 - mix) * new_theta[name] if name in chosen else state[name]
            for name in CANONICAL
        }

    everything = set(CANONICAL)
    for round_number in range(1, ROUNDS + 1):
        names = everything if round_number == ROUNDS else parts[(round_number - 1) % fragments]
        if new_theta is not None:
            theta = new_theta
        deltas = []
        for trainer in (0, 1):
            state = live[trainer]
            if new_theta is None:
                state = train_reference(state, trainer, round_number, range(H))
            else:
                merge_at = MERGE_AFTER[trainer][round_number - 1]
                state = train_reference(state, trainer, round_number, range(merge_at))
                state = mixed(state, parts[(round_number - 2) % fragments])
                state = train_reference(state, trainer, round_number, range(merge_at, H))
            live[trainer] = state
            deltas.append({name: state[name] - theta[name] for name in names})
        part = FRAGMENTS[fragments][(round_number - 1) % fragments]
        sent = set().union(*FRAGMENTS[fragments]) if round_number == ROUNDS else part
        record["sent"].append([sorted(sent) for _ in (0, 1)])
        record["deltas"].append(deltas)
        record["globals"].append([dict(theta), dict(theta)])
        new_theta = {
            name: theta[name] + SERVER_STEP * (deltas[0][name] + deltas[1][name]) / 2 if name in names else theta[name]
            for name in CANONICAL
        }  # fmt: skip
        record["thetas"].append(new_theta)
    last = everything
    record["live"] = [mixed(live[trainer], last) for trainer in (0, 1)]
    record["globals_after"] = [dict(new_theta), dict(new_theta)]
    return record


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(actual) == sorted(expected), what
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=2e-6, atol=2e-7, msg=f"{what}: {name}")


@pytest.mark.parametrize("fragments", [2, 3])
@pytest.mark.parametrize("mix", [0.0, 0.5, 0.9])
def test_streaming_trainers_follow_the_written_out_rule(fragments: int, mix: float) -> None:
    # when
    implementation = run_implementation(fragments, mix)
    reference = run_reference(fragments, mix)

    # then: the partition, the names sent each round (the fragment's, both names of the tied pair, nothing
    # else; in the job's last round every fragment's), every delta, θ_{r−1} at each send, every θ_r, and the
    # weights after the last merge
    assert [set(part) for part in implementation["parts"]] == FRAGMENTS[fragments]
    for round_index in range(ROUNDS):
        expected_names = sorted(
            set().union(*FRAGMENTS[fragments])
            if round_index == ROUNDS - 1
            else FRAGMENTS[fragments][round_index % fragments]
        )
        assert implementation["sent"][round_index] == [expected_names, expected_names], round_index + 1
        assert implementation["sent"][round_index] == reference["sent"][round_index]
        for trainer in (0, 1):
            what = f"round {round_index + 1}, trainer {trainer}"
            assert_same(
                implementation["deltas"][round_index][trainer],
                reference["deltas"][round_index][trainer],
                f"{what}: delta",
            )
            assert_same(
                implementation["globals"][round_index][trainer],
                reference["globals"][round_index][trainer],
                f"{what}: global_previous",
            )
        assert_same(
            implementation["thetas"][round_index], reference["thetas"][round_index], f"θ_{round_index + 1}"
        )
    for trainer in (0, 1):
        assert_same(implementation["live"][trainer], reference["live"][trainer], f"trainer {trainer}: live")
        assert_same(
            implementation["globals_after"][trainer],
            reference["globals_after"][trainer],
            f"trainer {trainer}: global_previous at the end",
        )


@pytest.mark.parametrize("mix", [0.0, 0.5, 0.9])
def test_the_rule_is_not_vacuous(mix: float) -> None:
    """Mixing every tensor instead of the fragment's changes the outcome, so the test above would catch it."""
    right = run_reference(2, mix)
    wrong = run_reference(2, mix, mix_everything=True)
    assert any(not torch.allclose(right["live"][0][name], wrong["live"][0][name]) for name in CANONICAL)
    # and the fragments differ from the global weights when they are sent: the deltas are not zero
    assert all(bool(delta[name].abs().max() > 0) for delta in right["deltas"][1] for name in delta)


def test_mix_into_changes_the_fragment_only_once_per_tied_group() -> None:
    # given: live weights, and merged weights that differ from them everywhere
    model = Toy()
    before = {name: model.entry(name).detach().clone() for name in CANONICAL}
    merged = {name: tensor + 1.0 for name, tensor in snapshot(float_state(model)).items()}
    merged["head"] = merged["embed"]
    fragment = FRAGMENTS[2][0]

    # when
    mix_into(model, merged, fragment, 0.5)

    # then: embed (tied to head) moved by exactly 0.5, once; the other fragment untouched, bit for bit
    torch.testing.assert_close(model.embed.detach(), before["embed"] + 0.5)
    assert model.head is model.embed
    torch.testing.assert_close(model.layers[0].weight.detach(), before["layers.0.weight"] + 0.5)
    for name in FRAGMENTS[2][1]:
        assert torch.equal(model.entry(name), before[name]), name


def test_mix_zero_replaces_the_fragment_by_the_global_weights_exactly() -> None:
    model = Toy()
    merged = {name: tensor * 3.1 + 0.7 for name, tensor in snapshot(float_state(model)).items()}
    merged["head"] = merged["embed"]
    mix_into(model, merged, FRAGMENTS[3][2], 0.0)
    assert torch.equal(model.embed, merged["embed"])


def test_mix_into_checks_everything_before_touching_the_model() -> None:
    model = Toy()
    before = {name: tensor.clone() for name, tensor in float_state(model).items()}
    merged = {name: tensor + 1.0 for name, tensor in snapshot(float_state(model)).items()}
    merged["layers.0.bias"] = torch.zeros(3)

    with pytest.raises(UpdateError, match="layers.0.bias"):
        mix_into(model, merged, FRAGMENTS[2][0], 0.5)
    del merged["layers.0.bias"]
    with pytest.raises(UpdateError, match="no tensor 'layers.0.bias'"):
        mix_into(model, merged, FRAGMENTS[2][0], 0.5)

    for name, tensor in float_state(model).items():
        assert torch.equal(tensor, before[name]), name


def test_a_fragments_merge_keeps_the_other_tensors_and_refuses_another_fragment() -> None:
    # given
    global_previous = snapshot(float_state(Toy()))
    fragment = FRAGMENTS[2][0]
    update = {name: torch.full_like(global_previous[name], 0.5) for name in ("embed", "layers.0.bias")}
    update["layers.0.weight"] = torch.ones_like(global_previous["layers.0.weight"])

    # when: the fragment's update (the tied pair under one name, as the parameter server publishes it)
    merged = merge(global_previous, update, fragment)

    # then: the fragment stepped, the tied pair still one tensor, every other tensor the very same object
    torch.testing.assert_close(merged["embed"], global_previous["embed"] + 0.5)
    assert merged["head"] is merged["embed"]
    for name in FRAGMENTS[2][1]:
        assert merged[name] is global_previous[name], name

    # an update naming another fragment's tensor, or missing one of the fragment's, is refused
    with pytest.raises(UpdateError, match="not in the round's fragment"):
        merge(global_previous, {**update, "running": torch.zeros(2)}, fragment)
    with pytest.raises(UpdateError, match="has no tensor 'layers.0.weight' of the round's fragment"):
        merge(global_previous, {name: update[name] for name in ("embed", "layers.0.bias")}, fragment)
    # and without a fragment a partial update is refused as ever
    with pytest.raises(UpdateError, match="the update has no tensor"):
        merge(global_previous, update)


def test_a_fragments_delta_holds_its_names_only_and_keeps_the_pair_tied() -> None:
    model = Toy()
    global_previous = snapshot(float_state(model))
    train_module(model, 0, 1, range(2))

    delta = compute_delta(float_state(model), global_previous, FRAGMENTS[2][0])

    assert sorted(delta) == sorted(FRAGMENTS[2][0])
    assert delta["head"] is delta["embed"]
    torch.testing.assert_close(
        delta["layers.0.bias"], model.layers[0].bias.detach() - global_previous["layers.0.bias"]
    )


def test_a_model_with_too_few_units_is_a_job_config_error() -> None:
    with pytest.raises(JobConfigError, match="cannot be split into 5 fragments"):
        fragments_of(snapshot(float_state(Toy())), 5)


def test_round_fragment_is_the_rounds_fragment_and_everything_in_the_jobs_last_round() -> None:
    parts = [frozenset({"a"}), frozenset({"b", "c"}), frozenset({"d"})]
    assert [round_fragment(parts, r, 7) for r in range(1, 7)] == [*parts, *parts]
    assert round_fragment(parts, 7, 7) == frozenset({"a", "b", "c", "d"})
    # the job's length unknown (a control plane that does not say it): fragments only, as before
    assert round_fragment(parts, 7, None) == parts[0]
    # a job shorter than F rounds ends with everything too
    assert round_fragment(parts, 2, 2) == frozenset({"a", "b", "c", "d"})
