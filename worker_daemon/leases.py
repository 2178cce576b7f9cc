"""The daemon's local lease book: which of its resources are promised to whom, and until when.

Two kinds of entries share the worker's capacity:

* a :class:`Reservation` backs an offer the daemon has sent. It is keyed by advertisement id (the daemon
  makes at most one offer per advertisement at a time), learns its lease id when the control plane answers
  ``offer_received``, and disappears when the offer is declined, granted or expires locally.
* a :class:`Lease` is an ACTIVE lease the control plane granted. It lives until ``lease_ended``, a release
  by the daemon, or its local expiry when the control plane stops renewing it.

Invariant: the resources of all entries together never exceed the capacity (component-wise), so the
daemon never promises more than it has; and no device index is held by two entries, so the leases of one
daemon hold disjoint devices. Every entry has a local expiry on the book's clock
(``time.monotonic`` by default; tests inject their own), and :meth:`LeaseBook.prune` removes the expired ones,
so a lost control plane cannot leave zombie reservations behind.

The book is a plain object: no I/O, no asyncio, no logging. The session decides what to say about changes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from worker_daemon.protocol import ZERO, Device, Resources

Clock = Callable[[], float]


@dataclass(slots=True)
class Reservation:
    """Resources held for an offer on one advertisement (a TEMPORARY lease, in the control plane's words)."""

    advertisement_id: uuid.UUID
    attempt: int
    resources: Resources
    expires_at: float
    lease_id: uuid.UUID | None = None
    devices: tuple[int, ...] = ()


@dataclass(slots=True)
class Lease:
    """An ACTIVE lease: the resources are promised to a job role until ``expires_at`` unless renewed."""

    lease_id: uuid.UUID
    job_id: uuid.UUID
    role: str
    resources: Resources
    price: float
    expires_at: float
    advertisement_id: uuid.UUID | None = None
    devices: tuple[int, ...] = ()


class LeaseBook:
    """Reservations and active leases against a fixed capacity, with local expiry.

    All durations are seconds on ``clock``; ``ttl`` arguments set ``expires_at = clock() + ttl``.
    """

    def __init__(
        self, *, capacity: Resources, clock: Clock = time.monotonic, devices: Sequence[Device] = ()
    ) -> None:
        self._capacity = capacity
        self._devices = tuple(devices)
        self._clock = clock
        self._reservations: dict[uuid.UUID, Reservation] = {}
        self._leases: dict[uuid.UUID, Lease] = {}

    # --- reading -------------------------------------------------------------------------------------------

    @property
    def capacity(self) -> Resources:
        return self._capacity

    @property
    def devices(self) -> tuple[Device, ...]:
        """All the worker's devices."""
        return self._devices

    def held_devices(self) -> set[int]:
        """The device indices some reservation or lease holds."""
        return {
            index
            for entry in (*self._reservations.values(), *self._leases.values())
            for index in entry.devices
        }

    def free_devices(self) -> list[Device]:
        """The devices no reservation or lease holds."""
        held = self.held_devices()
        return [device for device in self._devices if device.index not in held]

    def devices_free(self, indices: Iterable[int]) -> bool:
        """Whether every one of ``indices`` is one of the worker's devices and free now."""
        free = {device.index for device in self.free_devices()}
        return all(index in free for index in indices)

    @property
    def reservations(self) -> list[Reservation]:
        return list(self._reservations.values())

    @property
    def leases(self) -> list[Lease]:
        """The ACTIVE leases, oldest grant first."""
        return list(self._leases.values())

    def lease_ids(self) -> list[uuid.UUID]:
        """Ids of the ACTIVE leases (what ``hello`` claims)."""
        return list(self._leases)

    def lease(self, lease_id: uuid.UUID) -> Lease | None:
        return self._leases.get(lease_id)

    def reservation(self, advertisement_id: uuid.UUID) -> Reservation | None:
        return self._reservations.get(advertisement_id)

    def used(self) -> Resources:
        """The sum of the resources of all reservations and leases."""
        total = ZERO
        for entry in (*self._reservations.values(), *self._leases.values()):
            total = total + entry.resources
        return total

    def free(self) -> Resources:
        """Capacity minus :meth:`used` (never negative)."""
        return self._capacity - self.used()

    def fits(self, resources: Resources) -> bool:
        """Whether ``resources`` could be reserved now."""
        return resources.fits_within(self.free())

    # --- reservations --------------------------------------------------------------------------------------

    def reserve(
        self,
        *,
        advertisement_id: uuid.UUID,
        attempt: int,
        resources: Resources,
        ttl: float,
        devices: Sequence[int] = (),
    ) -> Reservation | None:
        """Hold ``resources`` and the device indices ``devices`` for an offer on ``advertisement_id`` for
        ``ttl`` seconds.

        Returns ``None`` and changes nothing when they do not fit in the free capacity, a device is not free,
        or a reservation for this advertisement is still pending (its offer has not been answered yet).
        """
        if (
            advertisement_id in self._reservations
            or not self.fits(resources)
            or not self.devices_free(devices)
        ):
            return None
        reservation = Reservation(
            advertisement_id=advertisement_id,
            attempt=attempt,
            resources=resources,
            expires_at=self._clock() + ttl,
            devices=tuple(sorted(devices)),
        )
        self._reservations[advertisement_id] = reservation
        return reservation

    def attach_lease(
        self, *, advertisement_id: uuid.UUID, lease_id: uuid.UUID, ttl: float
    ) -> Reservation | None:
        """Record the control plane's temporary lease id for a reservation and move its expiry to
        ``ttl`` seconds from now. Returns ``None`` if there is no reservation for the advertisement."""
        reservation = self._reservations.get(advertisement_id)
        if reservation is None:
            return None
        reservation.lease_id = lease_id
        reservation.expires_at = self._clock() + ttl
        return reservation

    def free_reservation(self, advertisement_id: uuid.UUID) -> Reservation | None:
        """Remove the reservation for ``advertisement_id``; return it, or ``None`` if there was none."""
        return self._reservations.pop(advertisement_id, None)

    def drop_reservations(self) -> list[Reservation]:
        """Remove every reservation (the connection that carried their offers is gone)."""
        dropped = list(self._reservations.values())
        self._reservations.clear()
        return dropped

    # --- leases ----------------------------------------------------------------------------------------------

    def activate(
        self,
        *,
        lease_id: uuid.UUID,
        job_id: uuid.UUID,
        role: str,
        resources: Resources,
        price: float,
        ttl: float,
        advertisement_id: uuid.UUID | None = None,
        devices: Sequence[int] = (),
    ) -> Lease | None:
        """Turn the reservation for ``advertisement_id`` (or the one holding ``lease_id``) into an ACTIVE
        lease of ``resources`` expiring in ``ttl`` seconds.

        Without a reservation (it expired locally, or this is a lease adopted after a reconnect) the
        resources are taken from the free capacity. Returns ``None`` when they do not fit; the reservation,
        whose offer is settled either way, is then removed and nothing else changes. Activating a lease that
        is already active only refreshes its expiry. ``devices`` (the lease's device indices, as granted) must
        be free once the reservation is removed, like the resources.
        """
        existing = self._leases.get(lease_id)
        if existing is not None:
            existing.expires_at = self._clock() + ttl
            return existing
        reservation = self._find_reservation(advertisement_id=advertisement_id, lease_id=lease_id)
        if reservation is not None:
            del self._reservations[reservation.advertisement_id]
        if not self.fits(resources) or not self.devices_free(devices):
            return None
        lease = Lease(
            lease_id=lease_id,
            job_id=job_id,
            role=role,
            resources=resources,
            price=price,
            expires_at=self._clock() + ttl,
            advertisement_id=advertisement_id,
            devices=tuple(sorted(devices)),
        )
        self._leases[lease_id] = lease
        return lease

    def renew(self, lease_id: uuid.UUID, *, ttl: float) -> bool:
        """Set the expiry of the lease (or the reservation holding that lease id) to ``ttl`` seconds from
        now — a renewal restarts from now, as in the original. Returns ``False`` if it is not held."""
        entry: Lease | Reservation | None = self._leases.get(lease_id) or self._find_reservation(
            advertisement_id=None, lease_id=lease_id
        )
        if entry is None:
            return False
        entry.expires_at = self._clock() + ttl
        return True

    def drop(self, lease_id: uuid.UUID) -> Lease | Reservation | None:
        """Remove the active lease, or the reservation holding ``lease_id``; return what was removed."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            return lease
        reservation = self._find_reservation(advertisement_id=None, lease_id=lease_id)
        if reservation is not None:
            del self._reservations[reservation.advertisement_id]
        return reservation

    def prune(self, *, lease_grace: float = 0.0) -> tuple[list[Reservation], list[Lease]]:
        """Remove every reservation whose expiry has passed, and every lease whose expiry passed more than
        ``lease_grace`` seconds ago; return them."""
        now = self._clock()
        reservations = [r for r in self._reservations.values() if r.expires_at <= now]
        for reservation in reservations:
            del self._reservations[reservation.advertisement_id]
        leases = [lease for lease in self._leases.values() if lease.expires_at + lease_grace <= now]
        for lease in leases:
            del self._leases[lease.lease_id]
        return reservations, leases

    def _find_reservation(
        self, *, advertisement_id: uuid.UUID | None, lease_id: uuid.UUID
    ) -> Reservation | None:
        if advertisement_id is not None and advertisement_id in self._reservations:
            return self._reservations[advertisement_id]
        for reservation in self._reservations.values():
            if reservation.lease_id == lease_id:
                return reservation
        return None
