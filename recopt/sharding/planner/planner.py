"""The sharding planner: enumerate options, estimate them, propose, partition, return a plan.

`EmbeddingShardingPlanner.plan` is what `DistributedModelParallel` calls when no plan is given;
`plan_collectively` runs it on rank 0 and broadcasts the result so every rank holds the same plan.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from recopt import comm
from recopt.kernels.config import FusedOptimizerConfig
from recopt.kernels.registry import optimizer_spec
from recopt.sharding.plan import ParameterSharding, PlanError, ShardingPlan, table_names
from recopt.sharding.plan_validation import validate_plan
from recopt.sharding.planner.constraints import (
    ParameterConstraints,
    module_label,
    resolve_constraints,
)
from recopt.sharding.planner.enumerator import (
    EnumerationError,
    ShardingOption,
    enumerate_all,
    table_workload,
)
from recopt.sharding.planner.partitioner import AssignmentFailure, RankAssignment
from recopt.sharding.planner.proposers import (
    greedy_proposal,
    improve,
    make_feasible,
    reclaim_device_memory,
)
from recopt.sharding.planner.stats import PlanStats, format_bytes, make_stats
from recopt.sharding.planner.storage import rank_output_bytes
from recopt.sharding.planner.topology import Topology, local_topology


class PlannerError(PlanError):
    """No valid plan exists: names the table that did not fit, where, by how much, and the fix.

    A `PlanError` (a ValueError): the planner's refusals, e.g. constraints that allow an
    id-mapped table only types it cannot have, are caught as any other plan error."""


class EmbeddingShardingPlanner:
    """Chooses a sharding for every table of every embedding module.

    Args:
        topology: ranks, hosts, memory and bandwidths.
        constraints: per-table constraints keyed by table name (any module) or by
            ``"module.path.table"``.
        batch_size: bags per feature per rank in one step (tables may override it).
        default_optimizer: the fused optimizer of tables whose constraints name none
            (``None``: `FusedOptimizerConfig()`, row-wise Adagrad).
        max_search_trials: re-partitions the search may try (``None``: a budget scaled to the
            number of shards, so 10,000 tables plan in seconds).

    Example::

        planner = EmbeddingShardingPlanner(Topology(world_size=8), batch_size=512)
        plan = planner.plan({"sparse.ebc": tables})
        print(planner.stats)
    """

    def __init__(
        self,
        topology: Topology,
        constraints: Mapping[str, ParameterConstraints] | None = None,
        batch_size: int = 512,
        default_optimizer: FusedOptimizerConfig | None = None,
        max_search_trials: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise PlannerError(f"planner batch_size must be >= 1, got {batch_size}")
        self.topology = topology
        self.constraints = dict(constraints or {})
        self.batch_size = batch_size
        self.default_optimizer = default_optimizer or FusedOptimizerConfig()
        self.max_search_trials = max_search_trials
        self.stats: PlanStats | None = None

    def plan(
        self,
        tables_by_module: Mapping[str, Sequence[Any]],
        table_optimizers: Mapping[str, Mapping[str, FusedOptimizerConfig]] | None = None,
    ) -> ShardingPlan:
        """The best plan found for ``tables_by_module`` (module path -> its tables).

        Args:
            tables_by_module: module path -> the module's tables.
            table_optimizers: module path -> table name -> the fused optimizer the module runs
                the table with, for the estimates (default: ``default_optimizer``). Only a
                constraint's optimizer is written into the plan.

        Returns:
            A plan that passes `validate_plan`; `stats` describes it.

        Raises:
            PlannerError: a table fits nowhere (naming it, the rank, the shortfall and the fix)
                or its constraints leave no option.
        """
        with _gc_paused():
            return self._plan(tables_by_module, table_optimizers or {})

    def _plan(
        self,
        tables_by_module: Mapping[str, Sequence[Any]],
        table_optimizers: Mapping[str, Mapping[str, FusedOptimizerConfig]],
    ) -> ShardingPlan:
        topo = self.topology
        for module, tables in tables_by_module.items():
            table_names(tables, module)
        try:
            per_table = resolve_constraints(self.constraints, tables_by_module)
            options = enumerate_all(
                tables_by_module,
                per_table,
                self.batch_size,
                lambda m, t: table_optimizers.get(m, {}).get(t, self.default_optimizer),
                topo,
            )
        except (EnumerationError, ValueError) as e:
            raise PlannerError(str(e)) from e
        if not options:
            raise PlannerError("nothing to plan: no module has tables")
        base = self._output_bytes(tables_by_module, per_table)  # optimizer-independent
        self._check_total_memory(options, base)
        capacity = topo.usable_bytes - base
        choice = greedy_proposal(options, capacity)
        result = make_feasible(options, choice, topo, [base] * topo.world_size)
        if isinstance(result, AssignmentFailure):
            raise PlannerError(self._explain(result, options, choice, base))
        result = reclaim_device_memory(options, choice, result, topo, [base] * topo.world_size)
        placement = improve(
            options, choice, result, topo, [base] * topo.world_size, self.max_search_trials
        )
        plan = _to_plan(placement, tables_by_module, topo.world_size)
        validate_plan(plan, tables_by_module, topo.world_size, topo.local_world_size)
        self.stats = make_stats(placement, topo)
        return plan

    def _output_bytes(
        self,
        tables_by_module: Mapping[str, Sequence[Any]],
        per_table: Mapping[tuple[str, str], ParameterConstraints],
    ) -> int:
        """Bytes every rank needs for its own pooled outputs (and grads) of every table."""
        default = ParameterConstraints()
        total = 0
        for module, tables in tables_by_module.items():
            for t in tables:
                c = per_table.get((module, t.name), default)
                w = table_workload(t, c, self.batch_size, self.default_optimizer)
                total += rank_output_bytes(t.embedding_dim, w)
        return total

    def _check_total_memory(self, options: Sequence[Sequence[ShardingOption]], base: int) -> None:
        """Fail at once, without partitioning, when the ranks' combined room cannot suffice."""
        topo = self.topology
        least = [
            (
                min(sum(o.shard_bytes) * (topo.world_size if o.is_replicated else 1) for o in opts),
                opts[0],
            )
            for opts in options
        ]
        need = sum(b for b, _ in least)
        room = max(0, topo.usable_bytes - base) * topo.world_size
        if need <= room:
            return
        largest = sorted(least, key=lambda bo: -bo[0])[:3]
        names = ", ".join(
            f"{o.table.name!r} (module {module_label(o.module)}) {format_bytes(b)}"
            for b, o in largest
        )
        raise PlannerError(
            f"the tables need at least {format_bytes(need)} in total but the "
            f"{topo.world_size} ranks have {format_bytes(room)} for them "
            f"({format_bytes(topo.usable_bytes)} usable per rank of "
            f"{format_bytes(topo.memory_bytes)}, less {format_bytes(base)} per rank for pooled "
            f"outputs at batch_size {self.batch_size}); short by {format_bytes(need - room)}. "
            f"Largest tables: {names}. To fit: add ranks or memory per rank, use fused "
            f"optimizers with less state{self._state_hint(options)}, or lower batch_size"
        )

    @staticmethod
    def _state_hint(options: Sequence[Sequence[ShardingOption]]) -> str:
        """Which optimizers with more than one float per row are in use, and on how many tables."""
        heavy = Counter(
            opts[0].optimizer.name
            for opts in options
            if not optimizer_spec(opts[0].optimizer.name).light_state
        )
        if not heavy:
            return ""
        now = ", ".join(f"{name!r} on {n} tables" for name, n in sorted(heavy.items()))
        return f" (now: {now}; row_wise_adagrad keeps one float per row)"

    def _explain(
        self,
        failure: AssignmentFailure,
        options: Sequence[Sequence[ShardingOption]],
        choice: Sequence[int],
        base: int,
    ) -> str:
        topo = self.topology
        opt = options[failure.option_index][choice[failure.option_index]]
        short = failure.needed_bytes - failure.free_bytes
        if failure.host:
            return (
                f"table {opt.table.name!r} (module {module_label(opt.module)}) does not fit: "
                f"device memory is full, and its layout {opt.describe()} in "
                f"{opt.placement.describe()} needs {format_bytes(failure.needed_bytes)} of host "
                "memory for UVM on one rank, but "
                f"the rank with the most (rank {failure.best_rank}) has "
                f"{format_bytes(failure.free_bytes)} free of "
                f"{format_bytes(topo.host_usable_bytes)} usable ({format_bytes(topo.ddr_bytes)} "
                f"ddr_bytes less the {topo.reserve_fraction:.0%} reserve); short by "
                f"{format_bytes(short)}. To fit: add ranks, device or host memory per rank, or "
                "use fused optimizers with less state"
            )
        # The least any layout of each table needs, over all ranks: if it exceeds the ranks'
        # combined room, no partitioning can succeed and the fix is more memory, not a layout.
        least = sum(
            min(sum(o.shard_bytes) * (topo.world_size if o.is_replicated else 1) for o in opts)
            for opts in options
        )
        room = (topo.usable_bytes - base) * topo.world_size
        fixes = ["add ranks or memory per rank"]
        if not optimizer_spec(opt.optimizer.name).light_state:
            fixes.append(
                f"use a fused optimizer with less state than {opt.optimizer.name!r} "
                "(row_wise_adagrad keeps one float per row)"
            )
        fixes.append(f"lower batch_size ({self.batch_size})")
        fixes.append("allow more sharding types for this table")
        return (
            f"table {opt.table.name!r} (module {module_label(opt.module)}) does not fit: its "
            f"layout {opt.describe()} needs {format_bytes(failure.needed_bytes)} on one rank, but "
            f"the rank with the most room (rank {failure.best_rank}) has "
            f"{format_bytes(failure.free_bytes)} free of {format_bytes(topo.usable_bytes)} usable "
            f"({format_bytes(topo.memory_bytes)} less the {topo.reserve_fraction:.0%} reserve; "
            f"{format_bytes(base)} of it holds every rank's pooled outputs); short by "
            f"{format_bytes(short)}. All tables need at least {format_bytes(least)} in total; "
            f"the {topo.world_size} ranks have {format_bytes(room)}. To fit: " + ", ".join(fixes)
        )


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    # Planning allocates hundreds of thousands of small objects and frees none of them until the
    # end; the cyclic collector's repeated full scans of them doubled the planning time.
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _to_plan(
    placement: RankAssignment, tables_by_module: Mapping[str, Sequence[Any]], world_size: int
) -> ShardingPlan:
    plan: dict[str, dict[str, ParameterSharding]] = {m: {} for m in tables_by_module}
    for opt, ranks in zip(placement.options, placement.shard_ranks, strict=True):
        plan[opt.module][opt.table.name] = opt.to_parameter_sharding(ranks, world_size)
    return ShardingPlan(plan)


def plan_collectively(
    planner: EmbeddingShardingPlanner,
    tables_by_module: Mapping[str, Sequence[Any]],
    process_group: dist.ProcessGroup | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=5),
    table_optimizers: Mapping[str, Mapping[str, FusedOptimizerConfig]] | None = None,
) -> ShardingPlan:
    """Plan on rank 0 of ``process_group`` and broadcast the plan, so every rank holds the same.

    If planning fails on rank 0, every rank raises the same `PlannerError`.

    Args:
        planner: the planner (only rank 0's runs).
        tables_by_module: module path -> its tables (the same on every rank).
        process_group: the group (default: the world).
        timeout: limit for each broadcast.
        table_optimizers: as in `EmbeddingShardingPlanner.plan`.

    Returns:
        The plan: validated once, on rank 0 (`EmbeddingShardingPlanner.plan`); its JSON round
        trip is exact, so every rank holds that same valid plan.

    Raises:
        PlannerError: planning failed on rank 0.
    """
    world = dist.get_world_size(process_group)
    if world != planner.topology.world_size:
        raise PlannerError(
            f"the planner's topology has world_size {planner.topology.world_size} but the process "
            f"group has {world} ranks; build the Topology with world_size={world}"
        )
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    payload, error = b"", None
    if dist.get_rank(process_group) == 0:
        try:
            plan = planner.plan(tables_by_module, table_optimizers)
            payload = plan.to_json().encode("utf-8")
        except Exception as e:  # every failure must reach the other ranks, not leave them waiting
            payload, error = f"{type(e).__name__}: {e}".encode(), e
    header = torch.tensor([len(payload), int(error is not None)], dtype=torch.int64)
    _broadcast(header, src, process_group, timeout)
    if payload:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        data = torch.empty(int(header[0]), dtype=torch.uint8)
    _broadcast(data, src, process_group, timeout)
    text = data.numpy().tobytes().decode("utf-8")
    if error is not None:
        raise error
    if int(header[1]):
        raise PlannerError(f"planning on rank 0 failed: {text}")
    return ShardingPlan.from_json(text)


def shared_topology(
    topology: Topology,
    process_group: dist.ProcessGroup | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=5),
) -> Topology:
    """``topology`` with each memory figure the least any rank of the group measured.

    Every rank measures its own memory (`local_topology`); a plan must fit the rank with the
    least, and `plan_collectively` needs the same topology on every rank. One MIN all-reduce
    of ``(hbm_bytes, ddr_bytes)``, through `recopt.comm`.

    Args:
        topology: this rank's topology.
        process_group: the ranks (default: the world); one rank returns ``topology``.
        timeout: limit for the all-reduce.

    Returns:
        The topology with ``hbm_bytes`` and ``ddr_bytes`` the minimum over the ranks.
    """
    if dist.get_world_size(process_group) == 1:
        return topology
    memory = torch.tensor([topology.hbm_bytes, topology.ddr_bytes], dtype=torch.int64)
    comm.all_reduce(memory, process_group, op=dist.ReduceOp.MIN, timeout=timeout)
    return topology.replace(hbm_bytes=int(memory[0]), ddr_bytes=int(memory[1]))


def training_topology(
    world_size: int,
    ranks_per_host: int | None,
    device: torch.device | str | None,
    process_group: dist.ProcessGroup | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=5),
) -> Topology:
    """The topology of the device a job trains on, the same on every rank.

    On CUDA this GPU's memory and the host's (`local_topology`), the least over the ranks
    (`shared_topology`; skipped for one rank, which needs no process group); elsewhere the
    `Topology` defaults (4 GiB per rank).
    """
    if device is None or torch.device(device).type != "cuda":
        return Topology(world_size=world_size, ranks_per_host=ranks_per_host)
    topology = local_topology(world_size, ranks_per_host, device=device)
    if world_size > 1:
        topology = shared_topology(topology, process_group, timeout)
    return topology


def _broadcast(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None, timeout: datetime.timedelta
) -> None:
    # Through comm: a CPU tensor, which an NCCL-only group could not carry by itself.
    comm.broadcast(tensor, src, group, timeout)
