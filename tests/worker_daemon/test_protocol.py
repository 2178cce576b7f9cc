"""The parse gate of the worker gateway protocol: every message the schemas define gets through it."""

from __future__ import annotations

import typing

import pytest

from worker_daemon import protocol


def message_types(union) -> set[str]:
    """The ``type`` values of the classes of a discriminated union (``Annotated[A | B | …, Field(…)]``)."""
    members = typing.get_args(typing.get_args(union)[0])
    return {member.model_fields["type"].default for member in members}


@pytest.mark.parametrize(
    ("union", "known"),
    [
        (protocol.ServerMessage, protocol.SERVER_MESSAGE_TYPES),
        (protocol.DaemonMessage, protocol.DAEMON_MESSAGE_TYPES),
    ],
    ids=["server", "daemon"],
)
def test_every_message_of_the_schema_is_a_known_type(union, known):
    # A message the schema defines but the gate does not know is dropped as "unknown" before it is validated:
    # the control plane's transfer_token frames were, and every job stalled when its tokens expired.
    assert set(known) == message_types(union)


def test_a_transfer_token_frame_parses():
    # given the frame the control plane sends with each lease renewal
    frame = protocol.TransferToken(
        task_id="6f1c1a5e-4f7e-4a55-9d1e-1f6f0e9c1a01", transfer_token="fresh"
    ).model_dump_json()

    # when / then
    assert protocol.parse_server_message(frame) == protocol.TransferToken.model_validate_json(frame)
