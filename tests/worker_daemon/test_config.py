"""The worker config: Hypha's TOML keys, defaults, leniency, clear errors, and env/CLI layering."""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

import pytest

from worker_daemon import protocol
from worker_daemon.config import (
    WorkerConfig,
    free_disk_gb,
    http_base_url,
    load_config,
    total_memory_gb,
    websocket_url,
)
from worker_daemon.exceptions import ConfigError, ExitCode

SEED = Path("/work/shared/seeds/002_ef485d7c7bb97522.txt")

# The "Complete Example Configuration" of the original's worker doc (seed 002), verbatim, so the test
# does not depend on the shared folder being present.
COMPLETE_EXAMPLE = """\
# TLS Configuration
cert_pem = "/etc/hypha/certs/worker-cert.pem"
key_pem = "/etc/hypha/certs/worker-key.pem"
trust_pem = "/etc/hypha/certs/ca-bundle.pem"

# Network
gateway_addresses = [
    "/ip4/203.0.113.50/tcp/4001",
    "/ip4/198.51.100.25/tcp/4001"
]

listen_addresses = [
    "/ip4/0.0.0.0/tcp/0"
]

relay_circuit = true

# Resources
[resources]
cpu = 32
memory = 128
storage = 1000
gpu = 48  # 2x A6000 GPUs

# Work Directory
work_dir = "/var/hypha/work"

# Executors
[[executors]]
class = "train"
name = "diloco-transformer"
runtime = "process"
cmd = "uv"
args = [
    "run",
    "--python", "3.12",
    "--no-project",
    "--with", "https://github.com/hypha-space/hypha/releases/download/v0.1.0/hypha_accelerate_executor-0.1.0-py3-none-any.whl",
    "--extra", "cu128",
    "--",
    "accelerate",
    "launch",
    "--config_file", "/etc/hypha/accelerate-2gpu.yaml",
    "-m", "hypha.accelerate_executor.training",
    "--socket", "{SOCKET_PATH}",
    "--work-dir", "{WORK_DIR}",
    "--job", "{JOB_JSON}",
]

[[executors]]
class = "aggregate"
name = "parameter-server"
runtime = "parameter-server"

# Telemetry
telemetry_endpoint = "http://otel-collector:4318"
telemetry_protocol = "http/protobuf"

[telemetry_attributes]
"service.name" = "hypha-worker"
"worker.instance" = "worker-gpu-01"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "worker.toml"
    path.write_text(text)
    return path


# --- the original's files -------------------------------------------------------------------------------


def test_complete_example_of_the_worker_doc_parses(tmp_path, caplog):
    # given the original's complete example (libp2p keys, telemetry, work_dir written under [resources])
    path = write(tmp_path, COMPLETE_EXAMPLE)

    # when
    with caplog.at_level(logging.INFO, logger="worker_daemon.config"):
        config = load_config(path, environ={})

    # then the worker keys are read exactly
    assert config.capacity == protocol.Resources(cpu=32, memory=128, storage=1000, gpu=48)
    assert [(e.executor_class, e.name, e.runtime, e.cmd) for e in config.executors] == [
        ("train", "diloco-transformer", "process", "uv"),
        ("aggregate", "parameter-server", "parameter-server", None),
    ]
    assert config.executors[0].args[-6:] == [
        "--socket",
        "{SOCKET_PATH}",
        "--work-dir",
        "{WORK_DIR}",
        "--job",
        "{JOB_JSON}",
    ]
    assert len(config.executors[0].args) == 21
    assert config.executors[1].args == []
    assert (config.offer.price, config.offer.floor, config.strategy) == (100.0, 100.0, "whole")
    # TOML puts `work_dir = …` after [resources] inside that table, so the top-level default applies
    assert config.work_dir == Path(tempfile.gettempdir())
    # and the ignored keys are reported in one info line and one warning that explains the TOML pitfall
    records = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert records == [
        (
            "INFO",
            f"{path}: ignoring keys of the original's libp2p/telemetry transport (not used here): cert_pem, "
            "key_pem, trust_pem, gateway_addresses, listen_addresses, relay_circuit, telemetry_attributes, "
            "executors[1].telemetry_endpoint (a top-level key: move it above the first [table] header), "
            "executors[1].telemetry_protocol (a top-level key: move it above the first [table] header)",
        ),
        (
            "WARNING",
            f"{path}: ignoring unknown config keys: resources.work_dir "
            "(a top-level key: move it above the first [table] header)",
        ),
    ]


@pytest.mark.skipif(not SEED.exists(), reason="the shared seeds are not on this machine")
def test_every_worker_example_in_seed_002_parses(tmp_path):
    blocks = re.findall(r"```toml\n(.*?)```", SEED.read_text(), re.DOTALL)
    assert len(blocks) == 10
    for index, block in enumerate(blocks):
        config = load_config(write(tmp_path, block), environ={})
        assert config.executors, f"block {index}"


def test_original_keys_alone_are_only_logged_at_info(tmp_path, caplog):
    path = write(tmp_path, 'cert_pem = "a.pem"\nexclude_cidr = ["10.0.0.0/8"]\ncrls_pem = "c.pem"\n')
    with caplog.at_level(logging.INFO, logger="worker_daemon.config"):
        load_config(path, environ={})
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert caplog.records[0].getMessage().endswith(": cert_pem, exclude_cidr, crls_pem")


def test_unknown_keys_are_warned_about_by_path(tmp_path, caplog):
    path = write(
        tmp_path,
        'colour = "blue"\n[offer]\nprice = 1\nbonus = 2\n'
        '[[executors]]\nclass = "aggregate"\nname = "ps"\nruntime = "parameter-server"\ncmd = "x"\n',
    )
    with caplog.at_level(logging.INFO, logger="worker_daemon.config"):
        config = load_config(path, environ={})
    assert config.offer.price == 1.0
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            f"{path}: ignoring unknown config keys: colour, offer.bonus, "
            "executors[0].cmd (only used by runtime = 'process')",
        )
    ]


# --- defaults -----------------------------------------------------------------------------------------------


def test_defaults_without_a_file(monkeypatch, tmp_path):
    # given no file and no env
    # when
    config = load_config(None, environ={})

    # then
    assert config.work_dir == Path(tempfile.gettempdir())
    assert config.resources.cpu == float(os.cpu_count() or 1)
    assert config.resources.memory == total_memory_gb()
    assert config.resources.storage == free_disk_gb(Path(tempfile.gettempdir()))
    assert config.resources.gpu == 0.0
    assert (config.offer.price, config.offer.floor, config.strategy) == (100.0, 100.0, "whole")
    assert [e.model_dump(by_alias=True, exclude_unset=False) for e in config.executors] == [
        # the built-in trainer in one process, no `accelerate launch` (issue 15)
        {
            "class": "train",
            "name": "diloco-transformer",
            "runtime": "trainer",
            "cmd": None,
            "args": [],
            "env": {},
        },
        {
            "class": "aggregate",
            "name": "parameter-server",
            "runtime": "parameter-server",
            "cmd": None,
            "args": [],
            "env": {},
        },
        # the built-in batch inference executor (issue 19)
        {
            "class": "inference",
            "name": "batch-inference",
            "runtime": "inference",
            "cmd": None,
            "args": [],
            "env": {},
        },
    ]
    assert [d.key() for d in config.descriptors()] == [
        ("train", "diloco-transformer"),
        ("aggregate", "parameter-server"),
        ("inference", "batch-inference"),
    ]
    assert config.warm_start is True


def test_only_absent_resources_are_measured(tmp_path):
    config = load_config(write(tmp_path, "[resources]\ngpu = 16\ncpu = 2.5\n"), environ={})
    assert (config.resources.cpu, config.resources.gpu) == (2.5, 16.0)
    assert config.resources.memory == total_memory_gb()
    assert config.resources.gpu == 16.0


def test_memory_from_meminfo_and_its_fallback(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16777216 kB\nMemFree:  1 kB\n")
    assert total_memory_gb(meminfo=meminfo) == 16.0
    assert total_memory_gb(meminfo=tmp_path / "missing") == 1.0


def test_free_disk_of_a_work_dir_that_does_not_exist_yet(tmp_path):
    assert free_disk_gb(tmp_path / "not" / "yet") == free_disk_gb(tmp_path)


def test_relative_work_dir_is_resolved_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(write(tmp_path, 'work_dir = "jobs/../work"\n'), environ={})
    assert config.work_dir == tmp_path / "work"


def test_an_empty_executor_list_means_the_defaults(tmp_path):
    config = load_config(write(tmp_path, "executors = []\n"), environ={})
    assert [e.name for e in config.executors] == ["diloco-transformer", "parameter-server", "batch-inference"]
    assert [e.runtime for e in config.executors] == ["trainer", "parameter-server", "inference"]


# --- strategy -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "strategy"),
    [
        ('[offer]\nstrategy = "whole"\n', "whole"),
        ('[offer]\nstrategy = "flexible"\n', "flexible"),
        ('[offer]\nstrategy = { type = "flexible" }\n', "flexible"),
        ('[offer.strategy]\ntype = "whole"\n', "whole"),
        ("[offer]\nprice = 5\n", "whole"),
    ],
)
def test_strategy_as_table_or_bare_string(tmp_path, toml, strategy):
    assert load_config(write(tmp_path, toml), environ={}).strategy == strategy


# --- invalid values -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[resources]\ncpu = -1\n", "resources.cpu: Input should be greater than or equal to 0 (got -1)"),
        ('[resources]\nmemory = "64"\n', "resources.memory: Input should be a valid number (got '64')"),
        ("[resources]\ngpu = inf\n", "resources.gpu: Input should be a finite number (got inf)"),
        ("[resources]\nstorage = true\n", "resources.storage: Input should be a valid number (got True)"),
        ("[offer]\nfloor = -5.0\n", "offer.floor: Input should be greater than or equal to 0 (got -5.0)"),
        ('[offer]\nprice = "cheap"\n', "offer.price: Input should be a valid number (got 'cheap')"),
        (
            '[offer]\nstrategy = "greedy"\n',
            "offer.strategy.type: Input should be 'whole' or 'flexible' (got 'greedy')",
        ),
        (
            '[offer.strategy]\ntype = "all"\n',
            "offer.strategy.type: Input should be 'whole' or 'flexible' (got 'all')",
        ),
        ("work_dir = 5\n", "work_dir: Input is not a valid path"),
        ('work_dir = ""\n', "work_dir: must not be empty (got '')"),
        (
            '[[executors]]\nclass = "train"\nname = "t"\nruntime = "process"\n',
            "executors[0]: cmd is required when runtime = 'process'",
        ),
        (
            '[[executors]]\nclass = "train"\nname = "t"\nruntime = "docker"\n',
            "executors[0].runtime: Input should be 'process', 'parameter-server', 'trainer' or 'inference' (got 'docker')",
        ),
        ('[[executors]]\nname = "t"\nruntime = "parameter-server"\n', "executors[0].class: Field required"),
        (
            '[[executors]]\nclass = "train"\nname = "t"\nruntime = "process"\ncmd = "x"\nargs = ["--port", 1]\n',
            "executors[0].args[1]: Input should be a valid string (got 1)",
        ),
        (
            '[[executors]]\nclass = "a"\nname = "b"\nruntime = "parameter-server"\n'
            '[[executors]]\nclass = "a"\nname = "b"\nruntime = "parameter-server"\n',
            "executors[1] repeats class='a' name='b' of executors[0]; each class+name may be configured once",
        ),
        ("resources = 5\n", "resources: Input should be a valid dictionary or instance of ResourcesConfig"),
        ("slowdown = 0.5\n", "slowdown: Input should be greater than or equal to 1 (got 0.5)"),
        ("slowdown = 101\n", "slowdown: Input should be less than or equal to 100 (got 101)"),
        ("slowdown = nan\n", "slowdown: Input should be a finite number (got nan)"),
        ('slowdown = "2"\n', "slowdown: Input should be a valid number (got '2')"),
        ("benchmark = 1\n", "benchmark: Input should be a valid boolean (got 1)"),
        ('warm_start = "no"\n', "warm_start: Input should be a valid boolean (got 'no')"),
    ],
)
def test_invalid_values_name_the_key(tmp_path, toml, message):
    path = write(tmp_path, toml)
    with pytest.raises(ConfigError) as raised:
        load_config(path, environ={})
    assert str(raised.value).startswith(f"{path}: ")
    assert message in str(raised.value)
    assert raised.value.exit_code == ExitCode.USAGE == 2


def test_work_dir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"work_dir: '.*/file' exists and is not a directory"):
        load_config(None, environ={}, work_dir=str(tmp_path / "file"))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as raised:
        load_config(tmp_path / "nope.toml", environ={})
    assert str(raised.value) == f"config file {tmp_path / 'nope.toml'} not found"


def test_invalid_toml(tmp_path):
    path = write(tmp_path, "[resources\ncpu = 1\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path, environ={})
    assert str(raised.value).startswith(f"config file {path} is not valid TOML: ")


# --- layering -----------------------------------------------------------------------------------------------


def test_env_overrides_file_and_cli_overrides_both(tmp_path):
    path = write(tmp_path, f'work_dir = "{tmp_path / "file"}"\n[offer]\nprice = 1.0\nfloor = 2.0\n')
    environ = {"HYPHA_WORK_DIR": str(tmp_path / "env"), "HYPHA_TOKEN": "ignored", "HYPHA_PRICE": "ignored"}

    # file only
    config = load_config(path, environ={})
    assert (config.work_dir, config.offer.price, config.offer.floor) == (tmp_path / "file", 1.0, 2.0)

    # env over file (top-level keys only: HYPHA_PRICE is not one)
    config = load_config(path, environ=environ)
    assert (config.work_dir, config.offer.price, config.offer.floor) == (tmp_path / "env", 1.0, 2.0)

    # CLI over env and file
    config = load_config(path, environ=environ, work_dir=str(tmp_path / "cli"), price=150.0, floor=90.0)
    assert (config.work_dir, config.offer.price, config.offer.floor) == (tmp_path / "cli", 150.0, 90.0)


def test_cli_price_keeps_the_rest_of_the_offer_table(tmp_path):
    config = load_config(
        write(tmp_path, '[offer]\nfloor = 7\nstrategy = "flexible"\n'), environ={}, price=9.0
    )
    assert (config.offer.price, config.offer.floor, config.strategy) == (9.0, 7.0, "flexible")


def test_invalid_cli_value_names_the_key(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^config: offer.floor: Input should be a finite number \(got nan\)$"
    ):
        load_config(None, environ={}, floor=float("nan"))


def test_parameter_server_table_kill_grace_and_their_cli_overrides(tmp_path):
    # given defaults
    config = load_config(None, environ={})
    assert config.parameter_server.model_dump() == {
        "host": "127.0.0.1",
        "port": 0,
        "public_url": None,
        "reachable": "auto",
    }
    assert config.kill_grace == 5.0

    # when a file sets them, and flags override some
    path = write(
        tmp_path,
        'kill_grace = 2\n[parameter_server]\nhost = "0.0.0.0"\nport = 8470\npublic_url = "http://gpu-01:8470/"\n',
    )
    assert load_config(path, environ={}).parameter_server.model_dump() == {
        "host": "0.0.0.0",
        "port": 8470,
        "public_url": "http://gpu-01:8470",
        "reachable": "auto",
    }
    config = load_config(path, environ={}, ps_port=9000, ps_public_url="https://ps.example")

    # then
    assert (config.kill_grace, config.parameter_server.host) == (2.0, "0.0.0.0")
    assert (config.parameter_server.port, config.parameter_server.public_url) == (9000, "https://ps.example")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"ps_port": 70000}, "parameter_server.port: Input should be less than or equal to 65535"),
        ({"ps_public_url": "gpu-01:8470"}, "parameter_server.public_url: must be an http:// or https:// URL"),
    ],
)
def test_bad_parameter_server_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, environ={}, **overrides)


@pytest.mark.parametrize(
    ("server", "base"),
    [
        ("http://localhost:8000/", "http://localhost:8000"),
        ("wss://h.example/p/ws/worker/", "https://h.example/p"),
        ("https://h.example/prefix", "https://h.example/prefix"),
    ],
)
def test_http_base_url(server, base):
    assert http_base_url(server) == base


# --- server URL ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("server", "url"),
    [
        ("http://localhost:8000", "ws://localhost:8000/ws/worker/"),
        ("http://localhost:8000/", "ws://localhost:8000/ws/worker/"),
        ("https://hypha.example.org/prefix", "wss://hypha.example.org/prefix/ws/worker/"),
        ("HTTPS://hypha.example.org/prefix/", "wss://hypha.example.org/prefix/ws/worker/"),
        ("ws://10.0.0.1:9000/ws/worker/", "ws://10.0.0.1:9000/ws/worker/"),
        ("wss://h.example/p/ws/worker/", "wss://h.example/p/ws/worker/"),
        ("ws://h.example:1/p", "ws://h.example:1/p/ws/worker/"),
    ],
)
def test_websocket_url(server, url):
    assert websocket_url(server) == url


@pytest.mark.parametrize(
    ("server", "message"),
    [
        ("ftp://host", "--server 'ftp://host': the URL must start with http://, https://, ws:// or wss://"),
        (
            "localhost:8000",
            "--server 'localhost:8000': the URL must start with http://, https://, ws:// or wss://",
        ),
        ("http://", "--server 'http://': the URL has no host"),
    ],
)
def test_bad_server_url(server, message):
    with pytest.raises(ConfigError) as raised:
        websocket_url(server)
    assert str(raised.value) == message


def test_config_built_in_code_fills_defaults_too(tmp_path):
    config = WorkerConfig(work_dir=tmp_path, resources={"cpu": 4, "memory": 8, "storage": 10})
    assert config.capacity == protocol.Resources(cpu=4, memory=8, storage=10, gpu=0)
    assert config.summary() == (
        f"work_dir={tmp_path} resources=cpu:4 memory:8GB storage:10GB gpu:0GB price=100 floor=100 "
        "strategy=whole executors=[train/diloco-transformer, aggregate/parameter-server, "
        "inference/batch-inference]"
    )


def test_at_most_64_executors_because_hello_carries_no_more(tmp_path):
    entries = "".join(
        f'[[executors]]\nclass = "aggregate"\nname = "ps-{index}"\nruntime = "parameter-server"\n'
        for index in range(65)
    )
    with pytest.raises(
        ConfigError, match=r"executors: List should have at most 64 items after validation, not 65"
    ):
        load_config(write(tmp_path, entries), environ={})


def test_benchmark_and_slowdown_default_and_their_cli_overrides(tmp_path):
    # given defaults: benchmark at start, full speed
    config = load_config(None, environ={})
    assert (config.benchmark, config.slowdown) == (True, 1.0)
    assert "slowdown" not in config.summary()

    # when a file sets them, and flags override them
    path = write(tmp_path, "benchmark = false\nslowdown = 2\n")
    from_file = load_config(path, environ={})
    overridden = load_config(path, environ={}, benchmark=True, slowdown=3.5)

    # then
    assert (from_file.benchmark, from_file.slowdown) == (False, 2.0)
    assert (overridden.benchmark, overridden.slowdown) == (True, 3.5)
    assert from_file.summary().endswith(" slowdown=2")
    with pytest.raises(ConfigError, match=r"^config: slowdown: Input should be greater than or equal to 1"):
        load_config(None, environ={}, slowdown=0.9)


def test_resources_above_what_a_hello_may_declare_are_a_config_error(tmp_path):
    # given a config declaring more cores than the control plane accepts in a hello
    path = tmp_path / "worker.toml"
    path.write_text(f'work_dir = "{tmp_path}"\n[resources]\ncpu = 100000\n')

    # when / then: a clear error naming the key, not a crash when the hello is built
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert "cpu" in str(refused.value)
    assert "4096" in str(refused.value)


def test_warm_start_and_the_trainer_runtime_from_a_file(tmp_path, caplog):
    # given: warm spares off, and the built-in trainer configured by hand (with a cmd it does not use)
    path = write(
        tmp_path,
        'warm_start = false\n[[executors]]\nclass = "train"\nname = "t"\nruntime = "trainer"\ncmd = "x"\n',
    )

    # when
    with caplog.at_level(logging.INFO, logger="worker_daemon.config"):
        config = load_config(path, environ={})

    # then
    assert config.warm_start is False
    assert config.summary().endswith(" warm_start=false")
    assert [(e.executor_class, e.name, e.runtime) for e in config.executors] == [("train", "t", "trainer")]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: ignoring unknown config keys: executors[0].cmd (only used by runtime = 'process')"
    ]
