"""``hypha-data-node --reachable``: the registration says it when it is said, and omits it otherwise (an older
control plane refuses unknown keys)."""

from __future__ import annotations

import pytest

from data_node.__main__ import build_parser
from data_node.server import ServedDataset, register
from data_node.slices import scan
from tests.data_node.test_server import TOKEN, control_plane, dataset_dir  # noqa: F401 (fixtures)


@pytest.mark.parametrize(("flag", "sent"), [("true", True), ("false", False)])
async def test_a_said_reachability_is_registered(control_plane, dataset_dir, flag, sent):  # noqa: F811
    from data_node.__main__ import _reachable

    served = ServedDataset(name="tiny-corpus", slices=scan(dataset_dir))

    # when
    await register(
        server=control_plane.url,
        token=TOKEN,
        dataset=served,
        public_url="http://n:1",
        reachable=_reachable(flag),
    )

    # then
    [(_, body)] = control_plane.requests
    assert body["reachable"] is sent


async def test_auto_is_not_sent(control_plane, dataset_dir):  # noqa: F811
    served = ServedDataset(name="tiny-corpus", slices=scan(dataset_dir))

    await register(server=control_plane.url, token=TOKEN, dataset=served, public_url="http://n:1")

    [(_, body)] = control_plane.requests
    assert sorted(body) == ["name", "slices", "url"]


def test_the_flag_defaults_to_auto_and_takes_only_true_false_or_auto(capsys):
    parser = build_parser()
    assert parser.parse_args(["--server", "http://cp", "--dataset", "d"]).reachable == "auto"
    assert (
        parser.parse_args(["--server", "http://cp", "--dataset", "d", "--reachable", "false"]).reachable
        == "false"
    )
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--server", "http://cp", "--dataset", "d", "--reachable", "no"])
    assert exited.value.code == 2
    assert "argument --reachable: invalid choice: 'no'" in capsys.readouterr().err
