"""Robust aggregation and verification through the whole parameter server (parameter_server/service.py):
six trainers over HTTP, three honest, one sending an update × 100, one a sign-flipped one, one noise; the
round report says who was rejected and why, and the result is the rule over the honest updates alone."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest
import torch
from torch.testing import assert_close

from parameter_server.job import parse_job
from parameter_server.service import run
from tests.parameter_server.conftest import ALICE, BOB, CAROL, aggregate_job
from tests.parameter_server.test_service import Trainer, delta_like, from_bytes, settings, to_bytes

DAVE = "44444444-4444-4444-8444-444444444444"
ERIN = "55555555-5555-4555-8555-555555555555"
FRANK = "66666666-6666-4666-8666-666666666666"
PEERS = [ALICE, BOB, CAROL, DAVE, ERIN, FRANK]


def honest_updates(theta: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Three honest pseudo-gradients: a shared direction (the data's) plus each trainer's own noise."""
    common = delta_like(theta, 100)
    return [
        {name: common[name] + 0.3 * noise[name] for name in common}
        for noise in (delta_like(theta, seed) for seed in (1, 2, 3))
    ]


def spool_files_held(incoming: Path) -> list[str]:
    """The files under ``incoming`` this process holds open (an unlinked one reads "… (deleted)")."""
    held = []
    for descriptor in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{descriptor}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(str(incoming.resolve())):
            held.append(target)
    return held


@pytest.mark.parametrize("rule", ["clipped_mean", "trimmed_mean", "median"])
async def test_scaled_sign_flipped_and_random_updates_are_rejected_and_the_honest_ones_aggregated(
    tmp_path, bridge, status_backend, receiver, rule
):
    # given: a job of six trainers with a robust rule (verification on by default); the bound at arrival is
    # opened wide so that the outliers reach the verdicts (it is tested on its own in test_service.py)
    document = aggregate_job(peers=PEERS, update_rounds=1)
    document["executor"]["config"]["rounds"].update({"aggregation": rule, "update_norm_ratio": 1e6})
    job = parse_job(document)
    service = asyncio.create_task(run(job, settings(tmp_path / "work", bridge, receiver), asyncio.Event()))
    (ready,) = await status_backend.wait_for("ready", timeout=60)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        trainers = {peer: Trainer(session, ready["url"], peer) for peer in PEERS}
        _, _, data = await trainers[ALICE].get("model/model.safetensors")
        theta_0 = from_bytes(tmp_path, data)
        a, b, c = honest_updates(theta_0)
        scaled = {name: 100 * a[name] for name in a}  # dave
        flipped = {name: -b[name] for name in b}  # erin
        generator = torch.Generator().manual_seed(9)
        noise = {name: 0.5 * torch.randn(t.shape, generator=generator) for name, t in a.items()}  # frank
        samples = {ALICE: 1, BOB: 2, CAROL: 1, DAVE: 8, ERIN: 8, FRANK: 8}

        # when: every trainer sends (the outliers first), then fetches the result
        for peer, update in [
            (DAVE, scaled),
            (ERIN, flipped),
            (FRANK, noise),
            (ALICE, a),
            (BOB, b),
        ]:
            assert await trainers[peer].send(1, to_bytes(tmp_path, update), samples=samples[peer]) == 200
        # (the round is open: each update stays spooled, its file unlinked but held open, until it closes)
        incoming = tmp_path / "work" / "incoming"
        assert len(spool_files_held(incoming)) == 5
        assert await trainers[CAROL].send(1, to_bytes(tmp_path, c), samples=samples[CAROL]) == 200
        fetched = {}
        for peer in PEERS:
            status, headers, data = await trainers[peer].get("rounds/1/result?wait=20")
            assert status == 200
            fetched[peer] = (headers["X-Included"], data)
        (report,) = await status_backend.wait_for("round")
        assert spool_files_held(incoming) == []  # the closed round let go of them: their bytes left the disk
        assert await asyncio.wait_for(service, 30) == 0

    # then: the report names the rejected, with reasons and scores, and counts only the honest
    verdicts = report["verdicts"]
    assert {peer: verdicts[peer]["verdict"] for peer in PEERS} == {
        ALICE: "accepted",
        BOB: "accepted",
        CAROL: "accepted",
        DAVE: "rejected",
        ERIN: "rejected",
        FRANK: "rejected",
    }
    assert "median norm (more than 10x)" in verdicts[DAVE]["reason"]
    assert verdicts[DAVE]["norm_ratio"] > 50
    assert "cosine similarity to the mean of the others" in verdicts[ERIN]["reason"]
    assert verdicts[ERIN]["cosine"] < -0.5
    assert "median norm" in verdicts[FRANK]["reason"]
    for peer in (ALICE, BOB, CAROL):
        assert verdicts[peer]["reason"] == ""
        assert 0.5 < verdicts[peer]["norm_ratio"] < 2 and verdicts[peer]["cosine"] > 0
    assert report["participants"] == [ALICE, BOB, CAROL]
    assert report["samples"] == 4
    assert report["left_out"] == [] and report["refused"] == {}
    assert {peer: included for peer, (included, _) in fetched.items()} == {
        **{peer: "true" for peer in (ALICE, BOB, CAROL)},
        **{peer: "false" for peer in (DAVE, ERIN, FRANK)},
    }

    # and the result is the rule over the honest updates, written out: first step u = lr·(1 + μ)·g = 0.75·g
    if rule == "clipped_mean":  # no honest update is over 2x the median norm: the sample-weighted mean
        g = {name: (1 * a[name] + 2 * b[name] + 1 * c[name]) / 4 for name in a}
    else:  # three updates: one dropped each side, i.e. the coordinate-wise median (the middle of three)
        g = {name: torch.stack([a[name], b[name], c[name]]).median(dim=0).values for name in a}
    u = from_bytes(tmp_path, fetched[ALICE][1])
    assert_close(u, {name: 0.75 * g[name] for name in u})


async def test_a_mean_job_reports_no_verdicts_and_averages_every_update(
    tmp_path, bridge, status_backend, receiver
):
    # given: the default rule (no aggregation key: the job JSON of every existing job)
    job = parse_job(aggregate_job(peers=[ALICE, BOB, CAROL], update_rounds=1))
    service = asyncio.create_task(run(job, settings(tmp_path / "work", bridge, receiver), asyncio.Event()))
    (ready,) = await status_backend.wait_for("ready", timeout=60)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        trainers = {peer: Trainer(session, ready["url"], peer) for peer in (ALICE, BOB, CAROL)}
        _, _, data = await trainers[ALICE].get("model/model.safetensors")
        theta_0 = from_bytes(tmp_path, data)
        a, b, _ = honest_updates(theta_0)
        flipped = {name: -b[name] for name in b}
        for peer, update in ((ALICE, a), (BOB, b), (CAROL, flipped)):
            assert await trainers[peer].send(1, to_bytes(tmp_path, update), samples=1) == 200
        results = [await trainers[peer].get("rounds/1/result?wait=20") for peer in (ALICE, BOB, CAROL)]
        (report,) = await status_backend.wait_for("round")
        assert await asyncio.wait_for(service, 30) == 0

    # then: as before — everyone counts, the mean bit for bit as the streaming sum takes it, no verdicts key
    assert "verdicts" not in report
    assert report["participants"] == [ALICE, BOB, CAROL]
    u = from_bytes(tmp_path, results[0][2])
    # the same operations as the parameter server: Σ then ÷ 3, then Nesterov's u = lr·(μ·m + g), m = g
    for name in a:
        total = torch.zeros_like(a[name])
        for update in (a, b, flipped):
            total.add_(update[name], alpha=1.0)
        g = total.div_(3.0)
        assert torch.equal(u[name], g.clone().add_(g, alpha=0.5).mul_(0.5)), name
