"""hypha_site/urls.py: a path under /api/ that no route matches is a JSON 404 like every other API error."""

from __future__ import annotations

import pytest


@pytest.mark.django_db
def test_an_api_path_no_route_matches_is_a_json_404(client):
    # when: a job id that is not a UUID (the router's id pattern refuses a '.')
    response = client.get("/api/jobs/0.5/cancel/")

    # then (it was Django's HTML page, which no API client reads)
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    assert response.json() == {"detail": "Not found."}


@pytest.mark.django_db
def test_a_page_no_route_matches_is_still_an_html_404(client):
    # when
    response = client.get("/no-such-page/")

    # then
    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")
