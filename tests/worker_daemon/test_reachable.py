"""Whether a worker accepts inbound connections: ``[parameter_server] reachable`` (true, false, "auto") in the
config, ``--reachable``, and the ``hello`` that carries it; Hypha's ``relay_circuit`` says nothing of it."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker_daemon import protocol
from worker_daemon.config import load_config
from worker_daemon.connection import WorkerSession
from worker_daemon.exceptions import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "worker.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("false", False), ('"auto"', "auto"), ('"false"', False), ('"True"', True)],
)
def test_the_config_says_whether_the_parameter_server_is_reachable(tmp_path, value, expected):
    config = load_config(write(tmp_path, f"[parameter_server]\nreachable = {value}\n"), environ={})
    assert config.parameter_server.reachable == expected


def test_reachable_is_auto_unless_said_and_the_flag_overrides_the_file(tmp_path):
    assert load_config(None, environ={}).parameter_server.reachable == "auto"
    path = write(tmp_path, '[parameter_server]\npublic_url = "http://gpu-01:8470"\nreachable = true\n')
    config = load_config(path, environ={}, reachable="false")
    assert (config.parameter_server.public_url, config.parameter_server.reachable) == (
        "http://gpu-01:8470",
        False,
    )
    assert config.summary().endswith(" reachable=false")


@pytest.mark.parametrize("value", ["1", '"yes"', '"sometimes"', "[]"])
def test_anything_else_is_refused_naming_the_key(tmp_path, value):
    with pytest.raises(ConfigError, match=r'parameter_server\.reachable: must be true, false or "auto"'):
        load_config(write(tmp_path, f"[parameter_server]\nreachable = {value}\n"), environ={})


def test_relay_circuit_is_still_ignored_and_implies_nothing(tmp_path, caplog):
    # Hypha's init writes relay_circuit = true for every node: it adds relayed addresses to direct ones.
    with caplog.at_level(logging.INFO):
        config = load_config(write(tmp_path, "relay_circuit = true\n"), environ={})
    assert config.parameter_server.reachable == "auto"
    assert [record.getMessage() for record in caplog.records] == [
        f"{tmp_path / 'worker.toml'}: ignoring keys of the original's libp2p/telemetry transport (not used "
        "here): relay_circuit"
    ]


@pytest.mark.parametrize(("value", "sent"), [(True, True), (False, False), ("auto", "auto")])
def test_the_hello_carries_it(tmp_path, value, sent):
    config = load_config(None, environ={}, reachable=value)
    hello = WorkerSession(config=config).hello()
    assert hello.reachable == sent
    assert protocol.parse_daemon_message(protocol.encode(hello)).reachable == sent


def test_the_flag_takes_only_true_false_or_auto():
    result = subprocess.run(
        [sys.executable, "-m", "worker_daemon", "--server", "http://x", "--reachable", "maybe"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 2
    assert re.search(
        r"argument --reachable: invalid choice: 'maybe' \(choose from '?true'?, '?false'?, '?auto'?\)",
        result.stderr,
    )
