"""The batch inference executor as a real subprocess against our real bridge (``serve_bridge``) and a backend
that answers from local files: the tiny GPT-2 saved with ``save_pretrained``, two data slices, then ``[]``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker_daemon.bridge import serve_bridge

from .conftest import REPOSITORY, TinyModel, executor_environment

JOB_ID = "6c1e2f3a-4b5c-4d6e-8f70-1a2b3c4d5e6f"
CONTROL_PLANE = "control-plane-peer"
DATASET = "prompts"
ROWS = 5
PROMPT_LENGTH = 6
SLICES = [3, 8]
EXECUTOR_TIMEOUT = 90.0


def make_slice(index: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + index)
    return {"input_ids": torch.randint(1, 256, (ROWS, PROMPT_LENGTH), generator=generator, dtype=torch.int64)}


class FileBackend:
    """A ``BridgeBackend`` that serves the model files and the ``SLICES`` in order, then ``[]`` (the job has
    no slice left for this worker), and keeps a copy of every file the executor sends."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.pending = list(SLICES)
        self.fetches: list[dict[str, Any]] = []
        self.sent: list[tuple[dict[str, Any], str, bytes]] = []
        self.progress: list[Any] = []

    async def fetch(self, *, reference: Any, artifacts_dir: Path) -> list[tuple[str, int]]:
        self.fetches.append(reference.model_dump(mode="json"))
        if reference.type == "uri":  # an uploaded model: one zip of its directory
            path = artifacts_dir / "upload"
            with zipfile.ZipFile(path, "w") as archive:
                for name in ("config.json", "model.safetensors"):
                    archive.write(self.model_dir / name, f"tiny-gpt2/{name}")
            return [("upload", path.stat().st_size)]
        if reference.type == "scheduler":
            if not self.pending:
                return []
            index = self.pending.pop(0)
            path = artifacts_dir / str(index)
            save_file(make_slice(index), str(path))
            return [(str(index), path.stat().st_size)]
        written = []
        for name in reference.filenames:
            shutil.copyfile(self.model_dir / name, artifacts_dir / name)
            written.append((name, (artifacts_dir / name).stat().st_size))
        return written

    async def send(self, *, reference: Any, path: Path) -> None:
        self.sent.append((reference.model_dump(mode="json"), path.name, path.read_bytes()))

    async def receive(self, *, reference: Any, directory: Path) -> AsyncIterator[tuple[str, int, str]]:
        raise AssertionError("the inference executor receives nothing")
        yield  # pragma: no cover

    async def status(self, *, job_id: str | None, progress: Any) -> dict[str, Any]:
        self.progress.append(progress)
        return {"type": "Ok"}


HUGGINGFACE = {
    "type": "huggingface",
    "repository": "test/tiny-gpt2",
    "revision": None,
    "filenames": ["config.json", "model.safetensors"],
    "token": None,
}
TINY_GPT2 = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": 256,
    "n_positions": 64,
}


def inference_job(
    task: dict[str, Any], *, model_task: str = "causal-lm", artifact: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "job_id": JOB_ID,
        "executor": {
            "class": "inference",
            "descriptor": {"name": "batch-inference"},
            "config": {
                "model": {
                    "task": model_task,
                    "artifact": artifact or HUGGINGFACE,
                },
                "data": {"type": "scheduler", "peer": CONTROL_PLANE, "dataset": DATASET},
                "results": {
                    "type": "peers",
                    "peers": [CONTROL_PLANE],
                    "strategy": {"type": "One"},
                    "resource": None,
                },
                "task": task,
                "batch_size": 2,
                "input_names": ["input_ids"],
            },
        },
    }


GREEDY = {"type": "generate", "max_new_tokens": 4, "temperature": 0.0, "seed": 0}


async def run_inference(
    tiny_model: TinyModel, work_dir: Path, job: dict[str, Any], *, env: dict[str, str] | None = None
) -> tuple[int, str, FileBackend]:
    """Serve the bridge on ``work_dir`` with a fresh :class:`FileBackend` and run the executor to its end."""
    for leftover in ("artifacts", "results"):
        shutil.rmtree(work_dir / leftover, ignore_errors=True)
    backend = FileBackend(tiny_model.directory)
    server = await serve_bridge(
        socket_path=work_dir / "bridge.sock", work_dir=work_dir, backend=backend, job_id=JOB_ID
    )
    environment = executor_environment()
    environment.pop("HYPHA_INFERENCE_WRONG_RESULTS", None)
    environment.update(env or {})
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "worker_daemon.executors.inference",
            "--socket",
            str(work_dir / "bridge.sock"),
            "--work-dir",
            str(work_dir),
            "--job",
            json.dumps(job, separators=(",", ":")),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=environment,
            cwd=str(REPOSITORY),
            start_new_session=True,
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), EXECUTOR_TIMEOUT)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        await asyncio.sleep(0.05)  # the bridge's background sends
    finally:
        await server.close()
    return process.returncode, output.decode(errors="replace"), backend


def tokens_of(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode().splitlines()]


async def test_generate_twice_greedily_gives_the_same_tokens_and_ends_at_the_empty_fetch(
    tiny_model: TinyModel, short_dir: Path
) -> None:
    # given
    job = inference_job(GREEDY)

    # when: the same job twice
    first_code, first_log, first = await run_inference(tiny_model, short_dir, job)
    second_code, second_log, second = await run_inference(tiny_model, short_dir, job)

    # then: a clean exit once the slice fetch answered []
    assert first_code == 0, first_log
    assert second_code == 0, second_log
    assert [fetch["type"] for fetch in first.fetches] == [
        "huggingface",
        "scheduler",
        "scheduler",
        "scheduler",
    ]
    # one result per slice, sent in order to the results reference with the slice named
    assert [(reference["resource"], name) for reference, name, _ in first.sent] == [
        ({"dataset": DATASET, "index": 3}, "3.jsonl"),
        ({"dataset": DATASET, "index": 8}, "8.jsonl"),
    ]
    reference = first.sent[0][0]
    assert (reference["type"], reference["peers"], reference["strategy"]) == (
        "peers",
        [CONTROL_PLANE],
        {"type": "One"},
    )
    rows = tokens_of(first.sent[0][2])
    assert [row["row"] for row in rows] == list(range(ROWS))
    assert all(1 <= len(row["tokens"]) <= GREEDY["max_new_tokens"] for row in rows)
    # greedy: the same tokens both times, the model's argmax
    assert [data for _, _, data in first.sent] == [data for _, _, data in second.sent]
    for index, (_, _, data) in zip(SLICES, first.sent, strict=True):
        assert [row["tokens"] for row in tokens_of(data)] == expected_greedy(tiny_model, index)
    # progress after each slice
    assert [p["metrics"]["metrics"]["slices_done"] for p in first.progress] == [1.0, 2.0]
    assert [p["metrics"]["metrics"]["samples"] for p in first.progress] == [ROWS, ROWS]


def expected_greedy(tiny_model: TinyModel, index: int) -> list[list[int]]:
    """Slice ``index``'s greedy tokens, by the plain model in this process: argmax, each row cut after eos (0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model.directory).eval()
    ids = make_slice(index)["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(GREEDY["max_new_tokens"]):
            token = model(input_ids=ids).logits[:, -1, :].argmax(-1, keepdim=True)
            new.append(token)
            ids = torch.cat([ids, token], dim=-1)
    rows = torch.cat(new, dim=-1).tolist()
    return [row[: next((at + 1 for at, token in enumerate(row) if token == 0), len(row))] for row in rows]


def expected_embeddings(tiny_model: TinyModel, index: int) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_model.directory).eval()
    with torch.no_grad():
        return model(input_ids=make_slice(index)["input_ids"]).last_hidden_state.mean(dim=1)


def tensors_of(data: bytes, directory: Path) -> dict[str, torch.Tensor]:
    path = directory / "result.safetensors"
    path.write_bytes(data)
    return load_file(str(path))


async def test_sampling_is_reproducible_from_the_seed(tiny_model: TinyModel, short_dir: Path) -> None:
    sampled = {"type": "generate", "max_new_tokens": 4, "temperature": 1.5, "seed": 7}
    _, _, first = await run_inference(tiny_model, short_dir, inference_job(sampled))
    _, _, again = await run_inference(tiny_model, short_dir, inference_job(sampled))
    _, _, other = await run_inference(tiny_model, short_dir, inference_job({**sampled, "seed": 8}))

    assert [data for *_, data in first.sent] == [data for *_, data in again.sent]
    assert [data for *_, data in first.sent] != [data for *_, data in other.sent]


async def test_embed_writes_one_vector_per_row(tiny_model: TinyModel, short_dir: Path) -> None:
    code, log, backend = await run_inference(
        tiny_model, short_dir, inference_job({"type": "embed"}, model_task="feature-extraction")
    )

    assert code == 0, log
    assert [name for _, name, _ in backend.sent] == ["3.safetensors", "8.safetensors"]
    embeddings = tensors_of(backend.sent[0][2], short_dir)["embeddings"]
    assert embeddings.dtype == torch.float32
    assert tuple(embeddings.shape) == (ROWS, 32)  # [rows, n_embd]
    torch.testing.assert_close(embeddings, expected_embeddings(tiny_model, SLICES[0]), rtol=1e-4, atol=1e-5)


async def test_classify_writes_the_logits(tiny_model: TinyModel, short_dir: Path) -> None:
    code, log, backend = await run_inference(
        tiny_model,
        short_dir,
        inference_job({"type": "classify", "top_k": None}, model_task="sequence-classification"),
    )

    assert code == 0, log
    path = short_dir / "logits.safetensors"
    path.write_bytes(backend.sent[1][2])
    logits = load_file(str(path))["logits"]
    assert logits.dtype == torch.float32 and logits.shape[0] == ROWS


async def test_the_wrong_results_knob_changes_the_output(tiny_model: TinyModel, short_dir: Path) -> None:
    knob = {"HYPHA_INFERENCE_WRONG_RESULTS": "1"}
    code, log, tokens = await run_inference(tiny_model, short_dir, inference_job(GREEDY), env=knob)
    _, _, vectors = await run_inference(
        tiny_model, short_dir, inference_job({"type": "embed"}, model_task="feature-extraction"), env=knob
    )

    assert code == 0, log
    assert "WRONG RESULTS" in log
    assert [row["tokens"] for row in tokens_of(tokens.sent[0][2])] == [
        [token + 1 for token in row] for row in expected_greedy(tiny_model, SLICES[0])
    ]
    torch.testing.assert_close(
        tensors_of(vectors.sent[0][2], short_dir)["embeddings"],
        expected_embeddings(tiny_model, SLICES[0]) + 1.0,
        rtol=1e-4,
        atol=1e-5,
    )


async def test_a_job_the_model_cannot_do_fails_before_any_fetch(
    tiny_model: TinyModel, short_dir: Path
) -> None:
    started = time.perf_counter()
    code, log, backend = await run_inference(
        tiny_model, short_dir, inference_job(GREEDY, model_task="feature-extraction")
    )

    assert code == 4, log
    assert "cannot generate" in log
    assert backend.fetches == []
    assert time.perf_counter() - started < EXECUTOR_TIMEOUT


async def test_an_uploaded_model_archive_is_unpacked(tiny_model: TinyModel, short_dir: Path) -> None:
    uploaded = inference_job(
        {"type": "embed"},
        model_task="feature-extraction",
        artifact={"type": "uri", "value": "/api/uploads/3/content/"},
    )

    code, log, backend = await run_inference(tiny_model, short_dir, uploaded)

    assert code == 0, log
    assert backend.fetches[0] == {"type": "uri", "value": "/api/uploads/3/content/"}
    torch.testing.assert_close(
        tensors_of(backend.sent[0][2], short_dir)["embeddings"],
        expected_embeddings(tiny_model, SLICES[0]),
        rtol=1e-4,
        atol=1e-5,
    )


async def test_a_config_artifact_is_built_with_the_same_random_weights_everywhere(
    tiny_model: TinyModel, short_dir: Path
) -> None:
    job = inference_job(GREEDY, artifact={"type": "config", "config": dict(TINY_GPT2)})

    code, log, first = await run_inference(tiny_model, short_dir, job)
    _, _, second = await run_inference(tiny_model, short_dir, job)

    assert code == 0, log
    assert [fetch["type"] for fetch in first.fetches] == ["scheduler"] * 3  # nothing to fetch for the model
    assert len(first.sent) == 2
    assert [data for *_, data in first.sent] == [data for *_, data in second.sent]


# --- the computations, in process ------------------------------------------------------------------------------


def test_classify_top_k_gives_the_largest_logits_and_their_classes(tiny_model: TinyModel) -> None:
    from worker_daemon.executors import inference_tasks as tasks

    config = tasks.parse_job(
        json.dumps(inference_job({"type": "classify", "top_k": 1}, model_task="sequence-classification"))
    ).config
    model = tasks.load_model(tiny_model.directory, config, device="cpu", trust_remote_code=False)
    inputs = make_slice(0)

    with torch.inference_mode():
        everything = tasks.classify(
            model, inputs, tasks.ClassifyTask(type="classify"), batch_size=2, device="cpu"
        )
        best = tasks.classify(model, inputs, config.task, batch_size=2, device="cpu")

    logits = everything["logits"]
    assert logits.shape == (ROWS, 2)  # GPT-2's default: two labels
    values, indices = logits.topk(1, dim=-1)
    assert torch.equal(best["values"], values) and torch.equal(best["indices"], indices)
    # each row is classified by its last position: in a batch as alone
    with torch.inference_mode():
        alone = tasks.classify(
            model, {"input_ids": inputs["input_ids"][:1]}, tasks.ClassifyTask(type="classify"), batch_size=1,
            device="cpu",
        )  # fmt: skip
    torch.testing.assert_close(alone["logits"][0], logits[0])


def test_a_left_padded_row_generates_what_it_would_alone(tiny_model: TinyModel) -> None:
    from worker_daemon.executors import inference_tasks as tasks

    config = tasks.parse_job(json.dumps(inference_job(GREEDY))).config
    model = tasks.load_model(tiny_model.directory, config, device="cpu", trust_remote_code=False)
    prompts = make_slice(0)["input_ids"][:2]
    padded = prompts.clone()
    padded[1, :2] = 0  # row 1: two pad tokens, then its last four tokens
    mask = torch.ones_like(padded)
    mask[1, :2] = 0

    with torch.inference_mode():
        batch = tasks.generate(
            model,
            {"input_ids": padded, "attention_mask": mask},
            config.task,
            index=0,
            batch_size=2,
            device="cpu",
        )
        alone = tasks.generate(
            model, {"input_ids": prompts[1:, 2:]}, config.task, index=0, batch_size=1, device="cpu"
        )

    assert batch[1] == alone[0]


def test_bad_jobs_are_refused_with_the_reason() -> None:
    from worker_daemon.executors.exceptions import JobConfigError
    from worker_daemon.executors.inference_tasks import parse_job

    train = inference_job(GREEDY)
    train["executor"]["class"] = "train"
    too_long = inference_job({**GREEDY, "max_new_tokens": 10**6})
    for job, reason in (
        (train, "runs inference jobs, not 'train'"),
        (too_long, "executor.config.task.generate.max_new_tokens"),
        (inference_job({"type": "classify"}), "a causal-lm model cannot classify"),
        (inference_job({"type": "translate"}), "executor.config.task"),
    ):
        with pytest.raises(JobConfigError, match=reason):
            parse_job(json.dumps(job))


def test_an_archive_with_an_unsafe_path_is_refused(tmp_path: Path) -> None:
    from worker_daemon.executors.exceptions import JobConfigError
    from worker_daemon.executors.inference_tasks import unpack_model

    archive = tmp_path / "upload"
    with zipfile.ZipFile(archive, "w") as bundle:
        bundle.writestr("../escape/config.json", "{}")

    with pytest.raises(JobConfigError, match="unsafe path"):
        unpack_model([archive], tmp_path)
    assert not (tmp_path.parent / "escape").exists()
