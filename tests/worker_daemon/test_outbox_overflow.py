"""The daemon's outbox in a long disconnect (``worker_daemon.link.ControlLink``): frames that change state at
the control plane (a task's ``job_started`` and ``job_exited``, slice acks) are never dropped, however much
output a task prints meanwhile. A task's waiting ``task_log`` frames merge into bounded frames, and when the
outbox is full its oldest log lines go first, said in the task's log rather than lost silently.

Every frame is sent as the daemon sends it (``protocol.encode``) and read back with the control plane's own
parser (``protocol.parse_daemon_message``)."""

from __future__ import annotations

import uuid

from worker_daemon import link as link_module
from worker_daemon import protocol
from worker_daemon.link import ControlLink

QUIET = uuid.UUID(int=1)  # a task that starts, prints a little and exits early in the outage
CHATTY = uuid.UUID(int=2)  # a task that prints a line at a time for the rest of it


class ControlPlane:
    """What reaches the control plane: each frame encoded as on the wire and parsed by the server's parser."""

    def __init__(self) -> None:
        self.received: list = []

    async def send(self, message) -> None:
        self.received.append(protocol.parse_daemon_message(protocol.encode(message)))

    def of_type(self, kind) -> list:
        return [message for message in self.received if isinstance(message, kind)]

    def lines_of(self, task_id: uuid.UUID) -> list[str]:
        return [
            line
            for frame in self.of_type(protocol.TaskLog)
            if frame.task_id == task_id
            for line in frame.lines
        ]


async def reconnect(link: ControlLink) -> ControlPlane:
    control_plane = ControlPlane()
    link.connected(control_plane.send)
    assert await link.flush(timeout=10.0)
    return control_plane


async def test_an_exit_posted_early_in_a_long_outage_survives_the_log_frames_after_it():
    # given: a small outbox, cut off; one task starts and exits, another prints 5,000 lines one frame at a
    # time (two tasks interleaved, so their frames cannot all merge) and exits too
    link = ControlLink(max_queued=50)
    link.post(protocol.JobStarted(task_id=QUIET))
    link.post(protocol.TaskLog(task_id=QUIET, lines=["quiet says hello"]))
    link.post(protocol.JobExited(task_id=QUIET, exit_code=0))
    link.post(protocol.JobStarted(task_id=CHATTY))
    for number in range(5000):
        link.post(protocol.TaskLog(task_id=CHATTY, lines=[f"chatty {number}"]))
        if number % 7 == 0:
            link.post(protocol.SliceAck(task_id=CHATTY, index=number))
    link.post(protocol.JobExited(task_id=CHATTY, exit_code=3))

    # when: the connection comes back
    control_plane = await reconnect(link)

    # then: every state frame arrived, in the order posted (the log lines made room for them)
    states = [
        (message.type, message.task_id)
        for message in control_plane.received
        if isinstance(message, protocol.JobStarted | protocol.JobExited)
    ]
    assert states == [
        ("job_started", QUIET),
        ("job_exited", QUIET),
        ("job_started", CHATTY),
        ("job_exited", CHATTY),
    ]
    assert [exit.exit_code for exit in control_plane.of_type(protocol.JobExited)] == [0, 3]
    assert [ack.index for ack in control_plane.of_type(protocol.SliceAck)] == list(range(0, 5000, 7))
    assert control_plane.received[-1] == protocol.JobExited(task_id=CHATTY, exit_code=3)


async def test_the_newest_log_lines_are_kept_and_the_dropped_ones_are_said():
    # given
    link = ControlLink(max_queued=20)
    link.post(protocol.JobStarted(task_id=CHATTY))
    for number in range(10_000):
        link.post(protocol.TaskLog(task_id=CHATTY, lines=[f"chatty {number}"]))
        link.post(protocol.TaskLog(task_id=QUIET, lines=[f"quiet {number}"]))
    link.post(protocol.JobExited(task_id=CHATTY, exit_code=0))
    assert len(link.queued) <= 20

    # when
    control_plane = await reconnect(link)

    # then: each task's lines that arrived are its newest, in order, after one line saying how many went
    for task_id, prefix in ((CHATTY, "chatty"), (QUIET, "quiet")):
        lines = control_plane.lines_of(task_id)
        notice, kept = lines[0], lines[1:]
        dropped = 10_000 - len(kept)
        assert dropped > 0
        assert kept == [f"{prefix} {number}" for number in range(dropped, 10_000)]
        assert notice == (
            f"[hypha: {dropped} lines of output were not forwarded (the control plane was unreachable and "
            f"the daemon's outbox was full)]"
        )
    assert control_plane.received[-1] == protocol.JobExited(task_id=CHATTY, exit_code=0)


async def test_a_tasks_waiting_log_frames_merge_into_bounded_frames_and_lose_nothing():
    # given: one task's output, a line a frame, while cut off
    link = ControlLink()
    for number in range(1000):
        link.post(protocol.TaskLog(task_id=CHATTY, lines=[f"line {number}"]))
    long_lines = ["x" * 1000] * 100
    for line in long_lines:
        link.post(protocol.TaskLog(task_id=CHATTY, lines=[line]))

    # when
    control_plane = await reconnect(link)

    # then: every line, in order, in frames of at most LOG_MERGE_LINES lines and LOG_MERGE_CHARS characters
    assert control_plane.lines_of(CHATTY) == [f"line {number}" for number in range(1000)] + long_lines
    frames = control_plane.of_type(protocol.TaskLog)
    assert len(frames) == 1000 // link_module.LOG_MERGE_LINES + 4  # 100 lines of 1000 characters: 32+32+32+4
    assert all(len(frame.lines) <= link_module.LOG_MERGE_LINES for frame in frames)
    assert all(sum(map(len, frame.lines)) <= link_module.LOG_MERGE_CHARS for frame in frames)


async def test_frames_that_are_not_logs_are_kept_past_the_bound_rather_than_dropped():
    # given: nothing droppable queued (no logs), more state frames than the bound
    link = ControlLink(max_queued=5)
    for index in range(12):
        link.post(protocol.SliceAck(task_id=CHATTY, index=index))
    link.post(protocol.JobExited(task_id=CHATTY, exit_code=0))

    # when
    control_plane = await reconnect(link)

    # then
    assert [ack.index for ack in control_plane.of_type(protocol.SliceAck)] == list(range(12))
    assert control_plane.of_type(protocol.JobExited) == [protocol.JobExited(task_id=CHATTY, exit_code=0)]
