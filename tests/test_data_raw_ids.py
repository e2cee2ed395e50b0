"""Raw ids for id-mapped tables (issue 26): the synthetic log's drifting id space and
Criteo's categoricals passed whole instead of hashed into a table."""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest
import torch
from test_data import criteo, criteo_line, write_criteo

from recopt.data import CriteoClickLog, SyntheticClickLog, SyntheticConfig, raw_categorical
from recopt.data.criteo import NUM_SPARSE
from recopt.data.synthetic import drifting_raw_ids

FEATURES = [("a", 1000), ("b", 50)]
DRIFTING = SyntheticConfig(id_space="drifting", drift_rate=1.0, max_ids_per_bag=3)


def drifting(**kwargs: object) -> SyntheticClickLog:
    options: dict[str, object] = {"raw_features": ["a"], **kwargs}
    config = options.pop("config", DRIFTING)
    return SyntheticClickLog(FEATURES, config, 256, **options)  # type: ignore[arg-type]


def ids(log: SyntheticClickLog, key: str, index: int) -> torch.Tensor:
    return log.generate(index)[1][key].values()


def top_ids(log: SyntheticClickLog, key: str, indices: range, k: int) -> set[int]:
    """The k most frequent ids of ``key`` over the batches ``indices``."""
    values, counts = torch.cat([ids(log, key, i) for i in indices]).unique(return_counts=True)
    return set(values[counts.argsort(descending=True)[:k]].tolist())


# ------------------------------------------------------------------------ synthetic, drifting


def test_drifting_batches_are_a_pure_function_of_the_global_batch() -> None:
    first, again = drifting(), drifting()
    for index in (0, 7, 12345):
        a, b = first.generate(index), again.generate(index)
        assert torch.equal(a[1].values(), b[1].values()) and torch.equal(a[2], b[2])
    # Two ranks take alternate global batches of the one stream.
    stream = drifting()
    expected = [next(stream).sparse.values() for _ in range(4)]
    ranks = [drifting(rank=r, world_size=2) for r in (0, 1)]
    got = [next(ranks[r]).sparse.values() for _ in range(2) for r in (0, 1)]
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_drifting_raw_ids_span_2_to_the_40_and_other_features_fold_them() -> None:
    raw_log, folded_log = drifting(), drifting(raw_features=())
    values = torch.cat([ids(raw_log, "a", i) for i in range(20)])
    assert values.min() >= 0 and values.max() < 2**40
    assert values.max() > 2**39  # spread over the space, not packed into a table's rows
    for index in range(3):
        raw, folded = raw_log.generate(index), folded_log.generate(index)
        assert torch.equal(folded[1]["a"].values(), raw[1]["a"].values() % 1000)
        assert torch.equal(raw[1]["b"].values(), folded[1]["b"].values())
        assert raw[1]["b"].values().max() < 50
        # The labels follow the raw ids whether a feature gets them whole or folded.
        assert torch.equal(raw[2], folded[2])


def test_the_popular_set_drifts_one_rank_per_batch_at_drift_rate_one() -> None:
    ranks = torch.arange(6)
    feature = torch.zeros(6, dtype=torch.int64)
    at = [drifting_raw_ids(ranks, feature, clock, 1.0, 0) for clock in (10, 11)]
    # Every id moved one rank down; a new item became the most popular.
    assert torch.equal(at[1][1:], at[0][:-1]) and at[1][0].item() not in at[0].tolist()
    assert len(set(at[0].tolist())) == 6  # distinct items, distinct raw ids
    half = [drifting_raw_ids(ranks, feature, clock, 0.5, 0) for clock in (10, 11, 12)]
    assert torch.equal(half[0], half[1]) and torch.equal(half[2][1:], half[0][:-1])


def test_drift_is_visible_in_the_hottest_ids_of_the_stream() -> None:
    log = drifting()
    now = top_ids(log, "a", range(0, 20), 20)
    soon = top_ids(log, "a", range(5, 25), 20)
    later = top_ids(log, "a", range(2000, 2020), 20)
    assert len(now & soon) >= 10  # most of the hot set is still hot 5 batches on
    assert not now & later  # 2000 batches on, none of it is
    fixed = SyntheticClickLog(FEATURES, SyntheticConfig(max_ids_per_bag=3), 256)
    assert top_ids(fixed, "a", range(0, 20), 5) == top_ids(fixed, "a", range(2000, 2020), 5)


def test_validation_sees_the_popular_set_of_the_training_clock() -> None:
    train = drifting()
    clock = 3000
    val_now = drifting(split="val", drift_clock=clock)
    val_start = drifting(split="val", drift_clock=0)
    hot_train = top_ids(train, "a", range(clock - 9, clock + 1), 10)  # up to the clock
    hot_val = top_ids(val_now, "a", range(10), 10)
    assert len(hot_train & hot_val) >= 5  # (7 of 10 with these seeds)
    assert not hot_train & top_ids(val_start, "a", range(10), 10)
    # The validation samples are the split's own, whatever the clock.
    assert not torch.equal(val_now.generate(0)[0], train.generate(clock)[0])
    assert torch.equal(val_now.generate(0)[0], val_start.generate(0)[0])


def test_drifting_fixed_mode_is_unchanged_by_the_new_options() -> None:
    plain = SyntheticClickLog(FEATURES, SyntheticConfig(max_ids_per_bag=3), 256)
    with_options = SyntheticClickLog(
        FEATURES, SyntheticConfig(max_ids_per_bag=3), 256, raw_features=["a"], drift_clock=5
    )
    a, b = plain.generate(3), with_options.generate(3)
    assert torch.equal(a[1].values(), b[1].values()) and torch.equal(a[2], b[2])


def test_drifting_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"id_space 'moving' is unknown; use one of"):
        SyntheticConfig(id_space="moving")
    with pytest.raises(ValueError, match=r"drift_rate must be finite and > 0.*got 0.0"):
        SyntheticConfig(id_space="drifting", drift_rate=0.0)
    with pytest.raises(ValueError, match=r"raw_features \['z'\] are not features"):
        drifting(raw_features=["z"])


# ------------------------------------------------------------------------ criteo, raw ids


def test_criteo_raw_columns_keep_the_value_salted_by_column(tmp_path: pathlib.Path) -> None:
    path = write_criteo(tmp_path / "day.tsv", range(8), missing_every=3)
    raw = [c in (2, 4) for c in range(NUM_SPARSE)]
    names = [f"cat_{c}" for c in range(NUM_SPARSE)]
    sizes = [1000] * NUM_SPARSE
    sizes[4] = 1  # the table size of a raw column is not used
    got = next(CriteoClickLog([path], names, sizes, 8, raw_ids=raw)).sparse
    hashed = next(criteo([path], batch_size=8)).sparse
    for c in (2, 4):
        tokens = [criteo_line(i).split("\t")[14 + c] for i in range(8)]
        expected = [(c + 1) * 2**32 + int(t, 16) for t in tokens]
        if c == 2:  # lines 0, 3, 6 miss column 2: the missing id as before
            expected = [0 if i % 3 == 0 else e for i, e in enumerate(expected)]
        assert got[f"cat_{c}"].values().tolist() == expected
    for c in (0, 3, 25):  # the other columns are hashed as before
        assert torch.equal(got[f"cat_{c}"].values(), hashed[f"cat_{c}"].values())


def test_raw_categorical_never_collides_across_columns_or_with_missing() -> None:
    values = np.array([0, 1, 0xFFFFFFFF], dtype=np.uint64)
    columns = [raw_categorical(values, c) for c in range(NUM_SPARSE)]
    every = np.concatenate(columns)
    assert len(set(every.tolist())) == every.size and every.min() > 0
    assert every.max() < 2**37 and math.isclose(columns[0][2], 2**33 - 1)


def test_criteo_raw_ids_must_name_every_column(tmp_path: pathlib.Path) -> None:
    path = write_criteo(tmp_path / "day.tsv", range(4))
    with pytest.raises(ValueError, match=r"raw_ids has 3 entries; give one per .* \(26\)"):
        criteo([path], batch_size=2, raw_ids=[True] * 3)
