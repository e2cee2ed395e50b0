"""The planner's placement choice on a (described) GPU: storage per placement, the cost of UVM,
device when it fits, then UVM caching, then UVM; the stats, the CLI explanation, the plan JSON.
All on CPU: the topology describes a GPU with a small fake HBM.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.kernels.placement import DEVICE, Location, Placement
from recopt.modules import EmbeddingBagConfig
from recopt.sharding import ShardingPlan
from recopt.sharding.plan import ShardingType
from recopt.sharding.planner import (
    ConstraintError,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    PlannerError,
    Topology,
    TopologyError,
    evaluate_plan,
)
from recopt.sharding.planner.cli import main
from recopt.sharding.planner.constraints import TableWorkload, constraints_from_dict
from recopt.sharding.planner.perf import shard_cost
from recopt.sharding.planner.storage import CACHE_SLOT_BYTES, resident_bytes

MIB = 2**20
GIB = 2**30
CACHED = Placement(location=Location.UVM_CACHING, cache_load_factor=0.2)
UVM = Placement(location=Location.UVM)
ROWS, DIM = 1_000_000, 64  # 256 MB of weights, 4 MB of row-wise Adagrad state


def table(name: str, rows: int = ROWS, dim: int = DIM) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name=name, num_embeddings=rows, embedding_dim=dim, feature_names=[f"{name}_f"]
    )


def gpu(hbm_mib: int, world_size: int = 1, **kw: object) -> Topology:
    return Topology(
        world_size=world_size,
        device="cuda",
        hbm_bytes=hbm_mib * MIB,
        ddr_bytes=64 * GIB,
        memory_bandwidth=800e9,
        **kw,  # type: ignore[arg-type]
    )


def plan_placements(
    topology: Topology, tables: list[EmbeddingBagConfig], **kw: object
) -> tuple[dict[str, Placement], EmbeddingShardingPlanner]:
    planner = EmbeddingShardingPlanner(topology, batch_size=512, **kw)  # type: ignore[arg-type]
    plan = planner.plan({"sparse": tables})
    return {name: ps.placement for name, ps in plan["sparse"].items()}, planner


def workload(optimizer: str = "row_wise_adagrad") -> TableWorkload:
    return TableWorkload(
        batch_size=512,
        num_features=1,
        pooling_factor=1.0,
        optimizer=FusedOptimizerConfig(name=optimizer),
    )


# ---------------------------------------------------------------------------- storage model


def test_resident_bytes_per_placement() -> None:
    weights, state = 4 * ROWS * DIM, 4 * ROWS
    rw = workload("row_wise_adagrad")
    assert resident_bytes(ROWS, DIM, rw, DEVICE) == (weights + state, 0)
    # Row-wise state stays in HBM (fbgemm keeps it on the device); the weights go to the host.
    assert resident_bytes(ROWS, DIM, rw, UVM) == (state, weights)
    cache = 200_000 * (4 * DIM + CACHE_SLOT_BYTES)
    assert resident_bytes(ROWS, DIM, rw, CACHED) == (cache + state, weights)
    # Element-wise state (adagrad) lives with the weights in host memory.
    ada = workload("adagrad")
    assert resident_bytes(ROWS, DIM, ada, UVM) == (0, 2 * weights)
    assert resident_bytes(ROWS, DIM, ada, CACHED) == (cache, 2 * weights)


@pytest.mark.parametrize("name", ["row_wise_adam", "row_wise_lamb"])
def test_uvm_row_wise_adam_keeps_only_its_row_state_in_hbm(name: str) -> None:
    # Issue 23's example: fbgemm keeps the [rows] second moment on the device and the
    # [rows, dim] first moment in UVM with the weights, so 50M x 128 needs ~0.19 GiB of HBM
    # (counting the first moment too made it 24 GiB).
    rows, dim = 50_000_000, 128
    hbm, host = resident_bytes(rows, dim, workload(name), UVM)
    assert hbm == 4 * rows and hbm / GIB == pytest.approx(0.186, abs=0.001)
    assert host == 4 * rows * dim * 2  # weights and exp_avg
    cache = math.ceil(0.2 * rows) * (4 * dim + CACHE_SLOT_BYTES)
    assert resident_bytes(rows, dim, workload(name), CACHED) == (cache + 4 * rows, host)
    # On the device everything is in HBM; plain Adam's two [rows, dim] moments stay in UVM.
    assert resident_bytes(rows, dim, workload(name), DEVICE) == (host + 4 * rows, 0)
    assert resident_bytes(rows, dim, workload("adam"), UVM) == (0, 3 * 4 * rows * dim)


def test_a_uvm_row_wise_adam_table_larger_than_hbm_is_planned() -> None:
    big = table("big", 50_000_000, 128)
    forced = {"big": ParameterConstraints(placements=(UVM,))}
    adam = FusedOptimizerConfig(name="row_wise_adam")
    placements, planner = plan_placements(
        gpu(1024), [big], constraints=forced, default_optimizer=adam
    )
    assert placements == {"big": UVM}
    stats = planner.stats
    assert stats is not None and stats.rank_bytes[0] <= stats.usable_bytes
    assert stats.rank_host_bytes[0] == 2 * 4 * 50_000_000 * 128


def test_bytes_per_value_scales_the_resident_bytes() -> None:
    half = TableWorkload(
        batch_size=512,
        num_features=1,
        pooling_factor=1.0,
        optimizer=FusedOptimizerConfig(name="adagrad"),
        weight_bytes=2,
        state_bytes=2,
    )
    assert resident_bytes(ROWS, DIM, half, DEVICE) == (2 * 2 * ROWS * DIM, 0)
    assert resident_bytes(ROWS, DIM, half, UVM) == (0, 2 * 2 * ROWS * DIM)


def test_cost_model_orders_device_caching_uvm() -> None:
    topo = gpu(1024)

    def cost(placement: Placement, hit: float | None = None) -> float:
        load = TableWorkload(
            batch_size=512,
            num_features=1,
            pooling_factor=1.0,
            optimizer=FusedOptimizerConfig(),
            cache_hit_rate=hit,
        )
        return shard_cost(
            ShardingType.TABLE_WISE, ROWS, DIM, ROWS, load, topo, placement=placement
        ).total

    device, cached, uvm = cost(DEVICE), cost(CACHED), cost(UVM)
    assert device < cached < uvm
    # A cache that serves every lookup costs what device memory costs; one that serves none
    # what UVM costs.
    assert cost(CACHED, hit=1.0) == pytest.approx(device)
    assert cost(CACHED, hit=0.0) == pytest.approx(uvm)
    faster_link = gpu(1024, uvm_bandwidth=64e9)
    load = workload()
    slow = shard_cost(ShardingType.TABLE_WISE, ROWS, DIM, ROWS, load, faster_link, placement=UVM)
    assert slow.total < uvm


# ------------------------------------------------------------------------------- planner


def test_device_when_everything_fits() -> None:
    placements, planner = plan_placements(gpu(2048), [table("a"), table("b", 100_000)])
    assert placements == {"a": DEVICE, "b": DEVICE}
    assert planner.stats is not None and planner.stats.explain_placements() == ""


def test_caching_when_hbm_is_short_and_the_cache_fits() -> None:
    # 200 MiB of HBM (180 usable): 'a' needs 260 MB in HBM, its 20% cache about 58 MB.
    placements, planner = plan_placements(gpu(200), [table("a"), table("b", 100_000)])
    assert placements == {"a": CACHED, "b": DEVICE}
    stats = planner.stats
    assert stats is not None
    assert stats.rank_bytes[0] <= stats.usable_bytes
    assert stats.rank_host_bytes[0] == 4 * ROWS * DIM  # a's weights, in host memory


def test_uvm_when_not_even_the_cache_fits() -> None:
    # 40 MiB of HBM: a's cache (58 MB) does not fit, UVM needs only its 4 MB of row state.
    placements, _ = plan_placements(gpu(40), [table("a")])
    assert placements == {"a": UVM}


def test_only_as_many_tables_leave_hbm_as_needed() -> None:
    # Room for one 1M-row table in HBM, not two: one stays, the other is cached (the cheaper
    # of the two placements that fit), never UVM.
    placements, planner = plan_placements(gpu(360), [table("a"), table("b")])
    assert sorted(p.location.value for p in placements.values()) == ["device", "uvm_caching"]
    assert planner.stats is not None
    moved = planner.stats.off_device
    assert len(moved) == 1 and moved[0].slowdown_seconds > 0.0


def test_the_topology_cache_load_factor_is_the_planners() -> None:
    placements, _ = plan_placements(gpu(200, cache_load_factor=0.1), [table("a")])
    assert placements["a"] == Placement(location="uvm_caching", cache_load_factor=0.1)


def test_constraints_choose_placements() -> None:
    forced = {"a": ParameterConstraints(placements=(UVM,))}
    placements, _ = plan_placements(gpu(2048), [table("a")], constraints=forced)
    assert placements == {"a": UVM}
    device_only = {"a": ParameterConstraints(placements=(DEVICE,))}
    with pytest.raises(PlannerError, match="does not fit|short by"):
        plan_placements(gpu(200), [table("a")], constraints=device_only)


def test_uvm_needs_fbgemm_so_a_recopt_only_table_stays_on_device() -> None:
    recopt = FusedOptimizerConfig(backend=Backend.RECOPT)
    with pytest.raises(PlannerError, match="does not fit|short by"):
        plan_placements(gpu(200), [table("a")], default_optimizer=recopt)
    # fbgemm's CUDA Adam has no L2 weight decay: no UVM option, so the same shortfall is an error.
    decayed = FusedOptimizerConfig(name="adam", weight_decay=0.01)
    with pytest.raises(PlannerError, match="does not fit|short by"):
        plan_placements(gpu(200), [table("a")], default_optimizer=decayed)
    # Plain Adam runs on fbgemm's CUDA kernel, so it can leave HBM.
    placements, _ = plan_placements(
        gpu(200), [table("a")], default_optimizer=FusedOptimizerConfig(name="adam")
    )
    assert not placements["a"].on_device


def test_cpu_topology_refuses_uvm_constraints() -> None:
    topo = Topology(world_size=1, device="cpu", ddr_bytes=4 * GIB)
    placements, _ = plan_placements(topo, [table("a")])
    assert placements == {"a": DEVICE}
    cons = {"a": ParameterConstraints(placements=(CACHED,))}
    with pytest.raises(PlannerError, match=r"placements \['uvm_caching\(0.2\)'\] need CUDA"):
        plan_placements(topo, [table("a")], constraints=cons)


def test_host_memory_short_for_uvm_is_named() -> None:
    topo = Topology(
        world_size=1, device="cuda", hbm_bytes=40 * MIB, ddr_bytes=100 * MIB, memory_bandwidth=8e11
    )
    with pytest.raises(PlannerError, match="host memory for UVM"):
        plan_placements(topo, [table("a")])


def test_multi_rank_plan_spreads_before_leaving_hbm() -> None:
    # Two ranks of 200 MiB: row-wise halves (130 MB each) fit, so nothing goes to UVM.
    placements, _ = plan_placements(gpu(200, world_size=2), [table("a")])
    assert placements == {"a": DEVICE}


# ---------------------------------------------------------------------- stats, JSON, CLI


def test_stats_table_shows_placement_and_host_memory() -> None:
    _, planner = plan_placements(gpu(200), [table("a"), table("b", 100_000)])
    assert planner.stats is not None
    text = planner.stats.format()
    assert "placement" in text and "host (UVM)" in text
    assert "uvm_caching(0.2)" in text and "device" in text
    why = planner.stats.explain_placements()
    assert "1 of 2 tables live in host memory (UVM)" in why
    assert "'a' (uvm_caching(0.2), +" in why and "Estimated slowdown" in why


def test_evaluate_plan_reads_the_placement_and_json_keeps_it() -> None:
    topo = gpu(200)
    tables = [table("a"), table("b", 100_000)]
    planner = EmbeddingShardingPlanner(topo, batch_size=512)
    plan = ShardingPlan.from_json(planner.plan({"sparse": tables}).to_json())
    assert plan["sparse"]["a"].placement == CACHED
    stats = evaluate_plan(plan, {"sparse": tables}, topo, batch_size=512)
    assert planner.stats is not None
    assert stats.rank_bytes == pytest.approx(planner.stats.rank_bytes)
    assert stats.rank_host_bytes == planner.stats.rank_host_bytes
    assert stats.max_seconds == pytest.approx(planner.stats.max_seconds)
    assert {t.table: t.placement for t in stats.tables} == {"a": "uvm_caching(0.2)", "b": "device"}
    assert [t.slowdown_seconds > 0 for t in stats.off_device] == [True]


def test_cli_explains_a_plan_that_needed_uvm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "model.toml"
    config.write_text(
        """
[[embedding.tables]]
name = "big"
num_embeddings = 1_000_000
embedding_dim = 64
feature_names = ["big"]

[[embedding.tables]]
name = "small"
num_embeddings = 1_000
embedding_dim = 64
feature_names = ["small"]

[planner]
device = "cuda"
hbm_bytes = 209_715_200
ddr_bytes = 68_719_476_736
memory_bandwidth = 8e11

[planner.constraints.small]
placements = ["device"]
"""
    )
    out = tmp_path / "plan.json"
    assert main([str(config), "--world-size", "1", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1 of 2 tables live in host memory (UVM)" in text
    assert "'big' (uvm_caching(0.2)" in text and "Estimated slowdown" in text
    assert ShardingPlan.load(out)[""]["big"].placement == CACHED


def test_constraint_placements_from_toml_values() -> None:
    c = constraints_from_dict(
        "t",
        {"placements": ["device", {"location": "uvm_caching", "cache_load_factor": 0.1}, "uvm"]},
    )
    assert c.placements == (DEVICE, Placement(location="uvm_caching", cache_load_factor=0.1), UVM)
    with pytest.raises(
        ConstraintError, match="constraints for table 't': placement location 'hbm'"
    ):
        constraints_from_dict("t", {"placements": ["hbm"]})
    with pytest.raises(ConstraintError, match=r"unknown keys \['size'\]"):
        constraints_from_dict("t", {"placements": [{"location": "uvm", "size": 3}]})
    with pytest.raises(ConstraintError, match="an empty list allows nothing"):
        ParameterConstraints(placements=())
    with pytest.raises(ConstraintError, match=r"cache_hit_rate must be in \[0, 1\]"):
        ParameterConstraints(cache_hit_rate=1.5)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"cache_load_factor": 0.0}, r"cache_load_factor must be in \(0, 1\]"),
        ({"cache_load_factor": 2.0}, r"cache_load_factor must be in \(0, 1\]"),
        ({"uvm_bandwidth": 0.0}, "uvm_bandwidth must be > 0"),
    ],
)
def test_topology_placement_fields_are_validated(kw: dict[str, float], match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        gpu(100, **kw)


def test_topology_host_memory_is_only_for_cuda() -> None:
    assert gpu(100).host_usable_bytes == int(64 * GIB * 0.9)
    assert Topology(world_size=1, ddr_bytes=GIB).host_usable_bytes == 0


def test_reclaim_moves_an_over_repaired_table_back_to_device() -> None:
    from recopt.sharding.planner.enumerator import enumerate_all
    from recopt.sharding.planner.partitioner import Placement as Assignment
    from recopt.sharding.planner.partitioner import partition
    from recopt.sharding.planner.proposers import reclaim_device_memory

    topo = gpu(360)
    options = enumerate_all(
        {"sparse": [table("a"), table("b")]}, {}, 512, lambda m, t: FusedOptimizerConfig(), topo
    )
    # Both cached, as a repair that moved a group of tables at once might leave them.
    choice = [next(k for k, o in enumerate(opts) if o.placement == CACHED) for opts in options]
    start = partition([o[k] for o, k in zip(options, choice, strict=True)], topo, [0])
    assert isinstance(start, Assignment)
    result = reclaim_device_memory(options, choice, start, topo, [0])
    placed = sorted(options[t][choice[t]].placement.location.value for t in range(2))
    assert placed == ["device", "uvm_caching"]
    assert result.max_cost < start.max_cost


@pytest.mark.cuda
def test_cuda_calibrate_measures_hbm_and_uvm_bandwidth() -> None:
    from recopt.sharding.planner.calibrate import measure_cuda_bandwidths

    hbm, uvm = measure_cuda_bandwidths(16 * MIB, repeats=2)
    assert hbm > uvm > 0.0
