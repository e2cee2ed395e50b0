"""Issue 17's UVM target, run by `bench_gpu.py --uvm`: tables 1.5x the GPU's free memory, placed
by the planner (UVM caching, 20% of rows in HBM), against the same model scaled down to fit HBM.

Both table sets have the same tables, dims and batches (ids log-uniform over rows, as the DLRM
synthetic data); only the rows differ. The planner sees a one-GPU topology whose HBM is the free
memory (or ``--uvm-hbm-gib``, which also caps PyTorch's allocator to it) and chooses each
table's placement itself; the run records its choice and its explanation. Target: the large set
trains at >= 50% of the small set's speed. Unmeasured: no GPU was lent while this was written.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

Step = Callable[[int], None]


@dataclass(frozen=True, kw_only=True)
class UvmConfig:
    """The UVM run: ``num_tables`` tables of ``dim`` columns, sized against the HBM budget."""

    num_tables: int = 8
    dim: int = 128
    batch: int = 16384
    ids_per_bag: int = 1
    scale: float = 1.5  # the large set's weights + state over the HBM budget
    fit_share: float = 0.5  # the small set's weights + state over the HBM budget
    optimizer: str = "row_wise_adagrad"


def rows_for(budget_bytes: int, share: float, cfg: UvmConfig) -> int:
    """Rows per table so that the tables' weights and row-wise state take ``share`` of the
    budget (4 bytes per weight, 4 per row of state)."""
    per_row = 4 * (cfg.dim + 1)
    return max(1, int(budget_bytes * share / (cfg.num_tables * per_row)))


def plan_placements(rows: int, budget_bytes: int, cfg: UvmConfig) -> tuple[dict[str, Any], str]:
    """The planner's placement per table on a one-GPU topology with ``budget_bytes`` of HBM,
    and its explanation (empty when every table is in HBM)."""
    from recopt.kernels.config import FusedOptimizerConfig
    from recopt.sharding.planner import EmbeddingShardingPlanner, Topology
    from recopt.sharding.planner.topology import DEFAULT_HBM_BANDWIDTH

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    topology = Topology(
        world_size=1,
        device="cuda",
        hbm_bytes=budget_bytes,
        ddr_bytes=int(host),
        memory_bandwidth=DEFAULT_HBM_BANDWIDTH,
        cache_load_factor=0.2,
    )
    planner = EmbeddingShardingPlanner(
        topology,
        batch_size=cfg.batch,
        default_optimizer=FusedOptimizerConfig(name=cfg.optimizer),
    )
    plan = planner.plan({"": _tables(rows, cfg)})
    assert planner.stats is not None
    placements = {name: ps.placement for name, ps in plan[""].items()}
    return placements, planner.stats.explain_placements()


def _tables(rows: int, cfg: UvmConfig) -> list[Any]:
    from recopt.modules import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=rows, embedding_dim=cfg.dim, feature_names=[f"f{i}"]
        )
        for i in range(cfg.num_tables)
    ]


def training_step(rows: int, placements: dict[str, Any], cfg: UvmConfig) -> Step:
    """Forward + backward (fused update) of a FusedEmbeddingBagCollection placed as planned."""
    from recopt.kernels.config import FusedOptimizerConfig
    from recopt.modules import FusedEmbeddingBagCollection
    from recopt.sparse import KeyedJaggedTensor

    device = torch.device("cuda", torch.cuda.current_device())
    module = FusedEmbeddingBagCollection(
        _tables(rows, cfg),
        optimizer=FusedOptimizerConfig(name=cfg.optimizer, lr=0.01),
        device=device,
        table_placements=placements,
    )
    keys = [f"f{i}" for i in range(cfg.num_tables)]
    n = cfg.num_tables * cfg.batch
    lengths = torch.full((n,), cfg.ids_per_bag, dtype=torch.int64, device=device)
    gen = torch.Generator().manual_seed(0)
    kjts = []
    for _ in range(4):  # log-uniform ids: a few hot rows, a long tail (the DLRM synthetic shape)
        u = torch.rand(n * cfg.ids_per_bag, generator=gen, dtype=torch.float64)
        ids = (torch.pow(rows + 1.0, u).floor().long() - 1).clamp(0, rows - 1)
        kjts.append(KeyedJaggedTensor(keys, ids.to(device), lengths=lengths, stride=cfg.batch))
    grad = torch.ones(cfg.batch, cfg.num_tables * cfg.dim, device=device)

    def step(i: int) -> None:
        module(kjts[i % len(kjts)]).values().backward(grad)

    return step


def run_uvm(
    time_ms: Callable[[Step, int, int], float],
    warmup: int,
    steps: int,
    hbm_gib: float | None,
    cfg: UvmConfig,
) -> dict[str, Any]:
    """Plan, build and time the large (UVM) and small (HBM) table sets; one result row."""
    free, total = torch.cuda.mem_get_info()
    budget = int(hbm_gib * 2**30) if hbm_gib else int(free)
    if hbm_gib:  # PyTorch's allocator (the HBM cache included) may use only the budget
        # The fraction is of the device's total memory, as torch defines it.
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    try:
        return _run_sets(time_ms, warmup, steps, budget, cfg)
    finally:  # the cap is process-wide: lift it for whatever runs next (kernels, tests)
        if hbm_gib:
            torch.cuda.set_per_process_memory_fraction(1.0)


def _run_sets(
    time_ms: Callable[[Step, int, int], float],
    warmup: int,
    steps: int,
    budget: int,
    cfg: UvmConfig,
) -> dict[str, Any]:
    row: dict[str, Any] = {"hbm_budget_gib": round(budget / 2**30, 2), **asdict(cfg)}
    for name, share in (("large", cfg.scale), ("small", cfg.fit_share)):
        rows = rows_for(budget, share, cfg)
        placements, why = plan_placements(rows, budget, cfg)
        row[f"{name}_rows"] = rows
        row[f"{name}_placements"] = sorted({p.describe() for p in placements.values()})
        row[f"{name}_planner_says"] = why
        try:
            row[f"{name}_ms"] = round(
                time_ms(training_step(rows, placements, cfg), warmup, steps), 3
            )
        except Exception as err:  # keep the other set's figure
            row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]
        torch.cuda.empty_cache()
    if row.get("large_ms") and row.get("small_ms"):
        row["large_speed_over_small"] = round(row["small_ms"] / row["large_ms"], 3)
        row["target_met"] = row["large_speed_over_small"] >= 0.5
    return row


def markdown(row: dict[str, Any]) -> list[str]:
    """The UVM section of bench_gpu's report."""
    return [
        "",
        "## UVM target (issue 17): tables 1.5x HBM, planner-placed, vs scaled to fit",
        "",
        f"HBM budget {row['hbm_budget_gib']} GiB; {row['num_tables']} tables x dim {row['dim']}, "
        f"batch {row['batch']}, {row['optimizer']}.",
        "",
        "| set | rows per table | placements | ms per step |",
        "| --- | --- | --- | --- |",
        *(
            f"| {name} | {row[f'{name}_rows']} | {', '.join(row[f'{name}_placements'])} | "
            f"{row.get(f'{name}_ms', row.get(f'{name}_error', '-'))} |"
            for name in ("large", "small")
        ),
        "",
        f"Large set speed / small set: {row.get('large_speed_over_small', '-')} (target >= 0.5).",
        f"Planner: {row['large_planner_says'] or 'every table in HBM'}",
    ]
