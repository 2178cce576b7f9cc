"""Why a task's process failed, read from the last lines of its output.

A trainer configured as a ``process`` executor under ``accelerate launch`` (the default before the ``trainer``
runtime, and still anyone's choice) runs under a launcher that re-raises its child's failure as its own: the
output of a trainer that could not reach its parameter server ends with the launcher's traceback and
``subprocess.CalledProcessError: Command '['…/python', '-m', 'worker_daemon.executors.training', …]' returned
non-zero exit status 3.`` — true, and useless. :func:`root_cause` skips such wrappers and the traceback frames,
and returns the failure the executor itself reported, the latest one in the output:

* an exception line closing a traceback (``ValueError: …``); of a chain (``The above exception was the direct
  cause of the following exception:``, ``During handling of the above exception, …``), the innermost, the
  first one printed, which is where it began;
* or a log record at ERROR or CRITICAL (``… ERROR worker_daemon.executors.training: BridgeCallError: …``: how
  the built-in executors report their own errors), whichever came later.

A bridge error's JSON body (``{"error": "connector_error", "detail": "…"}``) is shortened to
``connector_error: …``. A CUDA out-of-memory error (``torch.OutOfMemoryError: CUDA out of memory. Tried to
allocate 2.00 GiB. GPU 0 has a total capacity of …``, or the older ``(GPU 0; 15.90 GiB total capacity; …)``)
is put as ``CUDA out of memory on device 0 (tried to allocate 2.00 GiB; …)``. Pure functions of text: used by
the job manager when a process exits non-zero.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

#: Exceptions that only say a child process failed: the launcher's wrappers around the real failure.
WRAPPER_EXCEPTIONS = frozenset(
    {
        "subprocess.CalledProcessError",
        "CalledProcessError",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
        "ChildFailedError",
    }
)
#: Longest cause returned (it goes into ``job_exited.reason`` and the job's status reason).
MAX_CAUSE = 500

_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)
# The line after a traceback's frames: `module.Name: message`, or a bare `module.Name`.
_EXCEPTION_LINE = re.compile(r"^(?P<name>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)(?::\s?(?P<message>.*))?$")
# A log record of the built-in formats: `… ERROR logger.name: message` (asctime and the rest before it).
_ERROR_RECORD = re.compile(r"(?:^|\s)(?:ERROR|CRITICAL)\s+[\w.\-\[\]]+:\s(?P<message>.+)$")
# PyTorch's out-of-memory message: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of
# 79.15 GiB of which 3.75 MiB is free. …" (2.x), or "… Tried to allocate 2.00 MiB (GPU 0; 15.90 GiB total
# capacity; 14.50 GiB already allocated; …)" (1.x).
_CUDA_OOM = "CUDA out of memory"
_OOM_ALLOCATE = re.compile(r"Tried to allocate (?P<size>[\d.]+ ?[KMGT]?i?B)", re.IGNORECASE)
_OOM_DEVICE = re.compile(r"GPU (?P<device>\d+)")
_OOM_CAPACITY = re.compile(
    r"total capacity of (?P<total>[\d.]+ ?[KMGT]?i?B) of which (?P<free>[\d.]+ ?[KMGT]?i?B) is free"
    r"|(?P<total_old>[\d.]+ ?[KMGT]?i?B) total capacity"
)
# A bridge error's body inside a message: {"error": "connector_error", "detail": "..."}.
_BRIDGE_BODY = re.compile(r"HTTP \d{3}: (?P<body>\{.*\})\s*$")


def root_cause(lines: Iterable[str]) -> str:
    """The failure the output's last lines tell of (see the module docstring), or "" when they tell none."""
    found = ""
    chain: list[str] = []  # exception lines of the traceback chain being read, outermost last
    in_traceback = chained = False
    for raw in lines:
        line = raw.rstrip()
        if line == _TRACEBACK:
            if not chained:
                chain = []  # a traceback of its own, not the next link of the chain before it
            in_traceback, chained = True, False
            continue
        if line in _CHAINED:
            chained = True  # the chain goes on: its next traceback follows
            continue
        if in_traceback:
            if not line or line[0].isspace():
                continue  # a frame, its source line, or a caret marker
            match = _EXCEPTION_LINE.match(line)
            in_traceback = False
            if match is None:
                continue  # not an exception line after all (a traceback cut short)
            if match["name"] not in WRAPPER_EXCEPTIONS:
                chain.append(_exception_text(match["name"], match["message"]))
                # The first (innermost) of the chain is where it began.
                found = chain[0]
            continue
        if line:
            chain, chained = [], False  # output after the traceback: a later failure has a chain of its own
        record = _ERROR_RECORD.search(line)
        if record is not None:
            found = _shortened(record["message"])
    return _out_of_memory(found)[:MAX_CAUSE]


def _out_of_memory(cause: str) -> str:
    """``cause`` as ``CUDA out of memory on device N (tried to allocate X; total capacity Y, Z free)`` when it
    is PyTorch's CUDA out-of-memory error (what PyTorch's message tells of it), else ``cause`` itself."""
    if _CUDA_OOM not in cause:
        return cause
    device = _OOM_DEVICE.search(cause)
    facts = []
    if (allocate := _OOM_ALLOCATE.search(cause)) is not None:
        facts.append(f"tried to allocate {allocate['size']}")
    if (capacity := _OOM_CAPACITY.search(cause)) is not None:
        if capacity["total"]:
            facts.append(f"total capacity {capacity['total']}, {capacity['free']} free")
        else:
            facts.append(f"total capacity {capacity['total_old']}")
    where = f" on device {device['device']}" if device is not None else ""
    return f"{_CUDA_OOM}{where}" + (f" ({'; '.join(facts)})" if facts else "")


def _exception_text(name: str, message: str | None) -> str:
    short = name.rsplit(".", 1)[-1]
    return f"{short}: {_shortened(message)}" if message else short


def _shortened(message: str) -> str:
    """``message`` with a bridge error's JSON body put as ``kind: detail``."""
    match = _BRIDGE_BODY.search(message)
    if match is None:
        return message.strip()
    try:
        body = json.loads(match["body"])
    except ValueError:
        return message.strip()
    if not isinstance(body, dict) or not isinstance(body.get("detail"), str):
        return message.strip()
    kind = body.get("error") if isinstance(body.get("error"), str) else "error"
    return f"{message[: match.start()]}{kind}: {body['detail']}".strip()
