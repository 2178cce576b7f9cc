"""A trainer in a job with a lossy encoding (docs/training.md, "Encodings"): the real ``training_function``
against the real bridge and :class:`~.test_consistency.PublishingBackend` playing our parameter server, whose
results come encoded (θ_r = θ_{r−1} + deQ(Q(u_r)), published with θ_r's digest). The trainer must send its
pseudo-gradients in the job's encoding (tied weights once), merge each result decoded into exactly θ_r (no
fetch of the full weights), and keep its error-feedback residual."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from hypha_tensors import weights
from hypha_tensors.encoding import decode, encode
from hypha_tensors.formats import Encoding

from .conftest import TinyModel, running_bridge, train_job
from .test_consistency import PublishingBackend, canonical, make_update


def encoded_file(
    tensors: dict[str, torch.Tensor], encoding: Encoding, *, round_number: int, digest: str
) -> bytes:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "u.safetensors"
        weights.save(
            path,
            encode(tensors, encoding),
            metadata={"format": "pt", **encoding.metadata()},
            round_number=round_number,
            weights_digest=digest,
        )
        return path.read_bytes()


def encoded_rounds(tiny_model: TinyModel, encoding: Encoding) -> tuple[list[dict], list[bytes]]:
    """θ_0 … θ_2 and the files of rounds 1 and 2, each θ_r = θ_{r−1} + what its file decodes to."""
    thetas = [canonical(tiny_model.state)]
    files = []
    for round_number in (1, 2):
        update = canonical(make_update(tiny_model.state, seed=round_number))
        applied = decode(encode(update, encoding), encoding)
        thetas.append({name: thetas[-1][name] + applied[name] for name in thetas[-1]})
        files.append(
            encoded_file(update, encoding, round_number=round_number, digest=weights.digest(thetas[-1]))
        )
    return thetas, files


async def run_trainer(backend: PublishingBackend, short_dir: Path, job: dict[str, Any], monkeypatch):
    """Run ``training_function`` to its end (exit 0 asserted); the digests of the weights it loaded and the
    error feedback it used."""
    from hypha_tensors import encoding as encoding_module
    from worker_daemon.executors import consistency, pseudo_gradient
    from worker_daemon.executors.job import parse_job
    from worker_daemon.executors.training import EXIT_OK, parse_arguments, training_function

    names = {name: tensor.dtype for name, tensor in backend.global_weights[0].items()}
    loaded: list[str] = []
    feedbacks: list[Any] = []
    real_load_into, real_feedback = pseudo_gradient.load_into, encoding_module.ErrorFeedback

    def observed_load_into(model: torch.nn.Module, state: Any) -> None:
        real_load_into(model, state)
        loaded.append(consistency.state_digest(pseudo_gradient.float_state(model), names))

    def observed_feedback(encoding: Encoding) -> Any:
        feedbacks.append(real_feedback(encoding))
        return feedbacks[-1]

    monkeypatch.setattr(pseudo_gradient, "load_into", observed_load_into)
    monkeypatch.setattr(encoding_module, "ErrorFeedback", observed_feedback)
    job_json = json.dumps(job)
    arguments = parse_arguments(
        ["--socket", str(short_dir / "bridge.sock"), "--work-dir", str(short_dir), "--job", job_json]
    )
    async with running_bridge(short_dir, backend):
        code = await asyncio.to_thread(training_function, arguments, parse_job(job_json))
    assert code == EXIT_OK
    return loaded, feedbacks


@pytest.mark.parametrize("encoding", [Encoding("int8", 64), Encoding("float16")], ids=str)
async def test_an_encoded_job_sends_encoded_updates_and_merges_encoded_results_exactly(
    encoding: Encoding, tiny_model: TinyModel, short_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    # given
    thetas, files = encoded_rounds(tiny_model, encoding)
    backend = PublishingBackend(
        directory=tmp_path / "served",
        config_file=tiny_model.directory / "config.json",
        global_weights=thetas,
        model_rounds=[0],
        answers=[[(1, files[0], None)], [(2, files[1], None)]],
    )
    job = train_job()
    job["executor"]["config"].update(
        {"encoding": encoding.name, **({"encoding_block_size": 64} if encoding.name == "int8" else {})}
    )

    # when
    loaded, feedbacks = await run_trainer(backend, short_dir, job, monkeypatch)

    # then: both results merged into exactly θ_1 and θ_2, never a fetch of the full weights
    assert loaded == [weights.digest(thetas[1]), weights.digest(thetas[2])]
    assert backend.served_rounds == [0]
    # each update went in the job's encoding, the tied weights once (under the smaller name, lm_head.weight;
    # transformer.wte.weight is an alias)
    assert len(backend.sent) == 2
    for sent in backend.sent:
        assert sent.metadata["hypha.encoding"] == encoding.name
        assert "lm_head.weight" in sent.stored_names and "transformer.wte.weight" not in sent.stored_names
        if encoding.name == "int8":
            assert sent.metadata["hypha.block_size"] == "64"
            assert "lm_head.weight.__scale__" in sent.stored_names
            assert "transformer.wte.weight.__scale__" not in sent.stored_names
            assert sent.tensors["transformer.wte.weight"].dtype == torch.int8
        else:
            assert sent.tensors["transformer.wte.weight"].dtype == torch.float16
        assert set(decode(sent.tensors, encoding)) == set(thetas[0]) | {"lm_head.weight"}
    # and the trainer keeps what rounding lost: a float32 residual per tensor, tied names sharing one
    (feedback,) = feedbacks
    assert feedback.encoding == encoding
    assert set(feedback.residual) == set(thetas[0]) | {"lm_head.weight"}
    assert feedback.residual["lm_head.weight"] is feedback.residual["transformer.wte.weight"]
    assert all(residual.dtype == torch.float32 for residual in feedback.residual.values())
    assert any(bool(residual.abs().max() > 0) for residual in feedback.residual.values())


def test_the_train_job_json_takes_the_encoding_and_refuses_an_unknown_one():
    from worker_daemon.executors.exceptions import JobConfigError
    from worker_daemon.executors.job import parse_job

    job = train_job()
    assert (
        parse_job(json.dumps(job)).config.encoding,
        parse_job(json.dumps(job)).config.encoding_block_size,
    ) == (
        "float32",
        256,
    )
    job["executor"]["config"].update({"encoding": "int8", "encoding_block_size": 64})
    assert parse_job(json.dumps(job)).config.encoding_block_size == 64
    job["executor"]["config"]["encoding"] = "int4"
    with pytest.raises(
        JobConfigError, match="executor.config.encoding: Value error, unknown encoding 'int4'"
    ):
        parse_job(json.dumps(job))
