"""EmbeddingCollection: unpooled lookups (one row per id), the plain torch module.

It is the reference the fused and sharded embedding collections are tested against: one
``nn.Embedding`` per table, named ``embeddings.<table>.weight`` as in TorchRec.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from recopt.modules.config import EmbeddingConfig, validate_tables
from recopt.modules.id_map_lookup import refuse_id_maps
from recopt.modules.inputs import FeatureLayout, check_ids_in_range, require_features
from recopt.modules.unpooled import meta_rows_per_feature
from recopt.sparse import JaggedTensor, KeyedJaggedTensor


def common_embedding_dim(tables: Sequence[EmbeddingConfig]) -> int:
    """The one row width of every table (TorchRec's ``embedding_dim()``).

    Raises:
        ValueError: the tables have different widths (recopt allows that; ask each table).
    """
    dims = {t.embedding_dim for t in tables}
    if len(dims) != 1:
        raise ValueError(
            f"the tables have different embedding_dim {sorted(dims)}; read each table's "
            "embedding_dim from embedding_configs() instead"
        )
    return dims.pop()


class TableAccessors:
    """TorchRec's table accessors, shared by the plain, fused and sharded embedding collections
    (each sets ``tables`` and ``_need_indices``)."""

    tables: list[EmbeddingConfig]
    _need_indices: bool

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The tables (TorchRec's accessor)."""
        return list(self.tables)

    def embedding_dim(self) -> int:
        """The row width shared by every table (see `common_embedding_dim`)."""
        return common_embedding_dim(self.tables)

    def need_indices(self) -> bool:
        """Whether outputs carry their ids in ``weights``."""
        return self._need_indices


class EmbeddingCollection(nn.Module, TableAccessors):
    """A collection of tables looked up without pooling: each id gets its own row.

    Shapes: for each feature f with N_f ids in the input, the output holds a JaggedTensor whose
    values are ``[N_f, dim of f's table]`` (row i is id i's row) and whose lengths are the
    feature's lengths. Unlike TorchRec, tables may have different widths. fp16/bf16 tables
    (``weight_dtype``) store their rows in that dtype and return float32 rows.

    Args:
        tables: `EmbeddingConfig` tables (``validate_tables`` rules apply, except that a
            feature may look up several tables: its outputs are then keyed ``feature@table``,
            as in TorchRec, here and in the fused and sharded collections).
        device: where the weights live; None follows torch's default device; ``"meta"``
            allocates nothing and forward returns meta tensors of the right shapes.
        need_indices: put each feature's ids in its output's ``weights`` (as TorchRec).
        sparse_grad: produce sparse gradients (for ``torch.optim.SparseAdam``).

    Example::

        ec = EmbeddingCollection([
            EmbeddingConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"]),
        ])
        out = ec(KeyedJaggedTensor.from_id_lists({"f": [[1, 2], [3]]}))
        out["f"].values().shape  # torch.Size([3, 4]): rows 1, 2 and 3; lengths [2, 1]
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        sparse_grad: bool = False,
    ) -> None:
        super().__init__()
        validate_tables(tables, allow_shared_features=True, config_type=EmbeddingConfig)
        refuse_id_maps(tables, "EmbeddingCollection (use FusedEmbeddingCollection)")
        self.tables = list(tables)
        self._need_indices = need_indices
        self._layout = FeatureLayout(self.tables)
        self.embeddings = nn.ModuleDict()
        for table in self.tables:
            embedding = nn.Embedding(
                table.num_embeddings,
                table.embedding_dim,
                sparse=sparse_grad,
                # An explicit (uninitialised) weight skips nn.Embedding's normal_ init, so the RNG
                # draws only the table's own init, as in FusedEmbeddingCollection.
                _weight=torch.empty(
                    table.num_embeddings,
                    table.embedding_dim,
                    device=device,
                    dtype=table.weight_dtype.dtype,
                ),
            )
            table.init_weight(embedding.weight)
            self.embeddings[table.name] = embedding

    @property
    def device(self) -> torch.device:
        """Where the weights live (``meta`` when built there: no memory is allocated)."""
        return self._weight(self.tables[0].name).device

    def _weight(self, name: str) -> torch.Tensor:
        embedding = self.embeddings[name]
        assert isinstance(embedding, nn.Embedding)
        return embedding.weight

    def feature_names(self) -> list[str]:
        """The features looked up, in table order (repeated when shared by tables)."""
        return list(self._layout.feature_names)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Look up every id of every feature.

        Returns:
            Output key (the feature, or ``feature@table`` when shared) -> its rows.

        Raises:
            ValueError: missing features; ``InvalidIdError`` for an id outside its table.
        """
        layout = self._layout
        require_features(features.keys(), layout.feature_names)
        inputs = [features[f] for f in layout.feature_names]
        if self.device.type == "meta":
            named = dict(zip(layout.output_keys, inputs, strict=True))
            return meta_rows_per_feature(named, layout.dims, self._need_indices)
        counts = [jt.values().shape[0] for jt in inputs]
        ids = inputs[0].values() if len(inputs) == 1 else torch.cat([jt.values() for jt in inputs])
        check_ids_in_range(ids, counts, layout.feature_names, layout.table_names, layout.num_rows)
        result: dict[str, JaggedTensor] = {}
        for key, table, jt in zip(layout.output_keys, layout.table_names, inputs, strict=True):
            embedding = self.embeddings[table]
            assert isinstance(embedding, nn.Embedding)
            rows = embedding(jt.values())
            result[key] = JaggedTensor(
                values=rows.float(),  # fp16/bf16 tables: float32 rows, as the fused collection
                lengths=jt.lengths(),
                weights=jt.values() if self._need_indices else None,
            )
        return result
