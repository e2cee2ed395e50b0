"""ShardedEmbeddingCollection: the sharded twin of FusedEmbeddingCollection.

The sharded embedding-bag engine fed one-id bags (recopt/modules/unpooled.py): every sharding
type, ShardedTensor state and the bad-input protocol come from it unchanged. Each rank pads its
own features to its own stride; the engine already pads ranks to the largest batch.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recopt.kernels.config import FusedOptimizerConfig
from recopt.kernels.contract import Kernel
from recopt.modules.collection import FusedCollection
from recopt.modules.config import EmbeddingConfig, validate_tables
from recopt.modules.embedding import TableAccessors
from recopt.modules.id_map_lookup import IdMaps
from recopt.modules.inputs import FeatureLayout
from recopt.modules.prefetch import PrefetchQueue
from recopt.modules.unpooled import (
    lookup_bag_configs,
    one_id_bags,
    rows_per_feature,
    select_lookups,
)
from recopt.sharding.input_stage import DistributedInput
from recopt.sharding.plan import ParameterSharding
from recopt.sharding.sharded_embedding import AGREE_TIMEOUT, ShardedEmbeddingBagCollection
from recopt.sharding.state import ShardedFusedOptimizer
from recopt.sparse import JaggedTensor, KeyedJaggedTensor


@dataclass(slots=True)
class StartedLookups:
    """One batch's lookups selected and their distribution started (see `start_input_dist`)."""

    features: KeyedJaggedTensor
    selected: KeyedJaggedTensor | None
    bags: KeyedJaggedTensor | None
    engine_input: DistributedInput
    error: ValueError | None  # this rank's own error, clearer than the engine's

    def advance(self, timeout: datetime.timedelta) -> None:
        """Start the id all-to-all (`DistributedInput.advance`)."""
        self.engine_input.advance(timeout)

    def drain(self, timeout: datetime.timedelta) -> None:
        """Finish its collectives, result dropped (`DistributedInput.drain`)."""
        self.engine_input.drain(timeout)


class ShardedEmbeddingCollection(nn.Module, FusedCollection, TableAccessors):
    """A FusedEmbeddingCollection whose tables are split over ranks by a sharding plan.

    Same input (this rank's batch) and output (``dict[str, JaggedTensor]`` of this rank's ids) as
    the unsharded module; ranks may have different batch sizes and id counts. Every rank must
    call ``forward`` and ``backward`` together. ``state_dict()`` holds
    ``embeddings.<t>.weight`` as a ShardedTensor of the table's global shape (a plain tensor
    for data-parallel tables); the fused optimizer's names and state are plan-independent.

    Args:
        tables: `EmbeddingConfig` tables.
        shardings: table name -> `ParameterSharding` (checked with `validate_plan`).
        optimizer: the fused optimizer of tables whose sharding names none.
        table_optimizers: per-table optimizers (the plan's ``optimizer`` takes precedence).
        process_group: the ranks (default: the world).
        device: where the shards live.
        module_path: the module's path in the model, for error messages.
        need_indices: put each feature's ids in its output's ``weights`` (as TorchRec).
        skip_nonfinite: skip every rank's fused update when any rank's output gradient holds
            NaN/inf (see ShardedEmbeddingBagCollection).
        timeout: limit of that check's all-reduce.
        plan_validated: the caller validated ``shardings`` (as in ShardedEmbeddingBagCollection).

    Raises:
        ValueError: invalid tables; ``PlanError`` for an invalid plan or an unsupported
            optimizer/sharding pair.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        shardings: Mapping[str, ParameterSharding],
        optimizer: FusedOptimizerConfig | None = None,
        table_optimizers: Mapping[str, FusedOptimizerConfig] | None = None,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        module_path: str = "",
        need_indices: bool = False,
        skip_nonfinite: bool = True,
        timeout: datetime.timedelta = AGREE_TIMEOUT,
        *,
        plan_validated: bool = False,
    ) -> None:
        super().__init__()
        validate_tables(tables, allow_shared_features=True, config_type=EmbeddingConfig)
        self.tables: list[EmbeddingConfig] = list(tables)
        self._need_indices = need_indices
        engine = ShardedEmbeddingBagCollection(
            lookup_bag_configs(self.tables),
            shardings,
            optimizer=optimizer,
            table_optimizers=table_optimizers,
            process_group=process_group,
            device=device,
            module_path=module_path,
            skip_nonfinite=skip_nonfinite,
            timeout=timeout,
            param_prefix="embeddings",
            plan_validated=plan_validated,
        )
        self.__dict__["_engine"] = engine  # out of the module tree: state goes through it
        self.device = engine.device
        self._layout = FeatureLayout(self.tables)
        self._timeout = timeout
        self._prefetched: PrefetchQueue[StartedLookups] = PrefetchQueue(
            f"{type(self).__name__} {module_path!r}"
        )

    @property
    def _bags(self) -> ShardedEmbeddingBagCollection:
        engine: ShardedEmbeddingBagCollection = self.__dict__["_engine"]
        return engine

    @property
    def fused_optimizer(self) -> ShardedFusedOptimizer:
        """KeyedOptimizer over ``embeddings.<t>.weight`` with plan-independent state keys."""
        return self._bags.fused_optimizer

    @property
    def skip_nonfinite(self) -> bool:
        """Whether a NaN/inf output gradient skips the fused update on every rank."""
        return self._bags.skip_nonfinite

    @property
    def skipped_nonfinite_steps(self) -> int:
        """Backward passes whose fused update was skipped for a NaN/inf gradient."""
        return self._bags.skipped_nonfinite_steps

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group the collectives run on."""
        return self._bags.process_group

    @property
    def phase_seconds(self) -> dict[str, float] | None:
        """Forward time per phase when set to a dict (see ShardedEmbeddingBagCollection)."""
        return self._bags.phase_seconds

    @phase_seconds.setter
    def phase_seconds(self, value: dict[str, float] | None) -> None:
        self._bags.phase_seconds = value

    @property
    def id_maps(self) -> IdMaps | None:
        """This rank's id maps: its shard maps and step counters (None: no id-mapped table)."""
        return self._bags.id_maps

    def stats(self) -> dict[str, dict[str, float]]:
        """Per id-mapped table: occupancy, new ids, evictions, admissions of the last step."""
        return self._bags.stats()

    def kernels(self) -> list[Kernel]:
        """This rank's kernels: model-parallel ones, then data-parallel replicas."""
        return self._bags.kernels()

    def feature_names(self) -> list[str]:
        """The features looked up, in table order (repeated when shared by tables)."""
        return list(self._layout.feature_names)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Look up this rank's ids; backward updates every rank's looked-up rows in place.

        Returns:
            Output key (the feature, or ``feature@table`` when shared) -> this rank's rows.

        Raises:
            InvalidIdError / ValueError: this rank's input is bad; `RemoteInputError`: another
                rank's is. Every rank raises, before anything is looked up or updated.
        """
        started = self._prefetched.take(features) or self.start_input_dist(features)
        self._bags.training = self.training  # (this forward's mode, not its start's)
        if started.error is not None:
            started.advance(self._timeout)  # read the count exchange with the other ranks
            raise started.error
        assert started.selected is not None and started.bags is not None
        selected = started.selected
        self._bags.use_prefetched(started.engine_input)
        pooled = self._bags(started.bags)
        dims = self._layout.dims
        return rows_per_feature(pooled.values(), selected, dims, self._need_indices)

    def start_input_dist(self, features: KeyedJaggedTensor, ahead: bool = False) -> StartedLookups:
        """Select the lookups of ``features`` and start distributing them (a collective).

        A rejected input is not raised here but by the forward that consumes the result.
        ``ahead``: as `ShardedEmbeddingBagCollection.start_input_dist`.
        """
        self._bags.training = self.training  # the engine is outside the module tree
        try:
            selected = select_lookups(features, self._layout)
            bags = one_id_bags(selected)
        except ValueError as e:
            # The engine refuses the raw input too (its features are the lookups) and shares
            # that verdict with the other ranks, so no rank is left waiting in a collective;
            # this rank then raises its own, clearer error.
            engine = self._bags.start_input_dist(features, ahead)
            return StartedLookups(features, None, None, engine, e)
        engine = self._bags.start_input_dist(bags, ahead)
        return StartedLookups(features, selected, bags, engine, None)

    def advance_prefetched(self, started: StartedLookups, timeout: datetime.timedelta) -> None:
        """Start the id all-to-all of ``started`` (`ShardedEmbeddingBagCollection.
        advance_prefetched`)."""
        self._bags.advance_prefetched(started.engine_input, timeout)

    def use_prefetched(self, started: StartedLookups) -> None:
        """Have the next ``forward(started.features)`` consume ``started``."""
        self._prefetched.push(started)

    def unused_prefetched(self) -> int:
        """Queued distributions no forward consumed; clears them (as the engine's)."""
        count = self._prefetched.pending()
        self._prefetched.clear()
        if count:  # never handed to the engine: its steps ahead undone
            self._bags.rewind_ahead()
        return count + self._bags.unused_prefetched()

    def prefetch_stale(self, started: StartedLookups) -> bool:
        """Whether ``started`` must be distributed again (`ShardedEmbeddingBagCollection.
        prefetch_stale`)."""
        return self._bags.prefetch_stale(started.engine_input)

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        self._bags._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        self._bags._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
