"""The control plane scaled out: two web (daphne) processes and two Celery workers on one PostgreSQL and Redis,
and the daemons of one training job connected to different web processes.

Real processes on loopback (``bench/harness.py``, ``bench/cluster.py``): web A and web B on two ports, as two
instances behind a load balancer would be, two ``hypha-server worker`` processes and one beat. The parameter
server's daemon (a daemon that only runs parameter servers, so the market cannot place it elsewhere) connects to
web A, both trainers' daemons to web B, the data node to web B. Nothing in one web process can reach a
websocket of the other but the channel layer (channels_redis), so the job completes only if frames cross
processes through Redis:

* the parameter server's ``ready`` report reaches web A only, and web A tells the trainers on web B where it
  listens (a ``dispatch_job`` with its address: each trainer daemon logs "task …: peers now {…}");
* the lease clock runs in the Celery workers, and its ``renew_lease`` frames reach the daemons of both web
  processes (every lease is renewed, and each daemon logs its renewals);
* the final model, which the parameter server uploaded through web A, downloads from web B (one data
  directory, as docs/deploy.md asks of several web processes).

And web processes deployed at once on a fresh database (each migrates it at start) all come up.

Deadlines, not speed. Services mode only: the embedded mode is one process by design.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import (
    BIN_DIR,
    ProcessGroup,
    child_environment,
    free_port,
    only_in_mode,
    small_training_job,
    wait_for_healthz,
)
from tests.e2e.isolation import claimed_redis_database, throwaway_database

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(360),
    only_in_mode(
        "services",
        "several web processes and Celery workers share PostgreSQL and Redis; the embedded mode is one process",
    ),
]

ROUNDS = 2
TRAINERS = 2
#: Short, so that every lease is renewed a few times during the job (renewals are due a third of a TTL in).
LEASE_TTL = 4.0
WEB_A, WEB_B = 0, 1
#: worker-1 runs only parameter servers (connected to web A); worker-2 and worker-3 are the trainers (web B).
PARAMETER_SERVER_DAEMON = "worker-1"
TRAINER_DAEMONS = ("worker-2", "worker-3")


def test_a_job_whose_daemons_are_on_different_web_processes_completes(tmp_path: Path) -> None:
    from bench.cluster import training_cluster, worker_toml

    # given: two web processes and two Celery workers; the parameter server's daemon on web A, the trainers' on B
    dataset, spec = small_training_job(
        tmp_path,
        trainers=TRAINERS,
        rounds=ROUNDS,
        inner_steps=8,
        round_timeout=120.0,
        dedicated_parameter_server=True,
    )
    with training_cluster(
        root=tmp_path / "cluster",
        dataset_dir=dataset,
        workers=TRAINERS + 1,
        mode="services",
        settings={"HYPHA_LEASE_TTL": str(LEASE_TTL)},
        worker_tomls=[
            worker_toml(parameter_server_only=True, benchmark=False),
            *[worker_toml(benchmark=False)] * TRAINERS,
        ],
        benchmark=False,
        web=2,
        celery=2,
        daemon_web=[WEB_A, WEB_B, WEB_B],
        data_node_web=WEB_B,
    ) as cluster:
        plane = cluster.plane
        assert [child.name for child in plane.children if child.name.startswith(("web", "worker", "beat"))] == [
            "web", "web-b", "worker", "worker-b", "beat", *(f"worker-{n}" for n in range(1, TRAINERS + 2)),
        ]  # fmt: skip
        web_a, web_b = plane.web_urls

        # when: the job is submitted (through web A) and runs
        job_id = cluster.submit(spec, name="e2e-scale-out")
        job = cluster.follow(job_id, timeout=240)

        # then: it completed every round with both trainers
        assert job["status"] == "completed", f"{job['status_reason']}\n{cluster.logs()}"
        rounds = job["rounds"]
        assert [round_["number"] for round_ in rounds] == list(range(1, ROUNDS + 1))
        assert all(round_["closed"] and len(round_["participants"]) == TRAINERS for round_ in rounds), rounds
        trainers = [task for task in job["tasks"] if task["role"] == "trainer"]
        assert [(task["status"], task["round"], task["exit_code"]) for task in trainers] == [
            ("exited", ROUNDS, 0)
        ] * TRAINERS
        # on the daemons it was meant for: the parameter server's on web A, the trainers' on web B
        roles = {lease["worker"]: lease["role"] for lease in job["leases"]}
        assert roles == {
            PARAMETER_SERVER_DAEMON: "parameter_server",
            **dict.fromkeys(TRAINER_DAEMONS, "trainer"),
        }, job["leases"]
        assert {lease["status"] for lease in job["leases"]} == {"released"}, job["leases"]
        logs = {name: child.tail(5_000_000) for name, child in cluster.daemons.items()}
        for name, url in [(PARAMETER_SERVER_DAEMON, web_a), *((name, web_b) for name in TRAINER_DAEMONS)]:
            other = web_b if url == web_a else web_a
            connected = re.findall(r"connecting to (ws://\S+)", logs[name])
            assert connected and set(connected) == {f"{ws(url)}/ws/worker/"}, (name, connected)
            assert ws(other) not in logs[name], name

        # and web A's word reached web B's daemons: the parameter server's address, which only its ready
        # report (handled by web A, where its daemon is connected) tells the control plane
        server = next(task for task in job["tasks"] if task["role"] == "parameter_server")
        assert server["url"], server
        for task in trainers:
            name = task["worker"]
            told = re.findall(rf"task {task['id']}: peers now (.*)", logs[name])
            assert told and server["url"] in told[-1], (name, told, server["url"])

        # and the lease clock's renewal requests (Celery) reached the daemons of both web processes
        for lease in job["leases"]:
            assert lease["renewals"] >= 1, lease
            assert f"lease {lease['id']} renewed for" in logs[lease["worker"]], lease

        # and the model the parameter server uploaded through web A downloads from web B
        with httpx.Client(
            base_url=web_b, headers={"Authorization": f"Token {cluster.api_token}"}, timeout=30.0
        ) as client:
            response = client.get(f"/api/jobs/{job_id}/model")
            assert response.status_code == 200, response.text[:500]
        archive = tmp_path / "model.zip"
        archive.write_bytes(response.content)
        with zipfile.ZipFile(archive) as bundle:
            assert sorted(bundle.namelist()) == ["config.json", "generation_config.json", "model.safetensors"]

        # and every control-plane process is still running
        for child in plane.children:
            if child.name in ("web", "web-b", "worker", "worker-b", "beat"):
                assert child.popen.poll() is None, f"{child.name} exited:\n{child.tail()}"


def test_web_processes_started_at_once_on_a_fresh_database_all_come_up(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    import os

    # given: a fresh database, and two web processes deployed at the same moment (each migrates it at start)
    with (
        throwaway_database(os.environ["DATABASE_URL"]) as database_url,
        claimed_redis_database(os.environ["REDIS_URL"]) as redis_url,
    ):
        env = child_environment(
            tmp_path / "data", DATABASE_URL=database_url, REDIS_URL=redis_url, SECRET_KEY="e2e-" + "k" * 40
        )
        ports = [free_port(), free_port()]
        while ports[1] == ports[0]:
            ports[1] = free_port()
        try:
            # when
            webs = [
                processes.start(
                    f"web-{port}", [str(BIN_DIR / "hypha-server"), "web", "--port", str(port)], env=env
                )
                for port in ports
            ]

            # then: both migrate (one after the other) and serve
            for port in ports:
                wait_for_healthz(f"http://127.0.0.1:{port}", children=webs)
            assert [web.poll() for web in webs] == [None, None]
        finally:
            processes.stop_all()  # before the database is dropped


def ws(url: str) -> str:
    return url.replace("http://", "ws://", 1)
