"""EmbeddingCollection: unpooled lookups (one row per id), the plain torch module.

It is the reference the fused and sharded embedding collections are tested against: one
``nn.Embedding`` per table, named ``embeddings.<table>.weight`` as in TorchRec.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from recopt.modules.config import EmbeddingConfig, validate_tables
from recopt.modules.id_map_lookup import IdMaps
from recopt.modules.id_map_rows import init_rows
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

    Tables with ``id_map`` take any int64 id (docs/id_map.md): the rows given to new ids are
    re-initialised (the table's init); the optimizer is the caller's, so its state of such a
    row is not reset (`FusedEmbeddingCollection` resets it). An id not admitted yet gets a
    zero row that trains nothing.

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
        self.id_maps = IdMaps.of(self.tables, device)

    def stats(self) -> dict[str, dict[str, float]]:
        """Per id-mapped table: occupancy, new ids, evictions, admissions of the last step."""
        return {} if self.id_maps is None else self.id_maps.stats()

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
        rows = self._rows([jt.values() for jt in inputs])
        result: dict[str, JaggedTensor] = {}
        for key, table, jt, rows_N in zip(
            layout.output_keys, layout.table_names, inputs, rows, strict=True
        ):
            result[key] = JaggedTensor(
                values=self._lookup(table, rows_N).float(),  # fp16/bf16 tables: float32 rows
                lengths=jt.lengths(),
                weights=jt.values() if self._need_indices else None,
            )
        return result

    def _rows(self, ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each feature's ids as rows: ids of unmapped tables checked and kept; the raw ids of
        id-mapped tables remapped (every feature of a table together, one step of its map in
        training; -1: the zero row) and the rows given to new ids re-initialised.

        Raises:
            InvalidIdError: an id of an unmapped table outside it (before any map moves).
        """
        layout = self._layout
        mapped = [] if self.id_maps is None else list(self.id_maps)
        checked = [
            torch.zeros_like(v) if t in mapped else v
            for v, t in zip(ids, layout.table_names, strict=True)
        ]
        counts = [v.shape[0] for v in ids]
        check_ids_in_range(
            torch.cat(checked), counts, layout.feature_names, layout.table_names, layout.num_rows
        )
        if self.id_maps is None:
            return ids
        per_table = {
            name: torch.cat([v for v, t in zip(ids, layout.table_names, strict=True) if t == name])
            for name in mapped
        }
        results = self.id_maps.remap_ids(per_table, self.training)
        for table in self.tables:
            fresh = results.get(table.name)
            if fresh is not None:
                init_rows(table, self._weight(table.name), fresh, fresh.stats.step)
        rows = list(ids)
        for name, result in results.items():
            features = [f for f, t in enumerate(layout.table_names) if t == name]
            parts = result.rows_M.split([counts[f] for f in features])
            for f, part in zip(features, parts, strict=True):
                rows[f] = part
        return rows

    def _lookup(self, table: str, rows_N: torch.Tensor) -> torch.Tensor:
        """``[N, D]`` rows of ``table``; a row -1 (an id not admitted yet) reads zeros and
        trains nothing."""
        embedding = self.embeddings[table]
        assert isinstance(embedding, nn.Embedding)
        kept = rows_N >= 0
        if self.id_maps is None or table not in self.id_maps or bool(kept.all()):
            return embedding(rows_N)
        out = rows_N.new_zeros(
            rows_N.shape[0], embedding.embedding_dim, dtype=embedding.weight.dtype
        )
        return out.index_put((kept,), embedding(rows_N[kept]))
