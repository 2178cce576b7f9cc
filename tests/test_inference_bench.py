"""bench/inference.py: its arguments, how it reads the daemons' logs, and its loop is the executor's computation.

The benchmark itself starts a cluster (minutes; results in docs/benchmarks.md); here: the pieces that turn what
it sees into the table, and a loop over two tiny slices.
"""

from __future__ import annotations

import json

import pytest

from bench import inference


def test_the_defaults_are_the_issues_three_sizes_and_quick_is_smaller():
    arguments = inference.parse_arguments([])
    assert arguments.workers == [1, 2, 4]
    quick = inference.parse_arguments(["--quick"])
    assert quick.workers == [1, 2] and quick.slices < arguments.slices
    for bad in (["--workers", "0"], ["--workers", "x"], ["--slices", "1"], ["--max-new-tokens", "200"]):
        with pytest.raises(SystemExit):
            inference.parse_arguments(bad)


def test_the_logs_give_the_first_claim_and_each_daemons_compute_seconds():
    texts = {
        "worker-1": (
            "2026-12-02 04:19:25,664 INFO    worker_daemon.bridge.remote.results: task 3: slice 0 of stdlib "
            "handed out (65728 bytes)\n"
            "2026-12-02 04:19:25,791 INFO    worker_daemon.jobs: [task 3] 2026-12-02 04:19:25,791 INFO "
            "worker_daemon.executors.inference: slice 0 of stdlib: 32 rows in 0.12 s, result 0.jsonl sent\n"
            "2026-12-02 04:19:25,955 INFO    worker_daemon.jobs: [task 3] ... slice 1 of stdlib: 32 rows in "
            "0.25 s, result 1.jsonl sent\n"
        ),
        "worker-2": (
            "2026-12-02 04:19:25,500 INFO    worker_daemon.bridge.remote.results: task 4: slice 2 of stdlib "
            "handed out (65728 bytes)\n"
        ),
    }
    claimed = inference.first_claim(texts)
    assert claimed is not None and (claimed.second, claimed.microsecond) == (25, 500_000)
    assert inference.compute_seconds(texts) == {"worker-1": pytest.approx(0.37)}
    assert inference.first_claim({"worker-1": "nothing"}) is None


def test_the_loop_runs_the_executors_generate_over_every_slice(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    dataset = tmp_path / "tiny"
    dataset.mkdir()
    for index, rows in enumerate((3, 2)):
        ids = torch.randint(0, 256, (rows, inference.SEQ_LEN), generator=torch.Generator().manual_seed(index))
        save_file({"input_ids": ids, "labels": ids.clone()}, str(dataset / f"{index:05d}.safetensors"))
    spec = inference.job_spec("tiny", workers=1, max_new_tokens=2, batch_size=2)
    rows, seconds = inference.plain_loop(dataset, spec, tmp_path / "results")
    assert rows == 5 and seconds > 0
    lines = (tmp_path / "results" / "0.jsonl").read_text().splitlines()
    assert [json.loads(line)["row"] for line in lines] == [0, 1, 2]
    assert all(1 <= len(json.loads(line)["tokens"]) <= 2 for line in lines)
