"""A round the parameter server discarded (issue 18, "Discard a round"): its report's ``discarded`` reason is
stored on the round, shown on the API and marked in the job page's rounds table."""

from __future__ import annotations

import re

import pytest

from apps.jobs.models import Round
from tests.apps.dashboard.conftest import status, task_of

pytestmark = pytest.mark.django_db

REASON = "its held-out loss rises from 2.31 to 9.8 (more than 1.5x): the previous weights and momentum are kept <b>"


def test_a_discarded_round_is_stored_shown_on_the_api_and_marked_on_the_page(
    training_job, online_rigs, ada_browser
):
    rig_c = online_rigs[2]
    server = task_of(training_job, rig_c)
    status(rig_c, server, {"round": {"round": 1, "participants": [], "duration": 1.0, "eval_loss": 2.31}})
    status(
        rig_c,
        server,
        {"round": {"round": 2, "participants": [], "duration": 1.0, "eval_loss": 2.31, "discarded": REASON}},
    )

    first, second = Round.objects.filter(job=training_job).order_by("number")
    assert (first.discarded, first.discard_reason) == (False, "")
    assert (second.discarded, second.discard_reason) == (True, REASON)
    training_job.refresh_from_db()
    assert (
        "round 2 of" in training_job.status_reason and "discarded, weights kept" in training_job.status_reason
    )

    body = ada_browser.get(f"/api/jobs/{training_job.pk}/").json()
    shown = {round_["number"]: round_ for round_ in body["rounds"]}
    assert (shown[2]["discarded"], shown[2]["discard_reason"]) == (True, REASON)
    assert (shown[1]["discarded"], shown[1]["discard_reason"]) == (False, "")

    html = ada_browser.get(f"/jobs/{training_job.pk}/").content.decode()
    row_1 = re.search(r'<tr data-round="1">(.*?)</tr>', html).group(1)
    row_2 = re.search(r'<tr data-round="2">(.*?)</tr>', html).group(1)
    assert '<td class="error"><span title="its held-out loss rises from 2.31 to 9.8' in row_2
    assert 'kept &lt;b&gt;">discarded</span></td>' in row_2
    assert "discarded" not in row_1


@pytest.mark.parametrize("value", [["x"], 1, "", None, True])
def test_a_report_with_a_hostile_discarded_value_stores_no_discard(training_job, online_rigs, value):
    rig_c = online_rigs[2]
    status(
        rig_c, task_of(training_job, rig_c), {"round": {"round": 1, "participants": [], "discarded": value}}
    )
    assert (Round.objects.get(job=training_job, number=1).discarded, Round.objects.get().discard_reason) == (
        False,
        "",
    )


def test_a_long_reason_is_cut_to_500_characters(training_job, online_rigs):
    rig_c = online_rigs[2]
    status(
        rig_c,
        task_of(training_job, rig_c),
        {"round": {"round": 1, "participants": [], "discarded": "y" * 2000}},
    )
    assert Round.objects.get(job=training_job, number=1).discard_reason == "y" * 500
