"""scripts/gpu-check: what it says without a GPU, that it never pretends CUDA, and how it reads its numbers.

The check itself needs an NVIDIA GPU (it runs on lent GPU machines); here: the no-GPU answer, the honest
failure when nvidia-smi lists a GPU that torch cannot use, and the parsing of nvidia-smi, the trainers' log
lines and the rounds' metrics.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "gpu-check"

spec = importlib.util.spec_from_file_location("_gpu_check", REPO_ROOT / "scripts" / "_gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

#: On a machine with a real GPU these would run the real check (minutes): that is scripts/gpu-check's own job.
no_real_gpu = pytest.mark.skipif(
    shutil.which("nvidia-smi", path="/usr/bin:/bin") is not None, reason="a real nvidia-smi is installed here"
)

FAKE_NVIDIA_SMI = """#!/bin/sh
case "$*" in
  -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-test)" ;;
  *query-gpu=index,name*) echo "0, NVIDIA H200, 143771, 580.159.04" ;;
  *query-gpu=index,memory.used*) cat "$(dirname "$0")/used" ;;
  *query-compute-apps*) printf '101, 600\\n102, 700\\n' ;;
esac
"""


def fake_nvidia_smi(tmp_path: Path, used: str = "0, 500") -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    program = bin_dir / "nvidia-smi"
    program.write_text(FAKE_NVIDIA_SMI)
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    (bin_dir / "used").write_text(used + "\n")
    return bin_dir


def run_script(*arguments: str, path: str, tmp_path: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PATH": path, "TMPDIR": str(tmp_path), "HYPHA_GPU_PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(SCRIPT), *arguments],
        cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@no_real_gpu
def test_without_a_gpu_it_says_so_in_one_json_line_and_exits_0(tmp_path):
    # No nvidia-smi on the PATH, and this venv's torch has no CUDA device.
    done = run_script(path="/usr/bin:/bin", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["ok"] is True and result["gpu"] is False and result["skipped"] is True


@no_real_gpu
def test_a_gpu_torch_cannot_use_fails_the_check_instead_of_running_on_the_cpu(tmp_path):
    bin_dir = fake_nvidia_smi(tmp_path)
    venv = Path(sys.executable).parent.parent
    done = run_script("--venv", str(venv), path=f"{bin_dir}:/usr/bin:/bin", tmp_path=tmp_path)
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["ok"] is False and result["gpu"] is True and result["cuda_available"] is False
    assert "torch.cuda.is_available() is False" in result["error"]
    assert result["devices"] == [{"index": 0, "name": "NVIDIA H200", "memory_mib": 143771.0}]
    # Every line carries the core fields, null where the check did not get that far.
    assert set(gpu_check.CORE_FIELDS) <= set(result)
    assert result["trainers"] == 2
    assert result["samples_per_s"] is None and result["final_loss"] is None
    assert result["peak_memory_mib"] is None and result["peak_memory_source"] is None


def test_nvidia_smi_readings_give_the_peak_above_the_baseline(tmp_path, monkeypatch):
    bin_dir = fake_nvidia_smi(tmp_path, used="0, 500")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    poller = gpu_check.MemoryPoller(interval=3600)
    poller.sample()  # the baseline: 500 MiB in use before the check
    (bin_dir / "used").write_text("0, 2548\n")
    poller.sample()
    (bin_dir / "used").write_text("0, 1200\n")
    poller.sample()
    report = poller.report()
    assert report["peak_gpu_memory_mib"] == 2048
    assert report["peak_process_gpu_memory_mib"] == 700
    assert report["peak_all_processes_gpu_memory_mib"] == 1300
    assert report["gpu_processes_seen"] == 2


def test_no_nvidia_smi_readings_give_no_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    poller = gpu_check.MemoryPoller(interval=3600)
    poller.sample()
    assert poller.report()["peak_gpu_memory_mib"] is None


def test_trainer_devices_come_from_the_trainers_own_log_lines(tmp_path):
    line = (
        "INFO worker_daemon.jobs: [task 2c86b415] 2026-11-26 06:10:55,961 INFO worker_daemon.executors.training: "
        "job 63e1: model causal-lm (GPT2LMHeadModel, 3257856 parameters) loaded on {device}, batch size 32, lr 0.003\n"
    )
    (tmp_path / "worker-1.log").write_text(line.format(device="cuda:0"))
    (tmp_path / "worker-2.log").write_text("nothing of a trainer here\n")
    (tmp_path / "worker-3.log").write_text(line.format(device="cuda"))
    assert gpu_check.trainer_devices(tmp_path) == (["cuda:0", "cuda"], 3257856)


def test_samples_per_second_sums_the_trainers_and_leaves_out_the_first_round():
    job = {
        "rounds": [
            {"trainer_metrics": {"a": {"samples_per_second": 10.0}, "b": {"samples_per_second": 20.0}}},
            {"trainer_metrics": {"a": {"samples_per_second": 100.0}, "b": {"samples_per_second": 110.0}}},
            {"trainer_metrics": {"a": {"samples_per_second": 120.0}, "b": {"samples_per_second": 130.0}}},
        ]
    }
    assert gpu_check.trainer_rates(job) == {
        "samples_per_s": 230.0,
        "samples_per_s_per_trainer": 115.0,
        "samples_per_s_first_round": 30.0,
    }
    assert gpu_check.trainer_rates({"rounds": []})["samples_per_s"] is None


def test_peak_memory_is_the_trainers_own_max_memory_allocated_when_they_report_it():
    job = {
        "rounds": [
            {"trainer_metrics": {"a": {"peak_memory_bytes": 2 * 2**30}, "b": {"samples_per_second": 5.0}}},
            {"trainer_metrics": {"a": {"peak_memory_bytes": 3 * 2**30}, "b": {"peak_memory_bytes": 2**30}}},
        ]
    }
    assert gpu_check.trainer_peak_memory(job) == 3072.0
    assert gpu_check.trainer_peak_memory({"rounds": [{"trainer_metrics": {"a": {"loss": 1.0}}}]}) is None
    both = {"peak_memory_mib_torch": 3072.0, "peak_gpu_memory_mib": 3500.0}
    assert gpu_check.peak_memory(both)[0] == 3072.0
    assert gpu_check.peak_memory(both)[1].startswith("torch.cuda.max_memory_allocated")
    smi_only = {"peak_memory_mib_torch": None, "peak_gpu_memory_mib": 3500.0}
    assert gpu_check.peak_memory(smi_only)[0] == 3500.0
    assert gpu_check.peak_memory(smi_only)[1].startswith("nvidia-smi")
    assert gpu_check.peak_memory({}) == (None, None)
