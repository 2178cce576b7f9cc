"""The training knobs an executor receives (``training`` and ``optimizer.weight-decay`` in the train job JSON;
docs/configuration.md, "Training knobs"): parsed with validation, the defaults when absent."""

from __future__ import annotations

import copy
import json

import pytest

from worker_daemon.executors.exceptions import JobConfigError
from worker_daemon.executors.job import parse_job

from .conftest import train_job


def with_config(**changes: object) -> str:
    job = copy.deepcopy(train_job())
    job["executor"]["config"].update(changes)
    return json.dumps(job)


def test_a_job_without_knobs_gets_the_defaults() -> None:
    config = parse_job(json.dumps(train_job())).config
    assert config.optimizer.weight_decay is None
    assert config.training.model_dump() == {
        "max_grad_norm": None,
        "gradient_accumulation_steps": 1,
        "mixed_precision": "no",
        "gradient_checkpointing": False,
        "dataloader_workers": 0,
        "processes": 1,
        "process_timeout": 300.0,
    }


def test_the_knobs_are_read() -> None:
    knobs = {
        "max_grad_norm": 0.5,
        "gradient_accumulation_steps": 2,
        "mixed_precision": "bf16",
        "gradient_checkpointing": True,
        "dataloader_workers": 3,
    }
    optimizer = {"learning-rate": 1e-3, "weight-decay": 0.1}
    config = parse_job(with_config(batch_size=4, training=knobs, optimizer=optimizer)).config
    assert config.training.model_dump() == {**knobs, "processes": 1, "process_timeout": 300.0}
    assert config.optimizer.weight_decay == 0.1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"training": {"max_grad_norm": 0}}, "executor.config.training.max_grad_norm"),
        ({"training": {"gradient_accumulation_steps": 0}}, "training.gradient_accumulation_steps"),
        ({"training": {"mixed_precision": "fp8"}}, "training.mixed_precision"),
        ({"training": {"gradient_checkpointing": "yes"}}, "training.gradient_checkpointing"),
        ({"training": {"dataloader_workers": 64}}, "training.dataloader_workers"),
        ({"optimizer": {"learning-rate": 1e-3, "weight-decay": -1}}, "optimizer.weight-decay"),
        ({"batch_size": 3, "training": {"gradient_accumulation_steps": 2}}, r"must divide batch_size \(3\)"),
        ({"training": {"processes": -1}}, "training.processes"),
        ({"training": {"process_timeout": 0}}, "training.process_timeout"),
        ({"batch_size": 4, "training": {"processes": 3}}, r"\(3 × 1\) must divide batch_size \(4\)"),
    ],
)
def test_a_bad_knob_is_refused(changes: dict, message: str) -> None:
    with pytest.raises(JobConfigError, match=message):
        parse_job(with_config(**changes))


# --- each knob takes effect (worker_daemon.executors.knobs, on this machine's CPU) ------------------------


@pytest.fixture
def fresh_accelerate():
    """A fresh accelerate state per test: its state is process-wide, and each test picks its own precision."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def knobs(**values: object):
    from worker_daemon.executors.job import TrainingKnobs

    return TrainingKnobs(**values)


def regression(seed: int = 0):
    """A linear model with its own MSE loss, and a batch of 8 (no batch statistics: micro-batches add up)."""
    import torch

    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.linear(x), y)

    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Regression()
    inputs = {"x": torch.randn(8, 4, generator=generator), "y": 100 * torch.randn(8, 3, generator=generator)}
    return model, inputs


def one_step(training, *, optimizer_factory, seed: int = 0):
    """The model's parameters after one :func:`knobs.train_step` with ``training``; and the step's loss."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from worker_daemon.executors import knobs as knob_module

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, **knob_module.accelerator_options(training))
    model, inputs = regression(seed)
    before = {name: value.detach().clone() for name, value in model.named_parameters()}
    optimizer = optimizer_factory(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    loss = knob_module.train_step(
        accelerator=accelerator,
        model=model,
        optimizer=optimizer,
        lr_schedule=None,
        inputs=inputs,
        loss_of=lambda output: output,
        max_grad_norm=training.max_grad_norm,
    )
    after = {
        name: value.detach().clone() for name, value in accelerator.unwrap_model(model).named_parameters()
    }
    return before, after, float(loss)


def sgd(model):
    import torch

    return torch.optim.SGD(model.parameters(), lr=1.0)


def adamw(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=0.01)


def update_norm(before: dict, after: dict) -> float:
    import torch

    return float(torch.sqrt(sum(((after[name] - before[name]) ** 2).sum() for name in before)))


def test_clipping_bounds_the_gradient_norm(fresh_accelerate) -> None:
    # With SGD at lr 1 the update is the gradient: its norm is the gradient's.
    before, unclipped, _ = one_step(knobs(), optimizer_factory=sgd)
    assert update_norm(before, unclipped) > 10

    before, clipped, _ = one_step(knobs(max_grad_norm=0.5), optimizer_factory=sgd)

    assert update_norm(before, clipped) == pytest.approx(0.5, rel=1e-4)


@pytest.mark.parametrize("factory", [sgd, adamw])
@pytest.mark.parametrize("steps", [2, 4, 8])
def test_k_micro_batches_of_b_over_k_are_one_step_of_b(fresh_accelerate, factory, steps) -> None:
    import torch

    before, whole, whole_loss = one_step(knobs(), optimizer_factory=factory)
    _, accumulated, accumulated_loss = one_step(
        knobs(gradient_accumulation_steps=steps), optimizer_factory=factory
    )

    assert accumulated_loss == pytest.approx(whole_loss, rel=1e-5)
    for name in whole:
        assert not torch.equal(whole[name], before[name])  # it did step, once
        torch.testing.assert_close(accumulated[name], whole[name], rtol=1e-5, atol=1e-6)


def test_accumulation_with_clipping_clips_the_summed_gradient_once(fresh_accelerate) -> None:
    import torch

    before, whole, _ = one_step(knobs(max_grad_norm=0.5), optimizer_factory=sgd)
    _, accumulated, _ = one_step(
        knobs(max_grad_norm=0.5, gradient_accumulation_steps=4), optimizer_factory=sgd
    )

    for name in whole:
        torch.testing.assert_close(accumulated[name], whole[name], rtol=1e-5, atol=1e-6)


def test_weight_decay_shrinks_the_weights_as_adamws_formula_says(fresh_accelerate) -> None:
    import torch

    from worker_daemon.executors import knobs as knob_module

    def adamw_from_the_job(decay):
        def factory(model):
            optimizer = {"learning-rate": 0.01, **({"weight-decay": decay} if decay is not None else {})}
            config = parse_job(with_config(optimizer=optimizer)).config
            return torch.optim.AdamW(
                model.parameters(), lr=config.optimizer.learning_rate, **knob_module.optimizer_options(config)
            )

        return factory

    before, plain, _ = one_step(knobs(), optimizer_factory=adamw_from_the_job(0.0))
    _, decayed, _ = one_step(knobs(), optimizer_factory=adamw_from_the_job(0.5))
    _, default, _ = one_step(knobs(), optimizer_factory=adamw_from_the_job(None))

    # AdamW (decoupled): θ' = θ − lr·λ·θ − lr·adam(g); the Adam part does not depend on λ.
    for name in before:
        torch.testing.assert_close(
            decayed[name] - plain[name], -0.01 * 0.5 * before[name], rtol=1e-4, atol=1e-7
        )
        torch.testing.assert_close(
            default[name] - plain[name], -0.01 * 0.01 * before[name], rtol=1e-3, atol=1e-7
        )


def test_gradient_checkpointing_gives_the_same_loss_and_gradients() -> None:
    import torch

    from worker_daemon.executors import knobs as knob_module

    from .conftest import make_tiny_gpt2

    def loss_and_gradients(checkpointing: bool):
        torch.manual_seed(0)
        model = make_tiny_gpt2()
        knob_module.prepare_model(model, knobs(gradient_checkpointing=checkpointing))
        model.train()
        assert model.is_activation_checkpointing == checkpointing
        tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        return float(loss.detach()), {
            name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None
        }

    loss, gradients = loss_and_gradients(False)
    checkpointed_loss, checkpointed_gradients = loss_and_gradients(True)

    assert checkpointed_loss == pytest.approx(loss, rel=1e-6)
    assert gradients.keys() == checkpointed_gradients.keys()
    for name in gradients:
        torch.testing.assert_close(checkpointed_gradients[name], gradients[name], rtol=1e-5, atol=1e-6)


def test_gradient_checkpointing_on_a_model_without_it_is_a_job_config_error() -> None:
    import torch

    from worker_daemon.executors import knobs as knob_module

    with pytest.raises(JobConfigError, match="Linear does not support it"):
        knob_module.prepare_model(torch.nn.Linear(2, 2), knobs(gradient_checkpointing=True))


@pytest.mark.parametrize(("precision", "dtype"), [("no", "float32"), ("bf16", "bfloat16")])
def test_bf16_autocasts_the_matmuls_on_a_cpu(fresh_accelerate, precision, dtype) -> None:
    import torch
    from accelerate import Accelerator

    from worker_daemon.executors import knobs as knob_module

    training = knobs(mixed_precision=precision)
    knob_module.check_device(training, cuda=False)
    accelerator = Accelerator(cpu=True, **knob_module.accelerator_options(training))
    model, inputs = regression()
    seen = []
    model.linear.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    model = accelerator.prepare(model)

    model(**inputs)

    assert seen == [getattr(torch, dtype)]
    assert model.linear.weight.dtype == torch.float32  # the master weights stay float32


@pytest.mark.parametrize(
    ("precision", "cuda", "cuda_bf16", "message"),
    [
        ("fp16", False, None, "fp16 needs a CUDA GPU and this worker has none"),
        ("bf16", True, False, "bf16 is not supported by this worker's GPU"),
    ],
)
def test_a_precision_the_device_cannot_do_is_refused(precision, cuda, cuda_bf16, message) -> None:
    from worker_daemon.executors import knobs as knob_module

    with pytest.raises(JobConfigError, match=message):
        knob_module.check_device(knobs(mixed_precision=precision), cuda=cuda, cuda_bf16=cuda_bf16)
    # What such a machine can do passes.
    knob_module.check_device(knobs(mixed_precision="no"), cuda=cuda, cuda_bf16=cuda_bf16)


def test_a_batch_that_does_not_split_into_micro_batches_is_refused() -> None:
    import torch

    from worker_daemon.executors import knobs as knob_module

    with pytest.raises(JobConfigError, match=r"must divide the batch \(6 samples\)"):
        knob_module.micro_batches({"x": torch.zeros(6, 2)}, 4)


def test_the_lr_schedule_moves_once_per_step_not_per_micro_batch(fresh_accelerate) -> None:
    import torch
    from accelerate import Accelerator

    from worker_daemon.executors import knobs as knob_module

    accelerator = Accelerator(
        cpu=True, **knob_module.accelerator_options(knobs(gradient_accumulation_steps=4))
    )
    model, inputs = regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)

    for _ in range(2):
        knob_module.train_step(
            accelerator=accelerator,
            model=model,
            optimizer=optimizer,
            lr_schedule=schedule,
            inputs=inputs,
            loss_of=lambda output: output,
        )

    assert optimizer.param_groups[0]["lr"] == 0.25  # two steps of 4 micro-batches each
