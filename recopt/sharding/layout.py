"""The static layout of a sharded collection, computed identically on every rank from the plan.

Every non-data-parallel table is a set of rectangles (ShardSpec). Each rank runs one kernel per
(fused optimizer, backend) over its rectangles; the kernel's features are the virtual features
(source rank, feature, shard). Data-parallel tables get one replica kernel per optimizer that
looks up the global batch. Nothing here communicates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from recopt.kernels.config import Backend, FusedOptimizerConfig, TableSpec
from recopt.kernels.fbgemm_backend import fbgemm_auto_objections, fbgemm_problems
from recopt.kernels.precision import Precision
from recopt.kernels.registry import optimizer_spec
from recopt.modules.config import EmbeddingBagConfig
from recopt.modules.inputs import FeatureLayout
from recopt.sharding.bucketizer import VirtualFeature
from recopt.sharding.plan import ParameterSharding, PlanError, ShardingType


@dataclass(slots=True)
class GroupLayout:
    """One kernel of this rank: its optimizer, local tables and per-source features."""

    optimizer: FusedOptimizerConfig
    param_group: int
    tables: list[tuple[int, int]] = field(default_factory=list)  # (table, shard); shard -1: DP
    features: list[VirtualFeature] = field(default_factory=list)  # one source's features

    @property
    def width(self) -> int:
        """Output columns for one source rank."""
        return sum(vf.num_cols for vf in self.features)


def needs_row_stat_hook(kind: ShardingType, optimizer: FusedOptimizerConfig) -> bool:
    """A column shard of a row-wise optimizer needs the full row's statistic, which only the
    recopt kernel's ``row_stat_hook`` gives (fbgemm cannot run it)."""
    return kind.splits_columns and optimizer_spec(optimizer.name).row_wise


def sharding_refusal(kind: ShardingType, optimizer_name: str) -> str:
    """Why sharding type ``kind`` cannot run the fused optimizer ``optimizer_name``; ``""``
    when it can.

    A column statistic spans every row and a row statistic every column (adafactor): only a
    whole table (table-wise) or a replica (data-parallel) sees both. LAMB's trust ratio is a
    ratio of norms over each full row: a column shard sees part of the row.
    """
    spec = optimizer_spec(optimizer_name)
    if spec.whole_table_statistics and not kind.whole_table:
        return (
            f"{spec.name} keeps row and column statistics over the whole table, so it "
            f"supports table_wise and data_parallel sharding only, not {kind.value}; shard it "
            "table-wise or pick another fused optimizer"
        )
    if spec.full_row_norms and kind.splits_columns:
        return (
            f"{spec.name} scales each row's step by norms over the full row, so it cannot run "
            f"on column shards ({kind.value}); shard it table_wise, row_wise, table_row_wise "
            "or data_parallel, or pick another fused optimizer"
        )
    return ""


def resolve_optimizer(
    table: EmbeddingBagConfig,
    ps: ParameterSharding,
    optimizer: FusedOptimizerConfig,
    module_path: str,
) -> FusedOptimizerConfig:
    """The optimizer a table's shards run with, its backend fixed by the plan and the type.

    Raises:
        PlanError: a type the optimizer cannot run (`sharding_refusal`: adafactor on a type
            other than table-wise / data-parallel, lamb on column shards), a plan backend
            other than the optimizer's (neither ``auto``), a column-sharded
            row-wise optimizer forced onto fbgemm (which has no row statistic hook), or a table
            placed in UVM on a kernel other than fbgemm (the only one that reads UVM).
    """
    where = f"table {table.name!r} (module {module_path!r})"
    kind = ps.sharding_type
    refusal = sharding_refusal(kind, optimizer.name)
    if refusal:
        raise PlanError(f"{where}: {refusal}")
    backend = ps.backend if ps.backend is not Backend.AUTO else optimizer.backend
    if Backend.AUTO not in (ps.backend, optimizer.backend) and ps.backend != optimizer.backend:
        raise PlanError(
            f"{where}: the plan's backend {ps.backend.value!r} contradicts the optimizer's "
            f"backend {optimizer.backend.value!r}; set one of them to 'auto' or make them equal"
        )
    if not ps.placement.on_device:
        _check_uvm_kernel(where, ps, optimizer, backend, table)
        # Explicit: UVM shards get kernels of their own, never shared with device shards that
        # fbgemm might not run (AUTO would then have to pick fbgemm for both).
        backend = Backend.FBGEMM
    if needs_row_stat_hook(kind, optimizer):
        if backend is Backend.FBGEMM:
            raise PlanError(
                f"{where}: {kind.value} with {optimizer.name} needs the full-row statistic "
                "hook, which only the recopt kernel has; use backend 'auto' or 'recopt'"
            )
        backend = Backend.RECOPT
    return dataclasses.replace(optimizer, backend=backend)


def _check_uvm_kernel(
    where: str,
    ps: ParameterSharding,
    optimizer: FusedOptimizerConfig,
    backend: Backend,
    table: EmbeddingBagConfig,
) -> None:
    """A table in UVM runs on fbgemm: refuse what would put it on recopt's kernel, and what
    fbgemm cannot run (or, under AUTO, runs only when asked for), on every rank alike."""
    placed = f"{where}: placement {ps.placement.describe()!r} needs the fbgemm kernel"
    if backend is Backend.RECOPT:
        raise PlanError(f"{placed}, but backend is 'recopt'; use 'auto' or 'fbgemm'")
    if needs_row_stat_hook(ps.sharding_type, optimizer):
        raise PlanError(
            f"{placed}, but {ps.sharding_type.value} with {optimizer.name} needs recopt's "
            "full-row statistic hook; shard it another way or use placement 'device'"
        )
    widths = sorted({s.num_cols for s in ps.shards}) or [table.embedding_dim]
    shards = [
        TableSpec(
            name=table.name, num_embeddings=1, embedding_dim=w, weight_dtype=table.weight_dtype
        )
        for w in widths
    ]
    cuda = torch.device("cuda")
    problems = fbgemm_problems(shards, optimizer, cuda)
    if backend is Backend.AUTO:
        problems += fbgemm_auto_objections(optimizer, cuda)
    if problems:
        raise PlanError(f"{placed}, which cannot run it: {'; '.join(problems)}")


class ShardedLayout:
    """Where every rectangle lives and which kernel on which rank looks it up.

    Args:
        tables: the collection's tables.
        shardings: table name -> sharding (validated).
        optimizers: table name -> the table's user-facing fused optimizer.
        world_size: number of ranks.
        rank: this rank.
        module_path: for error messages.

    Raises:
        PlanError: see `resolve_optimizer`.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        shardings: Mapping[str, ParameterSharding],
        optimizers: Mapping[str, FusedOptimizerConfig],
        world_size: int,
        rank: int,
        module_path: str = "",
    ) -> None:
        self.tables = list(tables)
        self.shardings = [shardings[t.name] for t in self.tables]
        self.features = FeatureLayout(self.tables)
        self.world_size = world_size
        self.rank = rank
        # User-facing param groups: one per distinct optimizer, in table order.
        self.group_optimizers: list[FusedOptimizerConfig] = []
        self.table_group: list[int] = []
        resolved: list[FusedOptimizerConfig] = []
        for table, ps in zip(self.tables, self.shardings, strict=True):
            opt = optimizers[table.name]
            if opt not in self.group_optimizers:
                self.group_optimizers.append(opt)
            self.table_group.append(self.group_optimizers.index(opt))
            resolved.append(resolve_optimizer(table, ps, opt, module_path))
        self.resolved = resolved
        # One kernel per (param group, resolved optimizer, weight dtype): a kernel holds one
        # weight precision (fbgemm's rule; recopt's would take several).
        keys: list[tuple[int, FusedOptimizerConfig, Precision]] = []
        table_keys = [
            (self.table_group[t], resolved[t], self.tables[t].weight_dtype)
            for t in range(len(self.tables))
        ]
        for key in table_keys:
            if key not in keys:
                keys.append(key)
        self.kernel_key = [keys.index(key) for key in table_keys]
        self.dest_groups = [self._mp_groups(d, keys) for d in range(world_size)]
        self.dest_features = [[vf for g in gs for vf in g.features] for gs in self.dest_groups]
        self.mp_groups = self.dest_groups[rank]
        self.dp_groups = self._dp_groups(keys)
        self.dp_features = [vf.feature for g in self.dp_groups for vf in g.features]

    def is_data_parallel(self, t: int) -> bool:
        """Whether table ``t`` is replicated."""
        return self.shardings[t].sharding_type.replicated

    def _table_features(self, t: int) -> list[int]:
        return [f for f, ft in enumerate(self.features.feature_table) if ft == t]

    def _mp_groups(
        self, rank: int, keys: list[tuple[int, FusedOptimizerConfig, Precision]]
    ) -> list[GroupLayout]:
        groups: dict[int, GroupLayout] = {}
        for t, ps in enumerate(self.shardings):
            for k, s in enumerate(ps.shards):
                if s.rank != rank:
                    continue
                key = self.kernel_key[t]
                if key not in groups:
                    groups[key] = GroupLayout(keys[key][1], keys[key][0])
                g = groups[key]
                g.tables.append((t, k))
                for f in self._table_features(t):
                    g.features.append(
                        VirtualFeature(
                            feature=f,
                            table=t,
                            shard=k,
                            row_offset=s.row_offset,
                            num_rows=s.num_rows,
                            col_offset=s.col_offset,
                            num_cols=s.num_cols,
                        )
                    )
        return [groups[k] for k in sorted(groups)]

    def _dp_groups(
        self, keys: list[tuple[int, FusedOptimizerConfig, Precision]]
    ) -> list[GroupLayout]:
        groups: dict[int, GroupLayout] = {}
        for t, table in enumerate(self.tables):
            if not self.is_data_parallel(t):
                continue
            key = self.kernel_key[t]
            if key not in groups:
                groups[key] = GroupLayout(keys[key][1], keys[key][0])
            groups[key].tables.append((t, -1))
            for f in self._table_features(t):
                groups[key].features.append(
                    VirtualFeature(
                        feature=f,
                        table=t,
                        shard=-1,
                        row_offset=0,
                        num_rows=table.num_embeddings,
                        col_offset=0,
                        num_cols=table.embedding_dim,
                    )
                )
        return [groups[k] for k in sorted(groups)]

    def output_columns(self) -> list[int]:
        """For every column of the received outputs (mp from each rank, then dp), its column in
        the collection's output."""
        starts = [0]
        for d in self.features.dims:
            starts.append(starts[-1] + d)
        cols: list[int] = []
        for vfs in self.dest_features:
            for vf in vfs:
                base = starts[vf.feature] + vf.col_offset
                cols.extend(range(base, base + vf.num_cols))
        for g in self.dp_groups:
            for vf in g.features:
                cols.extend(range(starts[vf.feature], starts[vf.feature] + vf.num_cols))
        return cols
