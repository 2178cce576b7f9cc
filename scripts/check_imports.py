"""Fail when code that runs on GPU hosts (or a user's machine) imports the control plane.

``worker_daemon/``, ``parameter_server/``, ``data_node/`` and ``hypha_cli/`` are installed from
``requirements/daemon.txt``, which has no
Django and no database driver: an import of ``apps``, ``hypha_site`` or a server-only library there works in
the development venv and breaks on a real worker. Run by ``scripts/check``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DAEMON_PACKAGES = ("worker_daemon", "parameter_server", "data_node", "hypha_cli", "hypha_tensors")
FORBIDDEN = frozenset(
    {
        "apps",
        "hypha_site",
        "django",
        "rest_framework",
        "drf_spectacular",
        "channels",
        "channels_redis",
        "daphne",
        "celery",
        "psycopg",
        "redis",
        "boto3",
        "botocore",
    }
)


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level module) for every absolute import in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def main() -> int:
    problems = []
    for package in DAEMON_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for line, module in imported_modules(tree):
                if module in FORBIDDEN:
                    problems.append(f"{path.relative_to(ROOT)}:{line}: imports {module!r}")
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(
            f"{len(problems)} forbidden import(s): {', '.join(DAEMON_PACKAGES)} run without Django or a "
            "database driver (requirements/daemon.txt); move shared code to worker_daemon/protocol/",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
