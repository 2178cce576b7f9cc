"""Where the CLI's server and token come from, and the config file ``hypha login`` writes."""

from __future__ import annotations

import json
import stat

import pytest

from hypha_cli import config
from hypha_cli.exceptions import AuthenticationError, UsageError


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "cli.json"
    config.save_config(path, {"server": "http://saved.test", "token": "saved-token"})
    return {"HYPHA_CONFIG": str(path)}


def test_the_config_file_is_written_0600_and_replaces_a_looser_one(tmp_path):
    path = tmp_path / "dir" / "cli.json"
    path.parent.mkdir()
    path.write_text("{}")
    path.chmod(0o644)

    config.save_config(path, {"server": "http://a.test", "token": "t"})

    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"server": "http://a.test", "token": "t"}
    assert [entry.name for entry in path.parent.iterdir()] == ["cli.json"]  # no temporary file left


def test_the_default_config_path_is_under_the_home_config_dir(tmp_path):
    assert config.config_path({"HOME": str(tmp_path)}) == tmp_path / ".config" / "hypha" / "cli.json"
    assert config.config_path({"HYPHA_CONFIG": "/x/y.json", "HOME": str(tmp_path)}).as_posix() == "/x/y.json"


def test_flags_beat_the_environment_which_beats_the_config_file(saved):
    environ = {**saved, "HYPHA_SERVER": "http://env.test/", "HYPHA_API_TOKEN": "env-token"}

    assert config.resolve(server=None, token=None, timeout=None, environ=saved) == config.Settings(
        server="http://saved.test", token="saved-token", timeout=config.DEFAULT_TIMEOUT
    )
    assert config.resolve(server=None, token=None, timeout=None, environ=environ) == config.Settings(
        server="http://env.test", token="env-token"
    )
    assert config.resolve(
        server="http://flag.test", token="flag-token", timeout=5, environ=environ
    ) == config.Settings(server="http://flag.test", token="flag-token", timeout=5)


def test_the_saved_token_is_never_sent_to_another_server(saved):
    with pytest.raises(AuthenticationError, match="not logged in to http://other.test"):
        config.resolve(server="http://other.test", token=None, timeout=None, environ=saved)
    # the same server spelt with a trailing slash is the same server
    assert (
        config.resolve(server="http://saved.test/", token=None, timeout=None, environ=saved).token
        == "saved-token"
    )


def test_no_server_anywhere_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no server: run `hypha login --server URL`"):
        config.resolve(
            server=None, token=None, timeout=None, environ={"HYPHA_CONFIG": str(tmp_path / "none.json")}
        )


@pytest.mark.parametrize("content", ["{not json", '["a list"]', '{"server": 1}'])
def test_a_broken_config_file_is_a_usage_error_naming_it(tmp_path, content):
    path = tmp_path / "cli.json"
    path.write_text(content)
    with pytest.raises(UsageError, match=str(path)):
        config.load_config(path)
