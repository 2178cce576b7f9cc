"""Batch inference jobs end to end (issue 19), with real processes on loopback: the control plane (embedded),
one data node and two worker daemons whose executors are ``worker_daemon/executors/inference.py``.

* A ``generate`` job (greedy) and then an ``embed`` job over the same dataset, on a tiny GPT-2 built from a
  ``config`` source: each completes with one result per slice, from both workers, and the results are what the
  same model computes here, in the test process. The model is rebuilt as the executor builds a ``config``
  artifact (``inference_tasks.load_model``: ``torch.manual_seed`` of the artifact's seed, then the task's Auto
  class ``from_config`` in float32), but the computations are our own: greedy decoding recomputes the whole
  sequence at each step (the executor reuses its KV cache), so a mistake in the executor's cache, position or
  mask handling shows as different tokens.
* ``kill -9`` of a worker's daemon (its executor dies with it) once it has stored a result and holds a slice it
  has not: its lease expires (TTL :data:`LEASE_TTL`), its held slices go back to AVAILABLE and the other worker
  computes them; the job completes and every slice has exactly one result, the killed worker's stored ones
  kept, none computed twice.

One cluster serves the module (starting one costs seconds); the kill test runs last since it leaves one worker.
The daemons' ``--slowdown`` knob does not reach the inference executor (only the trainers read
``HYPHA_SLOWDOWN``), so the kill test's job is made slow by its own size: a wider model, 64 new tokens and 2 rows a batch.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import TIMINGS, only_in_mode

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(240),
    only_in_mode(
        "embedded",
        "the subject is the workers and executors (slices, results, a lost lease's slices), the same over "
        "either transport",
    ),
]

#: Short, so that a killed worker's lease ends soon, yet long enough for renewals on a loaded 2-core machine.
LEASE_TTL = 5
DATASET = "stdlib"
SAMPLES_PER_SLICE = 16
#: 21 slices of 16 sequences of 128 bytes (the last one shorter).
DATASET_BYTES = 45_000
WORKERS = 2
#: Seconds a job may take from submission to its end.
JOB_DEADLINE = 120.0

#: The tiny GPT-2 of the generate and embed jobs; end-of-sequence 0, so a row may stop early.
SMALL_MODEL = {
    "model_type": "gpt2",
    "vocab_size": 256,
    "n_positions": 160,
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 2,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
GENERATE = {"type": "generate", "max_new_tokens": 8, "temperature": 0.0}
BATCH_SIZE = 4

#: The kill test's: about 0.3 s a slice on an idle core (16 rows, 64 new tokens, 2 rows a batch), so a worker is caught holding one.
SLOW_MODEL = {**SMALL_MODEL, "n_positions": 256, "n_embd": 64, "n_layer": 2}
SLOW_GENERATE = {"type": "generate", "max_new_tokens": 64, "temperature": 0.0}
SLOW_BATCH_SIZE = 2

#: The Auto class the executor loads each job's model with (apps/jobs/spec/inference.py MODEL_TASKS, then
#: worker_daemon/executors/inference_tasks.py INFERENCE_MODEL_CLASSES).
AUTO_CLASS = {"generate": "AutoModelForCausalLM", "embed": "AutoModel"}
EMBEDDING_TOLERANCE = 1e-4


def inference_spec(model: dict, task: dict, *, batch_size: int) -> dict:
    return {
        "model": {"source": {"type": "config", "config": dict(model)}, "input_names": ["input_ids"]},
        "dataset": {"name": DATASET},
        "task": task,
        "batch_size": batch_size,
        "workers": WORKERS,
        "worker": {"resources": {"cpu": 1, "memory": 1}, "price": {"bid": 100, "max": 100}},
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    """The control plane, a data node serving :data:`DATASET` and two daemons; and the dataset's directory."""
    from bench.cluster import prepare_stdlib_text, training_cluster

    root = tmp_path_factory.mktemp("inference")
    dataset = prepare_stdlib_text(
        root / DATASET, max_bytes=DATASET_BYTES, samples_per_slice=SAMPLES_PER_SLICE
    )
    with training_cluster(
        root=root / "cluster",
        dataset_dir=dataset,
        workers=WORKERS,
        benchmark=False,
        settings={**TIMINGS, "HYPHA_LEASE_TTL": str(LEASE_TTL)},
    ) as running:
        yield running, dataset


# --- helpers ---------------------------------------------------------------------------------------------------


def submit(cluster: Any, spec: dict, name: str) -> str:
    with cluster.api() as client:
        response = client.post("/api/jobs/inference/", json={"name": name, **spec})
    assert response.status_code == 201, response.text
    assert response.json()["kind"] == "inference"
    return response.json()["id"]


def follow(cluster: Any, job_id: str) -> dict:
    deadline = time.monotonic() + JOB_DEADLINE
    while True:
        job = cluster.job(job_id)
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job['status']}\n{cluster.logs()}"
        time.sleep(0.3)


def download_results(cluster: Any, job_id: str) -> tuple[dict, dict[str, bytes]]:
    """The job's results archive: its manifest and every other file by name (each name once)."""
    with cluster.api() as client:
        response = client.get(f"/api/jobs/{job_id}/results/")
    assert response.status_code == 200, response.text
    with zipfile.ZipFile(io.BytesIO(response.content)) as bundle:
        names = bundle.namelist()
        assert len(names) == len(set(names)), names
        files = {name: bundle.read(name) for name in names}
    return json.loads(files.pop("manifest.json")), files


def dataset_slices(dataset: Path) -> dict[int, Any]:
    """Every slice's ``input_ids`` by index, read from the dataset directory the data node serves."""
    from safetensors.torch import load_file

    from data_node.slices import SLICE_NAME

    slices = {}
    for path in dataset.iterdir():
        match = SLICE_NAME.match(path.name)
        if match:
            slices[int(match.group(1))] = load_file(str(path))["input_ids"]
    assert sorted(slices) == list(range(len(slices))) and len(slices) >= 8, sorted(slices)
    return slices


def worker_ids(job: dict) -> dict[str, str]:
    """Worker name → id, of the job's inference tasks."""
    return {task["worker"]: str(task["worker_id"]) for task in job["tasks"] if task["role"] == "inference"}


def assert_one_result_per_slice(
    manifest: dict, files: dict[str, bytes], job: dict, count: int, ext: str
) -> None:
    import hashlib

    indices = [entry["index"] for entry in manifest["results"]]
    assert sorted(indices) == list(range(count)), indices  # each slice once, none twice
    assert set(files) == {f"{index}.{ext}" for index in range(count)}, sorted(files)
    for entry in manifest["results"]:
        assert entry["file"] == f"{entry['index']}.{ext}", entry
        assert hashlib.sha256(files[entry["file"]]).hexdigest() == entry["sha256"], entry
    assert (manifest["slices_done"], manifest["slices_total"]) == (count, count), manifest
    progress = job["progress"]
    assert (progress["slices_done"], progress["slices_total"]) == (count, count), progress
    assert (job["data"]["used"], job["data"]["total"]) == (count, count), job["data"]


def reference_model(config: dict, task: str) -> Any:
    """The model as the executor builds a ``config`` artifact without a seed (``inference_tasks.CONFIG_SEED``)."""
    import torch
    import transformers

    settings = dict(config)
    model_type = settings.pop("model_type")
    torch.manual_seed(0)
    auto_class = getattr(transformers, AUTO_CLASS[task])
    model = auto_class.from_config(
        transformers.AutoConfig.for_model(model_type, **settings), dtype=torch.float32
    )
    return model.eval()


def greedy(model: Any, input_ids: Any, max_new_tokens: int, batch_size: int) -> list[list[int]]:
    """Greedy new tokens of every row, recomputing the whole sequence at each step (no cache); a row ends at
    (and keeps) the end-of-sequence token."""
    import torch

    eos = model.config.eos_token_id
    rows: list[list[int]] = []
    for start in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[start : start + batch_size].long()
        new = []
        for _ in range(max_new_tokens):
            token = model(input_ids=ids).logits[:, -1, :].float().argmax(dim=-1)
            new.append(token)
            ids = torch.cat([ids, token.unsqueeze(-1)], dim=-1)
        for row in torch.stack(new, dim=1).tolist():
            cut = next((at + 1 for at, token in enumerate(row) if token == eos), len(row))
            rows.append(row[:cut])
    return rows


def mean_embeddings(model: Any, input_ids: Any, batch_size: int) -> Any:
    """The last hidden state's mean over every position (the slices have no attention mask)."""
    import torch

    return torch.cat(
        [
            model(input_ids=input_ids[start : start + batch_size].long())
            .last_hidden_state.float()
            .mean(dim=1)
            for start in range(0, input_ids.shape[0], batch_size)
        ]
    )


# --- the tests ---------------------------------------------------------------------------------------------------


def test_generate_then_embed_jobs_complete_with_every_slice_computed_right(cluster: tuple[Any, Path]) -> None:
    import torch
    from safetensors.torch import load as load_safetensors

    running, dataset = cluster
    slices = dataset_slices(dataset)
    count = len(slices)

    # given: two daemons; when: a greedy generate job, then an embed job, over the same dataset
    generate_job = follow(
        running, submit(running, inference_spec(SMALL_MODEL, GENERATE, batch_size=BATCH_SIZE), "e2e-generate")
    )
    assert generate_job["status"] == "completed", f"{generate_job['status_reason']}\n{running.logs()}"
    embed_job = follow(
        running,
        submit(running, inference_spec(SMALL_MODEL, {"type": "embed"}, batch_size=BATCH_SIZE), "e2e-embed"),
    )
    assert embed_job["status"] == "completed", f"{embed_job['status_reason']}\n{running.logs()}"

    # then: each has one result per slice, from both workers
    generated_manifest, generated = download_results(running, generate_job["id"])
    assert_one_result_per_slice(generated_manifest, generated, generate_job, count, "jsonl")
    embedded_manifest, embedded = download_results(running, embed_job["id"])
    assert_one_result_per_slice(embedded_manifest, embedded, embed_job, count, "safetensors")
    for job, manifest in ((generate_job, generated_manifest), (embed_job, embedded_manifest)):
        workers = set(worker_ids(job).values())
        assert len(workers) == WORKERS, job["tasks"]
        assert {entry["worker"] for entry in manifest["results"]} == workers, manifest["results"]

    # one slice's result on its own is the archive's
    with running.api() as client:
        single = client.get(f"/api/jobs/{generate_job['id']}/results/1/")
    assert single.status_code == 200 and single.content == generated["1.jsonl"], single.status_code

    # and the results are what the same model computes here (one thread, as the executors run)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            causal_lm = reference_model(SMALL_MODEL, "generate")
            bare = reference_model(SMALL_MODEL, "embed")
            for index, input_ids in slices.items():
                lines = [json.loads(line) for line in generated[f"{index}.jsonl"].decode().splitlines()]
                assert [line["row"] for line in lines] == list(range(input_ids.shape[0])), (index, lines)
                expected = greedy(causal_lm, input_ids, GENERATE["max_new_tokens"], BATCH_SIZE)
                assert [line["tokens"] for line in lines] == expected, index

                embeddings = load_safetensors(embedded[f"{index}.safetensors"])["embeddings"]
                assert embeddings.dtype == torch.float32
                assert tuple(embeddings.shape) == (input_ids.shape[0], SMALL_MODEL["n_embd"]), (
                    embeddings.shape
                )
                ours = mean_embeddings(bare, input_ids, BATCH_SIZE)
                difference = (embeddings - ours).abs().max().item()
                assert difference <= EMBEDDING_TOLERANCE, (index, difference)
    finally:
        torch.set_num_threads(threads)


def slice_log(daemon: Any, task_id: str) -> tuple[list[int], set[int]]:
    """The slices daemon's task ``task_id`` was handed (in order) and those whose results were stored, from its
    log (``worker_daemon/bridge/remote/results.py``)."""
    handed: list[int] = []
    stored: set[int] = set()
    prefix = f"task {task_id}: "
    for line in daemon.log.read_text(errors="replace").splitlines():
        _, found, rest = line.partition(prefix)
        if not found:
            continue
        words = rest.split()
        if rest.startswith("slice ") and " handed out " in rest:
            handed.append(int(words[1]))
        elif rest.startswith("result of slice ") and " stored " in rest:
            stored.add(int(words[3]))
    return handed, stored


def test_a_worker_killed_mid_job_has_its_slices_redone_and_none_counted_twice(
    cluster: tuple[Any, Path],
) -> None:
    running, dataset = cluster
    count = len(dataset_slices(dataset))
    job_id = submit(
        running, inference_spec(SLOW_MODEL, SLOW_GENERATE, batch_size=SLOW_BATCH_SIZE), "e2e-kill"
    )

    # when: a worker has stored at least one result and holds a slice whose result it has not, its daemon is
    # killed (kill -9 of its process group: the executor goes with it)
    deadline = time.monotonic() + JOB_DEADLINE
    tasks: dict[str, str] = {}
    while len(tasks) < WORKERS:
        job = running.job(job_id)
        tasks = {task["worker"]: task["id"] for task in job["tasks"] if task["role"] == "inference"}
        assert time.monotonic() < deadline and job["status"] in (
            "pending",
            "allocating",
            "allocated",
            "running",
        ), job
        time.sleep(0.1)
    victim = None
    while victim is None:
        for name, task_id in tasks.items():
            handed, stored = slice_log(running.daemons[name], task_id)
            if stored and handed and handed[-1] not in stored:
                victim = name
                os.killpg(running.daemons[name].popen.pid, signal.SIGKILL)
                break
        else:
            job = running.job(job_id)
            assert job["status"] == "running", f"{job['status']}: {job['status_reason']}\n{running.logs()}"
            assert time.monotonic() < deadline, f"no worker was caught holding a slice\n{running.logs()}"
            time.sleep(0.02)
    killed_at = time.monotonic()
    running.daemons[victim].popen.wait(10)
    at_kill = running.job(job_id)
    assert at_kill["status"] == "running" and at_kill["progress"]["slices_done"] < count, at_kill["progress"]

    # then: the job completes, the victim's unfinished slices computed by the other worker
    job = follow(running, job_id)
    assert job["status"] == "completed", f"{job['status_reason']}\n{running.logs()}"
    took = time.monotonic() - killed_at
    manifest, files = download_results(running, job_id)
    assert_one_result_per_slice(manifest, files, job, count, "jsonl")

    ids = worker_ids(job)
    survivor = next(name for name in ids if name != victim)
    by_index = {entry["index"]: entry["worker"] for entry in manifest["results"]}
    handed, stored = slice_log(running.daemons[victim], tasks[victim])  # its whole log: the daemon is dead
    assert stored and all(by_index[index] == ids[victim] for index in stored), (stored, by_index)
    redone = [index for index in handed if by_index[index] != ids[victim]]
    assert redone, (handed, stored, by_index)
    assert all(by_index[index] == ids[survivor] for index in redone), (redone, by_index)
    assert set(by_index.values()) == {ids[victim], ids[survivor]}
    survivor_handed, _ = slice_log(running.daemons[survivor], tasks[survivor])
    assert set(redone) <= set(survivor_handed), (redone, survivor_handed)

    lost = next(task for task in job["tasks"] if task["worker"] == victim)
    assert lost["status"] in ("cancelled", "failed") and lost["exit_code"] is None, lost
    assert took < 60, took
