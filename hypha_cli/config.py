"""Where the CLI finds its server and token, and the config file ``hypha login`` writes.

Each setting comes from the first of: the command-line flag, the environment (``HYPHA_SERVER``,
``HYPHA_API_TOKEN``), the config file (``$HYPHA_CONFIG``, else ``~/.config/hypha/cli.json``); the saved token
is only sent to the saved server, never to one named by a flag or the environment. The file is JSON,
``{"server": ..., "token": ...}``, written atomically with mode 0600 in a directory created 0700: it holds a
credential.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from hypha_cli.exceptions import AuthenticationError, UsageError

#: Default seconds every HTTP call may take (connecting, and each read or write).
DEFAULT_TIMEOUT = 30.0


@dataclass(frozen=True)
class Settings:
    """What a command needs to talk to the control plane."""

    server: str
    token: str | None
    timeout: float = DEFAULT_TIMEOUT


def config_path(environ: Mapping[str, str]) -> Path:
    """The config file: ``$HYPHA_CONFIG``, else ``$XDG_CONFIG_HOME/hypha/cli.json``, else
    ``~/.config/hypha/cli.json``."""
    if environ.get("HYPHA_CONFIG"):
        return Path(environ["HYPHA_CONFIG"]).expanduser()
    base = environ.get("XDG_CONFIG_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".config")
    return Path(base) / "hypha" / "cli.json"


def load_config(path: Path) -> dict[str, str]:
    """The saved settings (``{}`` when the file does not exist). Raises :class:`UsageError` for a file that
    cannot be read or is not a JSON object of strings."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as error:
        raise UsageError(f"cannot read the config file {path}: {error.strerror or error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(
            f"the config file {path} is not valid JSON ({error}); run `hypha login` again"
        ) from None
    if not isinstance(data, dict) or not all(isinstance(value, str) for value in data.values()):
        raise UsageError(f"the config file {path} is not a JSON object of strings; run `hypha login` again")
    with contextlib.suppress(OSError):
        if path.stat().st_mode & 0o077:
            print(f"hypha: warning: {path} is readable by others; chmod 600 it", file=sys.stderr)
    return data


def save_config(path: Path, values: Mapping[str, str]) -> None:
    """Write ``values`` to ``path`` atomically, mode 0600 (the parent directory is created 0700)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        # Created 0600 from the start: the token must never sit in a file others could read, not even briefly.
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                json.dump(dict(values), handle, indent=2)
                handle.write("\n")
            os.chmod(temporary, 0o600)  # O_CREAT leaves an existing file's mode alone
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    except OSError as error:
        raise UsageError(f"cannot write the config file {path}: {error.strerror or error}") from None


def normalise_server(url: str) -> str:
    """``url`` without trailing slashes; :class:`UsageError` unless it is an absolute http(s) URL."""
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"--server must be an http(s)://host[:port] URL, not {url!r}")
    return url.rstrip("/")


def resolve(
    *,
    server: str | None,
    token: str | None,
    timeout: float | None,
    environ: Mapping[str, str],
    need_token: bool = True,
) -> Settings:
    """The settings of a command: flags, then the environment, then the config file."""
    saved = load_config(config_path(environ))
    chosen_server = server or environ.get("HYPHA_SERVER") or saved.get("server")
    if not chosen_server:
        raise UsageError("no server: run `hypha login --server URL`, or pass --server or set HYPHA_SERVER")
    chosen_server = normalise_server(chosen_server)
    chosen_token = token or environ.get("HYPHA_API_TOKEN")
    if not chosen_token and saved.get("token") and _same_server(saved.get("server"), chosen_server):
        # The saved token belongs to the saved server: never send it to another one.
        chosen_token = saved["token"]
    if need_token and not chosen_token:
        raise AuthenticationError(
            f"not logged in to {chosen_server}: run `hypha login --server {chosen_server}`, "
            "or pass --token or set HYPHA_API_TOKEN"
        )
    return Settings(
        server=chosen_server,
        token=chosen_token,
        timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
    )


def _same_server(saved: str | None, chosen: str) -> bool:
    try:
        return saved is not None and normalise_server(saved) == chosen
    except UsageError:
        return False
