"""The accounting API: ``GET /api/me/``, the caller's own spend and earnings (nobody else's)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounting import services
from apps.accounting.api.serializers import MeSerializer
from hypha_site.api import error_responses


class MeView(APIView):
    """You: your username, what your jobs have cost (spend) and what your workers have earned (earnings)."""

    @extend_schema(
        summary="Show your spend and earnings",
        responses={200: MeSerializer, **error_responses(401)},
    )
    def get(self, request: Request) -> Response:
        user = request.user
        figures = {
            "username": user.username,
            "is_staff": user.is_staff,
            "spend": services.user_spend(user),
            "earnings": services.running_total(worker__owner=user),
        }
        return Response(MeSerializer(figures).data)
