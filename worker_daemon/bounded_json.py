"""JSON read with a bound on nesting, and the strings no database column or file name can hold.

``json.loads`` recurses once per nesting level: a 200 KB body of brackets raises ``RecursionError`` (a 500
wherever it is not caught), and whatever reads the document next (pydantic, serializers, a walk of its
strings) recurses again. :func:`loads` measures the nesting *before* parsing, with regular expressions and
C-level counting (no Python loop per character), and refuses a document deeper than asked with
:class:`TooDeep`, a ``ValueError`` like every other refusal here.

:func:`hostile_strings` finds NUL (PostgreSQL text refuses it, C strings end at it) and lone UTF-16 surrogates
(JSON's ``\\ud800`` escape decodes to one; it cannot be encoded as UTF-8, so SQLite and every renderer fail)
in keys and values. Used by the control plane's request parsers, the job bridge and the transfer tokens'
claims; standard library only (the daemon installs no Django).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

#: A JSON string, escapes included (possessive: linear time whatever the input).
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]++")
_HOSTILE_CHARACTER = re.compile("[\x00\ud800-\udfff]")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class TooDeep(ValueError):
    """A document nested deeper than allowed: refused before it was parsed."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"nested more than {limit} levels deep")
        self.limit = limit


def bracket_depth(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` in ``text`` outside its strings (``text`` with its strings
    already removed, for other languages). Malformed input gets a number too; the parser refuses it after."""
    brackets = _NOT_A_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)


def loads(data: str | bytes, *, max_depth: int, **options: Any) -> Any:
    """``json.loads(data, **options)`` if ``data`` nests at most ``max_depth`` levels; :class:`TooDeep`
    otherwise, and ``ValueError`` (``JSONDecodeError``, ``UnicodeDecodeError``) for what is not JSON."""
    text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
    if bracket_depth(text) > max_depth:
        raise TooDeep(max_depth)
    return json.loads(text, **options)


def escape_hostile(text: str) -> str:
    """``text`` with NUL and lone surrogates written as ``\\u0000``/``\\ud800`` escapes: safe to render."""
    return _HOSTILE_CHARACTER.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


def hostile_string_problem(text: str) -> str | None:
    """Why ``text`` cannot be stored (the messages of Django REST framework's own validators), or None."""
    found = _HOSTILE_CHARACTER.search(text)
    if found is None:
        return None
    if "\x00" in text:
        return "Null characters are not allowed."
    return f"Surrogate characters are not allowed: U+{ord(found.group()):X}."


def hostile_strings(document: Any) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """``(path, message)`` for every key and string value of a parsed JSON ``document`` that holds NUL or a
    lone surrogate; a path's parts are keys and list indices. A bad key is reported, its value is not looked
    into. Iterative: no recursion, whatever the depth."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), document)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            problem = hostile_string_problem(value)
            if problem is not None:
                yield path, problem
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                problem = hostile_string_problem(key) if isinstance(key, str) else None
                if problem is not None:
                    yield (*path, key), problem
                else:
                    stack.append(((*path, key), item))
        elif isinstance(value, list):
            stack.extend(((*path, index), item) for index, item in reversed(list(enumerate(value))))
