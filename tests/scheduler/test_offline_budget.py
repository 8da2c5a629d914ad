"""The embedded engine's default step budget (scheduler_svc.config.offline_batched_tokens):
vLLM's offline figures by device, and an explicit value always kept; and a device string
this machine cannot use is a ValueError naming it (check_device)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scheduler_svc.config import EngineConfig, offline_batched_tokens

GIB = 2**30


@pytest.mark.parametrize(
    "name,memory,want",
    [("NVIDIA H200", 141 * GIB, 16384), ("NVIDIA H100 80GB HBM3", 80 * GIB, 16384),
     ("NVIDIA A100-SXM4-80GB", 80 * GIB, 8192), ("NVIDIA L4", 24 * GIB, 8192)],
)  # fmt: skip
def test_by_device(monkeypatch, name, memory, want):
    props = SimpleNamespace(name=name, total_memory=memory)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert offline_batched_tokens("cuda") == want
    assert offline_batched_tokens("cuda:1") == want


def test_cpu_and_explicit_values():
    assert offline_batched_tokens("cpu") == 8192
    assert EngineConfig(device="cpu").max_num_batched_tokens == 8192
    assert EngineConfig(device="cpu", max_num_batched_tokens=40).max_num_batched_tokens == 40
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(device="cpu", max_num_batched_tokens=0)


@pytest.mark.parametrize(
    "device,message",
    [("tpu", "must be 'cpu', 'cuda' or 'cuda:N'"), ("cuda:x", "must be"), ("meta", "must be"),
     ("cuda:7", "this machine has 2 CUDA device")],
)  # fmt: skip
def test_bad_devices_are_one_clear_error(monkeypatch, device, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=message):
        EngineConfig(device=device)


def test_cuda_without_a_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no CUDA device"):
        EngineConfig(device="cuda")
