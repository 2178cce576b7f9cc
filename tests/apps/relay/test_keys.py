"""The relay's key grammar and who may touch which key (pure functions)."""

from __future__ import annotations

import pytest

from apps.relay import keys
from apps.relay.exceptions import RelayRefused

PEER = "0b6f6d2e-8f67-4c59-9f0c-3b1f3a0c9d11"
OTHER = "5d1c0c44-0e0a-4c1b-8f83-6f3e2a4b7c10"


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        (f"updates/1/{PEER}", keys.Key(f"updates/1/{PEER}", "updates", 1, peer=PEER)),
        ("results/999999999", keys.Key("results/999999999", "results", 999999999)),
        ("model/0/config.json", keys.Key("model/0/config.json", "model", 0, filename="config.json")),
        ("model/latest/x", keys.Key("model/latest/x", "model", None, filename="x", latest=True)),
    ],
)
def test_keys_of_the_grammar_parse(text, parsed):
    assert keys.parse_key(text) == parsed


@pytest.mark.parametrize(
    "text",
    [
        f"updates/0/{PEER}",
        f"updates/01/{PEER}",
        f"updates/1/{PEER.upper()}",
        "updates/1/not-a-uuid",
        "results/0",
        "results/1/",
        "results/1000000000",
        "model/1/../x",
        "model/1/a/b",
        "model/x/config.json",
        "model/1/" + "a" * 101,
        "other/1",
        "",
        None,
        7,
    ],
)
def test_anything_else_is_a_400_naming_the_key(text):
    with pytest.raises(RelayRefused) as refused:
        keys.parse_key(text)

    assert (refused.value.status, refused.value.field) == (400, "key")


def test_who_may_write_and_read_which_key():
    update, result, model = (
        keys.parse_key(f"updates/3/{PEER}"),
        keys.parse_key("results/3"),
        keys.parse_key("model/3/w.safetensors"),
    )
    latest = keys.parse_key("model/latest/w.safetensors")

    writes = {
        (role, peer, key.text): keys.may_write(role, peer, key)
        for role in (keys.TRAINER, keys.PARAMETER_SERVER)
        for peer in (PEER, OTHER)
        for key in (update, result, model, latest)
    }
    assert {entry for entry, allowed in writes.items() if allowed} == {
        (keys.TRAINER, PEER, update.text),
        (keys.PARAMETER_SERVER, PEER, result.text),
        (keys.PARAMETER_SERVER, PEER, model.text),
        (keys.PARAMETER_SERVER, OTHER, result.text),
        (keys.PARAMETER_SERVER, OTHER, model.text),
    }
    assert [keys.may_read(keys.TRAINER, key) for key in (update, result, model, latest)] == [
        False,
        True,
        True,
        True,
    ]
    assert [keys.may_read(keys.PARAMETER_SERVER, key) for key in (update, result, model, latest)] == [
        True
    ] * 4
    assert keys.may_read("evaluator", result) is False


@pytest.mark.parametrize(
    ("text", "namespace"), [("updates/", "updates"), ("results/1", "results"), ("model/", "model")]
)
def test_prefixes_name_a_namespace(text, namespace):
    assert keys.parse_prefix(text) == namespace


@pytest.mark.parametrize("text", ["updates", "/updates/", "secrets/", "model/%", "", None])
def test_other_prefixes_are_a_400(text):
    with pytest.raises(RelayRefused) as refused:
        keys.parse_prefix(text)

    assert (refused.value.status, refused.value.field) == (400, "prefix")
