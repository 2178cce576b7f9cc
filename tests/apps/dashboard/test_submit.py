"""The submit-a-job page: fields with defaults or a Hypha scheduler TOML, checked exactly as
``POST /api/jobs/diloco/`` checks them; a bad form shows each error next to its field and creates nothing."""

from __future__ import annotations

import json
import re

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from apps.dashboard.forms import TINY_GPT2, DiLoCoJobForm
from apps.datasets import services as dataset_services
from apps.jobs import services as job_services
from apps.jobs import spec as job_spec
from apps.jobs.models import Job
from tests.apps.jobs.test_spec import HYPHA_DEFAULT_TOML

pytestmark = pytest.mark.django_db


def default_fields(**changes) -> dict:
    """The form's initial values as a browser posts them, with ``changes``."""
    form = DiLoCoJobForm(owner=None, prefix="job")
    data = {"source": "fields"}
    for name, field in form.fields.items():
        value = form.get_initial_for_field(field, name)
        data[f"job-{name}"] = "" if value is None else value
    data["job-dataset"] = "tiny-text"
    data.update({f"job-{name}": value for name, value in changes.items()})
    return data


def errors_next_to(html: str, field: str) -> list[str]:
    """The error messages rendered inside the field's own block."""
    match = re.search(rf'<ul class="errorlist" id="errors-job-{field}" role="alert">(.*?)</ul>', html, re.S)
    return re.findall(r"<li>(.*?)</li>", match.group(1)) if match else []


def test_the_form_starts_with_a_tiny_gpt2_and_the_registered_datasets(ada_browser, tiny_text):
    html = ada_browser.get("/jobs/new/").content.decode()

    assert '<option value="tiny-text">tiny-text (4 slices)</option>' in html
    assert "&quot;model_type&quot;: &quot;gpt2&quot;" in html
    assert 'name="job-num_trainers" value="2"' in html
    assert 'name="csrfmiddlewaretoken"' in html


def test_a_valid_form_creates_the_job_the_api_would(ada_browser, tiny_text, job_owner):
    # when
    response = ada_browser.post("/jobs/new/", default_fields(name="from-the-form", update_rounds=5))

    # then: redirected to the new job, stored as POST /api/jobs/diloco/ stores the same spec
    job = Job.objects.get()
    assert (response.status_code, response["Location"]) == (302, f"/jobs/{job.pk}/")
    expected = job_spec.parse_json(
        {
            "model": {
                "source": {"type": "config", "config": TINY_GPT2},
                "type": "causal-lm",
                "input_names": ["input_ids", "labels"],
            },
            "dataset": {"name": "tiny-text"},
            "inner_optimizer": {"learning_rate": 3e-3},
            "outer_optimizer": {"learning_rate": 0.7, "momentum": 0.9},
            "rounds": {"update_rounds": 5, "inner_steps": 50, "round_timeout": 120.0},
            "batch_size": 16,
            "num_trainers": 2,
            "evaluation": {"holdout": 2, "batch_size": 32},
        }
    )
    assert (job.name, job.owner, job.num_trainers) == ("from-the-form", job_owner, 2)
    assert job.spec == job_services.spec_for_storage(expected, job_owner)
    assert job.requirements == job_spec.to_requirements(expected)
    assert job.status in ("pending", "allocating")


def test_bad_values_are_shown_next_to_their_fields_and_nothing_is_created(ada_browser, tiny_text):
    # when
    response = ada_browser.post(
        "/jobs/new/",
        default_fields(
            inner_steps=0, outer_momentum=2, trainer_max=50, num_trainers=0, model_type="causal-lm"
        ),
    )

    # then
    html = response.content.decode()
    assert response.status_code == 400
    assert errors_next_to(html, "inner_steps") == ["Input should be greater than or equal to 1"]
    assert errors_next_to(html, "outer_momentum") == ["Input should be less than or equal to 1"]
    assert errors_next_to(html, "trainer_max") == ["Must be at least the bid (100)."]
    assert errors_next_to(html, "num_trainers") == ["Input should be greater than or equal to 1"]
    assert errors_next_to(html, "batch_size") == []
    assert 'value="0"' in html  # what was typed is kept
    assert Job.objects.count() == 0


def test_the_form_takes_an_encoding_and_int8_block_size(ada_browser, tiny_text):
    response = ada_browser.post("/jobs/new/", default_fields(encoding="int8", encoding_block_size=64))

    job = Job.objects.get()
    assert response.status_code == 302
    assert (job.spec["rounds"]["encoding"], job.spec["rounds"]["encoding_block_size"]) == ("int8", 64)


def test_a_block_size_for_an_encoding_without_blocks_is_shown_next_to_it(ada_browser, tiny_text):
    response = ada_browser.post("/jobs/new/", default_fields(encoding="float16", encoding_block_size=64))

    assert response.status_code == 400
    assert errors_next_to(response.content.decode(), "encoding_block_size") == [
        "Only the int8 encoding has blocks (this job&#x27;s is float16)."
    ]
    assert Job.objects.count() == 0


def test_the_form_takes_eager_overlap_and_the_job_page_shows_it(ada_browser, tiny_text):
    html = ada_browser.get("/jobs/new/").content.decode()
    assert '<option value="eager">eager (train on while the round&#x27;s result travels)</option>' in html

    response = ada_browser.post("/jobs/new/", default_fields(overlap="eager"))

    job = Job.objects.get()
    assert response.status_code == 302
    assert job.spec["rounds"]["overlap"] == "eager"
    assert "&#x27;overlap&#x27;: &#x27;eager&#x27;" in ada_browser.get(f"/jobs/{job.pk}/").content.decode()


def test_an_overlap_mode_that_is_not_offered_is_refused_next_to_its_field(ada_browser, tiny_text):
    response = ada_browser.post("/jobs/new/", default_fields(overlap="lazy"))

    assert response.status_code == 400
    assert errors_next_to(response.content.decode(), "overlap") == [
        "Select a valid choice. lazy is not one of the available choices."
    ]
    assert Job.objects.count() == 0


def test_the_form_takes_streaming_overlap_with_its_fragments_and_mix(ada_browser, tiny_text):
    html = ada_browser.get("/jobs/new/").content.decode()
    assert (
        '<option value="streaming">streaming (sync one fragment of the model a round, training on)</option>'
        in html
    )
    assert 'name="job-fragments"' in html and 'name="job-mix"' in html

    response = ada_browser.post("/jobs/new/", default_fields(overlap="streaming", fragments="8", mix="0.25"))

    job = Job.objects.get()
    assert response.status_code == 302
    rounds = job.spec["rounds"]
    assert (rounds["overlap"], rounds["fragments"], rounds["mix"]) == ("streaming", 8, 0.25)


def test_streaming_with_its_options_left_empty_gets_the_servers_defaults(ada_browser, tiny_text):
    response = ada_browser.post("/jobs/new/", default_fields(overlap="streaming"))

    job = Job.objects.get()
    assert response.status_code == 302
    spec = job_spec.parse_json(job.spec)
    assert (spec.rounds.overlap, spec.rounds.fragment_count, spec.rounds.streaming_mix) == (
        "streaming",
        4,
        0.5,
    )


def test_a_job_without_streaming_sends_no_fragments_or_mix(ada_browser, tiny_text):
    response = ada_browser.post("/jobs/new/", default_fields(overlap="eager"))

    assert response.status_code == 302
    rounds = Job.objects.get().spec["rounds"]
    assert (rounds["overlap"], rounds.get("fragments"), rounds.get("mix")) == ("eager", None, None)


@pytest.mark.parametrize(
    ("changes", "errors"),
    [
        (
            {"overlap": "eager", "fragments": "8", "mix": "0.25"},
            {
                "fragments": [
                    "fragments is an option of overlap = &#x27;streaming&#x27; (this job&#x27;s is eager)."
                ],
                "mix": ["mix is an option of overlap = &#x27;streaming&#x27; (this job&#x27;s is eager)."],
            },
        ),
        (
            {"overlap": "none", "mix": "0.25"},
            {
                "fragments": [],
                "mix": ["mix is an option of overlap = &#x27;streaming&#x27; (this job&#x27;s is none)."],
            },
        ),
        (
            {"overlap": "streaming", "fragments": "1", "mix": "1"},
            {
                "fragments": ["Input should be greater than or equal to 2"],
                "mix": ["Input should be less than 1"],
            },
        ),
        (
            {"overlap": "streaming", "fragments": "65", "mix": "-0.5"},
            {
                "fragments": ["Input should be less than or equal to 64"],
                "mix": ["Input should be greater than or equal to 0"],
            },
        ),
    ],
)
def test_streaming_options_out_of_range_or_without_streaming_are_refused_next_to_their_fields(
    ada_browser, tiny_text, changes, errors
):
    response = ada_browser.post("/jobs/new/", default_fields(**changes))

    assert response.status_code == 400
    html = response.content.decode()
    assert {field: errors_next_to(html, field) for field in errors} == errors
    assert Job.objects.count() == 0


def test_a_model_config_that_is_not_json_or_has_no_model_type_is_refused(ada_browser, tiny_text):
    not_json = ada_browser.post("/jobs/new/", default_fields(model_config="{not json"))
    no_type = ada_browser.post("/jobs/new/", default_fields(model_config=json.dumps({"n_layer": 2})))

    assert errors_next_to(not_json.content.decode(), "model_config")[0].startswith("Not JSON: ")
    assert errors_next_to(no_type.content.decode(), "model_config") == [
        "A transformers config needs a &#x27;model_type&#x27; string, e.g. &#x27;gpt2&#x27;."
    ]
    assert Job.objects.count() == 0


def test_something_that_is_not_a_number_is_refused_by_its_field(ada_browser, tiny_text):
    response = ada_browser.post("/jobs/new/", default_fields(batch_size="many", inner_learning_rate="fast"))

    html = response.content.decode()
    assert errors_next_to(html, "batch_size") == ["Enter a whole number."]
    assert errors_next_to(html, "inner_learning_rate") == ["Enter a number."]
    assert Job.objects.count() == 0


def test_holding_out_every_slice_is_refused_next_to_the_holdout(ada_browser, tiny_text):
    response = ada_browser.post("/jobs/new/", default_fields(holdout=4))

    assert errors_next_to(response.content.decode(), "holdout") == [
        "Holding out 4 of 4 slices leaves none to train on."
    ]
    assert Job.objects.count() == 0


def test_an_unregistered_dataset_cannot_be_chosen(ada_browser, tiny_text):
    response = ada_browser.post("/jobs/new/", default_fields(dataset="nope"))

    assert errors_next_to(response.content.decode(), "dataset") == [
        "Select a valid choice. nope is not one of the available choices."
    ]
    assert Job.objects.count() == 0


def test_the_form_needs_the_csrf_token(job_owner, tiny_text):
    from django.test import Client

    browser = Client(enforce_csrf_checks=True)
    browser.force_login(job_owner)

    assert browser.post("/jobs/new/", default_fields()).status_code == 403
    assert Job.objects.count() == 0


# --- TOML --------------------------------------------------------------------------------------------------


@pytest.fixture
def mnist(db):
    node, _ = dataset_services.create_data_node(name="data-west", url="http://west.example:8100")
    return dataset_services.register_dataset(node, "mnist", [(0, 10, "a" * 64), (1, 10, "b" * 64)])


def test_an_uploaded_hypha_toml_creates_the_job(ada_browser, mnist):
    # when
    upload = SimpleUploadedFile("job.toml", HYPHA_DEFAULT_TOML.encode(), content_type="application/toml")
    response = ada_browser.post(
        "/jobs/new/", {"source": "toml", "toml-name": "lenet", "toml-toml_file": upload}
    )

    # then
    job = Job.objects.get()
    assert (response.status_code, response["Location"]) == (302, f"/jobs/{job.pk}/")
    parsed = job_spec.parse_toml(HYPHA_DEFAULT_TOML)
    assert (job.name, job.num_trainers) == ("lenet", parsed.num_trainers)
    assert job.requirements == job_spec.to_requirements(parsed)


def test_a_pasted_toml_with_mistakes_lists_them_by_key_and_creates_nothing(ada_browser, mnist):
    # when
    broken = HYPHA_DEFAULT_TOML.replace("momentum = 0.9", "momentum = 9").replace(
        'dataset = "mnist"', 'dataset = "x"'
    )
    response = ada_browser.post("/jobs/new/", {"source": "toml", "toml-toml_text": broken})

    # then: shown in the TOML tab, each mistake by its key
    html = response.content.decode()
    assert response.status_code == 400
    match = re.search(r'<ul class="errorlist" id="errors-toml-toml_text" role="alert">(.*?)</ul>', html, re.S)
    messages = re.findall(r"<li>(.*?)</li>", match.group(1))
    assert any(message.startswith("scheduler.job.outer_optimizer.momentum: ") for message in messages), (
        messages
    )
    assert '<section class="card tab-panel" id="toml">' in html
    assert Job.objects.count() == 0


def test_an_empty_toml_form_asks_for_a_file(ada_browser):
    response = ada_browser.post("/jobs/new/", {"source": "toml"})

    assert "Choose a TOML file or paste one." in response.content.decode()
    assert Job.objects.count() == 0
