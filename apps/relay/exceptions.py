"""Errors of the relay app.

RelayError
├── RelayRefused          the caller may not do this, or the input is invalid; ``status`` is the HTTP answer
│   │                     (400 bad input, 401 no or bad token, 403 role, 404 missing, 409 state, 413 too large,
│   │                     422 content mismatch); ``fields`` names the bad fields of a 400
│   └── PartsMissing      complete asked while parts are missing (400, ``missing`` their numbers)
└── StoreError            the object store failed or is unreachable (503); nothing was changed here
    ├── ContentMismatch   the stored bytes are not what the upload declared (size or SHA-256)
    └── UploadGone        the store no longer knows a pending upload (aborted or expired there)
"""

from __future__ import annotations


class RelayError(Exception):
    """Base class of relay errors."""


class RelayRefused(RelayError):
    def __init__(self, detail: str, *, status: int = 403, field: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status
        self.field = field

    def body(self) -> dict:
        """The JSON answer: a 400 names its field like every 400 of the API; the others are ``detail``."""
        if self.status == 400 and self.field:
            return {self.field: [self.detail]}
        return {"detail": self.detail}


class PartsMissing(RelayRefused):
    def __init__(self, missing: list[int]) -> None:
        shown = ", ".join(map(str, missing[:20])) + (" …" if len(missing) > 20 else "")
        super().__init__(f"parts not uploaded yet: {shown}", status=400)
        self.missing = missing

    def body(self) -> dict:
        return {"detail": self.detail, "missing": self.missing}


class StoreError(RelayError):
    """The object store refused or failed an operation the control plane asked of it."""


class ContentMismatch(StoreError):
    """The stored object's size or SHA-256 differs from the declared one."""


class UploadGone(StoreError):
    """The store has no such pending upload any more (aborted, or expired by the store's own rules)."""


def answer(error: Exception) -> tuple[dict, int] | None:
    """(JSON body, HTTP status) of a relay refusal or a store failure (503); None for any other error."""
    if isinstance(error, RelayRefused):
        return error.body(), error.status
    if isinstance(error, StoreError):
        return {"detail": f"the relay's store failed: {error}"}, 503
    return None
