"""A half-precision checkpoint trains on float32 master weights (issue 13, finding 3).

transformers 5 keeps a checkpoint's dtype: without ``dtype=float32`` a float16 model diverges at its first
AdamW step (v and eps underflow) and a bfloat16 one trains in pure bfloat16, where most of a first step at a
small learning rate is rounded away and the pseudo-gradient is bfloat16 too. The real ``training_function``
runs in process against the real bridge and a scripted backend for two rounds.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from .conftest import (
    ScriptedTrainerBackend,
    make_tiny_gpt2,
    running_bridge,
    train_job,
    update_bytes,
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
async def test_a_half_precision_checkpoint_trains_on_float32_masters(
    dtype: torch.dtype, short_dir: Path, tmp_path: Path
) -> None:
    from worker_daemon.executors.job import parse_job
    from worker_daemon.executors.training import EXIT_OK, parse_arguments, training_function

    # given: the tiny GPT-2 saved in half precision, and u = 1e-6 everywhere from the "parameter server"
    checkpoint = tmp_path / "checkpoint"
    model = make_tiny_gpt2()
    model.to(dtype).save_pretrained(checkpoint)
    assert json.loads((checkpoint / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    floats = {name: tensor for name, tensor in model.state_dict().items() if tensor.dtype.is_floating_point}
    update = {name: torch.full(tensor.shape, 1e-6) for name, tensor in floats.items()}
    update["lm_head.weight"] = update["transformer.wte.weight"]  # tied, like the model
    backend = ScriptedTrainerBackend(model_dir=checkpoint, updates=[update_bytes(update)])
    job_json = json.dumps(train_job(learning_rate=1e-4))
    arguments = parse_arguments(
        ["--socket", str(short_dir / "bridge.sock"), "--work-dir", str(short_dir), "--job", job_json]
    )

    # when
    async with running_bridge(short_dir, backend):
        code = await asyncio.to_thread(training_function, arguments, parse_job(job_json))

    # then: both rounds ran (float16 did not diverge); the pseudo-gradients are float32 and finite
    assert code == EXIT_OK
    assert len(backend.sent) == 2
    for sent in backend.sent:
        assert {tensor.dtype for tensor in sent.tensors.values()} == {torch.float32}
        assert all(bool(torch.isfinite(tensor).all()) for tensor in sent.tensors.values())
    # and round 1's first AdamW steps (≈ lr = 1e-4 per weight) were not rounded away: every weight of a
    # matrix moved (pure bfloat16 leaves about 12 % of them where they were)
    first = backend.sent[0].tensors
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight"):
        unchanged = float((first[name] == 0).float().mean())
        assert unchanged == 0.0, (name, unchanged)
        assert 1e-5 < float(first[name].abs().mean()) < 1e-3, name
