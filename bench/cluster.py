"""A whole training cluster on loopback, as real processes: used by ``scripts/demo`` and the training benchmarks.

:func:`training_cluster` starts the control plane (``bench/harness.py``: embedded, or PostgreSQL + Redis in
services mode), one data node serving a dataset directory, and worker daemons (each offers both the trainer
and the parameter server; the market decides who is which), and stops all of it on exit. :class:`Cluster`
submits DiLoCo specs and follows jobs through the REST API, exactly as a user's script would.

:func:`prepare_stdlib_text` makes a real, offline dataset: the Python standard library's own source files,
byte-level (``hypha-data prepare-text``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sysconfig
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from bench.harness import BIN_DIR, Child, ControlPlane, control_plane, free_port

if TYPE_CHECKING:
    from tests.e2e.wan import Wan

#: A tiny GPT-2 trained from scratch on bytes: 2 layers × 128 wide (0.45 M parameters), about 0.08 s per step
#: of 16 × 128 tokens on one of these CPU cores (docs/benchmarks.md, stack notes).
TINY_GPT2 = {
    "model_type": "gpt2",
    "vocab_size": 256,
    "n_positions": 128,
    "n_embd": 128,
    "n_layer": 2,
    "n_head": 4,
    "bos_token_id": 0,
    "eos_token_id": 0,
}

#: Half as wide (64): a round of a few steps takes about a second on a shared CPU (the end-to-end tests' model).
SMALL_GPT2 = {**TINY_GPT2, "n_embd": 64, "n_head": 2}

WORKER_TOML = """\
work_dir = "{work_dir}"

[resources]
cpu = 2
memory = 4
storage = 10
gpu = 0

[offer]
price = 100
floor = 50
"""

#: Bid of the parameter-server role in :func:`heterogeneous_spec`: below the trainer daemons' floor, so only
#: the daemon of :func:`worker_toml` with ``parameter_server_only`` answers it.
PARAMETER_SERVER_BID = 40.0


def worker_toml(
    *,
    slowdown: float = 1.0,
    parameter_server_only: bool = False,
    benchmark: bool = True,
    byzantine: str = "",
) -> str:
    """A daemon config template (``{work_dir}`` left to fill in): :data:`WORKER_TOML`, deliberately
    ``slowdown`` times slower, or a daemon that only runs parameter servers (and answers their low bid).
    ``byzantine`` (an experiment knob: ``"scale:K"``, ``"sign_flip"``, ``"random"``, ``"zero"``) makes its
    trainers send corrupted pseudo-gradients (``worker_daemon/executors/byzantine.py``)."""
    text = WORKER_TOML.replace(
        'work_dir = "{work_dir}"\n',
        f'work_dir = "{{work_dir}}"\nslowdown = {slowdown}\nbenchmark = {str(benchmark).lower()}\n'
        + (f"byzantine = {json.dumps(byzantine)}\n" if byzantine else ""),
    )
    if parameter_server_only:
        text = text.replace("price = 100\nfloor = 50", f"price = {PARAMETER_SERVER_BID:g}\nfloor = 0")
        text += (
            '\n[[executors]]\nclass = "aggregate"\nname = "parameter-server"\nruntime = "parameter-server"\n'
        )
    return text


def diloco_spec(
    *,
    dataset: str,
    trainers: int,
    rounds: int,
    inner_steps: int | None = None,
    batch_size: int = 16,
    learning_rate: float = 3e-3,
    outer_learning_rate: float = 0.7,
    outer_momentum: float = 0.9,
    holdout: int = 2,
    round_timeout: float = 120.0,
    model: dict | None = None,
    sample_target: int | None = None,
    dedicated_parameter_server: bool = False,
) -> dict:
    """The JSON spec of a causal-LM DiLoCo job on ``dataset`` (a byte-level text dataset): fixed-H sync with
    ``inner_steps``, or performance-aware sync when ``sample_target`` (samples per round) is given. With
    ``dedicated_parameter_server`` the parameter-server role bids :data:`PARAMETER_SERVER_BID`, which only a
    daemon of ``worker_toml(parameter_server_only=True)`` answers."""
    if (inner_steps is None) == (sample_target is None):
        raise ValueError("give exactly one of inner_steps and sample_target")
    sync = (
        {"inner_steps": inner_steps}
        if sample_target is None
        else {"avg_samples_between_updates": sample_target}
    )
    return {
        "model": {
            "source": {"type": "config", "config": dict(model or TINY_GPT2)},
            "type": "causal-lm",
            "input_names": ["input_ids", "labels"],
        },
        "dataset": {"name": dataset},
        "inner_optimizer": {"learning_rate": learning_rate},
        "outer_optimizer": {"learning_rate": outer_learning_rate, "momentum": outer_momentum},
        "rounds": {"update_rounds": rounds, **sync, "round_timeout": round_timeout},
        "batch_size": batch_size,
        "num_trainers": trainers,
        "evaluation": {"holdout": holdout, "batch_size": 32},
        "trainer": {"resources": {"cpu": 1, "memory": 1, "storage": 0, "gpu": 0}},
        "parameter_server": {
            "resources": {"cpu": 1, "memory": 1, "storage": 0, "gpu": 0},
            **({"price": {"bid": PARAMETER_SERVER_BID, "max": 100}} if dedicated_parameter_server else {}),
        },
    }


def prepare_stdlib_text(output: Path, *, max_bytes: int = 600_000, samples_per_slice: int = 64) -> Path:
    """A byte-level dataset from the standard library's ``*.py`` files (sorted, up to ``max_bytes``)."""
    source = Path(sysconfig.get_paths()["stdlib"])
    inputs = output.parent / f"{output.name}-input"
    inputs.mkdir(parents=True, exist_ok=True)
    total = 0
    for path in sorted(source.glob("*.py")):
        data = path.read_bytes()
        if total + len(data) > max_bytes:
            break
        (inputs / path.name).write_bytes(data)
        total += len(data)
    subprocess.run(
        [
            str(BIN_DIR / "hypha-data"), "prepare-text", "--input", str(inputs), "--output", str(output),
            "--seq-len", "128", "--samples-per-slice", str(samples_per_slice),
        ],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return output


@dataclass
class Cluster:
    plane: ControlPlane
    api_token: str
    data_node: Child
    data_node_argv: list[str] = field(default_factory=list)
    daemons: dict[str, Child] = field(default_factory=dict)
    daemon_argvs: dict[str, list[str]] = field(default_factory=dict)
    daemon_environment: dict[str, str] = field(default_factory=dict)

    def restart_data_node(self) -> Child:
        """Start the data node again, with the same dataset, token and address (after a test stopped it)."""
        self.data_node = self.plane.start("data-node", self.data_node_argv)
        return self.data_node

    def restart_daemon(self, name: str) -> Child:
        """Start daemon ``name`` again with its config, token and work directory (after a test stopped it);
        its log goes on in the same file."""
        saved_env = self.plane.env
        self.plane.env = self.daemon_environment
        try:
            self.daemons[name] = self.plane.start(name, self.daemon_argvs[name])
        finally:
            self.plane.env = saved_env
        return self.daemons[name]

    def api(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.plane.base_url, headers={"Authorization": f"Token {self.api_token}"}, timeout=30.0
        )

    def submit(self, spec: dict, *, name: str = "") -> str:
        with self.api() as client:
            response = client.post("/api/jobs/diloco/", json={"name": name, **spec})
        if response.status_code != 201:
            raise RuntimeError(f"submission refused ({response.status_code}): {response.text}")
        return response.json()["id"]

    def job(self, job_id: str) -> dict:
        with self.api() as client:
            response = client.get(f"/api/jobs/{job_id}/")
            response.raise_for_status()
            return response.json()

    def wait_for_dataset(self, name: str, *, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with self.api() as client:
            while time.monotonic() < deadline:
                self._check_alive()
                names = [entry["name"] for entry in _results(client.get("/api/datasets/").json())]
                if name in names:
                    return
                time.sleep(0.2)
        raise RuntimeError(f"dataset {name!r} was not registered within {timeout:g}s")

    def wait_for_workers(self, count: int, *, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with self.api() as client:
            while time.monotonic() < deadline:
                self._check_alive()
                workers = _results(client.get("/api/workers/").json())
                if sum(worker.get("status") == "online" for worker in workers) >= count:
                    return
                time.sleep(0.2)
        raise RuntimeError(f"{count} workers did not come online within {timeout:g}s")

    def wait_for_benchmarks(self, names: list[str], *, timeout: float = 180.0) -> None:
        """Wait until the named workers reported their start-up benchmark (a daemon makes no offers while it
        runs, so a job submitted before would wait for it)."""
        deadline = time.monotonic() + timeout
        with self.api() as client:
            while time.monotonic() < deadline:
                self._check_alive()
                workers = {worker["name"]: worker for worker in _results(client.get("/api/workers/").json())}
                if all(
                    name in workers
                    and (workers[name].get("benchmark_score") or workers[name].get("benchmark"))
                    for name in names
                ):
                    return
                time.sleep(0.5)
        raise RuntimeError(f"the workers {names} did not report a benchmark within {timeout:g}s")

    def follow(self, job_id: str, *, timeout: float, on_round: Callable[[dict], None] | None = None) -> dict:
        """Poll the job until it ends; call ``on_round`` for each round once the parameter server has reported
        it (a round is closed as soon as it is saved, its report with the eval loss and duration follows), or
        when the job ended without its report. Returns the final job."""
        seen: set[int] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            ended = job["status"] in ("completed", "failed", "cancelled")
            for round_ in job["rounds"]:
                reported = round_["closed"] and (round_["duration"] is not None or ended)
                if reported and round_["number"] not in seen:
                    seen.add(round_["number"])
                    if on_round is not None:
                        on_round(round_)
            if ended:
                return job
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} did not end within {timeout:g}s")

    def download_model(self, job_id: str, destination: Path) -> Path:
        with self.api() as client, client.stream("GET", f"/api/jobs/{job_id}/model") as response:
            response.raise_for_status()
            destination.parent.mkdir(parents=True, exist_ok=True)
            with destination.open("wb") as handle:
                for chunk in response.iter_bytes():
                    handle.write(chunk)
        return destination

    def logs(self) -> str:
        parts = [f"--- {child.name} ---\n{child.tail()}" for child in self.plane.children]
        parts += [f"--- data node ---\n{self.data_node.tail()}"]
        parts += [f"--- {name} ---\n{child.tail()}" for name, child in self.daemons.items()]
        return "\n".join(parts)

    def _check_alive(self) -> None:
        for child in [*self.plane.children, self.data_node, *self.daemons.values()]:
            if child.popen.poll() is not None:
                raise RuntimeError(f"{child.name} exited with {child.popen.returncode}:\n{child.tail()}")


def _results(payload) -> list[dict]:
    return payload["results"] if isinstance(payload, dict) and "results" in payload else payload


@contextlib.contextmanager
def training_cluster(
    *,
    root: Path,
    dataset_dir: Path,
    workers: int,
    mode: str = "embedded",
    settings: dict[str, str] | None = None,
    daemon_env: dict[str, str] | None = None,
    worker_tomls: list[str] | None = None,
    benchmark: bool = True,
    quiet: bool = True,
    wan: Wan | None = None,
    public_workers: Collection[str] = (),
    data_node_reachable: bool = True,
    web: int = 1,
    celery: int = 1,
    daemon_web: list[int] | None = None,
    data_node_web: int = 0,
) -> Iterator[Cluster]:
    """Control plane + one data node serving ``dataset_dir`` + ``workers`` daemons, all stopped on exit.
    ``worker_tomls``: each daemon's config template (:func:`worker_toml`); by default :data:`WORKER_TOML` for
    all, running the worker benchmark at start unless ``benchmark`` is False (tests that need no scores).
    With ``wan`` (an open ``tests/e2e/wan.py`` Wan), the control plane listens on its host address and the
    data node (a public peer) and every daemon (a private peer, behind NAT, unless ``public_workers`` names
    it: ``worker-<n>``, numbered from 1) run in namespaces of their own. ``data_node_reachable`` False starts
    the data node with ``--reachable false`` (with ``wan``: a private peer behind NAT, which only reaches the
    control plane), so it publishes its slices to the control plane's store and trainers download them there.

    Scale-out (services mode): ``web`` daphne processes and ``celery`` Celery workers (``bench/harness.py``);
    ``daemon_web`` names the web process (an index into ``plane.web_urls``) each daemon connects to (default:
    in turn), ``data_node_web`` the data node's. The REST API (:meth:`Cluster.api`) goes to the first."""
    if worker_tomls is not None and len(worker_tomls) != workers:
        raise ValueError(f"{len(worker_tomls)} worker configs for {workers} workers")
    if daemon_web is not None and (len(daemon_web) != workers or not all(0 <= i < web for i in daemon_web)):
        raise ValueError(
            f"daemon_web {daemon_web} must give each of {workers} daemons one of {web} web processes"
        )
    if not 0 <= data_node_web < web:
        raise ValueError(f"data_node_web {data_node_web} is not one of {web} web processes")
    host = wan.host_address if wan is not None else "127.0.0.1"
    with control_plane(
        mode=mode, root=root, settings=settings or {}, quiet=quiet, host=host, web=web, celery=celery
    ) as plane:
        api_token = plane.manage("create_user_token", "cluster-admin", "--staff")
        node_token = plane.manage("create_data_node_token", "data-node-1", "--url", "http://127.0.0.1:1")
        # Tokens go in files (0600), never on a command line, which every user of the host sees in ps.
        # A fixed port, so that a data node restarted by a test serves at the address trainers were given.
        data_node_argv = [
            str(BIN_DIR / "hypha-data-node"), "--server", plane.url_for(data_node_web),
            "--token-file", str(token_file(root / "data-node.token", node_token)),
            "--dataset", str(dataset_dir), "--port", str(free_port()), "--log-level", "WARNING",
        ]  # fmt: skip
        if not data_node_reachable:
            data_node_argv += ["--reachable", "false"]
        if wan is not None:
            data_node_peer = wan.add("data-node", public=data_node_reachable)
            data_node_argv = data_node_peer.command([*data_node_argv, "--host", data_node_peer.address])
        data_node = plane.start("data-node", data_node_argv)
        cluster = Cluster(
            plane=plane, api_token=api_token, data_node=data_node, data_node_argv=data_node_argv
        )
        names = [f"worker-{index + 1}" for index in range(workers)]
        tokens = [plane.manage("create_worker_token", name) for name in names]
        environment = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith("HYPHA_") and key not in {"DATABASE_URL", "REDIS_URL"}
        }
        # Every process of the cluster shares two cores: one thread per executor keeps them from thrashing.
        environment.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        environment.update(daemon_env or {})
        saved_env = plane.env
        plane.env = environment  # plane.start uses plane.env; daemons get a daemon's environment
        try:
            templates = worker_tomls or [worker_toml(benchmark=benchmark)] * workers
            servers = [plane.url_for(index) for index in daemon_web or range(workers)]
            for name, token, template, server in zip(names, tokens, templates, servers, strict=True):
                work_dir = root / "workers" / name
                work_dir.mkdir(parents=True, exist_ok=True)
                config = root / "workers" / f"{name}.toml"
                config.write_text(template.format(work_dir=work_dir))
                daemon_argv = [
                    str(BIN_DIR / "hypha-worker-daemon"), "--server", server,
                    "--token-file", str(token_file(root / "workers" / f"{name}.token", token)),
                    "--config", str(config), "--log-level", "INFO",
                ]  # fmt: skip
                if wan is not None:
                    peer = wan.add(name, public=name in public_workers)
                    daemon_argv = peer.command([*daemon_argv, "--ps-host", peer.address])
                cluster.daemons[name] = plane.start(name, daemon_argv)
                cluster.daemon_argvs[name] = daemon_argv
            cluster.daemon_environment = environment
        finally:
            plane.env = saved_env
        cluster.wait_for_dataset(dataset_dir.name)
        cluster.wait_for_workers(workers)
        cluster.wait_for_benchmarks(
            [
                name
                for name, template in zip(names, templates, strict=True)
                if "benchmark = false" not in template
            ]
        )
        yield cluster


def token_file(path: Path, token: str) -> Path:
    """``path`` holding ``token``, readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(token)
    return path


def summary(job: dict, *, model: Path | None) -> dict:
    """The demo's one-line result: status, rounds, first and final training loss, final eval loss, model."""
    rounds = [round_ for round_ in job["rounds"] if round_["closed"]]
    return {
        "job": job["id"],
        "status": job["status"],
        "rounds": len(rounds),
        "first_round_loss": rounds[0]["mean_loss"] if rounds else None,
        "final_loss": rounds[-1]["mean_loss"] if rounds else None,
        "eval_loss": rounds[-1]["eval_loss"] if rounds else None,
        "model": str(model) if model is not None else None,
    }


def dump(value: dict) -> str:
    return json.dumps(value, separators=(", ", ": "))
