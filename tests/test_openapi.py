"""docs/openapi.yaml is the schema the code generates: a change to the API must come with the regenerated file."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.management import call_command

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
