"""Errors of the market app.

MarketError
└── OfferRefused            the offer cannot be taken (``reason`` is sent back to the daemon)
    ├── UnknownAdvertisement
    └── AdvertisementClosed
"""

from __future__ import annotations


class MarketError(Exception):
    """Base class of market errors."""


class OfferRefused(MarketError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnknownAdvertisement(OfferRefused):
    pass


class AdvertisementClosed(OfferRefused):
    pass
