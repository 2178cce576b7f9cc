from __future__ import annotations

from django.urls import path

from apps.workers.consumers import WorkerGatewayConsumer

websocket_urlpatterns = [path("ws/worker/", WorkerGatewayConsumer.as_asgi())]
