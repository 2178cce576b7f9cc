"""A trainer's round facts (worker_daemon/executors/throughput.py): tokens and tokens/s, MFU from the device's peak
FLOPS (the table by device name, or HYPHA_PEAK_FLOPS), and peak device memory only on CUDA — on this CPU
machine it is absent, not zero."""

from __future__ import annotations

import pytest

from worker_daemon.executors.throughput import PEAK_FLOPS_ENV, RoundDevice, mfu, peak_flops

torch = pytest.importorskip("torch")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA GeForce RTX 4090", 165.2e12),
        ("NVIDIA GeForce RTX 3090", 71e12),
        ("Some Future GPU", None),
        (None, None),
    ],
)
def test_the_peak_flops_of_known_devices_come_from_the_table(name, expected):
    assert peak_flops(name, {}) == expected


def test_the_environment_overrides_the_table_and_a_bad_override_is_ignored():
    assert peak_flops("NVIDIA H100", {PEAK_FLOPS_ENV: "1.5e15"}) == 1.5e15
    assert peak_flops(None, {PEAK_FLOPS_ENV: "2e14"}) == 2e14
    assert peak_flops("NVIDIA H100", {PEAK_FLOPS_ENV: "lots"}) == 989e12
    assert peak_flops("NVIDIA H100", {PEAK_FLOPS_ENV: "-1"}) == 989e12


def test_mfu_is_six_times_parameters_times_tokens_per_second_over_the_peak():
    assert mfu(1_000_000_000, 10_000.0, 120e12) == pytest.approx(0.5)
    assert mfu(1_000_000_000, 10_000.0, None) is None
    assert mfu(0, 10_000.0, 120e12) is None


def test_on_cpu_a_round_reports_tokens_and_leaves_out_device_memory():
    device = RoundDevice(torch.device("cpu"), environ={})
    device.begin()

    facts = device.facts(tokens=2048, seconds=0.5, parameters=1_000_000)

    # no peak FLOPS known for a CPU: no MFU; no CUDA: no peak memory
    assert facts == {"tokens": 2048.0, "tokens_per_second": 4096.0}


def test_on_cpu_with_a_peak_given_the_mfu_is_reported():
    device = RoundDevice(torch.device("cpu"), environ={PEAK_FLOPS_ENV: "1e12"})

    facts = device.facts(tokens=1000, seconds=1.0, parameters=1_000_000)

    assert facts == {"tokens": 1000.0, "tokens_per_second": 1000.0, "mfu": pytest.approx(0.006)}


def test_a_model_without_tokens_reports_nothing_on_cpu():
    assert RoundDevice(torch.device("cpu"), environ={}).facts(tokens=0, seconds=1.0, parameters=10) == {}
