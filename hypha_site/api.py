"""Pieces the apps' REST APIs share: error bodies and their schema, strict input, validated list filters.

Each app's ``api`` package builds its serializers and viewsets from these so that every endpoint answers bad
input the same way: ``400`` with every field error at once (never a ``500``), ``404`` for an object the caller
cannot see, ``409`` with ``{"detail": ...}`` for an action the object's state refuses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from django.db import models
from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from drf_spectacular.utils import OpenApiExample, OpenApiResponse
from rest_framework import exceptions, serializers
from rest_framework.authentication import TokenAuthentication
from rest_framework.fields import empty

# Imported for its drf-spectacular extension: pydantic models as request bodies, in OpenAPI 3.0.
from hypha_site import openapi  # noqa: F401

# --- authentication -----------------------------------------------------------------------------------------


class UserTokenAuthentication(TokenAuthentication):
    """``Authorization: Token <key>`` with the key looked up by its hash (:class:`apps.workers.models.UserToken`):
    DRF's scheme and answers (401 with ``WWW-Authenticate: Token``), none of its plaintext storage."""

    def authenticate_credentials(self, key: str):
        from apps.workers.models import UserToken

        token = UserToken.authenticate(key)
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid token.")
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("User inactive or deleted.")
        return token.user, token


# --- error bodies -------------------------------------------------------------------------------------------


class ErrorSerializer(serializers.Serializer):
    """The body of an error that is not a validation error."""

    detail = serializers.CharField(help_text="What went wrong, for a human.")


#: The body of a 400: every invalid field maps to its messages; nested objects map by their path.
VALIDATION_ERROR_SCHEMA = {
    "type": "object",
    "description": (
        "Every invalid field with its messages, all at once. Nested objects are reported by their path "
        '(`{"trainer": {"price": {"max": ["..."]}}}`); errors that belong to no single field are under '
        "`non_field_errors`. A body that cannot be parsed at all (malformed JSON or TOML) gets "
        '`{"detail": "..."}` instead.'
    ),
    "properties": {"detail": {"type": "string", "description": "Why the body could not be parsed."}},
    "additionalProperties": {
        "oneOf": [
            {"type": "array", "items": {"type": "string"}},
            {"type": "object", "additionalProperties": True},
        ]
    },
}

_DESCRIPTIONS = {
    400: "Invalid input: every field error at once; nothing was changed.",
    401: "No or invalid credentials (send `Authorization: Token <key>` or use a session).",
    403: "The caller may not do this (staff only, or a transfer token that does not grant it).",
    404: "No such object, or it is not one the caller may see.",
    409: "The object's current state does not allow this action; nothing was changed.",
    413: "The body is larger than this endpoint accepts; nothing was stored.",
    415: "The body's content type is not one this endpoint reads; nothing was changed.",
}


def error_responses(*codes: int, examples: list[OpenApiExample] | None = None) -> dict[int, OpenApiResponse]:
    """``extend_schema(responses=...)`` entries for the error status ``codes`` an endpoint can answer."""
    responses = {}
    for code in codes:
        if code == 400:
            responses[code] = OpenApiResponse(
                response=VALIDATION_ERROR_SCHEMA, description=_DESCRIPTIONS[400], examples=examples or []
            )
        else:
            responses[code] = OpenApiResponse(response=ErrorSerializer, description=_DESCRIPTIONS[code])
    return responses


# --- input ----------------------------------------------------------------------------------------------------


class NumberField(serializers.FloatField):
    """A finite number (DRF's float field already refuses NaN and infinity), and not ``true``/``false``, which
    Python would otherwise take for 1 and 0."""

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool):
            self.fail("invalid")
        return super().to_internal_value(data)


class NullIfInfiniteFloatField(serializers.FloatField):
    """Output of a float that may legitimately be infinite (the score of an offer of no capacity) as ``null``:
    JSON has no infinity, and DRF's strict renderer would fail the whole response."""

    def to_representation(self, value: float) -> float | None:
        value = float(value)
        return value if math.isfinite(value) else None


class StrictSerializer(serializers.Serializer):
    """Base of input serializers: an unknown key is a field error (a typo must not silently become a default),
    reported with the other errors; an omitted nested object without a default validates as ``{}``, so the
    defaults of its fields apply."""

    default_error_messages = {"unknown": "Unknown field."}

    def validate_empty_values(self, data: Any) -> tuple[bool, Any]:
        if data is empty and not self.required and self.default is empty:
            return False, {}
        return super().validate_empty_values(data)

    def to_internal_value(self, data: Any) -> dict:
        errors: dict = {}
        value: dict = {}
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as error:
            if not isinstance(error.detail, Mapping):
                raise
            errors.update(error.detail)
        if isinstance(data, Mapping):
            for key in sorted(set(data) - set(self.fields), key=str):
                errors[str(key)] = [self.error_messages["unknown"]]
        if errors:
            raise serializers.ValidationError(errors)
        return value


# --- named enums ----------------------------------------------------------------------------------------------


class EnumField(serializers.ChoiceField):
    """A choice of a ``TextChoices`` class, documented as one schema component named after it (``JobStatus``,
    ``LeaseStatus``...). drf-spectacular would otherwise name enums after the field, and every model has a
    ``status`` with its own choices: it warns about the collision and invents hashed names."""

    def __init__(self, choices: type[models.TextChoices], **kwargs) -> None:
        self.enum_name = choices.__qualname__.replace(".", "")
        super().__init__(choices=choices.choices, **kwargs)


class EnumFieldExtension(OpenApiSerializerFieldExtension):
    target_class = EnumField
    match_subclasses = True

    def get_name(self) -> str:
        return self.target.enum_name

    def map_serializer_field(self, auto_schema, direction) -> dict:
        return {"type": "string", "enum": list(self.target.choices)}


# --- list filters ---------------------------------------------------------------------------------------------


# Validates a list's query parameters with ``filter_serializer_class`` (a bad value is a 400, not a 500) and
# applies them; ``filter_lookups`` maps a parameter to its ORM lookup (default: the parameter's name). Omitted or
# empty parameters do not filter. Document them with ``extend_schema(parameters=[TheFilterSerializer])``.
# (Comments, not a docstring: drf-spectacular would publish a docstring as every operation's description.)
class FilteredListMixin:
    filter_serializer_class: type[serializers.Serializer] | None = None
    filter_lookups: dict[str, str] = {}

    def filter_queryset(self, queryset):
        queryset = super().filter_queryset(queryset)
        if self.action != "list" or self.filter_serializer_class is None:
            return queryset
        serializer = self.filter_serializer_class(data=self.request.query_params)
        serializer.is_valid(raise_exception=True)
        conditions = {
            self.filter_lookups.get(name, name): value
            for name, value in serializer.validated_data.items()
            if value is not None
        }
        return queryset.filter(**conditions)


def uuid_filter(help_text: str) -> serializers.UUIDField:
    return serializers.UUIDField(required=False, help_text=help_text)


def status_filter(choices: type[models.TextChoices], help_text: str) -> EnumField:
    return EnumField(choices, required=False, help_text=help_text)


# --- output ---------------------------------------------------------------------------------------------------


# Nest it with ``source="*"`` on a model that has ``cpu``/``memory``/``storage``/``gpu`` columns.
class ResourcesSerializer(serializers.Serializer):
    """A resource vector: CPU cores, memory GB, storage GB, GPU GB of VRAM."""

    cpu = serializers.FloatField(read_only=True, help_text="CPU cores")
    memory = serializers.FloatField(read_only=True, help_text="memory, GB")
    storage = serializers.FloatField(read_only=True, help_text="storage, GB")
    gpu = serializers.FloatField(read_only=True, help_text="GPU memory, GB of VRAM")


class ExecutorSerializer(serializers.Serializer):
    """An executor: its class (`train`, `aggregate`) and its name."""

    # ``class`` is a Python keyword, so the fields are declared here rather than as class attributes.
    def get_fields(self) -> dict[str, serializers.Field]:
        return {
            "class": serializers.CharField(read_only=True, help_text="e.g. train, aggregate"),
            "name": serializers.CharField(read_only=True, help_text="e.g. diloco-transformer"),
        }
