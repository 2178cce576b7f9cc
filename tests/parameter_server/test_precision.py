"""The parameter server keeps float32 master weights whatever dtype the source is in (issue 13, finding 3):
its global weights, u, the momentum and the files it serves and uploads are float32."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from parameter_server.job import parse_job
from parameter_server.model import prepare_model
from parameter_server.rounds import RoundCoordinator
from tests.parameter_server.conftest import ALICE, BOB, TINY_GPT2, aggregate_job


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_config_naming_a_half_precision_dtype_builds_float32_masters(tmp_path, dtype):
    source = {"type": "config", "config": {**TINY_GPT2, "dtype": dtype}}

    initial = prepare_model(parse_job(aggregate_job(peers=[ALICE], source=source)), tmp_path)

    assert {tensor.dtype for tensor in initial.weights.values()} == {torch.float32}
    assert json.loads((initial.files_dir / "config.json").read_text())["dtype"] == "float32"


async def test_a_bfloat16_checkpoint_goes_through_a_round_in_float32(tmp_path, monkeypatch):
    # given: a checkpoint saved in bfloat16 (transformers 5 would load it as bfloat16), fetched from a "hub"
    import huggingface_hub
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint = tmp_path / "checkpoint"
    config = dict(TINY_GPT2)
    model_type = config.pop("model_type")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config)).to(
        torch.bfloat16
    ).save_pretrained(checkpoint)
    assert json.loads((checkpoint / "config.json").read_text())["dtype"] == "bfloat16"

    def fake_download(*, repo_id, filename, revision, token, local_dir):
        target = local_dir / filename
        target.write_bytes((checkpoint / filename).read_bytes())
        return str(target)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    source = {
        "type": "huggingface",
        "repository": "someone/tiny-bf16",
        "revision": None,
        "filenames": ["config.json", "model.safetensors"],
        "token": None,
    }

    # when: the initial model, then a round of two trainers' float32 deltas
    initial = prepare_model(parse_job(aggregate_job(peers=[ALICE, BOB], source=source)), tmp_path / "ps")
    rounds = RoundCoordinator(
        expected=[ALICE, BOB],
        weights=initial.weights,
        momentum=None,
        rounds_completed=0,
        update_rounds=2,
        round_timeout=30.0,
        weighted=True,
        learning_rate=0.7,
        momentum_factor=0.9,
        buffers=initial.buffers,
    )
    # A step far below bfloat16's resolution at these weights (~0.4 % of |θ|): lost in bfloat16.
    small = {name: torch.full_like(tensor, 1e-5) for name, tensor in initial.weights.items()}
    await rounds.submit(ALICE, 1, small, samples=1)
    await rounds.submit(BOB, 1, small, samples=1)
    result = await asyncio.wait_for(rounds.published.get(), 5)

    # then: float32 masters, u and momentum; the weights moved by u
    assert {tensor.dtype for tensor in initial.weights.values()} == {torch.float32}
    assert {tensor.dtype for tensor in result.update.values()} == {torch.float32}
    assert {tensor.dtype for tensor in rounds.momentum.values()} == {torch.float32}
    for name, tensor in initial.weights.items():
        moved = rounds.weights[name] - tensor
        assert bool((moved != 0).all()), name
        # up to half a float32 ulp of |θ| ≤ 2 (bfloat16 would move by 0 or by ≥ 0.0039 where |θ| is 1)
        torch.testing.assert_close(moved, result.update[name], rtol=0, atol=1.2e-7)
    # the checkpoint's values are kept exactly (bfloat16 → float32 is exact)
    original = AutoModelForCausalLM.from_pretrained(checkpoint)
    for name, tensor in initial.weights.items():
        assert torch.equal(tensor, original.state_dict()[name].float()), name
