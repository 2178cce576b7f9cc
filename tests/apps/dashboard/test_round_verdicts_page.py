"""The rounds table shows the parameter server's verdicts (issue 18): "rejected: 1" with the reasons as the tooltip."""

from __future__ import annotations

import re

import pytest

from tests.apps.dashboard.conftest import status, task_of

pytestmark = pytest.mark.django_db


def test_a_rejected_update_shows_in_the_rounds_table_with_its_reason(training_job, online_rigs, ada_browser):
    rig_a, rig_b, rig_c = online_rigs
    verdicts = {
        str(rig_a.pk): {
            "verdict": "rejected",
            "reason": "its norm is 100x the median <b>",
            "norm_ratio": 100.0,
            "cosine": -1.0,
        },
        str(rig_b.pk): {"verdict": "accepted", "reason": "", "norm_ratio": 1.0, "cosine": 0.9},
    }
    status(
        rig_c, task_of(training_job, rig_c), {"round": {"round": 1, "participants": [], "verdicts": verdicts}}
    )
    status(rig_c, task_of(training_job, rig_c), {"round": {"round": 2, "participants": []}})

    html = ada_browser.get(f"/jobs/{training_job.pk}/").content.decode()

    row_1 = re.search(r'<tr data-round="1">(.*?)</tr>', html).group(1)
    row_2 = re.search(r'<tr data-round="2">(.*?)</tr>', html).group(1)
    assert (
        '<td class="verdicts error"><span title="rig-a: rejected: its norm is 100x the median &lt;b&gt;">'
        "rejected: 1</span></td>" in row_1
    )
    # a round without verdicts (not verified): a dash after "left out"
    assert '<td class="num">0</td><td class="num">—</td>' in row_2
    assert "<th>Left out</th><th title=\"the parameter server's verdicts on the round's updates" in html
