"""Pydantic models in the OpenAPI document, and the document's fixes for client generators.

drf-spectacular writes OpenAPI 3.0.3; pydantic writes JSON Schema 2020-12. :class:`PydanticSchemaExtension` lets
a pydantic model be a request body (``@extend_schema(request=Model)``): its JSON Schema (validation mode, what
the endpoint accepts), converted by :func:`openapi30`, with every nested model (pydantic's ``$defs``) a
component of its own under its class name. A name that another component has already is a schema warning,
so ``manage.py spectacular --fail-on-warn`` fails rather than publish one model under another's name.

:func:`drop_object_defaults` (a postprocessing hook) removes a ``default`` beside a reference to an object
component: OpenAPI allows it, but generators cannot put a default on a model-typed field (openapi-python-client
drops the whole schema: "ModelProperty cannot have a default value"). The defaults stay in the descriptions.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.plumbing import ResolvedComponent

COMPONENT_REF = "#/components/schemas/{model}"
NULL = {"type": "null"}

#: The keywords of an OpenAPI 3.0 Schema Object; anything else left after the conversion is refused.
OPENAPI30_KEYWORDS = frozenset(
    {
        "$ref",
        "title",
        "multipleOf",
        "maximum",
        "exclusiveMaximum",
        "minimum",
        "exclusiveMinimum",
        "maxLength",
        "minLength",
        "pattern",
        "maxItems",
        "minItems",
        "uniqueItems",
        "maxProperties",
        "minProperties",
        "required",
        "enum",
        "type",
        "allOf",
        "oneOf",
        "anyOf",
        "not",
        "items",
        "properties",
        "additionalProperties",
        "description",
        "format",
        "default",
        "nullable",
        "discriminator",
        "readOnly",
        "writeOnly",
        "example",
        "deprecated",
    }
)


class UnsupportedSchema(ValueError):
    """A JSON Schema construct with no OpenAPI 3.0 form (the model must be written differently)."""


def openapi30(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (JSON Schema 2020-12, as pydantic writes it) as an OpenAPI 3.0 Schema Object.

    ``{"anyOf": [X, {"type": "null"}]}`` becomes X with ``nullable: true`` (a reference: ``allOf: [X]``, since
    3.0 ignores a ``$ref``'s siblings) and its ``default: null`` goes (absent means null); ``const`` becomes a
    one-value ``enum``; a tuple's ``prefixItems`` become ``items`` (one schema when all are the same, else
    ``anyOf``); a numeric ``exclusiveMinimum``/``exclusiveMaximum`` becomes ``minimum``/``maximum`` with the
    3.0 boolean; ``title`` goes (pydantic derives it from the field name; generators would name classes
    after it). Raises :class:`UnsupportedSchema` for anything else 3.0 cannot say.
    """
    if not isinstance(schema, dict):
        raise UnsupportedSchema(f"a schema must be an object, not {schema!r}")
    result = _nullable(dict(schema))
    result.pop("title", None)
    if "const" in result:
        result["enum"] = [result.pop("const")]
    if isinstance(result.get("type"), list):
        types = [kind for kind in result["type"] if kind != "null"]
        if len(types) != 1:
            raise UnsupportedSchema(f"a schema of several types {result['type']!r}")
        result["nullable"] = len(types) < len(result["type"]) or result.get("nullable", False)
        result["type"] = types[0]
    for exclusive, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        bound = result.get(exclusive)
        if bound is not None and not isinstance(bound, bool):
            if inclusive in result:
                raise UnsupportedSchema(f"both {exclusive} and {inclusive}")
            result[inclusive] = result.pop(exclusive)
            result[exclusive] = True
    if "prefixItems" in result:
        if "items" in result:
            raise UnsupportedSchema("a tuple with more items after its prefixItems")
        items = [openapi30(item) for item in result.pop("prefixItems")]
        result["items"] = items[0] if all(item == items[0] for item in items) else {"anyOf": items}
    if "examples" in result:
        examples = result.pop("examples")
        if examples:
            result["example"] = examples[0]
    if "$ref" in result and len(result) > 1:
        # 3.0 ignores every sibling of a $ref: the description (or default) must sit beside an allOf.
        result = {"allOf": [{"$ref": result.pop("$ref")}], **result}
    if "properties" in result:
        result["properties"] = {name: openapi30(value) for name, value in result["properties"].items()}
    for key in ("items", "not"):
        if key in result:
            result[key] = openapi30(result[key])
    if isinstance(result.get("additionalProperties"), dict):
        result["additionalProperties"] = openapi30(result["additionalProperties"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in result:
            result[key] = [openapi30(option) for option in result[key]]
    unknown = sorted(set(result) - OPENAPI30_KEYWORDS)
    if unknown:
        raise UnsupportedSchema(f"no OpenAPI 3.0 form for {', '.join(unknown)}")
    return result


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """Fold a ``{"type": "null"}`` option of ``anyOf``/``oneOf`` into ``nullable: true``."""
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if not isinstance(options, list) or NULL not in options:
            continue
        rest = [option for option in options if option != NULL]
        schema = {name: value for name, value in schema.items() if name != key}
        if schema.get("default", ...) is None:
            del schema["default"]
        if len(rest) == 1 and "$ref" in rest[0] and len(rest[0]) == 1:
            return {"allOf": rest, **schema, "nullable": True}
        if len(rest) == 1 and not set(rest[0]) & set(schema):
            return {**rest[0], **schema, "nullable": True}
        return {key: rest, **schema, "nullable": True}
    return schema


def model_components(model: type) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A pydantic model's OpenAPI 3.0 schema, and those of the models it nests, by their component names."""
    from pydantic.json_schema import model_json_schema

    schema = model_json_schema(model, ref_template=COMPONENT_REF, mode="validation")
    nested = {name: openapi30(sub_schema) for name, sub_schema in schema.pop("$defs", {}).items()}
    return openapi30(schema), nested


class PydanticSchemaExtension(OpenApiSerializerExtension):
    """A pydantic model as a request body (``@extend_schema(request=Model)``), in OpenAPI 3.0 (see above).

    Replaces drf-spectacular's own pydantic extension (higher priority), which writes the serialization
    schema as pydantic emits it (JSON Schema 2020-12) and hides name collisions.
    """

    target_class = "pydantic.BaseModel"
    match_subclasses = True
    priority = 1

    def get_name(self, auto_schema, direction) -> str:
        return self.target.__name__

    def map_serializer(self, auto_schema, direction) -> dict[str, Any]:
        schema, nested = model_components(self.target)
        for name, sub_schema in nested.items():
            # A str as the component's object: a serializer's component of the same name differs in
            # identity, which drf-spectacular reports as a warning (and --fail-on-warn as an error).
            component = ResolvedComponent(
                name=name, type=ResolvedComponent.SCHEMA, object=name, schema=sub_schema
            )
            auto_schema.registry.register_on_missing(component)
        return schema


def drop_object_defaults(result: dict, generator, request, public) -> dict:
    """Postprocessing hook: remove each ``default`` beside an ``allOf``/``$ref`` to an object component."""
    components = result.get("components", {}).get("schemas", {})

    def is_object(reference: dict) -> bool:
        target = reference.get("$ref", "")
        name = target.rsplit("/", 1)[-1] if target.startswith("#/components/schemas/") else None
        return name is not None and components.get(name, {}).get("type") == "object"

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            refs = node.get("allOf") or ([node] if "$ref" in node else [])
            if "default" in node and refs and all(is_object(ref) for ref in refs):
                del node["default"]
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(result)
    return result
