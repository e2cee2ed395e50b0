"""Which device a collective uses for a group, and which device a local rank gets (CPU only)."""

from __future__ import annotations

import datetime

import pytest
import torch

from recopt import comm
from recopt.testing import run_on_ranks


@pytest.mark.parametrize(
    ("config", "served"),
    [
        ("cpu:gloo,cuda:nccl", ["cpu", "cuda"]),
        ("cuda:nccl", ["cuda"]),
        ("cuda:gloo", ["cuda"]),
        ("nccl", ["cuda"]),
        ("gloo", ["cpu", "cuda"]),
        ("cpu:gloo", ["cpu"]),
    ],
)
def test_served_device_types(config: str, served: list[str]) -> None:
    assert comm.served_device_types(config) == served


def test_default_backend_serves_cpu_beside_nccl() -> None:
    assert comm.default_backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"
    assert comm.default_backend(torch.device("cpu")) == "gloo"


def test_more_local_ranks_than_gpus_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert comm.device_for_local_rank(0, use_cuda=True) == torch.device("cuda", 0)
    assert comm.device_for_local_rank(3, use_cuda=False) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"local rank 1 needs GPU 1, but this host has 1 visible"):
        comm.device_for_local_rank(1, use_cuda=True)


def _small_collectives(rank: int, world_size: int) -> list[float]:
    timeout = datetime.timedelta(seconds=60)
    cpu_only = comm.new_group(None, timeout, backend="cpu:gloo")
    assert comm.collective_device(cpu_only, torch.device("cpu")) == torch.device("cpu")
    value = torch.tensor([float(rank + 1)], dtype=torch.float64)
    comm.all_reduce(value, cpu_only, timeout=timeout)
    message = torch.tensor([7.0 if rank == 1 else 0.0])
    comm.broadcast(message, 1, cpu_only, timeout)
    gathered = comm.all_gather_object(rank * 10, cpu_only)
    return [float(value), float(message), *map(float, gathered)]


@pytest.mark.multiprocess
def test_small_collectives_on_two_ranks() -> None:
    assert run_on_ranks(_small_collectives, 2) == [[3.0, 7.0, 0.0, 10.0]] * 2


@pytest.mark.parametrize(
    ("config", "device", "expected"),
    [
        ("cpu:gloo,cuda:nccl", "cpu", "cpu"),
        ("cpu:gloo,cuda:nccl", "cuda:1", "cuda:1"),
        ("cuda:nccl", "cpu", "cuda:1"),  # NCCL alone: a CPU tensor goes to the current GPU
        ("cuda:gloo", "cpu", "cuda:1"),
        ("cpu:gloo", "cuda:0", "cpu"),
    ],
)
def test_collective_device_follows_the_group(
    monkeypatch: pytest.MonkeyPatch, config: str, device: str, expected: str
) -> None:
    monkeypatch.setattr(comm.dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert comm.collective_device(None, torch.device(device)) == torch.device(expected)


def _barriers(rank: int, world_size: int) -> bool:
    timeout = datetime.timedelta(seconds=60)
    comm.barrier(None, timeout)  # gloo: the monitored barrier
    # A group configured per device type, as a CUDA run's "cpu:gloo,cuda:nccl" (gloo stands
    # in for NCCL on this CPU host): torch's monitored barrier refuses it (gloo-only groups).
    mixed = comm.new_group(None, timeout, backend="cpu:gloo,cuda:gloo")
    assert str(torch.distributed.get_backend(mixed)) != "gloo"
    comm.barrier(mixed, timeout)
    return True


@pytest.mark.multiprocess
def test_barrier_on_a_group_with_a_backend_per_device_type() -> None:
    assert run_on_ranks(_barriers, 2, timeout_s=90) == [True, True]
