"""Request bodies read with bounds: size, nesting and storable strings, checked before anything trusts them.

* Size: JSON and form bodies are capped by ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (``HYPHA_MAX_REQUEST_BYTES``), which
  Django checks as it reads the body; a TOML body by ``HYPHA_MAX_TOML_BYTES`` (tomllib is pure Python: a few MB
  of TOML take seconds). Too large is a JSON ``413`` (:class:`RequestTooLarge`; ``hypha_site.api``'s exception
  handler turns Django's own ``RequestDataTooBig`` into one too). Streamed uploads are not parsed and keep
  their own limits.
* Nesting: JSON deeper than ``HYPHA_MAX_INPUT_DEPTH`` is refused before ``json.loads`` runs
  (:mod:`worker_daemon.bounded_json`); TOML's brackets and dotted keys likewise (:func:`toml_nesting`), because
  tomllib recurses per bracket and its cost grows with the square of a dotted key's length (a 100 KB key
  took gigabytes).
* Strings: NUL and lone surrogates, which PostgreSQL (NUL) or SQLite and every renderer (surrogates) cannot
  take, are field errors wherever they are in the document, keys included (:func:`hostile_string_errors`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from rest_framework import exceptions, parsers, status
from rest_framework.utils import json as drf_json

from worker_daemon import bounded_json


class RequestTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"The body is larger than this endpoint accepts ({limit} bytes).")


def exception_handler(exc: Exception, context: dict) -> Any:
    """DRF's handler (``REST_FRAMEWORK["EXCEPTION_HANDLER"]``), plus Django's refusals of a request body that
    DRF leaves to Django's HTML error pages: too large (``RequestDataTooBig``) is a JSON 413, another
    ``SuspiciousOperation`` (too many fields, a malformed multipart body) a JSON 400."""
    if isinstance(exc, RequestDataTooBig):
        exc = RequestTooLarge(settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
    elif isinstance(exc, SuspiciousOperation):
        exc = exceptions.ParseError(str(exc) or "The request could not be read.")
    # Imported here: rest_framework.views reads DEFAULT_PARSER_CLASSES, which names this module, as it loads.
    from rest_framework.views import exception_handler as drf_exception_handler

    return drf_exception_handler(exc, context)


def hostile_string_errors(problems: Iterable[tuple[tuple[str | int, ...], str]]) -> dict[str, Any]:
    """The ``(path, message)`` pairs of :func:`worker_daemon.bounded_json.hostile_strings` as a 400 body:
    nested by path (list indices as keys, like DRF's list fields), the offending characters escaped."""
    errors: dict[str, Any] = {}
    for path, message in problems:
        parts = [bounded_json.escape_hostile(str(part)) for part in path] or ["non_field_errors"]
        node = errors
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node.setdefault(parts[-1], []).append(message)
    return errors


class BoundedJSONParser(parsers.JSONParser):
    """DRF's JSON parser with the nesting bound and the string check; its errors are DRF's (``ParseError``
    ``{"detail": "JSON parse error - ..."}``; field errors for strings that cannot be stored)."""

    def parse(self, stream, media_type=None, parser_context=None) -> Any:
        parser_context = parser_context or {}
        encoding = parser_context.get("encoding", settings.DEFAULT_CHARSET)
        options = {"parse_constant": drf_json.strict_constant} if self.strict else {}
        try:
            document = bounded_json.loads(
                stream.read().decode(encoding), max_depth=settings.HYPHA_MAX_INPUT_DEPTH, **options
            )
        except bounded_json.TooDeep as error:
            raise exceptions.ParseError(f"JSON parse error - {error}.") from None
        except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, out-of-range constants
            raise exceptions.ParseError(f"JSON parse error - {error}") from None
        errors = hostile_string_errors(bounded_json.hostile_strings(document))
        if errors:
            raise exceptions.ValidationError(errors)
        return document


def read_bounded(stream, limit: int) -> bytes:
    """All of ``stream``, or :class:`RequestTooLarge` once it passes ``limit`` bytes (reading at most one
    byte more)."""
    data = stream.read(limit + 1) if stream is not None else b""
    if len(data) > limit:
        raise RequestTooLarge(limit)
    return data


# --- TOML ------------------------------------------------------------------------------------------------------

# Strings (replaced by one character, so that a quoted key still counts as a key segment) and comments
# (dropped). Possessive quantifiers: linear time whatever the input. An unterminated string is left alone:
# tomllib refuses the document after.
_TOML_STRING_OR_COMMENT = re.compile(
    r'"""(?:[^"\\]++|\\.|"(?!""))*+"""'
    r"|'''(?:[^']++|'(?!''))*+'''"
    r'|"(?:[^"\\\n]++|\\.)*+"'
    r"|'[^'\n]*+'"
    r"|#[^\n]*+",
    re.DOTALL,
)
_KEY_SEGMENT = r"[A-Za-z0-9_-]++[ \t]*+\.[ \t]*+"


def toml_nesting(text: str, *, limit: int) -> bool:
    """True when ``text`` nests more than ``limit`` levels in brackets (arrays, inline tables) or in one key's
    dotted segments (``a.b.c``, in a key or a table header), outside strings and comments. Cheap: a few
    regular-expression passes, whatever the input."""
    bare = _TOML_STRING_OR_COMMENT.sub(lambda match: "" if match.group().startswith("#") else "s", text)
    if bounded_json.bracket_depth(bare) > limit:
        return True
    # ``limit`` dots in a row in one key: ``limit + 1`` segments. A float has one dot, a date none.
    return re.search(f"(?:{_KEY_SEGMENT}){{{limit}}}", bare) is not None


def document_depth(document: Any) -> int:
    """How deep a parsed document nests (a scalar: 0, ``{}``: 1); iterative, whatever the depth."""
    deepest = 0
    stack = [(document, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            deepest = max(deepest, level)
            stack.extend((item, level + 1) for item in value.values())
        elif isinstance(value, list):
            deepest = max(deepest, level)
            stack.extend((item, level + 1) for item in value)
    return deepest
