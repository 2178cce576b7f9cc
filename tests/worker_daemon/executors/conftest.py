"""Fixtures for the executors' tests: a tiny GPT-2, a scripted bridge backend, and a runner for the trainer.

``ScriptedTrainerBackend`` implements the bridge's ``BridgeBackend`` protocol the way the daemon, the control
plane and the parameter server together would for one trainer: the model reference yields the tiny GPT-2's
``config.json`` + ``model.safetensors``; every ``scheduler`` fetch yields the next data slice; every sent
update is recorded and answered on the receive stream by a known update ``u``; statuses follow a fixed
script (below).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hypha_tensors import weights
from worker_daemon.bridge import BridgeServer, serve_bridge
from worker_daemon.config import ACCELERATE_LAUNCH_OPTIONS

REPOSITORY = Path(__file__).resolve().parents[3]
JOB_ID = "0b6c3c0e-1f5e-4c1d-8a57-1d7f0a9e2b11"
PS_PEER = "0a4f7e4e-3a8f-4d55-9d0c-6a3d0c1b7e22"
SLICE_SAMPLES = 5
"""Samples per slice; with a batch size of 4, batches span slices."""
SEQUENCE_LENGTH = 32
BATCH_SIZE = 4
LEARNING_RATE = 1e-3
EXECUTOR_TIMEOUT = 60.0


def make_tiny_gpt2() -> torch.nn.Module:
    """GPT-2 with 2 layers of width 32 over 256 tokens; dropout 0 so a run can be replayed exactly."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=256,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(1234)
    return GPT2LMHeadModel(config)


def make_slice(index: int) -> dict[str, torch.Tensor]:
    """Data slice ``index``: ``input_ids`` = ``labels``, int64 ``[SLICE_SAMPLES, SEQUENCE_LENGTH]``."""
    generator = torch.Generator().manual_seed(index)
    tokens = torch.randint(0, 256, (SLICE_SAMPLES, SEQUENCE_LENGTH), generator=generator, dtype=torch.int64)
    return {"input_ids": tokens, "labels": tokens.clone()}


def make_update(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A known update ``u`` over the floating-point entries of ``state``; tied names share one tensor."""
    from worker_daemon.executors.pseudo_gradient import tied_groups

    generator = torch.Generator().manual_seed(seed)
    floats = {name: tensor for name, tensor in state.items() if tensor.dtype.is_floating_point}
    update: dict[str, torch.Tensor] = {}
    for group in tied_groups(floats):
        reference = floats[group[0]]
        value = torch.randn(reference.shape, generator=generator, dtype=reference.dtype) * 0.05
        for name in group:
            update[name] = value
    return update


@dataclass
class SentUpdate:
    """One pseudo-gradient file as the backend saw it when the bridge handed it over."""

    path: Path
    stored_names: list[str]
    metadata: dict[str, str]
    tensors: dict[str, torch.Tensor]


class ScriptedTrainerBackend:
    """A ``BridgeBackend`` for one trainer of a two-round job.

    Status script, per round: round 1 answers ``ScheduleUpdate{2}`` at step 1 and ``Continue`` after (the
    counter runs 2 → 1 → 0: three steps); round 2 answers ``Continue``, ``Error``, then ``ScheduleUpdate{0}``
    at step 3 (counter -1 → -2 → -3 → 0: three steps). ``"update"`` and metrics get ``Ok``;
    ``"update-received"`` gets ``Continue`` after round 1 and ``Done`` after round ``rounds``.
    """

    def __init__(self, *, model_dir: Path, updates: list[bytes], rounds: int = 2) -> None:
        self.model_dir = model_dir
        self.updates = list(updates)
        self.rounds = rounds
        self.round = 1
        self.step_in_round = 0
        self.progress: list[Any] = []
        self.fetches: list[dict[str, Any]] = []
        self.slices_served: list[int] = []
        self.sent: list[SentUpdate] = []
        self.receive_calls = 0
        self._incoming: asyncio.Queue[bytes] = asyncio.Queue()

    async def fetch(self, *, reference: Any, artifacts_dir: Path) -> list[tuple[str, int]]:
        self.fetches.append(reference.model_dump(mode="json"))
        if reference.type == "scheduler":
            index = len(self.slices_served)
            self.slices_served.append(index)
            path = artifacts_dir / str(index)
            save_file(make_slice(index), str(path))
            return [(str(index), path.stat().st_size)]
        written = []
        for name in reference.filenames:
            shutil.copyfile(self.model_dir / name, artifacts_dir / name)
            written.append((name, (artifacts_dir / name).stat().st_size))
        return written

    async def send(self, *, reference: Any, path: Path) -> None:
        with safe_open(str(path), framework="pt") as file:
            stored_names = sorted(file.keys())
            metadata = dict(file.metadata() or {})
        self.sent.append(
            SentUpdate(path=path, stored_names=stored_names, metadata=metadata, tensors=weights.load(path))
        )
        # The parameter server's answer to this round: the next known update (or the last one, repeated).
        await self._incoming.put(self.updates[min(len(self.sent), len(self.updates)) - 1])

    async def receive(self, *, reference: Any, directory: Path) -> AsyncIterator[tuple[str, int, str]]:
        self.receive_calls += 1
        while True:
            data = await self._incoming.get()
            (directory / PS_PEER).write_bytes(data)
            yield PS_PEER, len(data), PS_PEER

    async def status(self, *, job_id: str | None, progress: Any) -> dict[str, Any]:
        self.progress.append(progress)
        if isinstance(progress, dict) and "status" in progress:
            self.step_in_round += 1
            return self._step_reply()
        if progress == "update-received":
            finished = self.round >= self.rounds
            self.round += 1
            self.step_in_round = 0
            return {"type": "Done" if finished else "Continue"}
        return {"type": "Ok"}

    def _step_reply(self) -> dict[str, Any]:
        if self.round == 1:
            return (
                {"type": "ScheduleUpdate", "counter": 2} if self.step_in_round == 1 else {"type": "Continue"}
            )
        script = {1: {"type": "Continue"}, 2: {"type": "Error"}, 3: {"type": "ScheduleUpdate", "counter": 0}}
        return script.get(self.step_in_round, {"type": "Continue"})


def peers_reference() -> dict[str, Any]:
    return {"type": "peers", "peers": [PS_PEER], "strategy": {"type": "All"}, "resource": None}


MODEL_FILES = ["config.json", "model.safetensors"]


def parameter_server_model() -> dict[str, Any]:
    """The model reference the control plane dispatches (our extension of Hypha's reference types)."""
    return {"type": "parameter-server", "peer": PS_PEER, "filenames": MODEL_FILES}


def huggingface_model() -> dict[str, Any]:
    """A Hypha-style model reference: the executor passes any reference type through verbatim."""
    return {
        "type": "huggingface",
        "repository": "test/tiny-gpt2",
        "revision": None,
        "filenames": MODEL_FILES,
        "token": None,
    }


def train_job(
    *, learning_rate: float = LEARNING_RATE, model_reference: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The train envelope the control plane would dispatch (docs/training.md, step 4)."""
    return {
        "job_id": JOB_ID,
        "executor": {
            "class": "train",
            "descriptor": {"name": "diloco-transformer"},
            "config": {
                "model": {
                    "task": "causal-lm",
                    "artifact": model_reference or parameter_server_model(),
                    "input-names": ["input_ids", "labels"],
                },
                "data": {"type": "scheduler", "peer": "control-plane", "dataset": "tiny"},
                "updates": peers_reference(),
                "results": peers_reference(),
                "optimizer": {"learning-rate": learning_rate, "betas": None, "epsilon": None},
                "batch_size": BATCH_SIZE,
            },
        },
    }


@dataclass
class TinyModel:
    """The tiny GPT-2 saved with ``save_pretrained`` (tied ``lm_head`` dropped from the file)."""

    directory: Path
    state: dict[str, torch.Tensor]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    directory = tmp_path_factory.mktemp("tiny-gpt2")
    model = make_tiny_gpt2()
    model.save_pretrained(directory)
    # The live state dict, not clones: cloning would untie lm_head.weight from transformer.wte.weight.
    return TinyModel(directory=directory, state=model.state_dict())


def update_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """``tensors`` as a file written by ``weights.save`` (tied names stored once, with the alias table)."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "u.safetensors"
        weights.save(path, tensors)
        return path.read_bytes()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A work dir with a short path: AF_UNIX socket paths are limited to ~108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="hx-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def running_bridge(work_dir: Path, backend: ScriptedTrainerBackend) -> AsyncIterator[BridgeServer]:
    server = await serve_bridge(
        socket_path=work_dir / "bridge.sock", work_dir=work_dir, backend=backend, job_id=JOB_ID
    )
    try:
        yield server
    finally:
        await server.close()


@dataclass
class ExecutorRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def executor_environment() -> dict[str, str]:
    environment = dict(os.environ)
    environment.update(
        {
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), environment.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return environment


async def run_executor(
    *, work_dir: Path, job: dict[str, Any], launcher: str = "python", extra: list[str] | None = None
) -> ExecutorRun:
    """Run the trainer as a real subprocess against the bridge on ``work_dir/bridge.sock``; always reaped."""
    arguments = [
        "-m",
        "worker_daemon.executors.training",
        "--socket",
        str(work_dir / "bridge.sock"),
        "--work-dir",
        str(work_dir),
        "--job",
        json.dumps(job, separators=(",", ":")),
        *(extra or []),
    ]
    if launcher == "accelerate":
        accelerate = Path(sys.executable).parent / "accelerate"
        command = [
            str(accelerate),
            "launch",
            *ACCELERATE_LAUNCH_OPTIONS,
            "--cpu",
            *arguments,
        ]
    else:
        command = [sys.executable, *arguments]
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=executor_environment(),
        cwd=str(REPOSITORY),
        start_new_session=True,  # its own process group: accelerate's child goes down with it
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), EXECUTOR_TIMEOUT)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
    return ExecutorRun(
        returncode=process.returncode,
        stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace"),
        seconds=time.perf_counter() - started,
    )
