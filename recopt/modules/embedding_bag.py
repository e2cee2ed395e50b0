"""EmbeddingBagCollection: the plain torch module, one `nn.EmbeddingBag` per table.

It is the reference the fused and sharded modules are tested against, and the module users build
models with before sharding. Gradients are dense by default or sparse (for SparseAdam).
fp16/bf16 tables (``weight_dtype``) pool in their dtype and return float32 outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from recopt.modules.config import EmbeddingBagConfig, validate_tables
from recopt.modules.id_map_batch import MappedBatch, mean_scale
from recopt.modules.id_map_lookup import IdMaps, prepare_mapped
from recopt.modules.id_map_rows import init_rows
from recopt.modules.inputs import FeatureLayout
from recopt.modules.variable_batch import expand_rows, regular_batch
from recopt.sparse import KeyedJaggedTensor, KeyedTensor


class EmbeddingBagCollection(nn.Module):
    """A collection of embedding tables looked up by the features of a KeyedJaggedTensor.

    Shapes: the input has F features and batch size B; the output is a KeyedTensor whose keys are
    the features in table order and whose values are ``[B, sum of each feature's table dim]``.

    Args:
        tables: the tables (``validate_tables`` rules apply, except that a feature may
            look up several tables: its outputs are then keyed ``feature@table``).
        is_weighted: the input carries one weight per id (weighted sum / mean pooling).
        device: where the weights live; None follows torch's default device (so
            ``with torch.device("meta"):`` builds on meta); ``"meta"`` allocates nothing
            and forward returns meta tensors of the right shapes.
        sparse_grad: produce sparse gradients (for ``torch.optim.SparseAdam``).

    Tables with ``id_map`` take any int64 id (docs/id_map.md): in training a batch's new ids
    get rows (re-initialised; the state of an optimizer outside the module is not reset),
    in eval unknown ids read a zero row. `stats` reports each map's last training batch.

    Example::

        ebc = EmbeddingBagCollection([
            EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"]),
        ])
        kt = ebc(KeyedJaggedTensor.from_id_lists({"f": [[1, 2], [3]]}))
        kt["f"].shape  # torch.Size([2, 4]): bag 0 = row 1 + row 2, bag 1 = row 3
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        sparse_grad: bool = False,
    ) -> None:
        super().__init__()
        validate_tables(tables, allow_shared_features=True)
        self.tables = list(tables)
        self.is_weighted = is_weighted
        self._layout = FeatureLayout(self.tables)
        self.embedding_bags = nn.ModuleDict()
        for table in self.tables:
            bag = nn.EmbeddingBag(
                table.num_embeddings,
                table.embedding_dim,
                mode=table.pooling.value,
                sparse=sparse_grad,
                include_last_offset=True,
                # An explicit (uninitialised) weight skips nn.EmbeddingBag's own normal_ init, so
                # the global RNG draws only our uniform_ below, as FusedEmbeddingBagCollection does.
                _weight=torch.empty(
                    table.num_embeddings,
                    table.embedding_dim,
                    device=device,
                    dtype=table.weight_dtype.dtype,
                ),
            )
            table.init_weight(bag.weight)
            self.embedding_bags[table.name] = bag
        self.id_maps = IdMaps.of(self.tables, device)

    def stats(self) -> dict[str, dict[str, float]]:
        """Per id-mapped table: occupancy, new ids, evictions, admissions of the last step."""
        return {} if self.id_maps is None else self.id_maps.stats()

    @property
    def device(self) -> torch.device:
        """Where the weights live (``meta`` when built there: no memory is allocated)."""
        bag = self.embedding_bags[self.tables[0].name]
        assert isinstance(bag, nn.EmbeddingBag)
        return bag.weight.device

    def feature_names(self) -> list[str]:
        """The features looked up, in table order (repeated when shared by tables)."""
        return list(self._layout.feature_names)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool each feature's bags from its table.

        With a variable batch per feature, each feature's pooled rows are expanded to the full
        batch through the input's ``inverse_indices`` (``[B, D]`` output, B their width);
        without them a variable batch is refused. Given ``inverse_indices`` expand a regular
        batch too (as TorchRec does).

        Raises:
            ValueError: missing features or weights mismatch; ``InvalidIdError`` for bad ids.
        """
        if self.device.type == "meta":
            # Shapes only (build-on-meta, then shard): ids cannot be read, nor need to be.
            pooled_meta = torch.empty(features.stride(), sum(self._layout.dims), device="meta")
            return KeyedTensor(self._layout.output_keys, self._layout.dims, pooled_meta)
        dtype = next((p.dtype for p in self.embedding_bags.parameters()), torch.float32)
        if dtype in (torch.float16, torch.bfloat16):
            dtype = torch.float32  # per-id weights: converted per table in _pool
        features, index_F_B = regular_batch(features, self._layout.feature_names)
        features, mapped = self._prepare(features, dtype)
        batch = features.stride()
        values, offsets = features.values(), features.offsets()
        weights = features.weights_or_none()
        pooled = []
        for f, start in enumerate(features.offset_per_key()[:-1]):
            bag = self.embedding_bags[self._layout.table_names[f]]
            assert isinstance(bag, nn.EmbeddingBag)
            bag_offsets = offsets[f * batch : (f + 1) * batch + 1] - start
            end = start + features.length_per_key()[f]
            pooled.append(
                _pool(
                    values[start:end],
                    bag_offsets,
                    None if weights is None else weights[start:end],
                    bag,
                )
            )
        pooled_B_D = torch.cat(pooled, dim=1)
        if mapped is not None:
            poolings = [self.tables[t].pooling for t in self._layout.feature_table]
            pooled_B_D = mean_scale(pooled_B_D, mapped, self._layout, poolings)
        if index_F_B is not None:
            pooled_B_D = expand_rows(pooled_B_D, self._layout.dims, index_F_B)
        return KeyedTensor(
            keys=self._layout.output_keys, length_per_key=self._layout.dims, values=pooled_B_D
        )

    def _prepare(
        self, features: KeyedJaggedTensor, dtype: torch.dtype
    ) -> tuple[KeyedJaggedTensor, MappedBatch | None]:
        """The checked features; with id maps, remapped to rows (fresh rows re-initialised)."""
        if self.id_maps is None:
            return self._layout.prepare(features, self.is_weighted, dtype), None
        mapped = prepare_mapped(
            self.id_maps, self._layout, features, self.is_weighted, dtype, self.training
        )
        for table in self.tables:
            if table.name in mapped.fresh:
                bag = self.embedding_bags[table.name]
                assert isinstance(bag, nn.EmbeddingBag)
                fresh = mapped.fresh[table.name]
                init_rows(table, bag.weight, fresh, fresh.stats.step)
        return mapped.features, mapped


def _pool(
    ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, bag: nn.EmbeddingBag
) -> torch.Tensor:
    if bag.weight.dtype in (torch.float16, torch.bfloat16):
        # Reduced-precision tables: per-id weights in the table's dtype, output float32 (as the
        # fused kernels return), so tables of different dtypes concatenate.
        weights = None if weights is None else weights.to(bag.weight.dtype)
        return _pool_same_dtype(ids, offsets, weights, bag).float()
    return _pool_same_dtype(ids, offsets, weights, bag)


def _pool_same_dtype(
    ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, bag: nn.EmbeddingBag
) -> torch.Tensor:
    # torch's embedding_bag takes per-id weights only in sum mode; a weighted mean is the
    # weighted sum divided by the bag's id count (as the fused kernels define it).
    if weights is None or bag.mode == "sum":
        return nn.functional.embedding_bag(
            ids,
            bag.weight,
            offsets,
            mode=bag.mode,
            sparse=bag.sparse,
            per_sample_weights=weights,
            include_last_offset=True,
        )
    summed = nn.functional.embedding_bag(
        ids,
        bag.weight,
        offsets,
        mode="sum",
        sparse=bag.sparse,
        per_sample_weights=weights,
        include_last_offset=True,
    )
    counts = (offsets[1:] - offsets[:-1]).clamp(min=1).to(summed.dtype)
    return summed / counts.unsqueeze(1)
