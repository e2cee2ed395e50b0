"""The DLRM script's data sources: a registry of builders returning `BatchIterator`s.

Each source builds this rank's stream from the config; an unknown source is an error listing
the known ones (it used to build a Criteo reader without paths); a source without validation
data gives None instead of the caller testing the source's name.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from recopt.data import CriteoClickLog, SyntheticClickLog

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "dlrm"))

import dlrm_build  # noqa: E402
import dlrm_config  # noqa: E402
import dlrm_data  # noqa: E402


def test_an_unknown_source_lists_the_known_ones() -> None:
    message = r"data.source 'parquet' is unknown; known sources: \['criteo', 'synthetic'\]"
    with pytest.raises(ValueError, match=message):
        dlrm_config.load_config(None, ["data.source=parquet"])
    with pytest.raises(ValueError, match=message):  # the builders' own lookup too
        dlrm_data.data_source("parquet")


def test_every_source_is_a_builder_of_batch_iterators(tmp_path: pathlib.Path) -> None:
    assert set(dlrm_data.DATA_SOURCES) == {"synthetic", "criteo"}
    env = dlrm_build.RunEnv(rank=1, world_size=2)
    config = dlrm_config.load_config(None, ["data.val_batches=2"])
    train = dlrm_build.build_data(config, env, "train")
    val = dlrm_build.build_data(config, env, "val")
    assert isinstance(train, SyntheticClickLog) and isinstance(val, SyntheticClickLog)
    assert len(list(val)) == 2
    batch = next(train)
    assert batch.sparse.keys() == [f for f, _ in dlrm_data.feature_sizes(config)]

    row = "\t".join(["1", *["0"] * 13, *["0a"] * 26])
    path = tmp_path / "day_0.tsv"
    path.write_text("\n".join([row] * 8) + "\n")
    criteo = dlrm_config.load_config(
        str(ROOT / "configs/dlrm_criteo_shape.toml"),
        [f'data.criteo.train_paths=["{path}"]', "data.source=criteo", "data.batch_size=2"],
    )
    train = dlrm_build.build_data(criteo, env, "train")
    assert isinstance(train, CriteoClickLog)
    assert torch.equal(next(train).labels, torch.ones(2))
    assert dlrm_build.build_data(criteo, env, "val") is None  # no validation files
