"""The parameter server's memory while updates arrive (issue 17): two update bodies received at once must not
both be held in memory whole. A real HTTP API in a process of its own (tests/parameter_server/
update_memory_probe.py: its RSS is not the test runner's), two real safetensors bodies PUT concurrently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]


def test_two_concurrent_updates_grow_the_rss_by_about_one_model_not_four(tmp_path):
    # given: a 64 MiB float32 model, and the round's sum (one model) the only model-sized memory it must take
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    # when: two 64 MiB updates arrive at once
    completed = subprocess.run(
        [sys.executable, "-m", "tests.parameter_server.update_memory_probe", str(tmp_path)],
        cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout + completed.stderr
    measured = json.loads(completed.stdout.strip().splitlines()[-1])
    # then: the peak is the sum plus a tensor or two at a time, well under 1.75 models (loading both bodies
    # whole, as before, took 4 or more: two copies, the files' mapped pages, the sum)
    growth = (measured["peak"] - measured["before"]) / measured["model_bytes"]
    assert growth < 1.75, measured
