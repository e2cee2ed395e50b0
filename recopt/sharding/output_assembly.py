"""The output side of ShardedEmbeddingBagCollection: received pooled partials to ``[B, D]``.

A rank receives, per source rank, the ``[B, width]`` block its shards pooled for this rank's
batch (then its data-parallel rows); one gather, or a scatter-add where row shards' partials
of a feature add up, puts them in the features' columns, and mean-pooled features are divided
by their full bag lengths (shards pool with SUM). Where every rank pools the same columns
(row-wise layouts), the exchange itself sums the blocks (`sums_over_ranks`). Legend: B this
rank's batch, F features, D output width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recopt.kernels.config import PoolingType
from recopt.modules.config import EmbeddingBagConfig
from recopt.sharding.layout import ShardedLayout
from recopt.sparse import KeyedJaggedTensor

Tensor = torch.Tensor


class OutputAssembly:
    """A layout's maps from the output exchange's buffer to the output, built once.

    Args:
        layout: this rank's view of the sharded layout.
        tables: the collection's tables (for each feature's pooling).
        device: where the maps and the output live.

    Attributes:
        dest_width: per destination rank, the width of the columns its shards pool here.
        dp_dim: the width of the data-parallel tables' columns.
        sums_over_ranks: every rank pools every column, no data-parallel rows: the exchange
            hands `assemble` the sum of the ranks' blocks (``[B * D]``), not the blocks.
    """

    def __init__(
        self, layout: ShardedLayout, tables: Sequence[EmbeddingBagConfig], device: torch.device
    ) -> None:
        self.device = device
        features = layout.features
        self._out_dim = sum(features.dims)
        cols = layout.output_columns()
        self._colmap = torch.tensor(cols, dtype=torch.int64, device=self.device)
        # A bijection (no row-split partials to add): a gather instead of an index_add.
        self._bijective = sorted(cols) == list(range(self._out_dim))
        col_feature = [f for f, d in enumerate(features.dims) for _ in range(d)]
        self._col_feature = torch.tensor(col_feature, dtype=torch.int64, device=self.device)
        mean = [tables[t].pooling == PoolingType.MEAN for t in features.feature_table]
        self._mean_F = torch.tensor(mean, dtype=torch.bool, device=self.device)
        self._any_mean = any(mean)
        self.dest_width = [sum(vf.num_cols for vf in vfs) for vfs in layout.dest_features]
        self.dp_dim = sum(g.width for g in layout.dp_groups)
        self._index_cache: dict[int, tuple[Tensor, bool]] = {}
        # Row-wise layouts: every rank sends the same columns; the partials are then a sum over
        # ranks of [B, D] blocks (no scatter), followed by one column permutation if needed.
        per_dest = [cols[sum(self.dest_width[:d]) :][:w] for d, w in enumerate(self.dest_width)]
        self._stacked: Tensor | None = None
        if (
            not self.dp_dim
            and len(per_dest) > 1
            and all(c == per_dest[0] for c in per_dest)
            and sorted(per_dest[0]) == list(range(self._out_dim))
        ):
            self._stacked = torch.argsort(torch.tensor(per_dest[0], device=self.device))
            if per_dest[0] == list(range(self._out_dim)):
                self._stacked = torch.zeros(0, dtype=torch.int64)  # identity
        self.sums_over_ranks = self._stacked is not None

    def assemble(self, mp_recv: Tensor, dp_own: Tensor, prepared: KeyedJaggedTensor) -> Tensor:
        """The ``[B, D]`` pooled output from the exchange's model- and data-parallel parts."""
        batch = prepared.stride()
        if self._stacked is not None:  # the exchange summed the ranks' blocks
            out_B_D = mp_recv.view(batch, self._out_dim)
            if self._stacked.numel():
                out_B_D = out_B_D.index_select(1, self._stacked)
            return self._mean_pool(out_B_D, prepared)
        src = mp_recv if not self.dp_dim else torch.cat([mp_recv, dp_own.reshape(-1)])
        index, bijective = self._output_index(batch)
        # One pass from the received buffer to [B, D]: a gather when every output column has
        # one source, else a scatter-add (row shards' partials of one feature add up).
        if bijective:
            out_B_D = src.index_select(0, index).view(batch, self._out_dim)
        else:
            out_B_D = src.new_zeros(batch * self._out_dim).index_add(0, index, src)
            out_B_D = out_B_D.view(batch, self._out_dim)
        return self._mean_pool(out_B_D, prepared)

    def _mean_pool(self, out_B_D: Tensor, prepared: KeyedJaggedTensor) -> Tensor:
        """Divide mean-pooled features by their full bag lengths (shards pool with SUM)."""
        batch = prepared.stride()
        if self._any_mean and batch:
            lengths_B_F = prepared.lengths().view(-1, batch).t()
            ones = torch.ones_like(lengths_B_F)
            div_B_F = torch.where(self._mean_F, lengths_B_F.clamp(min=1), ones)
            out_B_D = out_B_D / div_B_F.index_select(1, self._col_feature).to(out_B_D.dtype)
        return out_B_D

    def _output_index(self, batch: int) -> tuple[Tensor, bool]:
        """The gather (or scatter) index between the received buffer and the output, per batch
        size: the buffer holds, per source rank, its ``[B, width]`` block, then the DP rows."""
        cached = self._index_cache.get(batch)
        if cached is not None:
            return cached
        widths = [w for w in self.dest_width] + [self.dp_dim]
        block_start, block_width, col_in_block = [], [], []
        before = 0
        for w in widths:
            block_start += [before] * w
            block_width += [w] * w
            col_in_block += list(range(w))
            before += w
        t = torch.tensor([block_start, block_width, col_in_block], device=self.device)
        b_B_1 = torch.arange(batch, device=self.device).unsqueeze(1)
        source_B_C = batch * t[0] + b_B_1 * t[1] + t[2]
        target_B_C = b_B_1 * self._out_dim + self._colmap
        if self._bijective:
            index = torch.empty(batch * self._out_dim, dtype=torch.int64, device=self.device)
            index[target_B_C.reshape(-1)] = source_B_C.reshape(-1)
        else:
            index = torch.empty_like(source_B_C.reshape(-1))
            index[source_B_C.reshape(-1)] = target_B_C.reshape(-1)
        if len(self._index_cache) > 8:  # batch sizes vary: keep the cache small
            self._index_cache.clear()
        self._index_cache[batch] = (index, self._bijective)
        return index, self._bijective
