"""Reading an overlapping job's daemon logs (eager and streaming trainers, tests/e2e/test_overlap.py and
test_streaming.py): the digest of θ_r the parameter server published, each trainer's merges (the digest it
checked) and the order of its sends and merges."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TASK = re.compile(r"\[task ([0-9a-f]{8})\] ")
#: A trainer's merge of round r's result: (r, steps of the round in progress, that round, the digest checked).
MERGED = re.compile(
    r"round (\d+) merged after (\d+) steps of round (\d+).*, weights (sha256:[0-9a-f]+) \(checked\)"
)
PUBLISHED = re.compile(r"round (\d+): the global weights' digest is (sha256:[0-9a-f]+)")


@dataclass
class OverlapLogs:
    #: Round → the digest of θ_r the parameter server logged.
    published: dict[int, str] = field(default_factory=dict)
    #: Trainer task (first 8 hex digits) → its merges: (r, steps of the next round, that round, digest).
    merges: dict[str, list[tuple[int, int, int, str]]] = field(default_factory=dict)
    #: Trainer task → ("sent", r) and ("merged", r) in the order they were logged.
    order: dict[str, list[tuple[str, int]]] = field(default_factory=dict)


def read(logs: str, *, server: str, trainers: list[str], sent: re.Pattern[str]) -> OverlapLogs:
    """The events of ``logs`` (every daemon's, joined) for the parameter server task ``server`` and the trainer
    tasks ``trainers`` (ids; their first 8 characters are what the log lines carry); ``sent`` matches a
    trainer's end-of-round line, its first group the round."""
    found = OverlapLogs(
        merges={trainer[:8]: [] for trainer in trainers}, order={trainer[:8]: [] for trainer in trainers}
    )
    for line in logs.splitlines():
        owner = TASK.search(line)
        if owner is None:
            continue
        if owner[1] == server[:8] and (match := PUBLISHED.search(line)):
            found.published[int(match[1])] = match[2]
        elif owner[1] in found.merges and (match := MERGED.search(line)):
            found.merges[owner[1]].append((int(match[1]), int(match[2]), int(match[3]), match[4]))
            found.order[owner[1]].append(("merged", int(match[1])))
        elif owner[1] in found.merges and (match := sent.search(line)):
            found.order[owner[1]].append(("sent", int(match[1])))
    return found
