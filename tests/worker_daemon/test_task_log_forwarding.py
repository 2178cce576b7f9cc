"""A task's whole output reaches the control plane in ``task_log`` frames (which keeps it as the task's full
log, issue 16 item 8): the lines printed since the last interval go out before its ``job_exited``, a burst
goes out in frames of at most ``LOG_BATCH_LINES``, and lines dropped past the buffer are said, not lost
silently. Real child processes (the executor of ``test_jobs``)."""

from __future__ import annotations

import asyncio

from tests.worker_daemon.test_jobs import book, config, dispatch, manager, script  # noqa: F401 (fixtures)
from worker_daemon import jobs as jobs_module
from worker_daemon import protocol

EXECUTOR_LINES = [f"line {n}" for n in range(60)] + ["to stderr"]


async def sent_until_exit(answerer, timeout: float = 20.0) -> list:
    deadline = asyncio.get_running_loop().time() + timeout
    while not answerer.of_type(protocol.JobExited):
        assert asyncio.get_running_loop().time() < deadline, "no job_exited"
        await asyncio.sleep(0.02)
    return list(answerer.sent)


async def test_the_lines_since_the_last_interval_go_out_before_the_exit(
    manager,  # noqa: F811 (the fixture imported above)
    answerer,
    short_dir,
    monkeypatch,
):
    # given: an interval that never comes while the task runs
    monkeypatch.setattr(jobs_module, "LOG_FORWARD_INTERVAL", 600.0)

    # when: a task prints its lines and exits
    task = manager.start(dispatch(short_dir / "record.json", mode="exit"))
    await asyncio.wait_for(task.runner, 20)
    sent = await sent_until_exit(answerer)

    # then: every line went out once, in task_log frames posted before its job_exited
    logs = [index for index, message in enumerate(sent) if isinstance(message, protocol.TaskLog)]
    (exited,) = [index for index, message in enumerate(sent) if isinstance(message, protocol.JobExited)]
    assert logs and max(logs) < exited
    forwarded = [line for index in logs for line in sent[index].lines]
    assert sorted(forwarded) == sorted(EXECUTOR_LINES)


async def test_a_burst_goes_out_in_bounded_frames_and_dropped_lines_are_said(
    manager,  # noqa: F811 (the fixture imported above)
    answerer,
    short_dir,
    monkeypatch,
):
    # given: a buffer of 20 lines, frames of 8, and an interval that never comes while the task runs
    monkeypatch.setattr(jobs_module, "LOG_FORWARD_INTERVAL", 600.0)
    monkeypatch.setattr(jobs_module, "LOG_BUFFER_LINES", 20)
    monkeypatch.setattr(jobs_module, "LOG_BATCH_LINES", 8)

    # when: the task prints 61 lines at once
    task = manager.start(dispatch(short_dir / "record.json", mode="exit"))
    await asyncio.wait_for(task.runner, 20)
    await sent_until_exit(answerer)

    # then: the newest 20 lines, after one saying how many were dropped, in frames of at most 8
    frames = answerer.of_type(protocol.TaskLog)
    assert [len(frame.lines) for frame in frames] == [8, 8, 5]
    first, *kept = [line for frame in frames for line in frame.lines]
    assert first == (
        "[hypha: 41 lines of output were not forwarded (more than 20 lines or 131072 characters in 600 s)]"
    )
    assert len(kept) == 20 and set(kept) <= set(EXECUTOR_LINES)


async def test_the_buffer_and_the_frames_are_bounded_in_characters_too(
    manager,  # noqa: F811 (the fixture imported above)
    answerer,
    short_dir,
    monkeypatch,
):
    # given: a buffer of 100 characters and frames of 40
    monkeypatch.setattr(jobs_module, "LOG_FORWARD_INTERVAL", 600.0)
    monkeypatch.setattr(jobs_module, "LOG_BUFFER_CHARS", 100)
    monkeypatch.setattr(jobs_module, "LOG_BATCH_CHARS", 40)

    # when
    task = manager.start(dispatch(short_dir / "record.json", mode="exit"))
    await asyncio.wait_for(task.runner, 20)
    await sent_until_exit(answerer)

    # then: the newest lines within 100 characters, in frames of at most 40 (the long note has one of its own)
    frames = answerer.of_type(protocol.TaskLog)
    first, *kept = [line for frame in frames for line in frame.lines]
    assert first == (
        f"[hypha: {61 - len(kept)} lines of output were not forwarded (more than 500 lines or 100 characters "
        "in 600 s)]"
    )
    assert frames[0].lines == [first]
    assert 90 <= sum(map(len, kept)) <= 100 and set(kept) <= set(EXECUTOR_LINES)
    assert all(sum(map(len, frame.lines)) <= 40 for frame in frames[1:])
