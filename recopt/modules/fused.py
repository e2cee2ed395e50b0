"""FusedEmbeddingBagCollection: embedding bags whose optimizer runs inside the backward pass.

Tables sharing a fused optimizer and a pooling mode are batched into one kernel (fbgemm's or
recopt's, see recopt.kernels); each table's weight is exposed as ``embedding_bags.<t>.weight``,
a view of the kernel's storage, so state_dict keys match `EmbeddingBagCollection`'s.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from recopt.kernels.config import FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.contract import Kernel
from recopt.kernels.factory import create_kernel, rng_unchanged
from recopt.kernels.placement import DEVICE, Placement
from recopt.kernels.precision import Precision
from recopt.kernels.updates import ROUNDING_STEP
from recopt.modules.collection import FusedCollection
from recopt.modules.config import EmbeddingBagConfig, validate_tables
from recopt.modules.embedding_bag import EmbeddingBagCollection
from recopt.modules.fused_groups import (
    LearningRateSync,
    make_param_group,
    optimizer_from_param_group,
    resolve_table_optimizers,
)
from recopt.modules.id_map_batch import MappedBatch, mean_scale
from recopt.modules.id_map_lookup import IdMaps, prepare_mapped
from recopt.modules.id_map_rows import ResetPlan, ResetTarget, ResetTargets, fresh_resets
from recopt.modules.id_map_stage import RemapStage
from recopt.modules.inputs import FeatureLayout
from recopt.modules.nonfinite import NonFiniteGradGuard, guarded_lookup
from recopt.modules.torch_optimizers import fused_config
from recopt.modules.variable_batch import expand_rows, regular_batch
from recopt.optim.fused import FusedOptimizer
from recopt.sparse import KeyedJaggedTensor, KeyedTensor


class _TableWeight(nn.Module):
    """Holds one table's weight so its name is ``embedding_bags.<table>.weight``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        # A Parameter aliasing the kernel's storage: loads and in-place edits reach the kernel.
        # requires_grad=False: the kernel updates it in backward; no optimizer or DDP should.
        self.weight = nn.Parameter(weight, requires_grad=False)


@dataclasses.dataclass
class _KernelGroup:
    """Tables that one kernel runs: indices into the collection's tables and features."""

    optimizer: FusedOptimizerConfig
    pooling: PoolingType
    table_indices: list[int]
    feature_indices: list[int]
    kernel: Kernel


class EmbeddingFusedOptimizer(FusedOptimizer):
    """The fused optimizer of a `FusedEmbeddingBagCollection`: state is read and written in place.

    One param group per kernel; ``lr`` changes reach the kernel at the next forward. Other
    hyperparameters are fixed at construction. ``rounding_step`` counters are optional in a
    loaded state dict (absent: 0; present for a table that keeps none: dropped).
    """

    optional_state = (ROUNDING_STEP,)


def _resolve_placements(
    tables: Sequence[EmbeddingBagConfig], placements: Mapping[str, Placement] | None
) -> dict[str, Placement]:
    """Every table's placement (``device`` unless named), after checking the names."""
    names = [t.name for t in tables]
    unknown = sorted(set(placements or {}) - set(names))
    if unknown:
        raise ValueError(
            f"table_placements names tables {unknown}, which the collection does not have; "
            f"tables: {names}"
        )
    for name, placement in (placements or {}).items():
        if not isinstance(placement, Placement):
            raise ValueError(
                f"table_placements[{name!r}] must be a Placement, got {placement!r}; e.g. "
                "Placement(location='uvm_caching', cache_load_factor=0.2)"
            )
    return {name: (placements or {}).get(name, DEVICE) for name in names}


class FusedEmbeddingBagCollection(nn.Module, FusedCollection):
    """`EmbeddingBagCollection` with the sparse optimizer fused into backward.

    Same input and output as `EmbeddingBagCollection`. After ``loss.backward()`` the rows looked up
    in the batch are already updated; there is nothing to step. A backward whose gradient of the
    pooled output holds NaN or inf updates nothing (no weight, state or step counter) and is
    counted in ``skipped_nonfinite_steps`` (one warning, the first time).

    Args:
        tables: the tables (``validate_tables`` rules apply).
        optimizer: the fused optimizer of every table (default row-wise Adagrad, lr 0.01).
        table_optimizers: per-table overrides, table name -> optimizer.
        is_weighted: the input carries one weight per id.
        optimizer_type, optimizer_kwargs: TorchRec's way to name ``optimizer``: a torch
            optimizer class with a fused equivalent (``torch.optim.SGD``, ``Adagrad``,
            ``SparseAdam``, `recopt.optim.RowWiseAdagrad`) and its keyword arguments.
        device: where weights and optimizer state live.
        skip_nonfinite: check the output gradient before the fused update (one host read per
            backward) and skip the update when it is not finite. Not applied while a kernel has
            a ``grad_hook`` (fault tolerance): its collectives need every replica to update.
        table_placements: table name -> where its rows live (kernels/placement.py); tables not
            named are in device memory. UVM placements need CUDA and run on fbgemm.
        param_prefix: the fused optimizer's param names are ``<prefix>.<table>.weight`` (an
            embedding collection's lookup engine passes ``embeddings``).

    A feature may look up several tables; its outputs are then keyed ``feature@table``.
    Tables with ``id_map`` take any int64 id (docs/id_map.md): a row given to a new id is
    re-initialised and its per-row optimizer state zeroed before the lookup; the map's update
    stands when the gate skips the step. `stats` reports each map's last training batch.

    Raises:
        ValueError: invalid tables, an override naming an unknown table, a kernel that cannot
            take a table (e.g. fbgemm with a dim not a multiple of 4, or a UVM placement off
            CUDA: the message gives the fix), both ``optimizer`` and ``optimizer_type``, or an
            ``optimizer_type`` / keyword with no fused equivalent.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        optimizer: FusedOptimizerConfig | None = None,
        table_optimizers: Mapping[str, FusedOptimizerConfig] | None = None,
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        skip_nonfinite: bool = True,
        table_placements: Mapping[str, Placement] | None = None,
        *,
        optimizer_type: type | None = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        param_prefix: str = "embedding_bags",
    ) -> None:
        super().__init__()
        self._param_prefix = param_prefix
        validate_tables(tables, allow_shared_features=True)
        if optimizer_type is not None:
            if optimizer is not None:
                raise ValueError(
                    "pass the fused optimizer once: optimizer= (a FusedOptimizerConfig) or "
                    f"optimizer_type= ({optimizer_type.__name__}), not both"
                )
            optimizer = fused_config(optimizer_type, optimizer_kwargs)
        self.tables: list[EmbeddingBagConfig] = list(tables)
        self._placements = _resolve_placements(self.tables, table_placements)
        self.is_weighted = is_weighted
        self.device = torch.device(device if device is not None else "cpu")
        self._layout = FeatureLayout(self.tables)
        optimizers = resolve_table_optimizers(self.tables, optimizer, table_optimizers)
        # Our uniform_ draws below equal EmbeddingBagCollection's under the same seed, whatever
        # the kernels drew while being built.
        with rng_unchanged(self.device):
            self._groups = self._build_groups(optimizers)
        self.embedding_bags = nn.ModuleDict()
        weights: dict[int, torch.Tensor] = {}
        for group in self._groups:
            for t, w in zip(
                group.table_indices, group.kernel.split_embedding_weights(), strict=True
            ):
                weights[t] = w
        for t, table in enumerate(self.tables):
            table.init_weight(weights[t])  # table order: same draws as EmbeddingBagCollection
            self.embedding_bags[table.name] = _TableWeight(weights[t])
        self._optimizer = self._build_optimizer()
        self._lr_sync = LearningRateSync(
            [[g.kernel] for g in self._groups], [g.optimizer.learning_rate for g in self._groups]
        )
        self._single_group = len(self._groups) == 1
        self._skip_nonfinite = skip_nonfinite
        self._grad_guard = NonFiniteGradGuard(type(self).__name__)
        self.id_maps = IdMaps.of(self.tables, self.device)
        self._fresh_targets: ResetTargets | None = None  # `_reset_targets`
        self._remaps = (
            None
            if self.id_maps is None
            else RemapStage(
                type(self).__name__,
                self.id_maps,
                self._layout,
                self.tables,
                is_weighted,
                torch.float32,
            )
        )

    def _build_groups(self, optimizers: Mapping[str, FusedOptimizerConfig]) -> list[_KernelGroup]:
        # One kernel per optimizer, pooling and weight dtype (a kernel holds one precision);
        # tables in UVM get kernels of their own (fbgemm's; AUTO stays free for the others).
        tables_of: dict[tuple[FusedOptimizerConfig, PoolingType, Precision, bool], list[int]] = {}
        for t, table in enumerate(self.tables):
            on_device = self._placements[table.name].on_device
            key = (optimizers[table.name], table.pooling, table.weight_dtype, on_device)
            tables_of.setdefault(key, []).append(t)
        return [
            self._build_group(optimizer, pooling, table_indices)
            for (optimizer, pooling, *_), table_indices in tables_of.items()
        ]

    def _build_group(
        self, optimizer: FusedOptimizerConfig, pooling: PoolingType, table_indices: list[int]
    ) -> _KernelGroup:
        feature_indices = [
            f for f, t in enumerate(self._layout.feature_table) if t in table_indices
        ]
        specs = [
            TableSpec(
                name=self.tables[t].name,
                num_embeddings=self.tables[t].num_embeddings,
                embedding_dim=self.tables[t].embedding_dim,
                weight_dtype=self.tables[t].weight_dtype,
                placement=self._placements[self.tables[t].name],
            )
            for t in table_indices
        ]
        feature_table_map = [
            table_indices.index(self._layout.feature_table[f]) for f in feature_indices
        ]
        kernel = create_kernel(specs, feature_table_map, optimizer, pooling, self.device)
        return _KernelGroup(optimizer, pooling, table_indices, feature_indices, kernel)

    def _build_optimizer(self) -> EmbeddingFusedOptimizer:
        params: dict[str, torch.Tensor] = {}
        state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        param_groups: list[dict[str, Any]] = []
        for group in self._groups:
            group_params = []
            states = group.kernel.split_optimizer_states()
            for t, table_state in zip(group.table_indices, states, strict=True):
                name = self.tables[t].name
                param = self._table_weight(name)
                params[f"{self._param_prefix}.{name}.weight"] = param
                state[param] = {f"{name}.{key}": value for key, value in table_state.items()}
                group_params.append(param)
            param_groups.append(make_param_group(group.optimizer, group_params, [group.kernel]))
        return EmbeddingFusedOptimizer(params, state, param_groups)

    def __deepcopy__(self, memo: dict[int, Any]) -> FusedEmbeddingBagCollection:
        # nn.Parameter's deepcopy clones its data, which would cut each table weight loose from
        # the copied kernel's storage; re-point the copies at the new kernels' weights.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        new._fresh_targets = None  # views of the old kernels' storage
        old_groups = [dict(g) for g in new._optimizer.param_groups]
        for group in new._groups:
            for t, weight in zip(
                group.table_indices, group.kernel.split_embedding_weights(), strict=True
            ):
                holder = new.embedding_bags[new.tables[t].name]
                assert isinstance(holder, _TableWeight)
                holder.weight = nn.Parameter(weight, requires_grad=False)
        new._optimizer = new._build_optimizer()
        for param_group, old in zip(new._optimizer.param_groups, old_groups, strict=True):
            param_group.update({k: v for k, v in old.items() if k != "params"})
        return new

    def _table_weight(self, name: str) -> torch.Tensor:
        holder = self.embedding_bags[name]
        assert isinstance(holder, _TableWeight)
        return holder.weight

    @property
    def fused_optimizer(self) -> EmbeddingFusedOptimizer:
        """The KeyedOptimizer over this collection's weights and in-backward optimizer state."""
        return self._optimizer

    def feature_names(self) -> list[str]:
        """The features looked up, in table order (repeated when shared by tables)."""
        return list(self._layout.feature_names)

    def table_optimizers(self) -> dict[str, FusedOptimizerConfig]:
        """Table name -> the optimizer it runs with now (its param group's hyperparameters)."""
        result: dict[str, FusedOptimizerConfig] = {}
        for group, param_group in zip(self._groups, self._optimizer.param_groups, strict=True):
            config = optimizer_from_param_group(param_group)
            result.update((self.tables[t].name, config) for t in group.table_indices)
        return result

    @property
    def skip_nonfinite(self) -> bool:
        """Whether the output gradient is checked before the fused update (constructor arg)."""
        return self._skip_nonfinite

    @property
    def skipped_nonfinite_steps(self) -> int:
        """Backward passes whose fused update was skipped for a NaN/inf output gradient."""
        return self._grad_guard.skipped_steps

    def stats(self) -> dict[str, dict[str, float]]:
        """Per id-mapped table: occupancy, new ids, evictions, admissions of the last step."""
        return {} if self.id_maps is None else self.id_maps.stats()

    def kernels(self) -> list[Kernel]:
        """The kernels, one per (optimizer, pooling) group."""
        return [g.kernel for g in self._groups]

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool each feature's bags; backward updates the looked-up rows in place.

        A variable batch per feature is expanded through ``inverse_indices`` as in
        `EmbeddingBagCollection.forward`.

        Raises:
            ValueError: missing features or weights mismatch; ``InvalidIdError`` for bad ids.
        """
        if self.device.type == "meta":
            # Shapes only (build-on-meta, then shard): ids cannot be read, nor need to be.
            pooled_meta = torch.empty(features.stride(), sum(self._layout.dims), device="meta")
            return KeyedTensor(self._layout.output_keys, self._layout.dims, pooled_meta)
        ahead = None if self._remaps is None else self._remaps.take(features, self.training)
        if ahead is None:
            features, index_F_B = regular_batch(features, self._layout.feature_names)
            features, mapped = self._prepare(features)
        else:  # remapped by a pipeline while the previous batch trained
            index_F_B, mapped = ahead.index_F_B, ahead.mapped
            if not ahead.rows_reset:
                self._reset_fresh(mapped, ahead.reset_plan)
                ahead.rows_reset = True
            features = mapped.features
        self._lr_sync.apply(self._optimizer.param_groups)
        if self._skip_nonfinite and all(g.kernel.grad_hook is None for g in self._groups):
            pooled = guarded_lookup(
                lambda weights: self._lookup_all(features, weights),
                self._grad_guard,
                features.weights_or_none(),
                self.device,
            )
        else:
            pooled = self._lookup_all(features, features.weights_or_none())
        if mapped is not None:
            poolings = [self.tables[t].pooling for t in self._layout.feature_table]
            pooled = mean_scale(pooled, mapped, self._layout, poolings)
        if index_F_B is not None:
            pooled = expand_rows(pooled, self._layout.dims, index_F_B)
        return KeyedTensor(
            keys=self._layout.output_keys, length_per_key=self._layout.dims, values=pooled
        )

    def _prepare(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, MappedBatch | None]:
        """The checked features; with id maps, remapped to rows (fresh rows reset)."""
        if self.id_maps is None:
            return self._layout.prepare(features, self.is_weighted), None
        mapped = prepare_mapped(
            self.id_maps, self._layout, features, self.is_weighted, torch.float32, self.training
        )
        self._reset_fresh(mapped)
        return mapped.features, mapped

    def _reset_fresh(self, mapped: MappedBatch, plan: ResetPlan | None = None) -> None:
        """Re-initialise the rows the remap gave to new ids, their optimizer state zeroed
        (``plan``: worked out ahead, on a pipeline's worker, from this module's targets)."""
        assert self.id_maps is not None
        targets = self._reset_targets()
        if plan is None or plan.targets is not targets:
            plan = ResetPlan(fresh_resets(targets, mapped.fresh), targets)
        plan.run(self.id_maps)

    def _reset_targets(self) -> ResetTargets:
        """Per id-mapped table: its config, optimizer, weight and optimizer state views (the
        kernels' storage, as the module and its fused optimizer hold them: made once)."""
        if self._fresh_targets is None:
            self._fresh_targets = ResetTargets()
            for group in self._groups:
                kernel = group.kernel
                for t, weight, states in zip(
                    group.table_indices,
                    kernel.split_embedding_weights(),
                    kernel.split_optimizer_states(),
                    strict=True,
                ):
                    if self.tables[t].id_map is not None:
                        table = self.tables[t]
                        target = ResetTarget.of(table, group.optimizer.name, weight, states)
                        self._fresh_targets[table.name] = target
        return self._fresh_targets

    # ------------------------------------------------------- pipelined training (id maps)
    def start_remap(
        self,
        features: KeyedJaggedTensor,
        threads: int | None = 1,
        host_features: KeyedJaggedTensor | None = None,
    ) -> Any:
        """Remap a training batch's id-mapped features ahead of its forward (what
        `TrainPipelineSparseDist` does for batch i+1 while batch i trains; ``threads`` for the
        native remap on the worker thread; ``host_features``: the batch before its copy to
        a GPU, which maps kept on the host remap from). Returns what `use_prefetched` takes,
        or None (no id map, the collection in eval mode, or fault tolerance steps the maps
        inline)."""
        if self._remaps is None or not self.training:
            return None
        return self._remaps.start(features, threads, host_features, self._reset_targets())

    def use_prefetched(self, remap: Any) -> None:
        """Have the next ``forward(remap.features)`` take ``remap`` (from `start_remap`)."""
        if self._remaps is not None:
            self._remaps.push(remap)

    def unused_prefetched(self) -> int:
        """Remaps handed over that no forward took; cleared (their map steps undone)."""
        return 0 if self._remaps is None else self._remaps.unused()

    def prefetch_stale(self, remap: Any) -> bool:
        """Whether ``remap`` (from `start_remap`) was undone since: start it again."""
        return self._remaps is not None and self._remaps.stale(remap)

    def _lookup_all(
        self, features: KeyedJaggedTensor, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """Every kernel's pooled output, features in table order (``weights``: per id)."""
        if weights is not features.weights_or_none():  # the guard's detached copy
            features = KeyedJaggedTensor(
                features.keys(),
                features.values(),
                weights=weights,
                lengths=features.lengths(),
                offsets=features.offsets(),
                stride=features.stride(),
                length_per_key=features.length_per_key(),
            )
        if self._single_group:
            return self._lookup(self._groups[0], features)
        return self._lookup_groups(features)

    def _lookup(self, group: _KernelGroup, features: KeyedJaggedTensor) -> torch.Tensor:
        # The features' id bounds when the host knows them (after `prepare`, it does), so the
        # kernel need not read them back from the device.
        known = features.length_per_key_or_none() is not None
        result: torch.Tensor = group.kernel(
            features.values(),
            features.offsets(),
            features.weights_or_none(),
            offset_per_key=features.offset_per_key() if known else None,
        )
        return result

    def _lookup_groups(self, features: KeyedJaggedTensor) -> torch.Tensor:
        order = [f for g in self._groups for f in g.feature_indices]
        parts = features.permute(order).split([len(g.feature_indices) for g in self._groups])
        outputs = [self._lookup(g, part) for g, part in zip(self._groups, parts, strict=True)]
        # Kernel outputs are grouped by kernel; put every feature's columns back in table order.
        columns: list[torch.Tensor] = [torch.empty(0)] * len(order)
        for group, out in zip(self._groups, outputs, strict=True):
            start = 0
            for f in group.feature_indices:
                dim = self._layout.dims[f]
                columns[f] = out[:, start : start + dim]
                start += dim
        return torch.cat(columns, dim=1)


def fuse_embedding_optimizer(
    model: nn.Module,
    optimizer_type: type,
    optimizer_kwargs: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Replace every `EmbeddingBagCollection` in ``model`` by its fused twin, weights kept.

    Args:
        model: a collection, or a module holding collections (replaced in place).
        optimizer_type: the torch optimizer whose update the fused kernels apply.
        optimizer_kwargs: its keyword arguments.
        device: where the fused tables live (default: where the collection's weights are).

    Returns:
        ``model`` with its collections replaced (the fused collection if ``model`` is one).

    Raises:
        ValueError: as `fused_config`.
    """
    config = fused_config(optimizer_type, optimizer_kwargs)

    def fuse(ebc: EmbeddingBagCollection) -> FusedEmbeddingBagCollection:
        fused = FusedEmbeddingBagCollection(
            ebc.tables,
            optimizer=config,
            is_weighted=ebc.is_weighted,
            device=device if device is not None else ebc.device,
        )
        fused.load_state_dict(ebc.state_dict())
        return fused

    if isinstance(model, EmbeddingBagCollection):
        return fuse(model)
    for name, child in list(model.named_children()):
        if isinstance(child, EmbeddingBagCollection):
            setattr(model, name, fuse(child))
        else:
            fuse_embedding_optimizer(child, optimizer_type, optimizer_kwargs, device)
    return model
