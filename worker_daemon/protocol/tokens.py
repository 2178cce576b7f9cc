"""Transfer tokens (job-scoped bearer tokens for bulk transfers) and the public-address rule.

Part of :mod:`worker_daemon.protocol`, which re-exports every public name here. Importable without Django.
"""

from __future__ import annotations

import ipaddress
import uuid
from typing import Any

# --- transfer tokens ---------------------------------------------------------------------------------------
#
# Bulk bytes (weights, pseudo-gradients, the final model) go straight to the parameter server or the control
# plane over HTTP, never over this websocket. Each transfer carries ``Authorization: Bearer <token>``, where
# the token is ``base64url(JSON claims) "." base64url(HMAC-SHA256(job key, first part))``. The job key is
# derived by the control plane from its secret and the job id; the control plane hands it to the job's
# parameter server in ``dispatch_job.transfer_key`` so that the parameter server can verify the trainers'
# tokens without asking anyone. Claims: ``job`` (uuid), ``peer`` (worker id), ``lease`` (uuid), ``role``
# (``trainer`` or ``parameter_server``) and ``exp`` (unix seconds).


class TransferTokenError(ValueError):
    """A transfer token that is malformed, wrongly signed, expired, or for another job."""


def _b64encode(raw: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    import base64

    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign_transfer_token(key: str, claims: dict[str, Any]) -> str:
    """A token carrying ``claims`` (JSON-serialisable), signed with the job key ``key``."""
    import hashlib
    import hmac
    import json

    body = _b64encode(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode())
    signature = hmac.new(key.encode(), body.encode(), hashlib.sha256).digest()
    return f"{body}.{_b64encode(signature)}"


#: The longest transfer token read: the control plane's are about 350 characters.
_MAX_TRANSFER_TOKEN_CHARS = 4096


def verify_transfer_token(key: str, token: str, *, job_id: str, now: float | None = None) -> dict[str, Any]:
    """The claims of ``token`` if it is signed with ``key``, names job ``job_id`` and has not expired;
    :class:`TransferTokenError` saying why otherwise.

    The returned claims are well formed (callers use them in lookups without further checks): a flat object
    whose ``job``, ``peer`` and ``role`` are strings, ``lease`` (optional) a UUID string, ``exp`` a number,
    and no string holds NUL or a lone surrogate. The signature is checked before the claims are parsed, so
    nobody without the key gets the parser to read anything; a key holder (the job's parameter server) whose
    claims have another shape gets "malformed transfer token", never an exception of another kind."""
    import binascii
    import hashlib
    import hmac
    import time

    from worker_daemon import bounded_json

    body, separator, signature = token.partition(".")
    if (
        not separator
        or not body
        or not signature
        or len(token) > _MAX_TRANSFER_TOKEN_CHARS
        or not token.isascii()
    ):
        raise TransferTokenError("malformed transfer token")
    try:
        given = _b64decode(signature)
    except (binascii.Error, ValueError):
        raise TransferTokenError("malformed transfer token") from None
    expected = hmac.new(key.encode(), body.encode(), hashlib.sha256).digest()
    if not hmac.compare_digest(expected, given):
        raise TransferTokenError("transfer token signature does not match")
    try:
        claims = bounded_json.loads(_b64decode(body), max_depth=1)
    except (binascii.Error, ValueError):  # TooDeep, JSONDecodeError, UnicodeDecodeError
        raise TransferTokenError("malformed transfer token") from None
    if not _well_formed_claims(claims):
        raise TransferTokenError("malformed transfer token")
    if claims["job"] != str(job_id):
        raise TransferTokenError(f"transfer token is for another job, not {job_id}")
    if claims["exp"] < (time.time() if now is None else now):
        raise TransferTokenError("transfer token expired")
    return claims


def _well_formed_claims(claims: Any) -> bool:
    from worker_daemon import bounded_json

    if not isinstance(claims, dict) or next(bounded_json.hostile_strings(claims), None) is not None:
        return False
    if not all(isinstance(claims.get(name), str) for name in ("job", "peer", "role")):
        return False
    expires = claims.get("exp")
    if isinstance(expires, bool) or not isinstance(expires, int | float):
        return False
    lease = claims.get("lease")
    if lease is None:
        return True
    if not isinstance(lease, str):
        return False
    try:
        uuid.UUID(lease)
    except ValueError:
        return False
    return True


# --- addresses a worker may be told to fetch from ------------------------------------------------------------


def is_public_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """True for an address on the public internet: none of loopback, private, link-local, multicast, reserved or
    unspecified (an IPv4-mapped IPv6 address is judged as its IPv4 address). The one rule of the control plane's
    check of a model URL at submission and of the parameter server's when it downloads (SSRF)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )
