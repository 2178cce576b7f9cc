"""A round's report counts the relay bytes of its own round (a CI run of tests/e2e/test_wan.py counted three
updates in a round of two trainers: the next round's first update came through the relay while the report
waited for the result's upload and the evaluation)."""

from __future__ import annotations

from pathlib import Path

from parameter_server.relay_pump import RelayPump


def pump(tmp_path: Path) -> RelayPump:
    return RelayPump(
        client=None,  # type: ignore[arg-type]  # the accounting sends nothing
        session=None,  # type: ignore[arg-type]
        job_id="job",
        transfer_key="key",
        local_base="http://127.0.0.1:1",
        coordinator=None,  # type: ignore[arg-type]
        incoming_dir=tmp_path,
        model_file=lambda name: None,
    )


def test_a_next_rounds_update_waits_for_its_own_report(tmp_path: Path) -> None:
    relay = pump(tmp_path)
    # given: round 1's two updates and result, a model file asked for, and round 2's first update — all before
    # round 1's report takes its bytes
    relay.count_in(1, 100)
    relay.count_in(1, 100)
    relay.count_out(1, 90)
    relay.count_out(None, 7)
    relay.count_in(2, 100)

    # then: round 1's report has its two updates, its result and the model file; round 2's update waits
    assert relay.take_bytes(1) == (200, 97)
    relay.count_in(2, 100)
    relay.count_out(2, 90)
    assert relay.take_bytes(2) == (200, 90)
    assert relay.take_bytes(3) == (0, 0)


def test_a_late_update_counts_in_the_next_report(tmp_path: Path) -> None:
    relay = pump(tmp_path)
    relay.count_in(1, 100)
    assert relay.take_bytes(1) == (100, 0)
    # an update for round 1 that came after its report (the server refused it late): the next report has it
    relay.count_in(1, 100)
    relay.count_in(2, 50)
    assert relay.take_bytes(2) == (150, 0)
