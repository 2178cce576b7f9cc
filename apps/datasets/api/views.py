"""The datasets API: every authenticated user sees every dataset and the data nodes serving it, since trainers
of any job download from them; a data node, with its own ``hd_…`` token, registers the datasets it serves."""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser
from django.db.models import Prefetch, QuerySet
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import authentication, exceptions, permissions, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.datasets import services
from apps.datasets.api.serializers import (
    DatasetDetailSerializer,
    DatasetRegisteredSerializer,
    DatasetRegistrationSerializer,
    DatasetSerializer,
)
from apps.datasets.exceptions import DatasetConflict, InvalidDataset
from apps.datasets.models import DATA_NODE_TOKEN_PREFIX, DataNode, Dataset, DatasetReplica
from hypha_site.api import error_responses
from hypha_site.parsers import BoundedJSONParser


class DataNodeAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer hd_…``: the caller is the data node holding that token, not a user.

    ``request.user`` stays anonymous and ``request.auth`` is the :class:`DataNode`. Other schemes are left to
    other authenticators (none, on the endpoints that use this one), so a user token gets a 401 there.
    """

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[object, DataNode] | None:
        parts = authentication.get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword.lower().encode():
            return None
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed("Invalid bearer header: send `Bearer <data node token>`.")
        try:
            token = parts[1].decode()
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("Invalid data node token.") from None
        node = services.authenticate_data_node(token) if token.startswith(DATA_NODE_TOKEN_PREFIX) else None
        if node is None:
            raise exceptions.AuthenticationFailed("Invalid data node token.")
        return AnonymousUser(), node

    def authenticate_header(self, request: Request) -> str:
        # Makes DRF answer 401 (with WWW-Authenticate), not 403, when no or bad credentials are sent.
        return f'{self.keyword} realm="data nodes"'


class IsDataNode(permissions.BasePermission):
    """Only a request authenticated by :class:`DataNodeAuthentication`."""

    def has_permission(self, request: Request, view) -> bool:
        return isinstance(request.auth, DataNode)


class DataNodeAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "apps.datasets.api.views.DataNodeAuthentication"
    name = "dataNodeToken"

    def get_security_definition(self, auto_schema) -> dict:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A data node's token (`hd_…`, from `manage.py create_data_node_token`).",
        }


@extend_schema_view(
    list=extend_schema(summary="List datasets", responses={200: DatasetSerializer, **error_responses(401)}),
    retrieve=extend_schema(
        summary="Show a dataset and its slices",
        responses={200: DatasetDetailSerializer, **error_responses(401, 404)},
    ),
)
class DatasetViewSet(viewsets.ReadOnlyModelViewSet):
    """Datasets registered by data nodes: their slices and the nodes serving them. Looked up by name."""

    lookup_field = "name"
    lookup_value_regex = r"[-a-zA-Z0-9_]+"

    def get_queryset(self) -> QuerySet[Dataset]:
        if getattr(self, "swagger_fake_view", False):  # drf-spectacular inspecting the view
            return Dataset.objects.none()
        datasets = Dataset.objects.prefetch_related(
            Prefetch("replicas", queryset=DatasetReplica.objects.select_related("node"))
        )
        if self.action != "list":
            datasets = datasets.prefetch_related("slices")
        return datasets

    def get_serializer_class(self):
        return DatasetSerializer if self.action == "list" else DatasetDetailSerializer

    @extend_schema(
        summary="Register a dataset a data node serves",
        description=(
            "Called by a data node with its own token. Records the node's public URL (and whether trainers "
            "can connect to it: `reachable`) and marks it online. "
            "The first registration of a name creates the dataset (201); registering identical slices again, "
            "or from another node (a replica), changes nothing else (200). Different slices under a registered "
            "name are refused (409). The answer carries the node's `download_key`: the node serves a slice "
            "only to a request whose token is signed with it. A node registered with `reachable: false` "
            "publishes its slices to the relay's store (`POST /api/datanodes/publish/`) and trainers download "
            "them from there; its copies of another dataset, or all of them once it registers as reachable, "
            "are dropped."
        ),
        request=DatasetRegistrationSerializer,
        responses={
            200: DatasetRegisteredSerializer,
            201: DatasetRegisteredSerializer,
            **error_responses(400, 401, 409),
        },
    )
    @action(
        detail=False,
        methods=["post"],
        url_path="register",
        authentication_classes=[DataNodeAuthentication],
        permission_classes=[IsDataNode],
        # JSON only: a form body cannot carry the list of slice objects (and is not documented as if it could).
        parser_classes=[BoundedJSONParser],
    )
    def register(self, request: Request) -> Response:
        serializer = DatasetRegistrationSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        try:
            dataset, created = services.register_from_node(
                request.auth,
                name=data["name"],
                url=data["url"],
                slices=[(entry["index"], entry["size"], entry["sha256"]) for entry in data["slices"]],
                reachable=data["reachable"],
                # Trainers download a node that is not reachable from the control plane at this address.
                control_plane_url=request.build_absolute_uri("/"),
            )
        except InvalidDataset as error:
            return Response({"slices": [str(error)]}, status=status.HTTP_400_BAD_REQUEST)
        except DatasetConflict as error:
            return Response({"detail": str(error)}, status=status.HTTP_409_CONFLICT)
        dataset = (
            Dataset.objects.prefetch_related(
                Prefetch("replicas", queryset=DatasetReplica.objects.select_related("node")), "slices"
            )
        ).get(pk=dataset.pk)
        return Response(
            DatasetRegisteredSerializer(
                dataset, context={"download_key": services.download_key(request.auth)}
            ).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
            headers={"Cache-Control": "no-store"},  # it holds the node's download key
        )
