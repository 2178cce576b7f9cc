"""The submit page says, on the new job's page, when the connected workers cannot serve the job now."""

from __future__ import annotations

import pytest

from apps.jobs.models import Job
from tests.apps.dashboard.test_submit import default_fields

pytestmark = pytest.mark.django_db


def test_a_job_no_connected_worker_can_serve_is_created_and_its_page_says_why(ada_browser, tiny_text):
    # when: submitted while no worker is connected
    response = ada_browser.post("/jobs/new/", default_fields(name="lonely"), follow=True)

    # then: created, and the job's page warns (and its status history keeps the warning)
    job = Job.objects.get()
    assert response.redirect_chain == [(f"/jobs/{job.pk}/", 302)]
    html = response.content.decode()
    warning = "2 of the 2 trainers cannot be served now: no connected worker fits the trainer role"
    assert f'<li class="message warning">Warning: {warning}.</li>' in html
    assert f"PENDING: warning: {warning}" in html
    assert job.allocation_timeout == 600.0
