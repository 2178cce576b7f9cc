"""The relay's key grammar and who may touch which key (docs/transfers.md, "Objects").

Keys are job-scoped::

    updates/<round>/<peer>       written by the trainer whose token's peer is <peer>; read by the PS
    results/<round>              written by the PS; read by the job's trainers and PS
    model/<round>/<filename>     written by the PS; read by the job's trainers and PS
    model/latest/<filename>      read-only alias of the newest complete model/<round>/<filename>

<round> is 1..999999999 (0 allowed for model), <peer> a UUID in its canonical lower-case form (the form a
transfer token's ``peer`` claim has), <filename> ``[A-Za-z0-9_][A-Za-z0-9._-]{0,99}``. Pure functions: no
database, no Django settings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from apps.relay.exceptions import RelayRefused

TRAINER = "trainer"
PARAMETER_SERVER = "parameter_server"

_ROUND = r"[1-9][0-9]{0,8}"
_MODEL_ROUND = r"0|[1-9][0-9]{0,8}"
_PEER = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_FILENAME = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}"
_UPDATE = re.compile(rf"updates/(?P<round>{_ROUND})/(?P<peer>{_PEER})")
_RESULT = re.compile(rf"results/(?P<round>{_ROUND})")
_MODEL = re.compile(rf"model/(?P<round>{_MODEL_ROUND}|latest)/(?P<filename>{_FILENAME})")
#: A listing prefix: a namespace and then anything a key of it may hold.
_PREFIX = re.compile(r"(?P<namespace>updates|results|model)/[A-Za-z0-9._/-]{0,150}")
#: The longest key the grammar allows (model/999999999/<100 characters>).
MAX_KEY_LENGTH = 120

UPDATES, RESULTS, MODEL = "updates", "results", "model"


@dataclass(frozen=True, slots=True)
class Key:
    """A parsed key. ``round`` is None only for ``model/latest/<filename>`` (``latest`` True)."""

    text: str
    namespace: str
    round: int | None
    peer: str | None = None
    filename: str | None = None
    latest: bool = False


def parse_key(text: object) -> Key:
    """The parsed ``text``; :class:`RelayRefused` (400, field ``key``) if it is not a key of the grammar."""
    if not isinstance(text, str) or len(text) > MAX_KEY_LENGTH:
        raise _bad_key(text)
    if match := _UPDATE.fullmatch(text):
        return Key(text, UPDATES, int(match["round"]), peer=match["peer"])
    if match := _RESULT.fullmatch(text):
        return Key(text, RESULTS, int(match["round"]))
    if match := _MODEL.fullmatch(text):
        latest = match["round"] == "latest"
        return Key(
            text, MODEL, None if latest else int(match["round"]), filename=match["filename"], latest=latest
        )
    raise _bad_key(text)


def _bad_key(text: object) -> RelayRefused:
    shown = repr(text)[:150]
    return RelayRefused(
        f"{shown} is not a relay key: updates/<round>/<peer>, results/<round> or model/<round>/<filename> "
        "(round 1..999999999, 0 allowed for model; peer a lower-case UUID)",
        status=400,
        field="key",
    )


def parse_prefix(text: object) -> str:
    """The namespace of a listing prefix (``updates/``, ``results/3``, ``model/``…); 400 otherwise."""
    match = _PREFIX.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise RelayRefused(
            f"{repr(text)[:150]} is not a relay prefix: it starts with updates/, results/ or model/",
            status=400,
            field="prefix",
        )
    return match["namespace"]


def may_write(role: str, peer: str, key: Key) -> bool:
    """Whether a task of ``role`` on worker ``peer`` may upload ``key`` (never ``model/latest/…``)."""
    if key.latest:
        return False
    if key.namespace == UPDATES:
        return role == TRAINER and peer == key.peer
    return role == PARAMETER_SERVER


def may_read_namespace(role: str, namespace: str) -> bool:
    """Whether a task of ``role`` may read keys of ``namespace`` (updates: the PS; the others: everyone)."""
    if namespace == UPDATES:
        return role == PARAMETER_SERVER
    return role in (TRAINER, PARAMETER_SERVER)


def may_read(role: str, key: Key) -> bool:
    return may_read_namespace(role, key.namespace)


def write_refusal(role: str, key: Key) -> RelayRefused:
    """The 403 (400 for ``model/latest``) of a writer that may not upload ``key``, saying who may."""
    if key.latest:
        return RelayRefused(
            "model/latest/<filename> is read-only: upload model/<round>/<filename>", status=400, field="key"
        )
    if key.namespace == UPDATES:
        return RelayRefused(f"only the trainer {key.peer} may write {key.text}", status=403)
    return RelayRefused(f"only the job's parameter server may write {key.text}", status=403)


def read_refusal(key_or_namespace: str) -> RelayRefused:
    return RelayRefused(f"only the job's parameter server may read {key_or_namespace}", status=403)
