"""Hypothesis strategies for hostile input: strings no database column or file system holds, and depths
no recursive parser survives. Shared by the fuzz tests of the API, the job bridge and the parameter server.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

#: Strings that broke a layer once: NUL (PostgreSQL text, C strings, paths), lone UTF-16 surrogates (not
#: encodable as UTF-8: SQLite, renderers), escapes and separators, and one very long string.
KNOWN_HOSTILE = (
    "\x00",
    "a\x00b",
    "\ud800",
    "\udfff",
    "x\udc80y",
    "\ud83d",  # the first half of an emoji's surrogate pair, alone
    "%00",
    "\\u0000",
    "../../etc/passwd",
    "\u202e\ufeff\u200b",
    "\r\n\t\x7f\x1b[2J",
    "🙂" * 3,
    "a" * 100_000,
)


def hostile_strings() -> st.SearchStrategy[str]:
    """Known hostile strings, and short strings mixing control characters, surrogates and plain text."""
    alphabet = st.one_of(
        st.characters(categories=["Cc", "Cs"]),
        st.characters(codec="utf-8"),
        st.sampled_from(".[]{}\"'\\=#%/"),
    )
    return st.one_of(st.sampled_from(KNOWN_HOSTILE), st.text(alphabet, max_size=40))


def nested_json(depth: int, *, leaf: str = "") -> str:
    """JSON text of ``leaf`` inside ``depth`` levels of arrays and objects (alternating), built as text:
    ``json.dumps`` itself cannot write a document deeper than the interpreter's recursion limit."""
    opening = "".join('{"k": ' if level % 2 else "[" for level in range(depth))
    closing = "".join("}" if level % 2 else "]" for level in reversed(range(depth)))
    return opening + json.dumps(leaf) + closing
