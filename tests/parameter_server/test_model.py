"""The initial model (parameter_server/model.py): built from a config, fetched from Hugging Face or a URL."""

from __future__ import annotations

import asyncio
import io
import json
import zipfile
from pathlib import Path

import pytest
import torch
from aiohttp import web

from hypha_tensors import weights as weights_io
from parameter_server.exceptions import JobConfigError, ModelSourceError
from parameter_server.job import parse_job
from parameter_server.model import prepare_model
from tests.parameter_server.conftest import ALICE, BOB, aggregate_job


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """The tiny GPT-2 of the job, prepared once for the module, and in ``served/`` the global model as
    trainers get it (config.json + our model.safetensors)."""
    work_dir = tmp_path_factory.mktemp("gpt2")
    initial = prepare_model(parse_job(aggregate_job(peers=[ALICE, BOB])), work_dir)
    served = work_dir / "served"
    served.mkdir()
    (served / "config.json").write_bytes((initial.files_dir / "config.json").read_bytes())
    weights_io.save(served / "model.safetensors", initial.weights, metadata={"format": "pt"})
    return initial, work_dir


def test_a_tied_gpt2_is_saved_once_and_reloads_tied(gpt2):
    from transformers import AutoModelForCausalLM

    initial, work_dir = gpt2
    # then: the files trainers fetch
    assert sorted(path.name for path in initial.files_dir.iterdir()) == [
        "config.json",
        "generation_config.json",
    ]
    assert "lm_head.weight" not in initial.weights
    assert initial.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert len(initial.weights) == 28
    # then: the global weights as served (config.json + our model.safetensors) load back, still tied
    served = work_dir / "served"
    reloaded = AutoModelForCausalLM.from_pretrained(served)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()
    for name, tensor in initial.weights.items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_the_same_seed_builds_the_same_weights(gpt2, tmp_path):
    initial, _ = gpt2

    again = prepare_model(parse_job(aggregate_job(peers=[ALICE, BOB])), tmp_path)

    assert all(torch.equal(again.weights[name], tensor) for name, tensor in initial.weights.items())


def test_canonicalize_renames_or_drops_tied_aliases(gpt2):
    initial, _ = gpt2
    wte = torch.ones(256, 32)

    assert list(initial.canonicalize({"lm_head.weight": wte})) == ["transformer.wte.weight"]
    both = initial.canonicalize({"lm_head.weight": torch.zeros(256, 32), "transformer.wte.weight": wte})
    assert list(both) == ["transformer.wte.weight"] and both["transformer.wte.weight"] is wte


def test_an_unknown_task_or_config_is_a_job_error(tmp_path):
    job = aggregate_job(peers=[ALICE])
    job["executor"]["config"]["model"]["task"] = "telepathy"
    with pytest.raises(JobConfigError, match="AutoModelForTelepathy"):
        prepare_model(parse_job(job), tmp_path)
    job = aggregate_job(peers=[ALICE], source={"type": "config", "config": {"n_layer": 2}})
    with pytest.raises(JobConfigError, match="model_type"):
        prepare_model(parse_job(job), tmp_path)


def test_a_huggingface_source_downloads_each_file(gpt2, tmp_path, monkeypatch):
    import huggingface_hub

    _, gpt2_dir = gpt2
    original = gpt2_dir / "original"
    original.mkdir(exist_ok=True)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(gpt2_dir / "served").save_pretrained(original)
    calls = []

    def fake_download(*, repo_id, filename, revision, token, local_dir):
        calls.append((repo_id, filename, revision, token))
        target = Path(local_dir) / filename
        target.write_bytes((original / filename).read_bytes())
        return str(target)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    source = {
        "type": "huggingface",
        "repository": "hypha-space/tiny",
        "revision": None,
        "filenames": ["config.json", "model.safetensors"],
        "token": "hf_secret",
    }

    initial = prepare_model(parse_job(aggregate_job(peers=[ALICE], source=source)), tmp_path)

    assert calls == [
        ("hypha-space/tiny", "config.json", "main", "hf_secret"),
        ("hypha-space/tiny", "model.safetensors", "main", "hf_secret"),
    ]
    expected = weights_io.load(original / "model.safetensors")
    assert sorted(initial.weights) == sorted(expected)
    assert all(torch.equal(initial.weights[name], expected[name]) for name in expected)


async def test_a_uri_source_may_be_a_zip_of_the_model_directory(gpt2, tmp_path, monkeypatch):
    # the server is on loopback: the operator's allowance of private addresses lets the download through
    monkeypatch.setenv("HYPHA_ALLOW_PRIVATE_URLS", "1")
    _, gpt2_dir = gpt2
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zipped:
        for name in ("config.json", "model.safetensors"):
            zipped.write(gpt2_dir / "served" / name, f"model/{name}")

    async def serve_zip(request: web.Request) -> web.Response:
        return web.Response(body=archive.getvalue())

    app = web.Application()
    app.router.add_get("/models/final.zip", serve_zip)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        source = {"type": "uri", "value": f"http://127.0.0.1:{port}/models/final.zip"}
        job = parse_job(aggregate_job(peers=[ALICE], source=source))
        initial = await asyncio.to_thread(prepare_model, job, tmp_path)
    finally:
        await runner.cleanup()

    expected = weights_io.load(gpt2_dir / "served" / "model.safetensors")
    assert all(torch.equal(initial.weights[name], expected[name]) for name in expected)
    assert (initial.files_dir / "config.json").is_file()


async def test_an_upload_is_fetched_from_the_control_plane_with_the_transfer_token(gpt2, tmp_path):
    # given: a control plane serving an uploaded zip only to the bearer of the parameter server's token
    from parameter_server.model import ControlPlaneAccess

    _, gpt2_dir = gpt2
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zipped:
        for name in ("config.json", "model.safetensors"):
            zipped.write(gpt2_dir / "served" / name, name)
    seen: list[str | None] = []

    async def content(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer ps-token":
            return web.Response(status=401)
        return web.Response(body=archive.getvalue())

    app = web.Application()
    app.router.add_get("/api/uploads/{id}/content/", content)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    source = {"type": "uri", "value": "/api/uploads/4f1c/content/"}
    job = parse_job(aggregate_job(peers=[ALICE], source=source))
    try:
        # when
        initial = await asyncio.to_thread(
            prepare_model,
            job,
            tmp_path,
            control_plane=ControlPlaneAccess(server_url=server_url, token="ps-token"),
        )
        # then: without the control plane's address it cannot be fetched at all
        with pytest.raises(ModelSourceError, match="on the control plane"):
            await asyncio.to_thread(prepare_model, job, tmp_path / "other")
    finally:
        await runner.cleanup()

    assert seen == ["Bearer ps-token"]
    expected = weights_io.load(gpt2_dir / "served" / "model.safetensors")
    assert all(torch.equal(initial.weights[name], expected[name]) for name in expected)


async def test_the_final_model_carries_the_uploads_data_files_but_no_code(gpt2, tmp_path):
    # given: an uploaded model directory with its tokenizer, a generation config and custom code
    from parameter_server.model import ControlPlaneAccess, final_model_files

    _, gpt2_dir = gpt2
    archive = io.BytesIO()
    extras = {
        "tokenizer.json": b'{"version": "1.0"}',
        "tokenizer_config.json": b'{"model_max_length": 128}',
        "generation_config.json": b'{"max_new_tokens": 7}',
        "modeling_evil.py": b"import os",
        "notes/readme.txt": b"hello",
    }
    with zipfile.ZipFile(archive, "w") as zipped:
        for name in ("config.json", "model.safetensors"):
            zipped.write(gpt2_dir / "served" / name, name)
        for name, data in extras.items():
            zipped.writestr(name, data)

    async def content(request: web.Request) -> web.Response:
        return web.Response(body=archive.getvalue())

    app = web.Application()
    app.router.add_get("/api/uploads/{id}/content/", content)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    access = ControlPlaneAccess(server_url=f"http://127.0.0.1:{runner.addresses[0][1]}", token="ps-token")
    job = parse_job(
        aggregate_job(peers=[ALICE], source={"type": "uri", "value": "/api/uploads/4f1c/content/"})
    )
    try:
        # when
        initial = await asyncio.to_thread(prepare_model, job, tmp_path, control_plane=access)
    finally:
        await runner.cleanup()
    files = final_model_files(initial.files_dir, tmp_path / "global.safetensors")

    # then: the data files first (the upload's tokenizer, save_pretrained's generation config), the weights
    # last; not the code, not a nested file
    assert list(files) == [
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
        "model.safetensors",
    ]
    assert files["model.safetensors"] == tmp_path / "global.safetensors"
    assert files["tokenizer.json"].read_bytes() == extras["tokenizer.json"]
    assert json.loads(files["generation_config.json"].read_text())["max_new_tokens"] == 7


# --- SSRF: a model URL may not reach the worker's own network (issue 12, finding 7) ----------------------


async def _recording_server(host: str) -> tuple[web.AppRunner, str, list[str]]:
    """An HTTP server on ``host`` that records every path asked and redirects ``/hop`` to ``?to=``."""
    seen: list[str] = []

    async def anything(request: web.Request) -> web.StreamResponse:
        seen.append(request.path_qs)
        if request.path == "/hop":
            raise web.HTTPFound(request.query["to"])
        return web.Response(body=b"not a model")

    app = web.Application()
    app.router.add_get("/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, 0).start()
    return runner, f"http://{host}:{runner.addresses[0][1]}", seen


@pytest.mark.parametrize("host_of", [lambda port: f"127.0.0.1:{port}", lambda port: f"localhost:{port}"])
async def test_a_uri_source_on_a_private_address_is_refused_unfetched(tmp_path, monkeypatch, host_of):
    # given: no allowance, and a server on loopback (by address, and by a name that resolves to it)
    monkeypatch.delenv("HYPHA_ALLOW_PRIVATE_URLS", raising=False)
    runner, base, seen = await _recording_server("127.0.0.1")
    port = base.rsplit(":", 1)[1]
    source = {"type": "uri", "value": f"http://{host_of(port)}/internal/model.zip"}
    try:
        # when / then
        with pytest.raises(ModelSourceError, match=r"(127\.0\.0\.1|::1) is not a public address"):
            await asyncio.to_thread(
                prepare_model, parse_job(aggregate_job(peers=[ALICE], source=source)), tmp_path
            )
    finally:
        await runner.cleanup()
    assert seen == []


async def test_a_redirect_to_a_private_address_is_refused_unfollowed(tmp_path, monkeypatch):
    # given: 127.0.0.1 allowed (the operator's model host), and a second loopback address that is not
    monkeypatch.setenv("HYPHA_ALLOW_PRIVATE_URLS", "127.0.0.1/32")
    first, first_base, first_seen = await _recording_server("127.0.0.1")
    internal, internal_base, internal_seen = await _recording_server("127.0.0.2")
    target = f"{internal_base}/internal/secret.zip"
    source = {"type": "uri", "value": f"{first_base}/hop?to={target}"}
    try:
        # when / then
        with pytest.raises(ModelSourceError, match=r"redirect.*127\.0\.0\.2 is not a public address"):
            await asyncio.to_thread(
                prepare_model, parse_job(aggregate_job(peers=[ALICE], source=source)), tmp_path
            )
    finally:
        await first.cleanup()
        await internal.cleanup()
    assert first_seen == [f"/hop?to={target}"]
    assert internal_seen == []


def test_a_malformed_allowance_is_a_clear_error(monkeypatch):
    from parameter_server.safe_fetch import allowed_private_networks

    monkeypatch.setenv("HYPHA_ALLOW_PRIVATE_URLS", "127.0.0.1/40")
    with pytest.raises(JobConfigError, match="HYPHA_ALLOW_PRIVATE_URLS"):
        allowed_private_networks()


def test_the_model_the_parameter_server_evaluates_gives_its_loss_without_a_loss_type_warning(gpt2):
    """The eval model is the one prepare_model builds: unnamed, GPT-2's loss warns "`loss_type=None` was set in
    the config but it is unrecognized" at every eval into the parameter server's log (issue 16, item 8)."""
    import logging

    import torch

    initial, _ = gpt2
    batch = torch.randint(0, 16, (2, 8))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    try:
        initial.model(input_ids=batch, labels=batch)
    finally:
        library.removeHandler(handler)
    assert initial.model.loss_type == "ForCausalLM"
    assert not [message for message in records if "loss_type" in message]
