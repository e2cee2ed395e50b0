"""Table configs: `EmbeddingBagConfig` (pooled bags) and `EmbeddingConfig` (unpooled rows).

Both share `BaseEmbeddingConfig`'s fields and checks; a bag config adds how its bags pool.

`validate_tables` checks a whole collection the same way everywhere (modules, sharding): duplicate
table names are errors that name the table; a feature in two tables is one only when asked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from recopt.kernels.config import PoolingType
from recopt.kernels.precision import Precision, parse_precision
from recopt.modules.id_map import IdMapConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class BaseEmbeddingConfig:
    """What every embedding table has: a name, a shape, its features and its initialisation.

    Args:
        name: table name; parameters are named ``embedding_bags.<name>.weight`` in an
            embedding-bag collection, ``embeddings.<name>.weight`` in an embedding collection.
        num_embeddings: number of rows (valid ids are ``0 .. num_embeddings - 1``).
        embedding_dim: row width.
        feature_names: the features that look up this table (at least one).
        weight_init_min: lower bound of the uniform initialisation; default
            ``-sqrt(1 / num_embeddings)``.
        weight_init_max: upper bound; default ``sqrt(1 / num_embeddings)``.
        init_fn: optional function called (under ``torch.no_grad``) on the table's weight
            to initialise it in place, instead of the uniform initialisation (as TorchRec).
        weight_dtype: how the weights are stored: ``"fp32"`` (default), ``"fp16"`` or
            ``"bf16"`` (also ``"float16"``, ``torch.float16``, ...; stored as a `Precision`).
            Reduced-precision tables are updated in fp32 and stochastically rounded back
            (docs/kernels.md, "Reduced precision"); outputs (pooled or not) are fp32 either way.
        id_map: make the table take any int64 id, each distinct id mapped to its own row
            with eviction (`IdMapConfig`, docs/id_map.md); ``None``: ids are row numbers.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...] = field(default_factory=tuple)
    weight_init_min: float | None = None
    weight_init_max: float | None = None
    init_fn: Callable[[torch.Tensor], Any] | None = None
    weight_dtype: Precision = Precision.FP32
    id_map: IdMapConfig | None = None

    def __post_init__(self) -> None:
        # Accept lists (from TOML/JSON) but store tuples so the config stays hashable.
        object.__setattr__(self, "feature_names", tuple(self.feature_names))
        where = f"table {self.name!r}"
        object.__setattr__(
            self, "weight_dtype", parse_precision(self.weight_dtype, f"{where}: weight_dtype")
        )
        if not isinstance(self.name, str) or not self.name or "." in self.name:
            raise ValueError(f"table name {self.name!r} must be a non-empty string without '.'")
        if not isinstance(self.num_embeddings, int) or self.num_embeddings < 1:
            raise ValueError(
                f"{where}: num_embeddings must be an int >= 1, got {self.num_embeddings!r}"
            )
        if not isinstance(self.embedding_dim, int) or self.embedding_dim < 1:
            raise ValueError(
                f"{where}: embedding_dim must be an int >= 1, got {self.embedding_dim!r}"
            )
        if not self.feature_names:
            raise ValueError(f"{where}: feature_names is empty; name at least one feature")
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(
                f"{where}: feature_names repeats a feature: {list(self.feature_names)}"
            )
        if self.id_map is not None and not isinstance(self.id_map, IdMapConfig):
            raise ValueError(
                f"{where}: id_map must be an IdMapConfig, got {self.id_map!r}; e.g. "
                "id_map=IdMapConfig(policy='lru')"
            )
        lo, hi = self.init_bounds()
        if not lo <= hi:
            raise ValueError(f"{where}: weight_init_min {lo} is above weight_init_max {hi}")

    def init_weight(self, weight: torch.Tensor) -> None:
        """Initialises ``weight`` in place: ``init_fn`` if given, else uniform in init_bounds."""
        with torch.no_grad():
            if self.init_fn is not None:
                self.init_fn(weight)
            else:
                weight.uniform_(*self.init_bounds())

    def init_bounds(self) -> tuple[float, float]:
        """The uniform initialisation range of this table's weights."""
        bound = math.sqrt(1.0 / self.num_embeddings)
        lo = -bound if self.weight_init_min is None else self.weight_init_min
        hi = bound if self.weight_init_max is None else self.weight_init_max
        return lo, hi


@dataclass(frozen=True, kw_only=True, slots=True)
class EmbeddingBagConfig(BaseEmbeddingConfig):
    """One embedding table whose features' bags pool to one row per bag.

    Args (besides `BaseEmbeddingConfig`'s):
        pooling: ``sum`` or ``mean`` of the (weighted) rows of a bag.

    Example::

        EmbeddingBagConfig(name="user", num_embeddings=1000, embedding_dim=16,
                           feature_names=["user_id"])
    """

    pooling: PoolingType = PoolingType.SUM

    def __post_init__(self) -> None:
        # Explicit base call: zero-argument super() fails in a slots dataclass.
        BaseEmbeddingConfig.__post_init__(self)
        object.__setattr__(self, "pooling", PoolingType(self.pooling))


@dataclass(frozen=True, kw_only=True, slots=True)
class EmbeddingConfig(BaseEmbeddingConfig):
    """One embedding table looked up without pooling: one row per id (`EmbeddingCollection`).

    Same fields and checks as `BaseEmbeddingConfig`; there is no pooling.

    Example::

        EmbeddingConfig(name="item", num_embeddings=1000, embedding_dim=16,
                        feature_names=["item_history"])
    """

    def as_bag_config(self) -> EmbeddingBagConfig:
        """The same table as a SUM-pooled bag config: the lookup engine's view of it."""
        shared = {f.name: getattr(self, f.name) for f in fields(BaseEmbeddingConfig)}
        return EmbeddingBagConfig(**shared, pooling=PoolingType.SUM)


def validate_tables(
    tables: Sequence[BaseEmbeddingConfig],
    allow_shared_features: bool = False,
    config_type: type[BaseEmbeddingConfig] | None = None,
) -> None:
    """Check a collection of tables: at least one, unique names, each feature in one table.

    ``allow_shared_features`` lets a feature look up several tables: every embedding collection
    (plain, fused and sharded) allows it, naming that feature's outputs ``feature@table``.

    Args:
        tables: the collection's tables.
        allow_shared_features: see above.
        config_type: the config class every table must be (default `EmbeddingBagConfig`;
            `EmbeddingConfig` for the embedding collections).

    Raises:
        ValueError: naming the duplicated table or feature and the tables involved, or a
            table of the wrong config type.
    """
    expected = EmbeddingBagConfig if config_type is None else config_type
    if not tables:
        raise ValueError("an embedding collection needs at least one table")
    for table in tables:
        if not isinstance(table, expected):
            raise ValueError(
                f"expected {expected.__name__} tables, got {type(table).__name__} "
                f"{getattr(table, 'name', table)!r}; build the table as {expected.__name__}"
            )
    seen_tables: set[str] = set()
    owner: dict[str, str] = {}
    for table in tables:
        if table.name in seen_tables:
            raise ValueError(
                f"table {table.name!r} is configured twice; table names must be unique"
            )
        seen_tables.add(table.name)
        for feature in table.feature_names:
            if feature in owner and not allow_shared_features:
                raise ValueError(
                    f"feature {feature!r} is in two tables, {owner[feature]!r} and {table.name!r}; "
                    "pass allow_shared_features=True to let a feature look up several tables "
                    "(as the embedding collections do: its outputs are keyed feature@table)"
                )
            owner[feature] = table.name
