"""FusedEmbeddingCollection: unpooled lookups whose optimizer runs inside the backward pass.

A thin layer over the fused embedding-bag engine (recopt/modules/unpooled.py): each id becomes a
SUM-pooled bag of one, so every fused optimizer and backend works unchanged. Weights are named
``embeddings.<table>.weight`` (state dict and fused optimizer), as `EmbeddingCollection`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from recopt.kernels.config import FusedOptimizerConfig
from recopt.kernels.contract import Kernel
from recopt.modules.collection import FusedCollection
from recopt.modules.config import EmbeddingConfig, validate_tables
from recopt.modules.embedding import TableAccessors
from recopt.modules.fused import EmbeddingFusedOptimizer, FusedEmbeddingBagCollection
from recopt.modules.inputs import FeatureLayout
from recopt.modules.unpooled import (
    lookup_bag_configs,
    meta_rows_per_feature,
    one_id_bags,
    rows_per_feature,
    select_lookups,
)
from recopt.sparse import JaggedTensor, KeyedJaggedTensor


class FusedEmbeddingCollection(nn.Module, FusedCollection, TableAccessors):
    """`EmbeddingCollection` with the sparse optimizer fused into backward.

    Same input and output as `EmbeddingCollection`. After ``loss.backward()`` the rows looked up
    in the batch are already updated. A backward whose output gradient holds NaN or inf updates
    nothing (counted in ``skipped_nonfinite_steps``).

    Cost: the lookup runs over ``num_features x max ids per feature`` one-id bags (features with
    fewer ids are padded with empty bags), so its output buffer is ``num_features x max_f N_f x
    dim`` before each feature's ``N_f`` rows are cut out: cheap when features have similar id
    counts, up to ``num_features`` times the rows actually needed when one feature dominates.

    Args:
        tables: `EmbeddingConfig` tables (``validate_tables`` rules apply).
        optimizer: the fused optimizer of every table (default row-wise Adagrad, lr 0.01).
        table_optimizers: per-table overrides, table name -> optimizer.
        device: where weights and optimizer state live.
        need_indices: put each feature's ids in its output's ``weights`` (as TorchRec).
        skip_nonfinite: skip the fused update of a backward whose gradient is not finite.

    Tables with ``id_map`` take any int64 id, as in `FusedEmbeddingBagCollection`; an id
    that reads the zero row (not admitted) gets a zero output row.

    Raises:
        ValueError: invalid tables, an override naming an unknown table, or a kernel that cannot
            take a table (the message gives the fix).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        optimizer: FusedOptimizerConfig | None = None,
        table_optimizers: Mapping[str, FusedOptimizerConfig] | None = None,
        device: torch.device | str | None = None,
        need_indices: bool = False,
        skip_nonfinite: bool = True,
    ) -> None:
        super().__init__()
        validate_tables(tables, allow_shared_features=True, config_type=EmbeddingConfig)
        self.tables: list[EmbeddingConfig] = list(tables)
        self._need_indices = need_indices
        engine = FusedEmbeddingBagCollection(
            lookup_bag_configs(self.tables),
            optimizer=optimizer,
            table_optimizers=table_optimizers,
            device=device,
            skip_nonfinite=skip_nonfinite,
            param_prefix="embeddings",
        )
        # The engine stays out of the module tree; its weights are registered here under
        # ``embeddings`` (the same holders: loads and in-place edits reach the kernels).
        self.__dict__["_engine"] = engine
        self.embeddings = engine.embedding_bags
        self.device = engine.device
        self._layout = FeatureLayout(self.tables)
        if engine.id_maps is not None:  # the engine's maps, in this module's state_dict
            self.id_maps = engine.id_maps

    @property
    def _bags(self) -> FusedEmbeddingBagCollection:
        engine: FusedEmbeddingBagCollection = self.__dict__["_engine"]
        return engine

    @property
    def fused_optimizer(self) -> EmbeddingFusedOptimizer:
        """The KeyedOptimizer over ``embeddings.<table>.weight`` and its in-backward state."""
        return self._bags.fused_optimizer

    @property
    def skip_nonfinite(self) -> bool:
        """Whether a NaN/inf output gradient skips the fused update."""
        return self._bags.skip_nonfinite

    @property
    def skipped_nonfinite_steps(self) -> int:
        """Backward passes whose fused update was skipped for a NaN/inf output gradient."""
        return self._bags.skipped_nonfinite_steps

    def stats(self) -> dict[str, dict[str, float]]:
        """Per id-mapped table: occupancy, new ids, evictions, admissions of the last step."""
        return self._bags.stats()

    def kernels(self) -> list[Kernel]:
        """The kernels, one per optimizer group."""
        return self._bags.kernels()

    def feature_names(self) -> list[str]:
        """The features looked up, in table order (repeated when shared by tables)."""
        return list(self._layout.feature_names)

    def table_optimizers(self) -> dict[str, FusedOptimizerConfig]:
        """Table name -> the optimizer it runs with now (its param group's hyperparameters)."""
        return self._bags.table_optimizers()

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Look up every id; backward updates the looked-up rows in place.

        Returns:
            Output key (the feature, or ``feature@table`` when shared) -> its rows.

        Raises:
            ValueError: missing features; ``InvalidIdError`` for an id outside its table.
        """
        features = select_lookups(features, self._layout)
        dims = self._layout.dims
        if self.device.type == "meta":
            return meta_rows_per_feature(features.to_dict(), dims, self._need_indices)
        self._bags.training = self.training  # the engine is outside the module tree
        pooled = self._bags(one_id_bags(features))
        return rows_per_feature(pooled.values(), features, dims, self._need_indices)
