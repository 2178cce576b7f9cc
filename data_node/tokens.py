"""Slice download tokens: the control plane signs one per slice URL it hands out, the data node verifies it.

A token is ``BODY.SIGNATURE`` — the same shape as the parameter server's transfer tokens
(``worker_daemon.protocol.sign_transfer_token``): ``BODY`` is the unpadded base64url of the claims' compact JSON,
``SIGNATURE`` the unpadded base64url of HMAC-SHA256(node key, ``BODY``). The claims::

    {"dataset": "tiny-text", "slice": 3, "job": "<job id>", "peer": "<worker id>" | "parameter_server",
     "exp": <Unix seconds>}

The key is the data node's own download key, which the control plane derives from its ``SECRET_KEY`` and the
node's id and hands to the node in the answer to its registration: a token signed for one node is worth nothing
at another. The node checks the signature, the expiry and that the token names the dataset and slice of the
URL; ``job`` and ``peer`` say whom the control plane authorised (for the node's refusal messages and for
audits), the node cannot check them. The rules (``docs/training.md``): no token, a malformed one, a wrong
signature or an expired one → 401; a valid token for another dataset or slice → 403.

Only the standard library: the control plane (``apps/datasets``) imports this module to sign, the data node to
verify, and neither pulls in the other's dependencies.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from typing import Any

#: The claim ``peer`` of a token for the parameter server's download of an eval slice.
PARAMETER_SERVER_PEER = "parameter_server"


class SliceTokenError(Exception):
    """A token that does not authorise the download; ``status`` is the HTTP answer (401 or 403)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(key: str, *, dataset: str, index: int, job: str, peer: str, expires: int) -> str:
    """A token for ``GET /datasets/<dataset>/slices/<index>`` by ``peer`` of job ``job``, until ``expires``."""
    claims = {"dataset": dataset, "slice": index, "job": job, "peer": peer, "exp": expires}
    body = _b64encode(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode())
    signature = hmac.new(key.encode(), body.encode(), hashlib.sha256).digest()
    return f"{body}.{_b64encode(signature)}"


def verify(
    key: bytes, token: str | None, *, dataset: str, index: int, now: float | None = None
) -> dict[str, Any]:
    """The claims of ``token`` if it authorises downloading slice ``index`` of ``dataset``, else
    :class:`SliceTokenError` with the status to answer. ``key`` is the node key's UTF-8 bytes (encoded once)."""
    if not token:
        raise SliceTokenError(401, "a slice download needs the token the control plane put in its URL")
    body, separator, signature = token.partition(".")
    if not separator or not body or not signature:
        raise SliceTokenError(401, "malformed slice token")
    try:
        given = _b64decode(signature)
    except (binascii.Error, ValueError):
        raise SliceTokenError(401, "malformed slice token") from None
    # The signature first: nothing of an unsigned body is parsed.
    if not hmac.compare_digest(hmac.new(key, body.encode(), hashlib.sha256).digest(), given):
        raise SliceTokenError(401, "the slice token's signature does not match this data node's key")
    try:
        claims = json.loads(_b64decode(body))
    except (binascii.Error, ValueError):
        raise SliceTokenError(401, "malformed slice token") from None
    if not isinstance(claims, dict):
        raise SliceTokenError(401, "malformed slice token")
    expires = claims.get("exp")
    if isinstance(expires, bool) or not isinstance(expires, int | float):
        raise SliceTokenError(401, "malformed slice token")
    if expires < (time.time() if now is None else now):
        raise SliceTokenError(401, "the slice token expired: ask the control plane for the slice again")
    if claims.get("dataset") != dataset or claims.get("slice") != index:
        raise SliceTokenError(
            403,
            f"the token authorises slice {claims.get('slice')!r} of dataset {claims.get('dataset')!r}, "
            f"not slice {index} of {dataset}",
        )
    return claims
