"""ASGI entry point: Django views over HTTP, the worker gateway over websockets.

In the embedded default (no ``REDIS_URL``) the first connection also starts the in-process task runner
(:class:`hypha_site.runtime.EmbeddedRunner`) on the server's event loop, so the market clocks run without
Celery processes.
"""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hypha_site.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402

from apps.dashboard.routing import websocket_urlpatterns as dashboard_websockets  # noqa: E402
from apps.workers.routing import websocket_urlpatterns as worker_websockets  # noqa: E402
from hypha_site.runtime import EmbeddedRunner  # noqa: E402

#: The router without the embedded runner: what tests drive with WebsocketCommunicator.
#: Browsers authenticate with their session cookie (AuthMiddlewareStack); daemons with their Bearer token
#: (the gateway consumer checks it and ignores the session).
router = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": AuthMiddlewareStack(URLRouter(worker_websockets + dashboard_websockets)),
    }
)


async def application(scope, receive, send):
    if settings.EMBEDDED_TRANSPORTS and EmbeddedRunner.current() is None:
        EmbeddedRunner.start()
    return await router(scope, receive, send)
