"""Credentials never reach a log line: :func:`redact` masks them in text, :class:`RedactingFormatter` in every
record a handler writes (message, arguments, traceback), whoever logged it.

Libraries log what they send at DEBUG (websockets: every handshake header, ``Authorization: Bearer hw_…``
included, and the first bytes of every frame, where ``dispatch_job`` carries transfer keys); URLs carry slice
tokens in their query. Masked, wherever they appear:

* an ``Authorization`` header's credential, however it is printed, and whatever follows ``Bearer``;
* Hypha's prefixed tokens: ``hw_`` (worker), ``hd_`` (data node), ``hu_`` (user API);
* the value of a ``token=`` / ``access_token=`` / ``key=`` query parameter;
* the value of a JSON (or Python ``repr``) field whose name ends in ``token``, ``key``, ``secret`` or
  ``password`` — also when the line stops inside the value (a truncated frame).

The kind of a credential stays visible (``Bearer [redacted]``, ``hw_[redacted]``) so the log still says what
was sent. Nothing here imports more than the standard library: the daemon, the parameter server and the data
node all use it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

MASK = "[redacted]"

_PATTERNS: tuple[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = (
    # A field whose name says it is a secret, in JSON or a repr: "transfer_key":"…", 'token': '…'. The value may
    # be cut short by the end of the line (websockets truncates frames).
    (
        re.compile(r"""(["'][A-Za-z_]*(?:token|key|secret|password)["']\s*:\s*["'])[^"']*""", re.IGNORECASE),
        rf"\g<1>{MASK}",
    ),
    # An Authorization header however it is printed (``> Authorization: Bearer …``, a dict's repr), its scheme
    # kept.
    (
        re.compile(
            r"""(Authorization["']?\s*[:=]\s*["']?)(?:(Bearer|Token|Basic)\s+)?(?!\[redacted\])[^\s'",;]+""",
            re.IGNORECASE,
        ),
        lambda match: f"{match[1]}{match[2] + ' ' if match[2] else ''}{MASK}",
    ),
    # A bearer credential anywhere else (an error message quoting a header).
    (re.compile(r"\b(Bearer\s+)(?!\[redacted\])[^\s'\",;]{6,}"), rf"\1{MASK}"),
    # A token in a URL's query.
    (re.compile(r"([?&](?:access_token|token|key)=)[^&\s'\"#]+", re.IGNORECASE), rf"\g<1>{MASK}"),
    # Hypha's own tokens, wherever they are.
    (re.compile(r"\b(h[wdu]_)(?!\[redacted\])[A-Za-z0-9_\-]{8,}"), rf"\1{MASK}"),
)


def redact(text: str) -> str:
    """``text`` with every credential it holds masked (see the module docstring for which)."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class RedactingFormatter(logging.Formatter):
    """A :class:`logging.Formatter` whose output (message, traceback, stack) goes through :func:`redact`."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def install(format: str) -> None:
    """Give every handler of the root logger a :class:`RedactingFormatter` of ``format`` (call it after
    :func:`logging.basicConfig`)."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(RedactingFormatter(format))
