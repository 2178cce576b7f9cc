"""The checkpoint copy against the real control plane (pytest-django's live server): a parameter server run
with ``rounds.checkpoint_every = 2`` uploads its weights only at base rounds, a server resumed from the copy
at a round between bases replays it to the lost one's weights bit for bit, and a copy that is corrupt or
replays to other weights is refused (docs/training.md, "A parameter server lost")."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import aiohttp
import pytest
import torch
from asgiref.sync import sync_to_async

from hypha_tensors import weights as weights_io
from hypha_tensors.encoding import encode
from hypha_tensors.formats import Encoding
from parameter_server.exceptions import CheckpointError, UploadError
from parameter_server.job import parse_job
from parameter_server.service import Settings, Stopped, run
from tests.apps.relay.world import make_world
from tests.parameter_server.conftest import aggregate_job
from tests.parameter_server.test_service import assert_bit_identical, delta_like, from_bytes, to_bytes

pytestmark = pytest.mark.timeout(300)

FLOAT32 = Encoding()


@pytest.fixture
def world(transactional_db, settings, tmp_path):
    settings.HYPHA_DATA_DIR = tmp_path / "control-plane"
    return make_world()


def job_json(world, *, checkpoint: dict | None = None, encoding: Encoding = FLOAT32) -> dict:
    document = aggregate_job(peers=[world.trainers[0].peer], update_rounds=10)
    document["job_id"] = str(world.job.pk)
    document["executor"]["config"]["rounds"]["checkpoint_every"] = 2
    if encoding.lossy:
        document["executor"]["config"]["rounds"]["encoding"] = encoding.name
        document["executor"]["config"]["rounds"]["encoding_block_size"] = encoding.block_size
    if checkpoint is not None:
        document["executor"]["config"]["checkpoint"] = checkpoint
    return document


def server_settings(world, work_dir: Path, bridge, url: str) -> Settings:
    from apps.jobs.training.tokens import transfer_key

    return Settings(
        work_dir=work_dir,
        socket_path=bridge.socket_path,
        host="127.0.0.1",
        port=0,
        public_url=None,
        transfer_key=transfer_key(world.job.pk),
        transfer_token=world.server.token,
        server_url=url,
        final_wait=5.0,
        upload_deadline=5.0,
        checkpoint_deadline=5.0,
    )


@sync_to_async
def saved_copy(world) -> tuple[dict, dict[int, list[str]]]:
    """The job's ``checkpoint`` and, per round directory the control plane keeps, the files in it."""
    from apps.jobs.training.checkpoints import checkpoint_directory

    world.job.refresh_from_db()
    directory = checkpoint_directory(world.job.pk)
    rounds = {
        int(path.name.removeprefix("round-")): sorted(
            file.name for file in path.iterdir() if file.name[0] != "."
        )
        for path in directory.iterdir()
        if path.name.startswith("round-")
    }
    return world.job.checkpoint, rounds


def resume_entry(world, checkpoint: dict) -> dict:
    """The job JSON's ``checkpoint`` as apps/jobs/training/dispatch.py writes it."""
    return {
        "round": checkpoint["round"],
        "uri": f"/api/jobs/{world.job.pk}/checkpoint/",
        "files": checkpoint["files"],
    }


class Trainer:
    def __init__(self, session: aiohttp.ClientSession, url: str, world, encoding: Encoding = FLOAT32) -> None:
        self.session, self.base, self.encoding = session, f"{url}/jobs/{world.job.pk}", encoding
        self.headers = {"Authorization": f"Bearer {world.trainers[0].token}"}

    async def get(self, path: str) -> bytes:
        async with self.session.get(f"{self.base}/{path}", headers=self.headers) as response:
            assert response.status == 200, await response.text()
            return await response.read()

    async def round(self, tmp_path: Path, number: int, theta: dict[str, torch.Tensor]) -> None:
        delta = delta_like(theta, number)
        if self.encoding.lossy:  # sent as a trainer of a lossy job sends it
            path = tmp_path / "update.safetensors"
            weights_io.save(path, encode(delta, self.encoding), metadata=self.encoding.metadata())
            body = path.read_bytes()
        else:
            body = to_bytes(tmp_path, delta)
        headers = {**self.headers, "X-Samples": "4"}
        async with self.session.put(f"{self.base}/rounds/{number}/update", data=body, headers=headers) as r:
            assert r.status == 200, await r.text()
        await self.get(f"rounds/{number}/result?wait=30")


async def run_rounds(
    world, tmp_path: Path, bridge, status_backend, live_server, rounds: int, encoding: Encoding = FLOAT32
):
    """A server on ``tmp_path / "lost"`` that closes rounds 1..``rounds``, then is stopped; per round, the
    files the control plane got for it (read before the next round prunes them)."""
    stop = asyncio.Event()
    settings = server_settings(world, tmp_path / "lost", bridge, live_server.url)
    service = asyncio.create_task(run(parse_job(job_json(world, encoding=encoding)), settings, stop))
    (ready,) = await status_backend.wait_for("ready", timeout=60)
    uploaded = {0: (await saved_copy(world))[1][0]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        trainer = Trainer(session, ready["url"], world, encoding)
        theta_0 = from_bytes(tmp_path, await trainer.get("model/model.safetensors"))
        for number in range(1, rounds + 1):
            await trainer.round(tmp_path, number, theta_0)
            uploaded[number] = (await saved_copy(world))[1][number]
    stop.set()
    with pytest.raises(Stopped):
        await asyncio.wait_for(service, 20)
    return uploaded


@pytest.mark.parametrize("encoding", [FLOAT32, Encoding("int8", 64)], ids=["float32", "int8"])
async def test_weights_go_up_at_base_rounds_only_and_a_resumed_server_replays_them_bit_for_bit(
    world, tmp_path, bridge, status_backend, live_server, encoding
):
    # given a server that closed rounds 1 to 3 with a base every 2 rounds, and is then lost
    uploaded = await run_rounds(world, tmp_path, bridge, status_backend, live_server, 3, encoding)

    # then the control plane got the weights at rounds 0 and 2 only; it keeps round 2's and round 3's result
    momentum_and_result = ["momentum.safetensors", "result.safetensors", "round.json"]
    assert uploaded == {
        0: ["round.json", "weights.safetensors"],
        1: momentum_and_result,
        2: [*momentum_and_result, "weights.safetensors"],
        3: momentum_and_result,
    }
    checkpoint, rounds = await saved_copy(world)
    assert (checkpoint["round"], checkpoint["base"]) == (3, 2)
    assert sorted(checkpoint["files"]) == [
        "momentum.safetensors",
        "result-3.safetensors",
        "round.json",
        "weights.safetensors",
    ]
    assert rounds == {2: ["result.safetensors", "weights.safetensors"], 3: momentum_and_result}

    # when a server on an empty work dir resumes from the copy, as a lost server's replacement is dispatched
    stop = asyncio.Event()
    settings = server_settings(world, tmp_path / "resumed", bridge, live_server.url)
    resumed_job = parse_job(job_json(world, checkpoint=resume_entry(world, checkpoint), encoding=encoding))
    service = asyncio.create_task(run(resumed_job, settings, stop))
    ready = (await status_backend.wait_for("ready", 2, timeout=60))[1]

    # then its round 3 is the lost server's: weights (replayed from round 2's) and momentum bit for bit
    assert ready["round"] == 3
    lost = tmp_path / "lost" / "checkpoints" / "round-000000003"
    restored = tmp_path / "resumed" / "checkpoints" / "round-000000003"
    for name in ("weights.safetensors", "momentum.safetensors", "result.safetensors"):
        assert_bit_identical(weights_io.load(restored / name), weights_io.load(lost / name))
    manifest = json.loads((lost / "round.json").read_text())
    assert weights_io.digest(weights_io.load(restored / "weights.safetensors")) == manifest["digest"]
    assert (restored / "round.json").read_bytes() == (lost / "round.json").read_bytes()

    # and its next round is a base again (4 = 2 + 2): the weights go up with it
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        trainer = Trainer(session, ready["url"], world, encoding)
        theta_3 = from_bytes(tmp_path, await trainer.get("model/model.safetensors"))
        await trainer.round(tmp_path, 4, theta_3)
    checkpoint, rounds = await saved_copy(world)
    assert (checkpoint["round"], checkpoint["base"]) == (4, 4)
    assert rounds == {4: [*momentum_and_result, "weights.safetensors"]}
    stop.set()
    with pytest.raises(Stopped):
        await asyncio.wait_for(service, 20)


async def test_a_corrupt_copy_or_one_that_replays_to_other_weights_is_refused(
    world, tmp_path, bridge, status_backend, live_server
):
    from apps.jobs.training.checkpoints import checkpoint_directory

    # given a copy of round 3 on round 2's weights
    await run_rounds(world, tmp_path, bridge, status_backend, live_server, rounds=3)
    checkpoint, _ = await saved_copy(world)
    chain_file = checkpoint_directory(world.job.pk) / "round-3" / "result.safetensors"
    good = chain_file.read_bytes()

    async def resume(work_dir: Path, entry: dict) -> None:
        settings = server_settings(world, work_dir, bridge, live_server.url)
        await asyncio.wait_for(
            run(parse_job(job_json(world, checkpoint=entry)), settings, asyncio.Event()), 60
        )

    # when round 3's result has other bytes than the job names: the download refuses it
    chain_file.write_bytes(good[:-4] + b"\0\0\0\0")
    with pytest.raises(
        UploadError,
        match=f"expected {len(good)} bytes with {checkpoint['files']['result-3.safetensors']['sha256']}",
    ):
        await resume(tmp_path / "corrupt", resume_entry(world, checkpoint))
    assert list((tmp_path / "corrupt" / "checkpoints").iterdir()) == []

    # when it is another round-3 result that the job names consistently (size and SHA-256): the replay gives
    # other weights than round 3's digest, and the server refuses to resume from them
    result = weights_io.load(tmp_path / "lost" / "checkpoints" / "round-000000003" / "result.safetensors")
    other = tmp_path / "other.safetensors"
    weights_io.save(
        other,
        {name: tensor * 2 for name, tensor in result.items()},
        round_number=3,
        weights_digest="sha256:" + "0" * 64,
    )
    chain_file.write_bytes(other.read_bytes())
    forged = resume_entry(world, checkpoint)
    forged["files"] = {
        **forged["files"],
        "result-3.safetensors": {
            "size": other.stat().st_size,
            "sha256": hashlib.sha256(other.read_bytes()).hexdigest(),
        },
    }
    said = json.loads((tmp_path / "lost" / "checkpoints" / "round-000000003" / "round.json").read_text())[
        "digest"
    ]
    with pytest.raises(CheckpointError) as refused:
        await resume(tmp_path / "forged", forged)
    assert str(refused.value).startswith(
        "round 3's weights replayed from round 2's weights and the results of rounds 3 to 3 have the digest sha256:"
    )
    assert str(refused.value).endswith(
        f"but its round.json says {said}: the control plane's copy is inconsistent; not resuming from it"
    )
    assert list((tmp_path / "forged" / "checkpoints").iterdir()) == []
