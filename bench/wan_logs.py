"""bench/wan.py's reading of the processes' logs: when each trainer's rounds ended and merged, when the
parameter server accepted, closed and published each round (module docstring of ``bench/wan.py``), and each
trainer's utilisation from them. One machine, one clock: the timestamps are comparable."""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field

# --- the processes' logs -----------------------------------------------------------------------------------

#: A log line; the greedy prefix makes ``at`` the innermost timestamp (the executor's or the parameter
#: server's own, inside the daemon's line that relays it).
LOG_LINE = re.compile(
    r"^.*(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) +(?P<level>[A-Z]+) +(?P<logger>[\w.]+): (?P<message>.*)$"
)
MERGED = re.compile(r"round (?P<round>\d+): \d+ steps, .*, sync (?P<sync>[\d.]+) s")
#: An eager trainer's end of round r (update sent, round r + 1 started) and its later merge of round r's result.
SENT_EAGER = re.compile(r"round (?P<round>\d+): \d+ steps, .*, sent in (?P<sent>[\d.]+) s; round \d+ starts")
MERGED_EAGER = re.compile(
    r"round (?P<round>\d+) merged after (?P<steps>\d+) steps of round \d+(?: \(waited (?P<waited>[\d.]+) s\))?"
)
SENT = re.compile(r"task (?P<task>[0-9a-f-]+): round (?P<round>\d+) update sent")
RECEIVED = re.compile(r"task (?P<task>[0-9a-f-]+): received round (?P<round>\d+) result(?P<relay> through)?")
ACCEPTED = re.compile(r"round (?P<round>\d+): update from (?P<peer>\S+) accepted")
CLOSES = re.compile(r"round (?P<round>\d+) closes: ")
PUBLISHED = re.compile(r"round (?P<round>\d+) published: ")
CHECKPOINT = re.compile(r"uploaded \S+ \((?P<bytes>\d+) bytes\) to \S*/checkpoint/(?P<round>\d+)/")
RELAY_SERVER_LINE = "trainers reach this server through the control plane's relay"


@dataclass
class Timeline:
    """What the logs of one job say, as epoch seconds."""

    merged: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)  # (task, r) → (at, sync)
    #: An eager trainer's rounds: (task, r) → (at, seconds the sending took), and its merges: (task, r) →
    #: (at, steps of round r + 1 before it, seconds it waited for the result at the end of round r + 1).
    sent_eager: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    merged_eager: dict[tuple[str, int], tuple[float, int, float]] = field(default_factory=dict)
    sent: dict[tuple[str, int], float] = field(default_factory=dict)  # (task, r) → at
    received: dict[tuple[str, int], float] = field(default_factory=dict)
    through_relay: set[str] = field(default_factory=set)  # trainer tasks that received results through it
    accepted: dict[tuple[str, int], float] = field(default_factory=dict)  # (peer, r) → at
    closes: dict[int, float] = field(default_factory=dict)
    published: dict[int, float] = field(default_factory=dict)
    checkpoint_bytes: dict[int, int] = field(default_factory=dict)
    server_relayed: bool = False


def _epoch(stamp: str) -> float:
    # The processes log local time without a zone; this machine's zone makes it comparable to time.time().
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def parse_timeline(logs: dict[str, str], job: dict) -> Timeline:
    """The job's events from its daemons' log text (written since the job was submitted)."""
    timeline = Timeline()
    tasks = {str(task["id"]): task for task in job["tasks"]}
    prefixes = {task_id[:8]: task_id for task_id in tasks}
    server_prefixes = {task_id[:8] for task_id, task in tasks.items() if task["role"] == "parameter_server"}
    for text in logs.values():
        for line in text.splitlines():
            match = LOG_LINE.match(line)
            if match is None:
                continue
            at, message = _epoch(match["at"]), match["message"]
            relayed = re.search(r"\[task ([0-9a-f]{8})\] ", line)
            owner = prefixes.get(relayed[1]) if relayed else None
            if relayed and owner is None:
                continue  # another job's process
            if owner is not None and relayed[1] in server_prefixes:
                if found := ACCEPTED.search(message):
                    timeline.accepted.setdefault((found["peer"], int(found["round"])), at)
                elif found := CLOSES.search(message):
                    timeline.closes.setdefault(int(found["round"]), at)
                elif found := PUBLISHED.search(message):
                    timeline.published.setdefault(int(found["round"]), at)
                elif found := CHECKPOINT.search(message):
                    number = int(found["round"])
                    timeline.checkpoint_bytes[number] = timeline.checkpoint_bytes.get(number, 0) + int(
                        found["bytes"]
                    )
                elif RELAY_SERVER_LINE in message:
                    timeline.server_relayed = True
            elif owner is not None:
                if found := MERGED.search(message):
                    timeline.merged[(owner, int(found["round"]))] = (at, float(found["sync"]))
                elif found := SENT_EAGER.search(message):
                    timeline.sent_eager[(owner, int(found["round"]))] = (at, float(found["sent"]))
                elif found := MERGED_EAGER.search(message):
                    timeline.merged_eager[(owner, int(found["round"]))] = (
                        at,
                        int(found["steps"]),
                        float(found["waited"] or 0.0),
                    )
            elif (found := SENT.search(message)) and found["task"] in tasks:
                timeline.sent.setdefault((found["task"], int(found["round"])), at)
            elif (found := RECEIVED.search(message)) and found["task"] in tasks:
                timeline.received.setdefault((found["task"], int(found["round"])), at)
                if found["relay"]:
                    timeline.through_relay.add(found["task"])
    return timeline


def trainer_round(timeline: Timeline, task_id: str, number: int) -> tuple[float, float, float | None] | None:
    """A trainer's round ``number``: (end of its inner loop, end of the round — the next round's start —, round
    ``number``'s result merged), None when the logs do not say. A trainer that waits ends its round with the
    merge; an eager one when it has sent its update (and merges later, in the next round)."""
    if (task_id, number) in timeline.merged:
        at, sync = timeline.merged[(task_id, number)]
        return at - sync, at, at
    if (task_id, number) in timeline.sent_eager:
        at, after_steps = timeline.sent_eager[(task_id, number)]
        merged = timeline.merged_eager.get((task_id, number))
        return at - after_steps, at, merged[0] if merged else None
    return None


def utilisation(job: dict, timeline: Timeline) -> list[dict]:
    """Per trainer, over the steady rounds 2…R: Σ ``train_seconds`` ÷ (end of round R − end of round 1), and
    what else it spent: the seconds it waited for a result (eager: at a round's end; none: the whole sync)."""
    trainers = [task for task in job["tasks"] if task["role"] == "trainer"]
    closed = sorted((r for r in job["rounds"] if r["closed"]), key=lambda r: r["number"])
    found = []
    for task in trainers:
        task_id, worker = str(task["id"]), str(task["worker_id"])
        ends = {r["number"]: trainer_round(timeline, task_id, r["number"]) for r in closed}
        numbers = [number for number, end in ends.items() if end is not None]
        if len(numbers) < 2 or numbers != list(range(numbers[0], numbers[-1] + 1)):
            continue
        first, last = numbers[0], numbers[-1]
        steady = [r for r in closed if first < r["number"] <= last]
        metrics = [r["trainer_metrics"].get(worker) or {} for r in steady]
        if not all("train_seconds" in m for m in metrics):
            continue
        wall = ends[last][1] - ends[first][1]
        train = sum(float(m["train_seconds"]) for m in metrics)
        waited = sum(timeline.merged_eager.get((task_id, r["number"] - 1), (0.0, 0, 0.0))[2] for r in steady)
        found.append(
            {"task": task_id, "rounds": f"{first + 1}…{last}", "train": train, "wall": wall,
             "utilisation": train / wall if wall > 0 else None, "waited": waited}
        )  # fmt: skip
    return found
