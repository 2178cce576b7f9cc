"""The admin and the API docs work on a machine without internet: their assets come from this server."""

from __future__ import annotations

import pytest


@pytest.mark.django_db
def test_the_api_docs_load_swagger_ui_from_this_server(client):
    # when
    page = client.get("/api/docs/")

    # then: no CDN, and the bundle it names is served
    html = page.content.decode()
    assert page.status_code == 200
    assert "cdn.jsdelivr" not in html and "unpkg.com" not in html
    bundle = "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js"
    assert f'src="{bundle}"' in html
    asset = client.get(bundle)
    assert asset.status_code == 200
    assert b"SwaggerUIBundle" in b"".join(asset.streaming_content)


def test_the_admin_stylesheet_is_served(client):
    response = client.get("/static/admin/css/base.css")

    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/css")
