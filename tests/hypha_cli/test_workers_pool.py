"""``hypha workers`` against a real control plane (pytest-django's live server, over real HTTP): a user who owns
no worker lists the pool, with the public facts of each and nothing private."""

from __future__ import annotations

import json

import pytest

from hypha_cli.__main__ import run
from hypha_cli.exceptions import ExitCode

#: What the CLI may print of a worker its user does not own (tests/apps/workers/test_pool.py: PUBLIC_KEYS).
PUBLIC_KEYS = {
    "id",
    "view",
    "name",
    "status",
    "resources",
    "devices",
    "executors",
    "price_floor",
    "reachable",
    "benchmark_score",
    "leases",
}


@pytest.fixture
def pool(bobs_worker):
    """Bob's online worker and a registered worker nobody owns, never connected."""
    from apps.workers import services

    lab, _ = services.create_worker(name="lab-box")
    return [bobs_worker, lab]


def hypha(live_server, persona, tmp_path, *argv: str) -> int:
    return run(
        ["workers", "--server", live_server.url, "--token", persona.token, *argv],
        environ={"HOME": str(tmp_path)},
    )


def test_a_user_who_owns_no_worker_lists_the_pool(live_server, alice, pool, tmp_path, capsys):
    # when
    code = hypha(live_server, alice, tmp_path)

    # then
    assert code == ExitCode.OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["NAME", "STATUS"]
    rows = [line.split() for line in lines[1:]]
    assert rows[0][:8] == [
        "bobs-gpu",
        "online",
        "8",
        "32",
        "24",
        "train/diloco-transformer,",
        "aggregate/parameter-server",
        "10",
    ]
    assert rows[1][:2] == ["lab-box", "offline"]
    assert len(rows) == 2


def test_the_json_of_the_pool_holds_only_public_facts(live_server, alice, pool, tmp_path, capsys):
    # when
    code = hypha(live_server, alice, tmp_path, "--json")

    # then
    assert code == ExitCode.OK
    listed = json.loads(capsys.readouterr().out)
    assert [worker["name"] for worker in listed] == ["bobs-gpu", "lab-box"]
    for worker in listed:
        assert set(worker) == PUBLIC_KEYS
    assert listed[0]["resources"] == {"cpu": 8.0, "memory": 32.0, "storage": 100.0, "gpu": 24.0}


def test_mine_lists_only_the_users_own_workers(live_server, alice, bob, pool, tmp_path, capsys):
    # when
    alices = hypha(live_server, alice, tmp_path, "--mine")
    alices_out = capsys.readouterr().out
    bobs = hypha(live_server, bob, tmp_path, "--mine", "--json")
    bobs_out = json.loads(capsys.readouterr().out)

    # then
    assert (alices, bobs) == (ExitCode.OK, ExitCode.OK)
    assert alices_out.startswith("You own no workers: register one with POST /api/workers/")
    assert [(worker["name"], worker["owner"]) for worker in bobs_out] == [("bobs-gpu", "bob")]
