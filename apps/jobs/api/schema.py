"""The body of ``POST /api/jobs/diloco/`` as the OpenAPI document publishes it: the spec's pydantic models.

:class:`DiLoCoSubmission` documents the JSON body (the view validates it with :func:`apps.jobs.spec.parse_json`
after taking ``name`` out); ``hypha_site.openapi`` turns it and every model it nests into components.
"""

from __future__ import annotations

from pydantic import Field

from apps.jobs.spec import DiLoCoSpec

NAME_MAX_LENGTH = 200


class DiLoCoSubmission(DiLoCoSpec):
    """A DiLoCo training job: the model, data, both optimizers, the rounds, and what each role needs and pays;
    and a name for you."""

    name: str = Field(default="", max_length=NAME_MAX_LENGTH, description="a label for you")
