"""Eager updates' arithmetic against the rule of docs/training.md ("Overlap: eager updates"), written out.

Two eager trainers and a parameter server on a toy model (a tied pair of weights, a bias, a floating-point
buffer) for four rounds, with a deterministic, nonlinear "inner step". The implementation's side runs the
executor's own functions (``overlap.proxy_weights``, ``correct``, ``applied_update``; ``pseudo_gradient``'s
``compute_delta``, ``merge``, ``load_into``) on a real ``torch.nn.Module`` and the parameter server's real
``mean`` and ``nesterov_step``. The reference side is plain tensor formulas over the canonical names, the rule
as the docs state it:

    Δ_i^r = θ_i^r − θ_{r−1}                       (what trainer i sends)
    ḡ_r = mean_i Δ_i^r;  m_r = ḡ_r (r = 1) or μ·m_{r−1} + ḡ_r;  u_r = lr·(μ·m_r + ḡ_r);  θ_r = θ_{r−1} + u_r
    p_i^r = θ_{r−1} + μ²·u_{r−1} + lr·(1 + μ)·Δ_i^r   (u_0 = 0; a buffer: p = θ_{r−1} + Δ, and u_r = ḡ_r)
    round r+1 starts from p_i^r; after j_i steps of it: θ_live ← θ_live + (θ_r − p_i^r)
"""

from __future__ import annotations

import pytest
import torch

from parameter_server.math import mean, nesterov_step
from worker_daemon.executors.overlap import applied_update, correct, float_buffers, proxy_weights
from worker_daemon.executors.pseudo_gradient import compute_delta, float_state, load_into, merge, snapshot

H = 3
ROUNDS = 4
#: After how many steps of round r+1 each trainer merges round r's result (H: it waited at the end).
MERGE_AFTER = {0: [1, 2, 3, 0], 1: [2, 3, 1, 2]}
#: The parameter server's canonical names: the tied pair once, under its smaller name.
CANONICAL = ("bias", "embed", "running")
BUFFERS = {"running"}


class Toy(torch.nn.Module):
    """``embed`` and ``head`` are one parameter (as GPT-2's ``wte`` and ``lm_head``); ``running`` a float
    buffer (as BatchNorm's running mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.tensor([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]]))
        self.head = self.embed
        self.bias = torch.nn.Parameter(torch.tensor([0.1, -0.2]))
        self.register_buffer("running", torch.tensor([1.0, 2.0]))


def target(trainer: int, round_number: int, step: int, name: str, shape: torch.Size) -> torch.Tensor:
    """What trainer ``trainer``'s ``step``-th inner step of round ``round_number`` pulls ``name`` towards."""
    generator = torch.Generator().manual_seed(1000 * trainer + 10 * round_number + step + 7 * len(name))
    return torch.randn(shape, generator=generator)


def step_value(value: torch.Tensor, name: str, trainer: int, round_number: int, step: int) -> torch.Tensor:
    """One inner step, nonlinear (so where the merge falls matters): parameters θ − 0.3·tanh(θ − t),
    the buffer a running mean 0.8·b + 0.2·t."""
    goal = target(trainer, round_number, step, name, value.shape)
    if name in BUFFERS:
        return 0.8 * value + 0.2 * goal
    return value - 0.3 * torch.tanh(value - goal)


@torch.no_grad()
def train_module(model: Toy, trainer: int, round_number: int, steps: range) -> None:
    """The inner steps on the module, in place (the tied pair once, through the shared parameter)."""
    for step in steps:
        for name in CANONICAL:
            tensor = getattr(model, name)
            tensor.copy_(step_value(tensor, name, trainer, round_number, step))


def train_reference(
    state: dict[str, torch.Tensor], trainer: int, round_number: int, steps: range
) -> dict[str, torch.Tensor]:
    for step in steps:
        state = {name: step_value(state[name], name, trainer, round_number, step) for name in CANONICAL}
    return state


def canonical(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: state[name] for name in CANONICAL}


def tied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A canonical dict under the trainer's names (``head`` the same tensor as ``embed``)."""
    return {**state, "head": state["embed"]}


def run_implementation(learning_rate: float, momentum: float) -> dict[str, list]:
    """Two eager trainers through the executor's functions and the parameter server's math."""
    models = [Toy(), Toy()]
    buffers = float_buffers(models[0])
    assert buffers == {"running"}
    global_previous = [snapshot(float_state(model)) for model in models]
    last_update: list[dict | None] = [None, None]
    proxies: list[dict | None] = [None, None]
    server_theta = canonical(snapshot(float_state(models[0])))
    server_momentum = None
    record: dict[str, list] = {"deltas": [], "proxies": [], "thetas": [], "live": []}
    for round_number in range(1, ROUNDS + 1):
        deltas = []
        for trainer, model in enumerate(models):
            merge_at = MERGE_AFTER[trainer][round_number - 1] if round_number > 1 else 0
            if proxies[trainer] is None:
                train_module(model, trainer, round_number, range(H))
            else:
                train_module(model, trainer, round_number, range(merge_at))
                # round r−1's result: θ as the trainer merges it (θ_{r−2} + u), then the correction
                theta = merge(global_previous[trainer], tied(record["updates"][-1]))
                correct(model, proxies[trainer], theta)
                last_update[trainer] = applied_update(theta, global_previous[trainer])
                global_previous[trainer] = theta
                train_module(model, trainer, round_number, range(merge_at, H))
            delta = compute_delta(float_state(model), global_previous[trainer])
            deltas.append(delta)
            proxy = proxy_weights(
                global_previous[trainer],
                delta,
                last_update[trainer],
                learning_rate=learning_rate,
                momentum=momentum,
                buffers=buffers,
            )
            load_into(model, proxy)
            proxies[trainer] = proxy
            assert model.head is model.embed
        gradient = mean([canonical(delta) for delta in deltas])
        update, server_momentum = nesterov_step(
            gradient=gradient,
            momentum=server_momentum,
            learning_rate=learning_rate,
            momentum_factor=momentum,
            averaged=buffers,
        )
        server_theta = {name: server_theta[name] + update[name] for name in CANONICAL}
        record.setdefault("updates", []).append(update)
        record["deltas"].append([canonical(delta) for delta in deltas])
        record["proxies"].append([canonical(proxies[t]) for t in (0, 1)])
        record["thetas"].append(server_theta)
    # the last round's result, merged mid-round by both
    for trainer, model in enumerate(models):
        theta = merge(global_previous[trainer], tied(record["updates"][-1]))
        correct(model, proxies[trainer], theta)
        record["live"].append({name: getattr(model, name).detach().clone() for name in CANONICAL})
        assert torch.equal(model.head, model.embed) and model.head is model.embed
    return record


def run_reference(learning_rate: float, momentum: float) -> dict[str, list]:
    """The rule, by hand."""
    lr, mu = learning_rate, momentum
    initial = {name: getattr(Toy(), name).detach().clone() for name in CANONICAL}
    theta = dict(initial)  # θ_{r−1}
    previous_step = {name: torch.zeros_like(initial[name]) for name in CANONICAL}  # u_{r−1}
    m = None
    live = [dict(initial), dict(initial)]
    proxies: list[dict | None] = [None, None]
    new_theta: dict | None = None
    record: dict[str, list] = {"deltas": [], "proxies": [], "thetas": [], "live": []}
    for round_number in range(1, ROUNDS + 1):
        if new_theta is not None:  # round r−1's result exists: θ_{r−1}, merged mid-round below
            previous_step = {name: new_theta[name] - theta[name] for name in CANONICAL}
            theta = new_theta
        deltas, proxies_now = [], []
        for trainer in (0, 1):
            state = live[trainer]
            if proxies[trainer] is None:
                state = train_reference(state, trainer, round_number, range(H))
            else:
                merge_at = MERGE_AFTER[trainer][round_number - 1]
                state = train_reference(state, trainer, round_number, range(merge_at))
                state = {name: state[name] + (theta[name] - proxies[trainer][name]) for name in CANONICAL}
                state = train_reference(state, trainer, round_number, range(merge_at, H))
            delta = {name: state[name] - theta[name] for name in CANONICAL}
            proxy = {
                name: theta[name] + delta[name]
                if name in BUFFERS
                else theta[name] + mu**2 * previous_step[name] + lr * (1 + mu) * delta[name]
                for name in CANONICAL
            }
            deltas.append(delta)
            proxies_now.append(proxy)
            live[trainer] = proxy
        proxies = list(proxies_now)
        g = {name: (deltas[0][name] + deltas[1][name]) / 2 for name in CANONICAL}
        m = (
            {name: g[name] for name in CANONICAL if name not in BUFFERS}
            if m is None
            else {name: mu * m[name] + g[name] for name in m}
        )
        u = {name: g[name] if name in BUFFERS else lr * (mu * m[name] + g[name]) for name in CANONICAL}
        new_theta = {name: theta[name] + u[name] for name in CANONICAL}
        record["deltas"].append(deltas)
        record["proxies"].append(proxies_now)
        record["thetas"].append(new_theta)
    for trainer in (0, 1):
        record["live"].append(
            {name: live[trainer][name] + (new_theta[name] - proxies[trainer][name]) for name in CANONICAL}
        )
    return record


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(actual) == sorted(expected), what
    for name in expected:
        # float32 both sides; the formulas associate the same way up to the mean's and momentum's order
        torch.testing.assert_close(actual[name], expected[name], rtol=2e-6, atol=2e-7, msg=f"{what}: {name}")


@pytest.mark.parametrize(("learning_rate", "momentum"), [(0.7, 0.9), (1.0, 0.0), (1.0, 0.5), (0.4, 0.0)])
def test_eager_trainers_follow_the_written_out_rule(learning_rate: float, momentum: float) -> None:
    # when
    implementation = run_implementation(learning_rate, momentum)
    reference = run_reference(learning_rate, momentum)

    # then: every delta sent, every proxy loaded, every θ_r, and the weights after the last merge
    for round_index in range(ROUNDS):
        for trainer in (0, 1):
            assert_same(
                implementation["deltas"][round_index][trainer],
                reference["deltas"][round_index][trainer],
                f"round {round_index + 1}, trainer {trainer}: delta",
            )
            assert_same(
                implementation["proxies"][round_index][trainer],
                reference["proxies"][round_index][trainer],
                f"round {round_index + 1}, trainer {trainer}: proxy",
            )
        assert_same(
            implementation["thetas"][round_index], reference["thetas"][round_index], f"θ_{round_index + 1}"
        )
    for trainer in (0, 1):
        assert_same(implementation["live"][trainer], reference["live"][trainer], f"trainer {trainer}: live")


def test_the_rule_is_not_vacuous() -> None:
    """The momentum term and the correction both change the outcome (a wrong rule would fail the test above)."""
    with_momentum = run_reference(0.7, 0.9)
    without = run_reference(0.7, 0.0)
    assert not torch.allclose(with_momentum["live"][0]["embed"], without["live"][0]["embed"])
    # the proxy differs from θ_r: the correction is not zero
    theta_1 = with_momentum["thetas"][0]
    assert not torch.allclose(with_momentum["proxies"][0][0]["embed"], theta_1["embed"])


def test_after_a_full_fetch_the_proxy_has_no_momentum_term() -> None:
    # given: θ_{r−1}, own delta, and no last update (first round, or the full weights were fetched)
    previous = {"w": torch.tensor([1.0, 2.0])}
    delta = {"w": torch.tensor([0.5, -0.25])}

    # when
    proxy = proxy_weights(previous, delta, None, learning_rate=0.7, momentum=0.9)
    with_last = proxy_weights(
        previous, delta, {"w": torch.tensor([1.0, 1.0])}, learning_rate=0.7, momentum=0.9
    )

    # then: p = θ + lr·(1+μ)·Δ, and μ²·u on top when there is a u
    torch.testing.assert_close(proxy["w"], torch.tensor([1.0 + 1.33 * 0.5, 2.0 - 1.33 * 0.25]))
    torch.testing.assert_close(with_last["w"], proxy["w"] + 0.81)


def test_a_correction_of_the_wrong_shape_changes_nothing() -> None:
    from worker_daemon.executors.exceptions import UpdateError

    model = Toy()
    before = {name: tensor.clone() for name, tensor in float_state(model).items()}
    proxy = snapshot(float_state(model))
    merged = dict(proxy)
    merged["bias"] = torch.zeros(3)

    with pytest.raises(UpdateError, match="bias"):
        correct(model, proxy, merged)

    for name, tensor in float_state(model).items():
        assert torch.equal(tensor, before[name])
