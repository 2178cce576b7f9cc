"""The CLI runs on a user's laptop with httpx and rich only: it never imports the control plane."""

from __future__ import annotations

import ast
from pathlib import Path

from scripts.check_imports import FORBIDDEN, imported_modules

PACKAGE = Path(__file__).resolve().parents[2] / "hypha_cli"


def test_hypha_cli_imports_nothing_of_the_control_plane() -> None:
    found = [
        f"{path.name}:{line}: {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, module in imported_modules(ast.parse(path.read_text(encoding="utf-8")))
        if module in FORBIDDEN or module in {"worker_daemon", "parameter_server", "data_node", "bench"}
    ]
    assert found == []
