"""docs/openapi.yaml is the schema the code generates: a change to the API must come with the regenerated file."""

from __future__ import annotations

from pathlib import Path

import yaml
from django.conf import settings
from django.core.management import call_command

from apps.jobs.api.schema import DiLoCoSubmission

SCHEMA_FILE = Path(settings.BASE_DIR) / "docs" / "openapi.yaml"
REGENERATE = "python manage.py spectacular --file docs/openapi.yaml --validate --fail-on-warn"


def test_the_committed_schema_is_the_generated_one(tmp_path):
    # given
    generated = tmp_path / "openapi.yaml"

    # when (the same command as REGENERATE: it fails on any warning and validates against the OpenAPI spec)
    call_command("spectacular", "--file", str(generated), "--validate", "--fail-on-warn")

    # then
    assert SCHEMA_FILE.exists(), f"docs/openapi.yaml is missing; generate it with: {REGENERATE}"
    assert generated.read_text() == SCHEMA_FILE.read_text(), (
        f"docs/openapi.yaml is out of date with the API; regenerate it with: {REGENERATE}"
    )


def _document() -> dict:
    return yaml.safe_load(SCHEMA_FILE.read_text())


def test_the_diloco_submission_body_is_the_spec_schema():
    # given
    document = _document()
    components = document["components"]["schemas"]

    # when
    body = document["paths"]["/api/jobs/diloco/"]["post"]["requestBody"]["content"]["application/json"]
    submission = components[body["schema"]["$ref"].rsplit("/", 1)[-1]]

    # then: a typed object whose parts are the spec's models, not a bare object
    assert body["schema"] == {"$ref": "#/components/schemas/DiLoCoSubmissionRequest"}
    assert submission["additionalProperties"] is False
    assert submission["required"] == ["model", "dataset", "inner_optimizer", "outer_optimizer", "rounds"]
    assert submission["properties"]["model"] == {"$ref": "#/components/schemas/ModelSpec"}
    assert submission["properties"]["rounds"] == {"$ref": "#/components/schemas/RoundsSpec"}
    assert submission["properties"]["evaluation"] == {
        "allOf": [{"$ref": "#/components/schemas/EvaluationSpec"}],
        "nullable": True,
    }
    source = components["ModelSpec"]["properties"]["source"]
    assert source["discriminator"]["propertyName"] == "type"
    assert {option["$ref"].rsplit("/", 1)[-1] for option in source["oneOf"]} == {
        "HuggingFaceSource",
        "UrlSource",
        "UploadSource",
        "ConfigSource",
    }


def test_the_published_spec_schemas_have_the_fields_of_the_pydantic_models():
    # given: what the models say now (JSON Schema 2020-12, as pydantic writes it)
    models = DiLoCoSubmission.model_json_schema(ref_template="#/components/schemas/{model}")
    models = {**models.pop("$defs"), "DiLoCoSubmissionRequest": models}

    # when
    components = _document()["components"]["schemas"]

    # then: every model is a component with the same fields and the same required ones
    for name, model in models.items():
        assert name in components, f"{name} is not in docs/openapi.yaml; regenerate it with: {REGENERATE}"
        published = components[name]
        assert list(published["properties"]) == list(model["properties"]), name
        assert published.get("required", []) == model.get("required", []), name
        assert published["additionalProperties"] is False, name


def test_no_object_reference_has_a_default():
    # Generators cannot put a default on a model-typed field: openapi-python-client drops the whole schema
    # ("ModelProperty cannot have a default value"), and every endpoint that uses it.
    components = _document()["components"]["schemas"]
    found = []

    def visit(node, path):
        if isinstance(node, dict):
            references = node.get("allOf") or ([node] if "$ref" in node else [])
            targets = [ref.get("$ref", "").rsplit("/", 1)[-1] for ref in references]
            if (
                "default" in node
                and targets
                and all(components.get(target, {}).get("type") == "object" for target in targets)
            ):
                found.append(path)
            for key, value in node.items():
                visit(value, f"{path}/{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                visit(value, f"{path}/{index}")

    visit(_document(), "")

    assert found == []
    executor = components["TrainerRequirementRequest"]["properties"]["executor"]
    assert executor == {
        "allOf": [{"$ref": "#/components/schemas/ExecutorRequest"}],
        "description": "default: class 'train', name 'diloco-transformer'",
    }
