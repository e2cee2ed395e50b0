"""DistributedModelParallel's default plan is made for the device it trains on.

On CUDA the planner sees the GPU's memory (free HBM, the least over the ranks) and host memory
for UVM, so tables that do not fit HBM get UVM placements; on CPU it is unchanged. No GPU is
needed: the torch.cuda functions the topology reads are replaced by fakes.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.modules import EmbeddingBagCollection, EmbeddingBagConfig
from recopt.sharding import model_parallel
from recopt.sharding.model_parallel import DistributedModelParallel
from recopt.sharding.planner import (
    Topology,
    TopologyError,
    cuda_memory_bytes,
    local_topology,
    shared_topology,
)
from recopt.testing import run_on_ranks

MIB = 2**20
GIB = 2**30
TIMEOUT = datetime.timedelta(seconds=60)


def fake_gpus(
    set_attr: Callable[[Any, str, Any], None],
    free_mib: list[int],
    total_mib: int = 80 * 1024,
    reserved_mib: int = 0,
    current: int = 0,
    allocated_mib: int = 0,
) -> None:
    """Make torch.cuda describe ``len(free_mib)`` GPUs, GPU i with ``free_mib[i]`` MiB free."""

    def index(device: Any = None) -> int:
        if device is None:
            return current
        if isinstance(device, int):
            return device
        found = torch.device(device).index
        return current if found is None else found

    cuda = torch.cuda
    set_attr(cuda, "is_available", lambda: True)
    set_attr(cuda, "device_count", lambda: len(free_mib))
    set_attr(cuda, "current_device", lambda: current)
    set_attr(cuda, "mem_get_info", lambda d=None: (free_mib[index(d)] * MIB, total_mib * MIB))
    set_attr(cuda, "memory_reserved", lambda d=None: reserved_mib * MIB)
    set_attr(cuda, "memory_allocated", lambda d=None: allocated_mib * MIB)
    set_attr(cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=total_mib * MIB))


def table(name: str, rows: int = 1_000_000, dim: int = 64) -> EmbeddingBagConfig:
    """1M x 64 fp32: 256 MB of weights (plus 4 MB of row-wise Adagrad state)."""
    return EmbeddingBagConfig(
        name=name, num_embeddings=rows, embedding_dim=dim, feature_names=(f"{name}_f",)
    )


# ------------------------------------------------------------------ this rank's memory


def test_cuda_memory_is_what_this_process_can_fill(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch.setattr, [1000, 3000], total_mib=4000, reserved_mib=500, current=1)
    assert cuda_memory_bytes() == 3500 * MIB  # the current GPU: free + this process's cache
    assert cuda_memory_bytes("cuda:0") == 1500 * MIB
    assert cuda_memory_bytes(torch.device("cuda", 1)) == 3500 * MIB
    fake_gpus(monkeypatch.setattr, [3900], total_mib=4000, reserved_mib=500)
    assert cuda_memory_bytes(0) == 4000 * MIB  # never more than the GPU has
    # Live tensors (e.g. the unsharded model, still there while the shards are allocated)
    # count as used; only the allocator's unused cache is added to the free memory.
    fake_gpus(monkeypatch.setattr, [1000], total_mib=4000, reserved_mib=500, allocated_mib=300)
    assert cuda_memory_bytes(0) == 1200 * MIB


def test_local_topology_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch.setattr, [1000, 3000])
    topo = local_topology(4, ranks_per_host=2, device=torch.device("cuda", 1))
    cpu = local_topology(4, ranks_per_host=2, device="cpu")
    assert (topo.device, topo.hbm_bytes, topo.memory_bytes) == ("cuda", 3000 * MIB, 3000 * MIB)
    assert topo.ddr_bytes == cpu.ddr_bytes and topo.host_usable_bytes > 0
    assert topo.memory_bandwidth > cpu.memory_bandwidth  # HBM's default, not DDR's
    assert local_topology(4, device="cuda").hbm_bytes == 1000 * MIB  # the current GPU


# ------------------------------------------------------------------ the default plan


def _default_plan_on_fake_gpus(
    rank: int, world: int, free_mib: list[int], names: list[str], backend: str
) -> dict[str, Any]:
    fake_gpus(setattr, free_mib, current=rank)
    topo = shared_topology(local_topology(world, device="cuda"), None, TIMEOUT)
    optimizer = FusedOptimizerConfig(backend=Backend(backend))
    try:
        plan = model_parallel._default_plan(
            {"sparse": [table(n) for n in names]}, world, None, optimizer, None, "cuda", TIMEOUT
        )
    except Exception as e:  # returned, so the test sees every rank's error
        return {"hbm": topo.hbm_bytes, "error": f"{type(e).__name__}: {e}"}
    placements = {t: ps.placement.describe() for t, ps in plan["sparse"].items()}
    return {"hbm": topo.hbm_bytes, "placements": placements}


def test_default_plan_on_a_gpu_places_what_hbm_cannot_hold_in_uvm() -> None:
    # 200 MiB of HBM (180 usable): "a" (260 MB) does not fit; it is cached in HBM instead.
    result = run_on_ranks(_default_plan_on_fake_gpus, 1, [200], ["a"], "auto", timeout_s=120)[0]
    assert result["placements"] == {"a": "uvm_caching(0.2)"}
    # The same model on a GPU where it fits stays in device memory.
    result = run_on_ranks(_default_plan_on_fake_gpus, 1, [2048], ["a"], "auto", timeout_s=120)[0]
    assert result["placements"] == {"a": "device"}


def test_default_plan_fits_the_rank_with_the_least_memory() -> None:
    # Rank 0 plans, with 8 GiB free; rank 1 has 200 MiB. Three 260 MB tables need UVM only
    # because the plan fits rank 1 too; both ranks hold the same plan.
    results = run_on_ranks(
        _default_plan_on_fake_gpus, 2, [8192, 200], ["a", "b", "c"], "auto", timeout_s=120
    )
    assert [r["hbm"] for r in results] == [200 * MIB, 200 * MIB]
    assert results[0]["placements"] == results[1]["placements"]
    assert any(p != "device" for p in results[0]["placements"].values())


def test_default_plan_on_a_gpu_without_uvm_is_a_clear_error_on_every_rank() -> None:
    # recopt's own kernel keeps tables in device memory: no UVM option, so no plan fits.
    results = run_on_ranks(
        _default_plan_on_fake_gpus, 2, [200, 200], ["a", "b", "c"], "recopt", timeout_s=120
    )
    for result in results:
        assert result["error"].startswith("PlannerError")
        assert "does not fit" in result["error"] or "short by" in result["error"]


class _Planned(Exception):
    """Raised by the spy in place of planning, carrying the planner's topology."""


def _dmp_topology(rank: int, world: int, device: str | None) -> dict[str, Any]:
    import recopt.sharding.planner as planner_package

    fake_gpus(setattr, [300, 200], current=rank)

    def spy(planner: Any, *args: Any, **kwargs: Any) -> Any:
        raise _Planned(planner.topology)

    planner_package.plan_collectively = spy
    module = EmbeddingBagCollection([table("a", rows=10, dim=4)], device="meta")
    try:
        DistributedModelParallel(module, device=device)
    except _Planned as planned:
        topo: Topology = planned.args[0]
        return {"device": topo.device, "hbm": topo.hbm_bytes, "ddr": topo.ddr_bytes}
    raise AssertionError("DistributedModelParallel did not plan")


def test_dmp_plans_against_the_device_it_trains_on() -> None:
    cuda = run_on_ranks(_dmp_topology, 2, "cuda", timeout_s=120)
    assert cuda[0] == cuda[1] and cuda[0]["device"] == "cuda" and cuda[0]["hbm"] == 200 * MIB
    for device in (None, "cpu"):  # CPU: the planner's default topology, as before
        cpu = run_on_ranks(_dmp_topology, 1, device, timeout_s=120)[0]
        assert cpu == {"device": "cpu", "hbm": 0, "ddr": Topology(world_size=1).ddr_bytes}


def _dmp_plan_of_a_fused_adam_table(rank: int, world: int) -> dict[str, str]:
    import recopt.sharding.planner as planner_package
    from recopt.modules import FusedEmbeddingBagCollection

    fake_gpus(setattr, [600])  # 540 MiB usable: a's weights (256 MB) fit, with Adam's state not
    real = planner_package.plan_collectively

    def spy(*args: Any, **kwargs: Any) -> Any:
        raise _Planned(real(*args, **kwargs))

    planner_package.plan_collectively = spy
    adam = FusedOptimizerConfig(name="adam")
    module = FusedEmbeddingBagCollection([table("a")], optimizer=adam, device="meta")
    try:
        DistributedModelParallel(module, device="cuda")
    except _Planned as planned:
        return {t: ps.placement.describe() for t, ps in planned.args[0][""].items()}
    raise AssertionError("DistributedModelParallel did not plan")


def test_dmp_counts_the_state_of_the_optimizer_a_fused_module_runs() -> None:
    # Adam keeps two fp32 moments per value (768 MB in all): the default plan must see that,
    # not the default row-wise Adagrad's 4 MB, and take the table off the device.
    placements = run_on_ranks(_dmp_plan_of_a_fused_adam_table, 1, timeout_s=120)[0]
    assert placements == {"a": "uvm_caching(0.2)"}


def test_local_topology_refuses_other_devices() -> None:
    with pytest.raises(TopologyError, match="topology device 'meta' is unknown"):
        local_topology(2, device="meta")


@pytest.mark.cuda
def test_cuda_memory_on_a_real_gpu() -> None:
    # Other test workers may share the GPU, so free memory moves; only the bounds are sure.
    held = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")  # this process's cache
    _, total = torch.cuda.mem_get_info()
    measured = cuda_memory_bytes("cuda")
    assert held.numel() <= torch.cuda.memory_reserved() <= measured <= total
    topo = local_topology(1, device=torch.device("cuda", torch.cuda.current_device()))
    assert topo.device == "cuda" and 0 < topo.hbm_bytes <= total
