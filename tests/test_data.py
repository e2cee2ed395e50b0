"""recopt.data: the synthetic click log and the Criteo TSV reader (parsing, hashing, rank split)."""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest
import torch

from recopt.data import CriteoClickLog, SyntheticClickLog, SyntheticConfig, hash_categorical
from recopt.data.criteo import NUM_SPARSE

FEATURES = [("a", 1000), ("b", 50), ("c", 7)]


def synthetic(**kwargs: object) -> SyntheticClickLog:
    config = SyntheticConfig(min_ids_per_bag=0, max_ids_per_bag=4)
    defaults: dict[str, object] = {"features": FEATURES, "config": config, "batch_size": 64}
    defaults.update(kwargs)
    return SyntheticClickLog(**defaults)  # type: ignore[arg-type]


def same_batch(x: tuple[torch.Tensor, ...], y: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(x, y, strict=True))


def flat(batch: object) -> tuple[torch.Tensor, ...]:
    dense, sparse, labels, _ = batch  # type: ignore[misc]
    return dense, sparse.values(), sparse.lengths(), labels


# ------------------------------------------------------------------------ synthetic


def test_synthetic_batch_layout_and_ranges() -> None:
    batch = next(synthetic())
    assert batch.dense.shape == (64, 13) and batch.dense.dtype == torch.float32
    assert batch.labels.shape == (64,) and set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    assert batch.sparse.keys() == ["a", "b", "c"] and batch.sparse.stride() == 64
    lengths = batch.sparse.lengths()
    assert lengths.min() >= 0 and lengths.max() <= 4 and lengths.float().std() > 0
    for (_, rows), jt in zip(FEATURES, batch.sparse.to_dict().values(), strict=True):
        assert jt.values().numel() == 0 or (jt.values().min() >= 0 and jt.values().max() < rows)
    assert batch.position == 1


def test_synthetic_is_deterministic_by_seed_and_split() -> None:
    assert same_batch(flat(next(synthetic())), flat(next(synthetic())))
    other_seed = synthetic(config=SyntheticConfig(max_ids_per_bag=4, seed=1))
    assert not torch.equal(next(other_seed).dense, next(synthetic()).dense)
    assert not torch.equal(next(synthetic(split="val")).dense, next(synthetic()).dense)


def test_ranks_take_disjoint_interleaved_shares_of_one_stream() -> None:
    single = synthetic()
    stream = [flat(next(single)) for _ in range(6)]
    ranks = [synthetic(rank=r, world_size=3) for r in range(3)]
    for step in range(2):
        for r, it in enumerate(ranks):
            assert same_batch(flat(next(it)), stream[step * 3 + r])


def test_synthetic_resumes_exactly_and_checks_batch_size() -> None:
    first = synthetic(rank=1, world_size=2)
    for _ in range(3):
        next(first)
    state = first.state_dict()
    expected = flat(next(first))
    resumed = synthetic(rank=1, world_size=2)
    resumed.load_state_dict(state)
    batch = next(resumed)
    assert same_batch(flat(batch), expected) and batch.position == 4
    with pytest.raises(ValueError, match="data.batch_size 64, this run has 32"):
        synthetic(batch_size=32).load_state_dict(state)


def _resumed_stream(make: object, sizes: tuple[int, int], steps: tuple[int, int]) -> list[object]:
    """What N ranks yield for steps[0] steps, then M ranks resumed from rank 0's state, in
    (step, rank) order: the order an uninterrupted single stream would hold them in."""
    before, after = sizes
    ranks = [make(rank=r, world_size=before) for r in range(before)]  # type: ignore[operator]
    seen = [next(it) for _ in range(steps[0]) for it in ranks]
    state = ranks[0].state_dict()
    resumed = [make(rank=r, world_size=after) for r in range(after)]  # type: ignore[operator]
    for it in resumed:
        it.load_state_dict(state)
    seen += [next(it) for _ in range(steps[1]) for it in resumed]
    return seen


@pytest.mark.parametrize("sizes", [(1, 2), (2, 3), (3, 1)])
def test_synthetic_resumes_at_another_world_size_without_repeat_or_skip(
    sizes: tuple[int, int],
) -> None:
    seen = _resumed_stream(synthetic, sizes, (3, 2))
    single = synthetic()
    stream = [flat(next(single)) for _ in range(len(seen))]
    assert len(seen) == 3 * sizes[0] + 2 * sizes[1]
    for got, want in zip(seen, stream, strict=True):
        assert same_batch(flat(got), want)  # the same batches, in the same order


def test_synthetic_ids_follow_a_power_law() -> None:
    it = SyntheticClickLog([("a", 10_000)], SyntheticConfig(zipf_exponent=1.1), 4096)
    ids = torch.cat([next(it).sparse.values() for _ in range(5)])
    counts = torch.bincount(ids, minlength=10_000).float()
    assert counts[0] > counts[1] > counts[10] > counts[1000]
    # The hottest 1% of ids carry most of the lookups; the tail is still reached.
    assert counts[:100].sum() / counts.sum() > 0.5
    assert (counts[5000:] > 0).sum() > 100


def test_synthetic_labels_carry_a_planted_signal() -> None:
    it = SyntheticClickLog([("a", 100), ("b", 100)], SyntheticConfig(), 8192)
    batch = next(it)
    ctr = batch.labels.mean().item()
    assert 0.1 < ctr < 0.5
    # The hidden model reads the first dense columns: their click rates differ by half.
    high = batch.dense[:, 0] > batch.dense[:, 0].median()
    rates = batch.labels[high].mean().item(), batch.labels[~high].mean().item()
    assert abs(rates[0] - rates[1]) > 0.03


def test_synthetic_finite_stream_and_bad_arguments() -> None:
    assert len(list(synthetic(num_batches=3))) == 3
    with pytest.raises(ValueError, match="rank 2"):
        synthetic(rank=2, world_size=2)
    with pytest.raises(ValueError, match="split"):
        synthetic(split="test")
    with pytest.raises(ValueError, match="max_ids_per_bag"):
        SyntheticConfig(min_ids_per_bag=3, max_ids_per_bag=2)


# ------------------------------------------------------------------------ criteo


def criteo_line(i: int, missing: bool = False) -> str:
    """Line i: label i % 2, first dense column = i (so the test can tell lines apart)."""
    dense = [str(i), "-3", ""] + [str(i * k) for k in range(10)]
    cats = [format(0x1000 + i * 31 + c, "08x") for c in range(NUM_SPARSE)]
    if missing:
        cats[2] = ""
    return "\t".join([str(i % 2), *dense, *cats]) + "\n"


def write_criteo(path: pathlib.Path, lines: range, missing_every: int = 5) -> pathlib.Path:
    path.write_text("".join(criteo_line(i, i % missing_every == 0) for i in lines))
    return path


def criteo(paths: list[pathlib.Path], **kwargs: object) -> CriteoClickLog:
    names = [f"cat_{c}" for c in range(NUM_SPARSE)]
    sizes = [1000] * NUM_SPARSE
    return CriteoClickLog(paths, names, sizes, **kwargs)  # type: ignore[arg-type]


def line_ids(batch: object) -> list[int]:
    return [round(math.expm1(x)) for x in batch.dense[:, 0].tolist()]  # type: ignore[attr-defined]


def test_criteo_parses_dense_labels_and_missing_values(tmp_path: pathlib.Path) -> None:
    path = write_criteo(tmp_path / "day.tsv", range(8))
    batch = next(criteo([path], batch_size=8))
    assert batch.labels.tolist() == [float(i % 2) for i in range(8)]
    row = 3
    expected = [math.log1p(row), 0.0, 0.0] + [math.log1p(row * k) for k in range(10)]
    assert batch.dense[row].tolist() == pytest.approx(expected)  # -3 -> 0, "" -> 0
    ids = batch.sparse["cat_2"].values()
    assert ids[0] == 0 and ids[5] == 0  # lines 0 and 5 miss cat_2: the reserved id 0
    assert (batch.sparse.values() < 1000).all() and batch.sparse.lengths().eq(1).all()


def test_criteo_hashing_is_stable_and_salted_per_column(tmp_path: pathlib.Path) -> None:
    values = np.array([0x68FD1E64, 0x80E26C9B, 0], dtype=np.uint64)
    # Fixed numbers: a checkpoint trained on one machine must see the same ids on another.
    assert hash_categorical(values, 0, 1000).tolist() == [82, 517, 584]
    assert hash_categorical(values[:1], 5, 1000).tolist() == [179]
    ids = hash_categorical(np.arange(100_000, dtype=np.uint64), 3, 50)
    assert ids.min() == 1 and ids.max() == 49  # 0 stays reserved for missing
    assert np.bincount(ids)[1:].min() > 100_000 / 49 * 0.8  # spread evenly
    path = write_criteo(tmp_path / "day.tsv", range(4), missing_every=100)
    batch = next(criteo([path], batch_size=4))
    token = int(criteo_line(1).split("\t")[14 + 4], 16)
    assert (
        batch.sparse["cat_4"].values()[1]
        == hash_categorical(np.array([token], dtype=np.uint64), 4, 1000)[0]
    )


def test_criteo_ranks_split_lines_and_stay_in_lockstep(tmp_path: pathlib.Path) -> None:
    path = write_criteo(tmp_path / "day.tsv", range(23))
    per_rank = [
        [line_ids(b) for b in criteo([path], batch_size=3, rank=r, world_size=2)] for r in (0, 1)
    ]
    assert per_rank[0] == [[0, 2, 4], [6, 8, 10], [12, 14, 16]]
    assert per_rank[1] == [
        [1, 3, 5],
        [7, 9, 11],
        [13, 15, 17],
    ]  # same count: window 18..23 is partial
    tail = [
        line_ids(b) for b in criteo([path], batch_size=3, rank=1, world_size=2, drop_last=False)
    ]
    assert tail[-1] == [19, 21]


def test_criteo_reads_files_in_sequence_and_resumes(tmp_path: pathlib.Path) -> None:
    paths = [
        write_criteo(tmp_path / "a.tsv", range(5)),
        write_criteo(tmp_path / "b.tsv", range(5, 12)),
    ]
    reader = criteo(paths, batch_size=4)
    assert line_ids(next(reader)) == [0, 1, 2, 3]
    state = reader.state_dict()
    expected = [line_ids(b) for b in reader]
    assert expected == [[4, 5, 6, 7], [8, 9, 10, 11]]
    resumed = criteo(paths, batch_size=4)
    resumed.load_state_dict(state)
    assert [line_ids(b) for b in resumed] == expected


@pytest.mark.parametrize("sizes", [(1, 2), (2, 3), (3, 2)])
def test_criteo_resumes_at_another_world_size_without_repeat_or_skip(
    tmp_path: pathlib.Path, sizes: tuple[int, int]
) -> None:
    paths = [
        write_criteo(tmp_path / "a.tsv", range(7)),
        write_criteo(tmp_path / "b.tsv", range(7, 40)),
    ]

    def make(**kw: object) -> CriteoClickLog:
        return criteo(paths, batch_size=2, **kw)

    seen = _resumed_stream(make, sizes, (2, 3))
    lines = sorted(i for b in seen for i in line_ids(b))
    total = 2 * 2 * sizes[0] + 3 * 2 * sizes[1]
    assert lines == list(range(total))  # every line once: none repeated, none skipped


def test_criteo_malformed_lines_name_file_line_and_column(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.tsv"
    path.write_text(criteo_line(0) + criteo_line(1).replace("\t1\t-3", "\t1\tx7", 1))
    with pytest.raises(ValueError, match=r"bad.tsv:2: column 2 \(integer feature 2\)"):
        next(criteo([path], batch_size=2))
    path.write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match="bad.tsv:1: expected 40"):
        next(criteo([path], batch_size=1))
    with pytest.raises(ValueError, match="too small"):
        CriteoClickLog([path], [f"c{i}" for i in range(26)], [1] * 26, batch_size=1)


def test_criteo_smaller_than_a_batch_or_empty_says_so(tmp_path: pathlib.Path) -> None:
    small = write_criteo(tmp_path / "small.tsv", range(5))
    with pytest.raises(
        ValueError, match=r"holds 5 samples, fewer than one batch of 6 \(batch_size 3 x 2 ranks\)"
    ):
        next(criteo([small], batch_size=3, rank=1, world_size=2))
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty.tsv is empty: there is no sample"):
        next(criteo([empty], batch_size=1))
    with pytest.raises(ValueError, match="epochs must be >= 1, got 0"):
        criteo([small], batch_size=1, epochs=0)


def test_criteo_epochs_pass_over_the_files_again_and_resume(tmp_path: pathlib.Path) -> None:
    paths = [
        write_criteo(tmp_path / "a.tsv", range(3)),
        write_criteo(tmp_path / "b.tsv", range(3, 7)),
    ]
    reader = criteo(paths, batch_size=3, epochs=3)
    first = [line_ids(next(reader)) for _ in range(3)]
    assert first == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]  # line 6 is a partial window: dropped
    assert reader.epoch == 1
    state = reader.state_dict()
    rest = [line_ids(b) for b in reader]
    assert rest == [[3, 4, 5], [0, 1, 2], [3, 4, 5]]
    resumed = criteo(paths, batch_size=3, epochs=3)
    resumed.load_state_dict(state)
    assert [line_ids(b) for b in resumed] == rest


def _with_field(line: str, column: int, token: str) -> str:
    fields = line.rstrip("\n").split("\t")
    fields[column] = token
    return "\t".join(fields) + "\n"


@pytest.mark.parametrize(
    ("column", "token", "message"),
    [
        (1, "99999999999999999999", r"column 1 \(integer feature 1\).*fit in 64 bits"),
        (1, " 12 ", r"column 1 \(integer feature 1\).*decimal digits"),
        (2, "+3", r"column 2 \(integer feature 2\).*decimal digits"),
        (3, "1_000", r"column 3 \(integer feature 3\).*decimal digits"),
        (3, "-", r"column 3 \(integer feature 3\).*decimal digits"),
        (14, "0x1f", r"column 14 \(categorical feature 1\).*no '0x'"),
        (15, " 1f ", r"column 15 \(categorical feature 2\).*no spaces"),
        (16, "1f2a3b4c5", r"column 16 \(categorical feature 3\).*up to 8 hex digits"),
        (0, " 1", r"column 0 \(label\).*0 or 1"),
    ],
)
def test_criteo_rejects_tokens_python_would_accept_with_file_and_line(
    tmp_path: pathlib.Path, column: int, token: str, message: str
) -> None:
    path = tmp_path / "odd.tsv"
    path.write_text(criteo_line(0) + _with_field(criteo_line(1), column, token))
    with pytest.raises(ValueError, match=r"odd.tsv:2: " + message):
        next(criteo([path], batch_size=2))


def test_criteo_short_hex_tokens_still_parse(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "short.tsv"
    path.write_text(_with_field(criteo_line(0), 14, "1f"))
    batch = next(criteo([path], batch_size=1))
    expected = hash_categorical(np.array([0x1F], dtype=np.uint64), 0, 1000)[0]
    assert batch.sparse["cat_0"].values().tolist() == [expected]


def test_criteo_bulk_and_line_by_line_parsers_agree(tmp_path: pathlib.Path) -> None:
    from recopt.data.criteo import _parse_columns_checked, _parse_columns_fast

    lines = [criteo_line(i, i % 3 == 0).rstrip("\n").encode() for i in range(50)]
    rows = [("f", i + 1, line) for i, line in enumerate(lines)]
    for fast, checked in zip(_parse_columns_fast(lines), _parse_columns_checked(rows), strict=True):
        np.testing.assert_array_equal(fast, checked)
    # A short hex token is valid Criteo-like input the bulk path does not take: same ids.
    short = criteo_line(1).replace(format(0x1000 + 31, "08x"), "41f", 1)
    path = tmp_path / "short.tsv"
    path.write_text(short)
    batch = next(criteo([path], batch_size=1))
    expected = hash_categorical(np.array([0x41F], dtype=np.uint64), 0, 1000)[0]
    assert batch.sparse["cat_0"].values().tolist() == [expected]
