"""Errors of the accounting app.

AccountingError   (nothing raises it yet: an accrual that lost a race is skipped, not an error)
"""

from __future__ import annotations


class AccountingError(Exception):
    """Base class of accounting errors."""
