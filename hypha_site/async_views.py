"""An async DRF view, shared by the relay's API and the data nodes' publishing API.

Its own module: importing ``rest_framework.views`` loads DRF's settings, which name
``hypha_site.api.UserTokenAuthentication`` — so ``hypha_site.api`` must not import it."""

from __future__ import annotations

import inspect

from asgiref.sync import sync_to_async
from rest_framework.response import Response
from rest_framework.views import APIView


class AsyncAPIView(APIView):
    """DRF's APIView with an async ``dispatch``: its handlers are coroutines (Django runs the view on the event
    loop under ASGI, in an event loop of its own under WSGI); authentication and permissions (``initial``,
    which may query the database) run in a thread. An exception :meth:`answer` knows becomes its HTTP answer;
    any other is DRF's to handle."""

    @staticmethod
    def answer(error: Exception) -> tuple[dict, int] | None:
        """(body, status) of a refusal this view's services raise; None for anything else."""
        return None

    async def dispatch(self, request, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        request = self.initialize_request(request, *args, **kwargs)
        self.request = request
        self.headers = self.default_response_headers
        try:
            await sync_to_async(self.initial)(request, *args, **kwargs)
            method = request.method.lower()
            handler = getattr(self, method, None) if method in self.http_method_names else None
            response = (handler or self.http_method_not_allowed)(request, *args, **kwargs)
            if inspect.isawaitable(response):
                response = await response
        except Exception as exc:
            answered = self.answer(exc)
            response = Response(*answered) if answered is not None else self.handle_exception(exc)
        self.response = self.finalize_response(request, response, *args, **kwargs)
        return self.response
