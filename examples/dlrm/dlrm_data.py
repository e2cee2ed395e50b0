"""The DLRM script's data sources: a small registry of builders, each returning a BatchIterator.

``[data] source`` names one of `DATA_SOURCES`; adding a source is one builder here (and its
config section in dlrm_config.py). An unknown name is an error that lists the known ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from recopt.data import CriteoClickLog, SyntheticClickLog
from recopt.data.batch import BatchIterator
from recopt.data.criteo import NUM_SPARSE

if TYPE_CHECKING:
    from dlrm_config import TrainingConfig


class DataBuilder(Protocol):
    """(config, rank, world size, split "train" / "val") -> this rank's share of the split's
    stream: endless for "train" where the source allows it, ``data.val_batches`` batches for
    "val"; or None when the source has no data for the split (Criteo without validation
    files). ``clock``: the global batches trained so far (a drifting source's validation
    follows it; others ignore it)."""

    def __call__(
        self, config: TrainingConfig, rank: int, world_size: int, split: str, *, clock: int = 0
    ) -> BatchIterator | None: ...


def feature_sizes(config: TrainingConfig) -> list[tuple[str, int]]:
    """(feature, rows of its table) in table order: the KJT keys the data must produce."""
    return [(f, t.num_embeddings) for t in config.embedding.tables for f in t.feature_names]


def raw_id_features(config: TrainingConfig) -> list[str]:
    """The features of id-mapped tables: they get raw ids, not ids folded into their table."""
    return [f for t in config.embedding.tables if t.id_map is not None for f in t.feature_names]


def check_criteo_features(features: list[tuple[str, int]]) -> None:
    """Criteo needs one feature (and table) per categorical column: say which config has them.

    Raises:
        ValueError: naming the count, the 26-table config and how to use it.
    """
    if len(features) != NUM_SPARSE:
        raise ValueError(
            f"data.source is 'criteo', whose files have {NUM_SPARSE} categorical columns, but "
            f"the config's embedding.tables look up {len(features)} features; start from the "
            "26-table config: --config configs/dlrm_criteo_shape.toml (26 tables of 100k "
            "rows, dim 64: about 650 MB a checkpoint), or give one feature per column in "
            "embedding.tables"
        )


def synthetic_source(
    config: TrainingConfig, rank: int, world_size: int, split: str, *, clock: int = 0
) -> BatchIterator:
    """Generated click logs (`SyntheticClickLog`, ``[data.synthetic]``). Under a drifting id
    space, the validation batches see the popular ids of training's ``clock``."""
    data = config.data
    return SyntheticClickLog(
        feature_sizes(config),
        data.synthetic,
        data.batch_size,
        rank=rank,
        world_size=world_size,
        split=split,
        num_batches=None if split == "train" else data.val_batches,
        raw_features=raw_id_features(config),
        drift_clock=None if split == "train" else clock,
    )


def criteo_source(
    config: TrainingConfig, rank: int, world_size: int, split: str, *, clock: int = 0
) -> BatchIterator | None:
    """Criteo TSV files (`CriteoClickLog`, ``[data.criteo]``); None for a split without files.
    Id-mapped tables get the raw 32-bit values (salted per column), the others hashed ids."""
    data = config.data
    features = feature_sizes(config)
    check_criteo_features(features)
    paths = data.criteo.train_paths if split == "train" else data.criteo.val_paths
    if not paths:
        return None
    return CriteoClickLog(
        paths,
        [name for name, _ in features],
        [rows for _, rows in features],
        data.batch_size,
        rank=rank,
        world_size=world_size,
        epochs=config.training.epochs if split == "train" else 1,
        raw_ids=[name in raw_id_features(config) for name, _ in features],
    )


DATA_SOURCES: dict[str, DataBuilder] = {
    "synthetic": synthetic_source,
    "criteo": criteo_source,
}


def data_source(name: str) -> DataBuilder:
    """The builder of the source ``name``.

    Raises:
        ValueError: ``name`` is no source; the message lists the known ones.
    """
    builder = DATA_SOURCES.get(name)
    if builder is None:
        raise ValueError(f"data.source {name!r} is unknown; known sources: {sorted(DATA_SOURCES)}")
    return builder
