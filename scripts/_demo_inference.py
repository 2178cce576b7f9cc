"""The demo's batch inference job (``scripts/demo --inference``, docs/inference.md): the demo's model over the
demo's dataset, on the same daemons, its results downloaded as one zip.

The model is the training job's, as the user would pass it on: the model zip the demo downloaded, uploaded to
the control plane (``POST /api/uploads/``) and named by the job's ``upload`` source (the spec has no "model of
a finished job" source). With ``--inference-only`` there is no training job: the model is built from the
demo's config (the ``config`` source, untrained weights). The task is ``embed``: the demo's GPT-2 holds 128
positions and every row of its dataset has 128 bytes already, so ``generate`` has no room for new tokens.
"""

from __future__ import annotations

import io
import json
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.cluster import TINY_GPT2, Cluster


def model_source(cluster: Cluster, model_zip: Path | None) -> dict[str, Any]:
    """The inference job's model source: the uploaded model zip, or (no training job) the demo's config."""
    if model_zip is None:
        return {"type": "config", "config": dict(TINY_GPT2)}
    with cluster.api() as client:
        response = client.post(
            "/api/uploads/",
            params={"name": model_zip.name},
            content=model_zip.read_bytes(),
            headers={"Content-Type": "application/octet-stream"},
        )
    if response.status_code != 201:
        raise RuntimeError(f"uploading {model_zip} was refused ({response.status_code}): {response.text}")
    return {"type": "upload", "file": str(response.json()["id"])}


def inference_spec(*, source: dict[str, Any], dataset: str, workers: int) -> dict[str, Any]:
    return {
        "model": {"source": source, "input_names": ["input_ids"]},
        "dataset": {"name": dataset},
        "task": {"type": "embed"},
        "batch_size": 16,
        "workers": workers,
        "worker": {"resources": {"cpu": 1, "memory": 1, "storage": 0, "gpu": 0}},
    }


def submit(cluster: Cluster, spec: dict[str, Any], *, name: str) -> str:
    with cluster.api() as client:
        response = client.post("/api/jobs/inference/", json={"name": name, **spec})
    if response.status_code != 201:
        raise RuntimeError(f"inference submission refused ({response.status_code}): {response.text}")
    return response.json()["id"]


def follow(
    cluster: Cluster, job_id: str, *, log: Callable[[str], None], started: float, timeout: float
) -> dict[str, Any]:
    """Poll the job until it ends, logging ``slices k/N`` whenever more are done; the final job."""
    deadline = time.monotonic() + timeout
    shown: tuple[int, int] | None = None
    while True:
        job = cluster.job(job_id)
        progress = job.get("progress") or {}
        counts = (progress.get("slices_done"), progress.get("slices_total"))
        if counts != shown and None not in counts:
            shown = counts
            log(f"inference: slices {counts[0]}/{counts[1]} done ({time.monotonic() - started:.0f} s)")
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        if time.monotonic() >= deadline:
            raise TimeoutError(f"inference job {job_id} did not end within {timeout:g}s")
        time.sleep(0.5)


def download_results(cluster: Cluster, job_id: str, destination: Path) -> tuple[Path, dict[str, Any]]:
    """Save the job's results zip (``GET /api/jobs/{id}/results/``); its path and its ``manifest.json``."""
    with cluster.api() as client:
        response = client.get(f"/api/jobs/{job_id}/results/")
    response.raise_for_status()
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_bytes(response.content)
    with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
        manifest = json.loads(archive.read("manifest.json"))
    return destination, manifest


def embeddings_shape(archive: Path, manifest: dict[str, Any]) -> list[int] | None:
    """The shape of the first slice's embeddings (rows × hidden), to show what a result holds."""
    results = manifest.get("results") or []
    if not results:
        return None
    from safetensors.numpy import load

    with zipfile.ZipFile(archive) as bundle:
        tensors = load(bundle.read(results[0]["file"]))
    return list(tensors["embeddings"].shape) if "embeddings" in tensors else None


def run(
    cluster: Cluster,
    *,
    model_zip: Path | None,
    dataset: str,
    workers: int,
    output: Path,
    log: Callable[[str], None],
    timeout: float,
) -> dict[str, Any]:
    """Run the demo's inference job to its end; its summary (``status``, slices, where the results are)."""
    started = time.monotonic()
    source = model_source(cluster, model_zip)
    what = (
        f"the trained model (uploaded as {model_zip.name})" if model_zip else "the demo's config (untrained)"
    )
    job_id = submit(
        cluster, inference_spec(source=source, dataset=dataset, workers=workers), name="demo-embed"
    )
    log(f"submitted inference job {job_id}: embed every slice of '{dataset}' with {what}, {workers} workers")
    job = follow(cluster, job_id, log=log, started=started, timeout=timeout)
    progress = job.get("progress") or {}
    summary: dict[str, Any] = {
        "job": job_id,
        "status": job["status"],
        "slices": progress.get("slices_done"),
        "slices_total": progress.get("slices_total"),
        "seconds": round(time.monotonic() - started, 1),
        "results": None,
    }
    if job["status"] != "completed":
        summary["reason"] = job.get("status_reason")
        return summary
    archive, manifest = download_results(cluster, job_id, output / f"results-{job_id}.zip")
    shape = embeddings_shape(archive, manifest)
    summary["results"] = str(archive)
    summary["workers"] = len({entry.get("worker") for entry in manifest.get("results") or []})
    log(
        f"inference job completed in {summary['seconds']:.0f} s: {len(manifest.get('results') or [])} result "
        f"files (safetensors, embeddings {shape} each) from {summary['workers']} workers, saved to {archive} "
        f"(manifest.json lists them; or: hypha results {job_id})"
    )
    return summary
