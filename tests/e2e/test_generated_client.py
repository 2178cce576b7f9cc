"""A Python client generated from docs/openapi.yaml by openapi-python-client, used against a real control plane.

The generator runs as a user would run it (a subprocess, from its own venv that scripts/_bootstrap.sh makes:
its typer pin conflicts with the CLI's). Every schema of the document must survive it: a schema it cannot
process is dropped with a warning, and so are the endpoints that use it. The generated package is then
imported and, as an ordinary user with a token, submits a DiLoCo job through the typed spec models (the pydantic
models' JSON Schema, published in the document), submits an allocation-only job with typed role requirements,
lists the jobs and reads a documented 400 into its typed model.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ControlPlane, only_in_mode

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_FILE = REPO_ROOT / "docs" / "openapi.yaml"
GENERATOR_VENV = Path(sys.prefix) / "tools" / "openapi-python-client"
GENERATOR = GENERATOR_VENV / "bin" / "openapi-python-client"
PACKAGE = "hypha_control_plane_api_client"
#: The generator's warnings that are expected: bodies it has no model for (zip files, TOML, plain text).
UNSUPPORTED_CONTENT = re.compile(r"Unsupported content[ _]type")
DATASET = "client-text"
TINY_GPT2 = {
    "model_type": "gpt2",
    "vocab_size": 256,
    "n_positions": 64,
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 2,
}


def generate_client(output: Path) -> str:
    """Run openapi-python-client on docs/openapi.yaml into ``output``; its output (stdout and stderr)."""
    if not GENERATOR.exists():
        pytest.skip(
            f"openapi-python-client is not installed at {GENERATOR_VENV}: scripts/test installs it "
            "(requirements/openapi-client.txt), or run "
            "`source scripts/_bootstrap.sh && _hypha_install_openapi_client`"
        )
    env = {**os.environ, "PATH": f"{GENERATOR.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(
        [str(GENERATOR), "generate", "--path", str(SCHEMA_FILE), "--output-path", str(output)],
        cwd=output.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"openapi-python-client failed ({done.returncode}):\n{log}"
    return log


def import_client(output: Path) -> dict[str, ModuleType]:
    sys.path.insert(0, str(output))
    try:
        names = [
            "client",
            "models",
            "api.jobs.jobs_create",
            "api.jobs.jobs_diloco_create",
            "api.jobs.jobs_list",
        ]
        return {name: importlib.import_module(f"{PACKAGE}.{name}") for name in names}
    finally:
        sys.path.remove(str(output))


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The generator's output and the generated package's modules (removed from ``sys.modules`` afterwards)."""
    output = tmp_path_factory.mktemp("generated") / "client"
    log = generate_client(output)
    yield log, import_client(output)
    for name in [name for name in sys.modules if name == PACKAGE or name.startswith(f"{PACKAGE}.")]:
        del sys.modules[name]


def register_dataset(plane: ControlPlane) -> None:
    """Register :data:`DATASET` as a data node would (no node serves it: nothing trains in this test)."""
    url = "http://127.0.0.1:9/"
    token = plane.manage("create_data_node_token", "client-node", "--url", url)
    slices = [{"index": index, "size": 1024, "sha256": f"{index:064x}"} for index in range(4)]
    response = httpx.post(
        f"{plane.base_url}/api/datasets/register/",
        json={"name": DATASET, "url": url, "slices": slices},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10.0,
    )
    assert response.status_code == 201, response.text


def diloco_body(models: ModuleType, *, dataset: str, num_trainers: int = 2) -> Any:
    """A small causal-LM DiLoCo job, built from the generated spec models."""
    return models.DiLoCoSubmissionRequest(
        name="from-generated-client",
        model=models.ModelSpec(
            source=models.ConfigSource(
                type_=models.ConfigSourceTypeEnum.CONFIG,
                config=models.ConfigSourceConfig.from_dict(TINY_GPT2),
            ),
            type_="causal-lm",
            input_names=["input_ids", "labels"],
        ),
        dataset=models.DatasetSpec(name=dataset),
        inner_optimizer=models.InnerOptimizerSpec(
            learning_rate=0.003,
            schedule=models.WarmupSchedule(
                type_=models.WarmupScheduleTypeEnum.COSINE, warmup_steps=2, training_steps=20
            ),
        ),
        outer_optimizer=models.OuterOptimizerSpec(learning_rate=0.7, momentum=0.9),
        rounds=models.RoundsSpec(update_rounds=2, inner_steps=5),
        num_trainers=num_trainers,
        trainer=models.RoleSpec(price=models.PriceSpec(bid=90.0, max_=120.0)),
        parameter_server=models.ParameterServerSpec(reachable=models.ReachableEnum.ANY),
        evaluation=models.EvaluationSpec(holdout=1),
    )


@only_in_mode("embedded", "the generator reads docs/openapi.yaml, the same in either run")
def test_the_schema_generates_a_complete_client(generated) -> None:
    # given
    log, _ = generated

    # then: no schema dropped, no endpoint left out; only bodies without a model (zip, TOML) are warned about
    assert "Unable to process schema" not in log, log
    assert "removal of" not in log, log
    assert "will not be generated" not in log, log
    warnings = log.split("WARNING parsing ")[1:]
    assert all(UNSUPPORTED_CONTENT.search(warning) for warning in warnings), log


@only_in_mode("embedded", "the generated client speaks HTTP to the API, the same in either run")
def test_a_generated_client_submits_lists_and_reads_400s(generated, control_plane: ControlPlane) -> None:
    # given
    _, modules = generated
    models, jobs_create, jobs_diloco_create, jobs_list = (
        modules["models"],
        modules["api.jobs.jobs_create"],
        modules["api.jobs.jobs_diloco_create"],
        modules["api.jobs.jobs_list"],
    )
    register_dataset(control_plane)
    token = control_plane.manage("create_user_token", "client-user")
    client = modules["client"].AuthenticatedClient(
        base_url=control_plane.base_url, token=token, prefix="Token", timeout=httpx.Timeout(30.0)
    )

    with client:
        # when: a DiLoCo job from the typed spec models
        submitted = jobs_diloco_create.sync_detailed(client=client, body=diloco_body(models, dataset=DATASET))

        # then
        assert submitted.status_code == 201, submitted.content
        job = submitted.parsed
        assert isinstance(job, models.JobSubmitted)
        assert job.name == "from-generated-client"
        assert job.status == models.JobStatus.PENDING
        assert job.spec.additional_properties["inner_optimizer"]["schedule"]["type"] == "cosine"
        assert job.spec.additional_properties["evaluation"]["holdout"] == 1
        assert job.parameter_server.reachable == models.ReachableEnum.ANY
        assert (job.trainer.price.bid, job.trainer.price.max_) == (90.0, 120.0)

        # when: an allocation-only job with typed role requirements (the schemas generators used to drop)
        allocation_only = jobs_create.sync_detailed(
            client=client,
            body=models.JobSubmissionRequest(
                name="allocation-only",
                num_trainers=1,
                trainer=models.TrainerRequirementRequest(
                    resources=models.ResourcesRequest(cpu=1.0, memory=1.0),
                    price=models.PriceRequest(bid=50.0, max_=60.0),
                ),
                parameter_server=models.ParameterServerRequirementRequest(
                    executor=models.ExecutorRequest(class_="aggregate", name="parameter-server"),
                    reachable=models.ReachableEnum.REQUIRE,
                ),
            ),
        )

        # then
        assert allocation_only.status_code == 201, allocation_only.content
        assert allocation_only.parsed.parameter_server.reachable == models.ReachableEnum.REQUIRE
        assert allocation_only.parsed.trainer.executor.class_ == "train"

        # when: the jobs are listed
        page = jobs_list.sync(client=client)

        # then
        assert isinstance(page, models.PaginatedJobList)
        assert page.count == 2
        assert {listed.id for listed in page.results} == {job.id, allocation_only.parsed.id}

        # when: documented 400s — too many trainers, a dataset no data node registered, max below bid
        too_many = jobs_diloco_create.sync_detailed(
            client=client, body=diloco_body(models, dataset=DATASET, num_trainers=300)
        )
        unknown_dataset = jobs_diloco_create.sync_detailed(
            client=client, body=diloco_body(models, dataset="nobody-serves-this")
        )
        below_bid = jobs_create.sync_detailed(
            client=client,
            body=models.JobSubmissionRequest(
                trainer=models.TrainerRequirementRequest(price=models.PriceRequest(bid=80.0, max_=70.0))
            ),
        )

    # then: each parsed into its 400 model, keyed by the field's path
    assert too_many.status_code == 400
    assert isinstance(too_many.parsed, models.JobsDilocoCreateResponse400)
    assert too_many.parsed.additional_properties["num_trainers"] == [
        "Input should be less than or equal to 256"
    ]
    assert unknown_dataset.status_code == 400
    assert "nobody-serves-this" in unknown_dataset.parsed.additional_properties["dataset.name"][0]
    assert below_bid.status_code == 400
    assert isinstance(below_bid.parsed, models.JobsCreateResponse400)
    price_errors = below_bid.parsed.additional_properties["trainer"].additional_properties["price"]
    assert price_errors == {"max": ["Must be at least the bid (80)."]}
