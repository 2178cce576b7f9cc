"""The ``hypha`` CLI as a user runs it: a real subprocess against a real control plane.

* A tiny DiLoCo job on a real training cluster (``bench.cluster.training_cluster``: control plane, data node,
  three worker daemons): ``hypha login`` (the token typed on stdin), ``submit job.json``, ``watch`` to
  completion (exit 0), ``jobs``, ``workers --json``, ``download -o DIR --extract`` (a zip with
  ``model.safetensors``), and cancelling the completed job (refused: exit 1).
* Against the ``control_plane`` fixture: a bad token (exit 3), an unknown job (exit 4), a wrong server — a
  closed port and a URL that is not a Hypha API (exit 5). Nothing is saved by a failed login.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest

from tests.e2e.conftest import only_in_mode, services_mode
from tests.e2e.isolation import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BIN_DIR = Path(sys.executable).parent
#: The installed console script when there is one (`pip install -e .`), else the module.
HYPHA = [str(BIN_DIR / "hypha")] if (BIN_DIR / "hypha").exists() else [sys.executable, "-m", "hypha_cli"]
TRAINERS = 2
ROUNDS = 2
#: Exit codes of `hypha` (hypha_cli.exceptions.ExitCode), spelt out: they are the CLI's contract.
EXIT_OK, EXIT_FAILED_OR_REFUSED, EXIT_BAD_TOKEN, EXIT_NO_JOB, EXIT_WRONG_SERVER = 0, 1, 3, 4, 5


def hypha(
    *arguments: str, config: Path, stdin: str | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """Run ``hypha`` with its own config file and none of the caller's HYPHA_* settings."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("HYPHA_")}
    env["HYPHA_CONFIG"] = str(config)
    return subprocess.run(
        [*HYPHA, *arguments],
        cwd=REPO_ROOT,
        env=env,
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@only_in_mode("embedded", "the CLI speaks HTTP to the API, the same in either run")
def test_login_submit_watch_and_download_a_tiny_training_job(tmp_path: Path) -> None:
    from bench.cluster import diloco_spec, prepare_stdlib_text, training_cluster

    # given: a byte-level dataset, a spec file, and a cluster of three daemons
    dataset = prepare_stdlib_text(tmp_path / "stdlib", max_bytes=120_000, samples_per_slice=32)
    spec = diloco_spec(
        dataset="stdlib",
        trainers=TRAINERS,
        rounds=ROUNDS,
        inner_steps=4,
        batch_size=8,
        holdout=1,
        round_timeout=60.0,
        model={
            "model_type": "gpt2",
            "vocab_size": 256,
            "n_positions": 128,
            "n_embd": 32,
            "n_layer": 1,
            "n_head": 2,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
    )
    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps(spec))
    config = tmp_path / "home" / "hypha" / "cli.json"
    with training_cluster(
        root=tmp_path / "cluster",
        dataset_dir=dataset,
        workers=TRAINERS + 1,
        mode="services" if services_mode() else "embedded",
        settings={"HYPHA_LEASE_TTL": "10"},
        benchmark=False,
    ) as cluster:
        server = cluster.plane.base_url

        # when: login, with the token typed on stdin (no --token on the command line)
        login = hypha("login", "--server", server, config=config, stdin=f"{cluster.api_token}\n")
        assert login.returncode == EXIT_OK, login.stderr
        assert json.loads(config.read_text()) == {"server": server, "token": cluster.api_token}
        assert stat.S_IMODE(config.stat().st_mode) == 0o600

        # and: submit
        submitted = hypha("submit", str(spec_file), "--name", "e2e-cli", config=config)
        assert submitted.returncode == EXIT_OK, submitted.stderr
        job_id = submitted.stdout.strip()
        assert str(uuid.UUID(job_id)) == job_id

        # and: watch until it ends
        watched = hypha("watch", job_id, config=config, timeout=240)

        # then: it completed, round by round
        assert watched.returncode == EXIT_OK, f"{watched.stdout}\n{watched.stderr}\n{cluster.logs()}"
        lines = watched.stdout.splitlines()
        assert [line.split(":")[0] for line in lines if line.startswith("round ")] == [
            "round 1/2",
            "round 2/2",
        ]
        assert lines[-1].startswith(f"job {job_id} completed · rounds 2/2 · loss "), lines

        # and: it is listed as completed with its rounds and its last loss
        listed = hypha("jobs", config=config)
        assert listed.returncode == EXIT_OK, listed.stderr
        (row,) = [line.split() for line in listed.stdout.splitlines() if line.startswith(job_id)]
        assert row[1:4] == ["e2e-cli", "completed", "2/2"]
        assert float(row[4]) > 0
        as_json = hypha("jobs", "--json", config=config)
        assert [(job["id"], job["status"]) for job in json.loads(as_json.stdout)] == [(job_id, "completed")]

        workers = hypha("workers", "--json", config=config)
        assert workers.returncode == EXIT_OK, workers.stderr
        assert sorted(worker["name"] for worker in json.loads(workers.stdout)) == [
            "worker-1",
            "worker-2",
            "worker-3",
        ]

        # and: the model downloads as a zip (and unpacks)
        out = tmp_path / "models"
        downloaded = hypha("download", job_id, "-o", str(out), "--extract", config=config)
        assert downloaded.returncode == EXIT_OK, downloaded.stderr
        archive = out / f"model-{job_id}.zip"
        assert downloaded.stdout.splitlines() == [str(archive), str(out / f"model-{job_id}")]
        with zipfile.ZipFile(archive) as bundle:
            assert sorted(bundle.namelist()) == ["config.json", "generation_config.json", "model.safetensors"]
        assert (out / f"model-{job_id}" / "model.safetensors").stat().st_size > 0

        # and: a completed job cannot be cancelled (refused, and it stays completed)
        cancelled = hypha("cancel", job_id, config=config)
        assert cancelled.returncode == EXIT_FAILED_OR_REFUSED, cancelled.stdout
        assert cancelled.stderr.startswith("hypha: error: ")
        assert cluster.job(job_id)["status"] == "completed"


def test_a_bad_token_exits_3_and_saves_nothing(control_plane, tmp_path: Path) -> None:
    config = tmp_path / "cli.json"

    login = hypha("login", "--server", control_plane.base_url, "--token", "not-a-token", config=config)

    assert login.returncode == EXIT_BAD_TOKEN
    assert login.stderr == (
        f"hypha: error: {control_plane.base_url} refused the API token (Invalid token.); "
        f"run `hypha login --server {control_plane.base_url}`\n"
    )
    assert not config.exists()
    # a token that was good once and is not any more: the same exit code on any command
    listed = hypha("--server", control_plane.base_url, "--token", "not-a-token", "jobs", config=config)
    assert listed.returncode == EXIT_BAD_TOKEN
    assert "refused the API token" in listed.stderr


def test_an_unknown_job_exits_4(control_plane, tmp_path: Path) -> None:
    config = tmp_path / "cli.json"
    login = hypha(
        "login", "--server", control_plane.base_url, "--token", control_plane.api_token, config=config
    )
    assert login.returncode == EXIT_OK, login.stderr
    unknown = str(uuid.uuid4())

    for command in ("show", "watch", "cancel", "download"):
        result = hypha(command, unknown, config=config)
        assert (command, result.returncode) == (command, EXIT_NO_JOB)
        assert result.stderr == (
            f"hypha: error: no job {unknown} on {control_plane.base_url} (or it is not one of yours)\n"
        )
    assert not list(tmp_path.glob("*.zip")) and not list(Path(REPO_ROOT).glob(f"*{unknown}*"))


def test_a_wrong_server_exits_5(control_plane, tmp_path: Path) -> None:
    config = tmp_path / "cli.json"
    closed = f"http://127.0.0.1:{free_port()}"

    refused = hypha("login", "--server", closed, "--token", "anything", config=config)
    assert refused.returncode == EXIT_WRONG_SERVER
    assert (
        refused.stderr
        == f"hypha: error: cannot connect to {closed}: Connection refused (is --server right?)\n"
    )

    # a live web server that is not a Hypha API (the control plane under a path it does not serve)
    elsewhere = f"{control_plane.base_url}/not-the-api"
    wrong = hypha("login", "--server", elsewhere, "--token", control_plane.api_token, config=config)
    assert wrong.returncode == EXIT_WRONG_SERVER
    assert "is not a Hypha control plane" in wrong.stderr
    assert not config.exists()
