"""The browsers' websockets: live events for the overview and for one job's page.

Separate from the worker gateway (``/ws/worker/``): a browser is authenticated by its session cookie
(``AuthMiddlewareStack`` in ``hypha_site/asgi.py``), never by a worker token, and only listens. A connection is
refused (closed during the handshake, so the browser sees a failed upgrade) when the user is not logged in,
when the page is not theirs to see (another user's job: the same answer as an unknown job), or when the
``Origin`` header names another site (the session cookie would otherwise let any site listen in).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from apps.dashboard import live, snapshots

#: Close codes of a refused handshake (browsers only see that the upgrade failed; tests see the code).
NOT_LOGGED_IN = 4401
FORBIDDEN = 4403


def _same_origin(scope) -> bool:
    """No ``Origin`` (not a browser) or one whose host is the host the request was sent to."""
    headers = dict(scope.get("headers") or [])
    origin = headers.get(b"origin")
    if origin is None:
        return True
    host = headers.get(b"host", b"").decode("latin-1").lower()
    return urlsplit(origin.decode("latin-1")).netloc.lower() == host


class _DashboardConsumer(AsyncWebsocketConsumer):
    groups_joined: list[str]

    async def connect(self) -> None:
        self.groups_joined = []
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_active:
            await self.close(code=NOT_LOGGED_IN)
            return
        if not _same_origin(self.scope):
            await self.close(code=FORBIDDEN)
            return
        groups = await self.groups_for(user)
        if groups is None:
            await self.close(code=FORBIDDEN)
            return
        for group in groups:
            await self.channel_layer.group_add(group, self.channel_name)
            self.groups_joined.append(group)
        await self.accept()
        await self.opened(user)

    async def disconnect(self, code: int) -> None:
        for group in getattr(self, "groups_joined", []):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive(self, text_data=None, bytes_data=None) -> None:
        """Browsers only listen; anything they send is ignored."""

    async def dashboard_event(self, message: dict) -> None:
        await self.send(text_data=message["text"])

    async def groups_for(self, user) -> list[str] | None:
        raise NotImplementedError

    async def opened(self, user) -> None:
        """Called once the connection is accepted."""


class OverviewConsumer(_DashboardConsumer):
    """``/ws/dashboard/``: a compact ``job`` event whenever one of the user's jobs (staff: any job) changes."""

    async def groups_for(self, user) -> list[str]:
        return [live.STAFF_GROUP] if user.is_staff else [live.owner_group(user.pk)]


class JobConsumer(_DashboardConsumer):
    """``/ws/dashboard/jobs/<id>/``: a ``snapshot`` first, then the job's ``job``, ``round`` and ``progress``
    events."""

    async def groups_for(self, user) -> list[str] | None:
        job_id = self.scope["url_route"]["kwargs"]["job_id"]
        if not await database_sync_to_async(snapshots.can_see_job)(user, job_id):
            return None
        return [live.job_group(job_id)]

    async def opened(self, user) -> None:
        # Joined before the snapshot is read, so nothing that commits in between is missed (an event may
        # repeat what the snapshot already holds; the page applies both idempotently).
        job_id = self.scope["url_route"]["kwargs"]["job_id"]
        text = await database_sync_to_async(_snapshot_text)(user, job_id)
        if text is None:
            await self.close(code=FORBIDDEN)
            return
        await self.send(text_data=text)


def _snapshot_text(user, job_id) -> str | None:
    job = snapshots.visible_jobs(user).filter(pk=job_id).first()
    return None if job is None else snapshots.to_json(snapshots.job_snapshot(job))
