"""hypha_site.openapi: pydantic's JSON Schema (2020-12) as OpenAPI 3.0, and the defaults generators cannot take."""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

from hypha_site.openapi import UnsupportedSchema, drop_object_defaults, model_components, openapi30


class Inner(BaseModel):
    size: int = Field(gt=0, lt=10)


class Outer(BaseModel):
    kind: Literal["outer"]
    inner: Inner | None = None
    pair: tuple[float, float] | None = None
    mixed: tuple[int, str]
    label: str | None = Field(default=None, description="a label")
    count: Annotated[int, Field(ge=1)] = 1


def test_a_model_becomes_openapi_30_components():
    # when
    schema, nested = model_components(Outer)

    # then
    assert schema == {
        "type": "object",
        "properties": {
            "kind": {"type": "string", "enum": ["outer"]},
            "inner": {"allOf": [{"$ref": "#/components/schemas/Inner"}], "nullable": True},
            "pair": {
                "type": "array",
                "items": {"type": "number"},
                "minItems": 2,
                "maxItems": 2,
                "nullable": True,
            },
            "mixed": {
                "type": "array",
                "items": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                "minItems": 2,
                "maxItems": 2,
            },
            "label": {"type": "string", "nullable": True, "description": "a label"},
            "count": {"type": "integer", "minimum": 1, "default": 1},
        },
        "required": ["kind", "mixed"],
    }
    assert nested == {
        "Inner": {
            "type": "object",
            "properties": {
                "size": {
                    "type": "integer",
                    "minimum": 0,
                    "exclusiveMinimum": True,
                    "maximum": 10,
                    "exclusiveMaximum": True,
                }
            },
            "required": ["size"],
        }
    }


@pytest.mark.parametrize(
    ("json_schema", "openapi"),
    [
        ({"type": ["string", "null"]}, {"type": "string", "nullable": True}),
        ({"$ref": "#/x", "description": "d"}, {"allOf": [{"$ref": "#/x"}], "description": "d"}),
        (
            {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
            {
                "anyOf": [{"type": "integer"}, {"type": "string"}],
                "nullable": True,
            },
        ),
        ({"type": "string", "examples": ["a", "b"]}, {"type": "string", "example": "a"}),
    ],
)
def test_json_schema_forms_have_their_openapi_30_spelling(json_schema, openapi):
    assert openapi30(json_schema) == openapi


@pytest.mark.parametrize(
    "json_schema",
    [
        {"type": "object", "patternProperties": {"^a": {"type": "string"}}},
        {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}},
        {"type": ["string", "integer"]},
        {"if": {"type": "string"}},
    ],
)
def test_what_openapi_30_cannot_say_is_refused(json_schema):
    with pytest.raises(UnsupportedSchema):
        openapi30(json_schema)


def test_defaults_beside_object_references_are_dropped_and_others_kept():
    # given
    document = {
        "components": {
            "schemas": {
                "Executor": {"type": "object", "properties": {"name": {"type": "string"}}},
                "Colour": {"type": "string", "enum": ["red", "blue"]},
                "Role": {
                    "type": "object",
                    "properties": {
                        "executor": {
                            "allOf": [{"$ref": "#/components/schemas/Executor"}],
                            "default": {"name": "x"},
                        },
                        "colour": {"allOf": [{"$ref": "#/components/schemas/Colour"}], "default": "red"},
                        "count": {"type": "integer", "default": 2},
                    },
                },
            }
        }
    }

    # when
    result = drop_object_defaults(document, None, None, True)

    # then
    properties = result["components"]["schemas"]["Role"]["properties"]
    assert properties["executor"] == {"allOf": [{"$ref": "#/components/schemas/Executor"}]}
    assert properties["colour"]["default"] == "red"
    assert properties["count"]["default"] == 2
