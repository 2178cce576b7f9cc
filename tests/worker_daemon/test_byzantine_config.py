"""The ``--byzantine MODE`` experiment knob (issue 18): parsed and validated at start, exported to every task."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from worker_daemon import protocol
from worker_daemon.config import WorkerConfig, load_config
from worker_daemon.exceptions import ConfigError
from worker_daemon.jobs import JobManager, Task
from worker_daemon.leases import LeaseBook

REPO = Path(__file__).resolve().parents[2]
LEASE = uuid.UUID(int=7)
JOB = uuid.UUID(int=8)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "worker.toml"
    path.write_text(f'work_dir = "{tmp_path / "w"}"\n' + text)
    return path


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("scale:100", "scale:100"),
        ("scale:-0.5", "scale:-0.5"),
        (" sign_flip ", "sign_flip"),
        ("random", "random"),
        ("zero", "zero"),
        ("", ""),
    ],
)
def test_good_modes_from_the_file_and_the_flag(tmp_path, value, expected):
    from_file = load_config(write(tmp_path, f"byzantine = {value!r}\n".replace("'", '"')), environ={})
    from_flag = load_config(write(tmp_path, 'byzantine = "zero"\n'), environ={}, byzantine=value)

    assert from_file.byzantine == expected
    assert from_flag.byzantine == expected
    assert ("BYZANTINE=" in from_file.summary()) == bool(expected)


def test_honest_by_default(tmp_path):
    config = load_config(write(tmp_path, ""), environ={})

    assert config.byzantine == ""
    assert "BYZANTINE" not in config.summary()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'byzantine = "scale:abc"\n',
            "byzantine: 'scale:abc': scale:K needs a finite number K with 0 < |K| <= 1e+06",
        ),
        ('byzantine = "scale:0"\n', "byzantine: 'scale:0': scale:K needs a finite number K"),
        ('byzantine = "scale:inf"\n', "byzantine: 'scale:inf': scale:K needs a finite number K"),
        ('byzantine = "scale:1e7"\n', "byzantine: 'scale:1e7': scale:K needs a finite number K"),
        ('byzantine = "flip"\n', "byzantine: 'flip' is not one of scale:K, sign_flip, random, zero"),
        ("byzantine = 3\n", "byzantine: Input should be a valid string"),
        (f'byzantine = "{"x" * 65}"\n', "byzantine: String should have at most 64 characters"),
    ],
)
def test_bad_modes_are_config_errors_naming_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError) as raised:
        load_config(write(tmp_path, text), environ={})

    assert message in str(raised.value)


def test_a_bad_flag_exits_2_with_the_message_not_a_traceback(tmp_path):
    environment = {key: value for key, value in os.environ.items() if not key.startswith("HYPHA_")}
    environment["HYPHA_WORKER_TOKEN"] = "t" * 40

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "worker_daemon",
            "--server",
            "http://127.0.0.1:1",
            "--no-benchmark",
            "--work-dir",
            str(tmp_path / "w"),
            "--byzantine",
            "sideways",
        ],
        capture_output=True,
        text=True,
        env=environment,
        cwd=REPO,
        timeout=60,
    )

    assert result.returncode == 2
    assert result.stderr.endswith(
        "hypha-worker-daemon: error: config: byzantine: 'sideways' is not one of scale:K, sign_flip, random, zero "
        "(e.g. scale:100) (got 'sideways')\n"
    )
    assert "Traceback" not in result.stderr


def test_an_executor_env_may_not_set_it(tmp_path):
    path = write(
        tmp_path,
        '[[executors]]\nclass = "train"\nname = "x"\nruntime = "process"\ncmd = "true"\n'
        'env = { HYPHA_BYZANTINE = "zero" }\n',
    )

    with pytest.raises(ConfigError) as raised:
        load_config(path, environ={})

    assert "HYPHA_BYZANTINE is reserved" in str(raised.value)


@pytest.mark.parametrize("mode", ["", "scale:100"])
def test_every_task_gets_the_configs_mode_never_the_inherited_one(tmp_path, monkeypatch, mode):
    # given: a daemon whose own environment says something else
    monkeypatch.setenv("HYPHA_BYZANTINE", "zero")
    config = WorkerConfig.model_validate(
        {
            "work_dir": str(tmp_path / "w"),
            "resources": {"cpu": 8, "memory": 32, "storage": 100, "gpu": 0},
            "byzantine": mode,
            "executors": [{"class": "train", "name": "t", "runtime": "process", "cmd": "true"}],
        }
    )
    book = LeaseBook(capacity=protocol.Resources(cpu=8, memory=32, storage=100, gpu=0))
    manager = JobManager(config=config, book=book, server_url="wss://cp.example/ws/worker/")
    message = protocol.DispatchJob(
        task_id=uuid.uuid4(), lease_id=LEASE, job_id=JOB, role="trainer", spec={"job_id": str(JOB)}
    )
    task = Task(
        dispatch=message,
        executor=config.find_executor("train", "t"),
        work_dir=tmp_path,
        socket_path=tmp_path / "s",
    )

    # when
    _, environment = manager._command(task)

    # then
    assert environment["HYPHA_BYZANTINE"] == mode
