"""Pieces of the client: 400 bodies as dotted field paths, and safe attachment names."""

from __future__ import annotations

import pytest

from hypha_cli.client import _attachment_name, flatten_errors


def test_flatten_errors_gives_dotted_paths_in_order():
    body = {
        "num_trainers": ["Ensure this value is less than or equal to 256."],
        "trainer": {
            "resources": {"gpu": ["Ensure this value is greater than or equal to 0."]},
            "price": {"max": ["Must be at least the bid (150)."]},
        },
        "spec": ['Expected a dictionary of items but got type "list".'],
        "rounds.update_rounds": ["Input should be greater than or equal to 1"],
        "items": [{}, {"name": ["Required."]}],
        "non_field_errors": ["Everything is wrong."],
    }

    assert flatten_errors(body) == [
        ("num_trainers", "Ensure this value is less than or equal to 256."),
        ("trainer.resources.gpu", "Ensure this value is greater than or equal to 0."),
        ("trainer.price.max", "Must be at least the bid (150)."),
        ("spec", 'Expected a dictionary of items but got type "list".'),
        ("rounds.update_rounds", "Input should be greater than or equal to 1"),
        ("items.1.name", "Required."),
        ("", "Everything is wrong."),
    ]


def test_flatten_errors_of_a_detail_body_and_a_bare_list():
    assert flatten_errors({"detail": "JSON parse error"}) == [("", "JSON parse error")]
    assert flatten_errors(["one", "two"]) == [("", "one"), ("", "two")]


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ('attachment; filename="model-1.zip"', "model-1.zip"),
        ("attachment; filename=model-1.zip", "model-1.zip"),
        ('attachment; filename="../../etc/passwd"', "passwd"),
        ('attachment; filename=".bashrc"', None),
        ("attachment", None),
        ("", None),
    ],
)
def test_attachment_names_are_reduced_to_a_safe_base_name(header, name):
    assert _attachment_name(header) == name
