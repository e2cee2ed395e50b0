"""The native id-map remap (recopt/modules/id_map_native.py) against the torch path, step by step.

Both paths see the same long random streams (power-law ids over a drifting space, batches of
varying size, empty ones included) and must give the same rows, fresh rows, fresh ids and
stats, and leave every buffer equal, after every step; reads (eval) must agree too.
"""

from __future__ import annotations

import copy
import ctypes
import pickle
from collections.abc import Iterator

import pytest
import torch

from recopt.kernels import cpu_id_map, native_build
from recopt.modules import IdMapConfig
from recopt.modules.id_map import IdMap, Remapped
from recopt.modules.id_map_native import remap_tables
from recopt.modules.id_map_rows import hash_uniform, hash_uniform_torch

pytestmark = pytest.mark.skipif(not cpu_id_map.available(), reason="no C compiler")

CONFIGS = {
    "lru": IdMapConfig(policy="lru"),
    "lfu": IdMapConfig(policy="lfu"),
    "lfu_no_decay": IdMapConfig(policy="lfu", decay=1.0),
    "lfu_decay_half": IdMapConfig(policy="lfu", decay=0.5),
    "lru_ttl": IdMapConfig(policy="lru", ttl_steps=3),
    "lfu_ttl": IdMapConfig(policy="lfu", decay=0.9, ttl_steps=5),
    "lru_admit": IdMapConfig(policy="lru", admit_after=2),
    "lru_admit_overflow": IdMapConfig(policy="lru", admit_after=3, candidate_slots=4),
    "lfu_all": IdMapConfig(policy="lfu", decay=0.95, ttl_steps=6, admit_after=2, candidate_slots=9),
}


@pytest.fixture(autouse=True)
def lfu_buckets() -> Iterator[None]:
    """lfu's rows in buckets by key in every native map here, as large maps keep them (the
    other way, every row's key read: tests/test_id_map_lfu.py runs both)."""
    library = cpu_id_map.library()  # (a test below hides it: put the value back through it)
    was = library.rim_set_lfu_buckets_min_rows(0)
    yield
    library.rim_set_lfu_buckets_min_rows(was)


def _pair(config: IdMapConfig, rows: int) -> tuple[IdMap, IdMap]:
    native, reference = IdMap(config, rows), IdMap(config, rows)
    reference.native = False
    return native, reference


def _batch(gen: torch.Generator, step: int, rows: int) -> torch.Tensor:
    """Power-law ids over 3x the rows, drifting by rows/20 a step, scattered over int64; every
    40 steps, 10 steps of at most 2 ids (rows expire), and every 17th batch empty."""
    most = 2 if step % 40 >= 30 else 3 * rows + 2
    size = int(torch.randint(0, most + 1, (1,), generator=gen)) if step % 17 else 0
    rank = (torch.rand(size, generator=gen) ** 3 * 3 * rows).long() + step * max(rows // 20, 1)
    return rank * 0x9E3779B97F4A7C15 - 5  # wraps: any int64, negatives too


def _assert_same(a: Remapped, b: Remapped, a_map: IdMap, b_map: IdMap, where: str) -> None:
    assert torch.equal(a.rows_M, b.rows_M), where
    assert torch.equal(a.fresh_rows, b.fresh_rows), where
    assert torch.equal(a.fresh_ids, b.fresh_ids), where
    assert a.stats == b.stats and a_map.last_stats == b_map.last_stats, where
    b_state = b_map.state_dict()
    for key, value in a_map.state_dict().items():
        assert value.dtype == b_state[key].dtype, (where, key)
        assert torch.equal(value, b_state[key]), (where, key)


def _run(config: IdMapConfig, rows: int, steps: int, seed: int) -> dict[str, int]:
    native, reference = _pair(config, rows)
    gen = torch.Generator().manual_seed(seed)
    totals = {"evictions": 0, "expired": 0, "admissions": 0, "zero_row_ids": 0}
    for step in range(steps):
        ids = _batch(gen, step, rows)
        a, b = native.remap(ids, True), reference.remap(ids, True)
        _assert_same(a, b, native, reference, f"step {step}")
        for key in totals:
            totals[key] += getattr(a.stats, key)
        if step % 5 == 0:  # reads: the next batch's ids, known and unknown
            probe = _batch(gen, step + 1, rows)
            assert torch.equal(
                native.remap(probe, False).rows_M, reference.remap(probe, False).rows_M
            )
    assert native._native_map is not None and reference._native_map is None
    return totals


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("rows", [1, 7, 64, 2000])
def test_native_equals_torch_after_every_step(name: str, rows: int) -> None:
    steps = 60 if rows == 2000 else 150
    totals = _run(CONFIGS[name], rows, steps, seed=rows)
    assert totals["evictions"] > 0  # the streams overflow the table: eviction is exercised
    config = CONFIGS[name]
    if config.ttl_steps is not None and rows > 1:
        assert totals["expired"] > 0
    if config.admit_after is not None:
        assert totals["admissions"] > 0 and totals["zero_row_ids"] > 0


def test_native_cache_follows_state_loaded_and_undone() -> None:
    """A state_dict load, an undo and a copy between steps: the native cache is rebuilt."""
    config = CONFIGS["lfu_all"]
    native, reference = _pair(config, 50)
    other = IdMap(config, 50)
    gen = torch.Generator().manual_seed(9)
    for step in range(80):
        ids = _batch(gen, step, 50)
        if step == 30:  # both load another map's state
            for _ in range(5):
                other.remap(_batch(gen, step, 50), True)
            native.load_state_dict(other.state_dict())
            reference.load_state_dict(other.state_dict())
        if step == 50:  # native takes an undone step
            undo = native.remap(_batch(gen, step, 50), True, record_undo=True).undo
            assert undo is not None and undo.rows.numel() > 0
            native.apply_undo(undo)
        if step == 60:  # a deep copy continues on its own cache
            native = copy.deepcopy(native)
        _assert_same(
            native.remap(ids, True), reference.remap(ids, True), native, reference, str(step)
        )


def test_switching_paths_mid_stream_agrees() -> None:
    """Native steps then torch steps on one map (the torch index must not go stale)."""
    native, reference = _pair(CONFIGS["lru_admit_overflow"], 20)
    gen = torch.Generator().manual_seed(4)
    for step in range(60):
        native.native = (step // 7) % 2 == 0
        ids = _batch(gen, step, 20)
        _assert_same(
            native.remap(ids, True), reference.remap(ids, True), native, reference, str(step)
        )


def test_without_compiler_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = native_build.LazyLibrary("native id map", cpu_id_map._build)
    monkeypatch.setattr(cpu_id_map, "_native", fresh)
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    assert not cpu_id_map.available()
    idmap = IdMap(CONFIGS["lru"], 4)
    assert idmap.remap(torch.tensor([5, 6, 5]), True).rows_M.tolist() == [0, 1, 0]
    assert idmap._native_map is None  # the torch ops ran


def test_one_call_for_all_tables_equals_each_torch_map() -> None:
    """`remap_tables`: every native map stepped in one call (over threads), lru and lfu (a
    2,000-row lfu map: its victims through the sampled pivot) alike."""
    names = ["lru", "lru_ttl", "lru_admit_overflow", "lfu_all", "lru_small", "lfu"]
    configs = {**CONFIGS, "lru_small": CONFIGS["lru"]}
    sizes = {"lru": 300, "lru_ttl": 64, "lru_admit_overflow": 40, "lfu_all": 50, "lru_small": 1}
    sizes["lfu"] = 2000
    pairs = {name: _pair(configs[name], sizes[name]) for name in names}
    gen = torch.Generator().manual_seed(11)
    for step in range(80):
        ids = {name: _batch(gen, step, sizes[name]) for name in names}
        natives = remap_tables({n: pairs[n][0] for n in names}, ids, training=True)
        assert list(natives) == names
        for name in names:
            native, reference = pairs[name]
            expected = reference.remap(ids[name], True)
            _assert_same(natives[name], expected, native, reference, f"{name} step {step}")


@pytest.mark.parametrize("dim", [1, 5, 64])
def test_native_hash_uniform_equals_torch(dim: int) -> None:
    ids = torch.cat(
        [
            torch.randint(-(2**63), 2**63 - 1, (300,), generator=torch.Generator().manual_seed(2)),
            torch.tensor([0, -1, 2**63 - 1, -(2**63)]),
        ]
    )
    for step in (0, 7, 2**40):
        assert torch.equal(hash_uniform(ids, step, dim), hash_uniform_torch(ids, step, dim))
    assert hash_uniform(ids[:0], 3, dim).shape == (0, dim)


def test_native_fill_uniform_equals_init_rows_torch_ops() -> None:
    """`init_rows`'s native path writes the values the torch ops write, views included."""
    gen = torch.Generator().manual_seed(8)
    base = torch.zeros(40, 24)
    weight = base[:, 4:20]  # a view: row stride 24, 16 columns
    rows = torch.randperm(40, generator=gen)[:25]
    ids = torch.randint(-(2**62), 2**62, (25,), generator=gen)
    lo, hi = -0.37, 0.11
    version = weight._version
    assert cpu_id_map.fill_uniform(weight, rows, ids, 123, lo, hi)
    assert weight._version > version
    expected = torch.zeros(40, 24)
    expected[rows, 4:20] = (lo + (hi - lo) * hash_uniform_torch(ids, 123, 16)).float()
    assert torch.equal(base, expected)
    assert not cpu_id_map.fill_uniform(weight.double(), rows, ids, 1, lo, hi)  # torch ops then


def test_writes_unseen_by_version_counters_are_announced_by_buffers_changed() -> None:
    """A raw write (as a collective's receive) keeps the version counters: after
    `buffers_changed` both paths read the new state."""
    config = CONFIGS["lru_ttl"]
    native, reference = _pair(config, 30)
    other = IdMap(config, 30)
    gen = torch.Generator().manual_seed(12)
    for step in range(40):
        ids = _batch(gen, step, 30)
        if step == 20:
            other.load_state_dict(reference.state_dict())
            for _ in range(4):
                other.remap(_batch(gen, step, 30), True)
            for idmap in (native, reference):
                for name, value in other.state_dict().items():
                    target = idmap.get_buffer(name)
                    versions = target._version
                    ctypes.memmove(target.data_ptr(), value.data_ptr(), value.nbytes)
                    assert target._version == versions  # unseen by the counters
                idmap.buffers_changed()
        _assert_same(
            native.remap(ids, True), reference.remap(ids, True), native, reference, str(step)
        )


@pytest.mark.parametrize("layout", ["own tensors", "one storage", "rows cut"])
def test_device_reset_hashes_all_tables_at_once_like_init_rows_one_by_one(layout: str) -> None:
    """The reset of tables on a device (`_reset_hashed`: one hash per width for all tables,
    per-id steps and bounds, or the values made ahead) writes what `init_rows` +
    `reset_state_rows` write per table; whether each table has its own tensors, or the
    tables are views of one weight and one state storage (fbgemm's layout: written with one
    index each, `write_rows`), or views that do not start at a whole row of it (one by one)."""
    from recopt.modules import EmbeddingBagConfig
    from recopt.modules.id_map_results import RemapStats
    from recopt.modules.id_map_rows import (
        FreshTable,
        ResetTarget,
        _reset_hashed,
        init_rows,
        reset_state_rows,
    )

    gen = torch.Generator().manual_seed(3)
    specs = [(12, 8, 5, (-0.5, 0.25)), (12, 16, 9, (-0.1, 0.1)), (30, 8, 7, (0.0, 1.0))]
    pad = 1 if layout == "rows cut" else 0  # an element before each table: rows cut apart
    flat_weight = torch.randn(sum(pad + r * d for r, d, _, _ in specs), generator=gen)
    flat_state = torch.rand(sum(r for r, _, _, _ in specs), generator=gen)
    at = [0, 0]
    made, expected = [], []
    for i, (rows, dim, step, bounds) in enumerate(specs):
        table = EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"],
            weight_init_min=bounds[0], weight_init_max=bounds[1],
        )  # fmt: skip
        fresh_rows = torch.randperm(rows, generator=gen)[: rows // 2]
        fresh_ids = torch.randint(-(2**62), 2**62, (fresh_rows.numel(),), generator=gen)
        fresh = Remapped(fresh_rows, fresh_rows, fresh_ids, RemapStats(step=step))
        if i == 1:  # values made ahead (a pipeline's worker), then copied to the device
            (fresh.fresh_values,) = cpu_id_map.fill_values([fresh_ids], [step], [dim], [bounds], 1)
        weight, state = torch.randn(rows, dim, generator=gen), torch.rand(rows, generator=gen)
        if layout != "own tensors":
            start = at[0] + pad
            weight = flat_weight[start : start + rows * dim].view(rows, dim)
            state = flat_state[at[1] : at[1] + rows]
            at[0], at[1] = start + rows * dim, at[1] + rows
        want_weight, want_state = weight.clone(), state.clone()
        init_rows(table, want_weight, fresh, step)
        reset_state_rows("row_wise_adagrad", {"momentum1": want_state}, fresh_rows)
        target = ResetTarget.of(table, "row_wise_adagrad", weight, {"momentum1": state})
        made.append(FreshTable(target, fresh))
        expected.append((want_weight, want_state))
    _reset_hashed(made)
    for t, (want_weight, want_state) in zip(made, expected, strict=True):
        assert torch.equal(t.target.weight, want_weight), t.target.table.name
        assert torch.equal(t.target.states["momentum1"], want_state), t.target.table.name


def test_a_map_kept_on_the_host_stays_there_through_module_moves() -> None:
    """A CUDA table's map lives on the host (`on_host`): `.to()`, `.half()` and the like
    leave its buffers (device and dtype) alone; other maps move as modules do."""
    kept, moved = IdMap(CONFIGS["lfu"], 8), IdMap(CONFIGS["lfu"], 8)
    kept.on_host = True
    kept.remap(torch.tensor([5, 7, 5]), True)
    before = {name: b.clone() for name, b in kept.named_buffers()}
    for module in (kept, moved):
        module.half()
        module.to("meta")
    assert all(torch.equal(b, before[name]) for name, b in kept.named_buffers())
    assert moved.buffer("frequency").device.type == "meta"


def test_the_zero_row_check_trusts_what_the_host_read() -> None:
    """Rows moved to a device carry ``zero_row`` (read on the host before they left), which
    `apply_rows`' check takes instead of reading the device; without it the rows are read."""
    from recopt.modules.id_map_batch import _any_zero_row
    from recopt.modules.id_map_results import results_to

    empty = torch.empty(0, dtype=torch.int64)
    with_zero = Remapped(torch.tensor([3, -1]), empty, empty)
    without = Remapped(torch.tensor([3, 4]), empty, empty)
    assert _any_zero_row({"a": with_zero, "b": without})
    assert not _any_zero_row({"b": without})
    assert results_to({"a": with_zero}, torch.device("cpu"))["a"] is with_zero  # no move
    with_zero.zero_row, without.zero_row = False, False  # as a host read would have said
    assert not _any_zero_row({"a": with_zero, "b": without})
    without.zero_row = None  # one unknown: the rows are read (and hold a -1)
    assert _any_zero_row({"a": with_zero, "b": without})


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_native_zero_row_drop_equals_the_torch_ops(weighted: bool) -> None:
    """`cpu_id_map.drop_zero_rows` against `apply_rows`' torch ops, on random batches: keys
    mapped or not, empty bags, bags of the zero row only, weights or none."""
    from types import SimpleNamespace
    from typing import Any

    from recopt.modules.id_map_batch import _row_pieces, drop_zero_rows
    from recopt.sparse import KeyedJaggedTensor

    generator = torch.Generator().manual_seed(3)
    for trial in range(30):
        keys, stride = 1 + trial % 4, 1 + trial % 5
        lengths = torch.randint(0, 4, (keys * stride,), generator=generator)
        total = int(lengths.sum())
        rows = torch.randint(-1, 5, (total,), generator=generator)  # about a sixth: zero row
        weights = torch.rand(total, generator=generator) if weighted else None
        names = [f"f{k}" for k in range(keys)]
        features = KeyedJaggedTensor(names, rows, weights=weights, lengths=lengths)
        tables = [f"t{k}" if (trial + k) % 3 else "plain" for k in range(keys)]
        layout: Any = SimpleNamespace(table_names=tables)
        per_table = {
            name: Remapped(
                torch.cat(
                    [
                        p
                        for p, t in zip(rows.split(features.length_per_key()), tables, strict=True)
                        if t == name
                    ]
                ),
                torch.zeros(0, dtype=torch.int64),
                torch.zeros(0, dtype=torch.int64),
            )  # fmt: skip
            for name in set(tables) - {"plain"}
        }
        pieces, mapped = _row_pieces(features, layout, per_table)
        bounds = features.offset_per_key()
        expected = drop_zero_rows(
            torch.cat(pieces), features.offsets(), bounds, mapped[:-1], weights, native=False
        )
        native = cpu_id_map.drop_zero_rows(torch.cat(pieces), features.offsets(), mapped[:-1],
                                           weights)  # fmt: skip
        assert native is not None
        assert torch.equal(native[0], expected[0]), trial
        assert (native[1] is None) == (expected[1] is None)
        assert native[1] is None or torch.equal(native[1], expected[1])
        assert torch.equal(native[2], expected[2]) and native[3] == expected[3], trial


def _states(maps: dict[str, IdMap]) -> dict[str, dict[str, torch.Tensor]]:
    return {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in maps.items()}


def test_deferred_undo_records_copied_before_their_maps_step_again() -> None:
    """A native step's undo records stay in the native logs until read; the maps' next step
    copies them out first, so records read steps later still put every map back."""
    maps = {name: IdMap(config, 12) for name, config in CONFIGS.items()}
    gen = torch.Generator().manual_seed(7)
    for step in range(8):
        remap_tables(maps, {n: _batch(gen, step, 12) for n in maps}, True)
    before = _states(maps)
    steps = [
        remap_tables(maps, {n: _batch(gen, 8 + s, 12) for n in maps}, True, record_undo=True)
        for s in range(3)
    ]
    for results in reversed(steps):  # read only now, two steps later
        for name, result in results.items():
            assert result.undo is not None
            maps[name].apply_undo(result.undo)
    after = _states(maps)
    for name, state in before.items():
        for key, value in state.items():
            assert torch.equal(value, after[name][key]), (name, key)


def test_released_undo_records_are_dropped_uncopied_and_cannot_be_read() -> None:
    maps = {name: IdMap(CONFIGS["lru"], 12) for name in ("a", "b")}
    gen = torch.Generator().manual_seed(8)
    results = remap_tables(maps, {n: _batch(gen, 1, 12) for n in maps}, True, record_undo=True)
    natives = [m._native() for m in maps.values()]
    assert all(n is not None and n.logs is not None for n in natives)
    undo_a, undo_b = results["a"].undo, results["b"].undo
    assert undo_a is not None and undo_b is not None
    undo_a.release()
    assert all(n is not None and n.logs is not None for n in natives)  # b's still wanted
    with pytest.raises(RuntimeError, match="after its release"):
        undo_a.rows  # noqa: B018
    undo_b.release()
    assert all(n is not None and n.logs is None for n in natives)  # nothing left to copy
    remap_tables(maps, {n: _batch(gen, 2, 12) for n in maps}, True)
    with pytest.raises(RuntimeError, match="after its release"):
        undo_b.row_values  # noqa: B018


def test_deferred_undo_records_copy_and_pickle_with_their_tensors() -> None:
    idmap = IdMap(CONFIGS["lfu_all"], 12)
    gen = torch.Generator().manual_seed(9)
    for step in range(6):
        idmap.remap(_batch(gen, step, 12), True)
    before = {k: v.clone() for k, v in idmap.state_dict().items()}
    undo = remap_tables({"t": idmap}, {"t": _batch(gen, 6, 12)}, True, record_undo=True)["t"].undo
    assert undo is not None
    copied = pickle.loads(pickle.dumps(copy.deepcopy(undo)))  # read from the native log
    assert copied.source is None and torch.equal(copied.rows, undo.rows)
    idmap.apply_undo(copied)
    for key, value in idmap.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_one_call_results_make_their_fresh_tensors_when_read() -> None:
    """A native step's results keep their fresh rows and ids in one buffer (`FreshBlock`),
    with the initial values `fresh_values` makes there: the tensors, made when first read,
    equal the per-map torch step's and `fill_values`' per tensor; a pickle carries them."""
    from recopt.modules import EmbeddingBagConfig
    from recopt.modules.id_map_rows import fresh_values

    names = ["a", "b", "c"]
    pairs = {name: _pair(CONFIGS["lru_ttl" if name == "b" else "lfu"], 40) for name in names}
    made = {  # "b" gets no values: not a table whose values are made ahead
        name: EmbeddingBagConfig(name=name, num_embeddings=40, embedding_dim=3 + i,
                                 feature_names=(name,))
        for i, name in enumerate(["a", "c"])
    }  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    fresh_seen = 0
    for step in range(30):
        ids = {name: _batch(gen, step, 40) for name in names}
        results = remap_tables({name: pairs[name][0] for name in names}, ids, training=True)
        fresh_values(results, made, 2)
        for name in names:
            result, expected = results[name], pairs[name][1].remap(ids[name], True)
            assert result.block is not None, name
            assert result.num_fresh() == expected.fresh_rows.numel() == result.stats.new_ids
            copied = pickle.loads(pickle.dumps(result))  # before any view was made
            _assert_same(result, expected, pairs[name][0], pairs[name][1], f"{name} {step}")
            assert torch.equal(copied.fresh_ids, expected.fresh_ids), (name, step)
            fresh_seen += result.num_fresh()
            if name not in made or not result.num_fresh():
                assert result.fresh_values is None, (name, step)
                continue
            table = made[name]
            (want,) = cpu_id_map.fill_values(
                [expected.fresh_ids], [result.stats.step], [table.embedding_dim],
                [table.init_bounds()], 1,
            )  # fmt: skip
            assert result.fresh_values is not None and torch.equal(result.fresh_values, want)
            assert copied.fresh_values is not None and torch.equal(copied.fresh_values, want)
    assert fresh_seen > 100


def test_one_call_follows_loads_regroupings_and_replaced_buffers() -> None:
    """`remap_tables`' arguments kept for a group of maps (`step_args`, `_group_args`) follow
    a state loaded into one map, a buffer replaced, other groups led by the same map and the
    maps in another order: every step equals the torch maps'."""
    names = ["a", "b", "c"]
    pairs = {name: _pair(CONFIGS["lfu_all" if name == "b" else "lru_ttl"], 30) for name in names}
    other = IdMap(CONFIGS["lru_ttl"], 30)
    gen = torch.Generator().manual_seed(13)
    for step in range(60):
        group = names
        if step == 20:  # "a" loads another map's state (its buffers written by torch)
            for _ in range(4):
                other.remap(_batch(gen, step, 30), True)
            for idmap in pairs["a"]:
                idmap.load_state_dict(other.state_dict())
        if step == 30:  # "c"'s step counter replaced by another tensor
            for idmap in pairs["c"]:
                idmap._buffers["step"] = idmap.buffer("step").clone()
        if 35 <= step < 45:  # led by "a" with fewer maps, then in another order
            group = ["a", "c"] if step % 2 else ["c", "b", "a"]
        ids = {name: _batch(gen, step, 30) for name in group}
        got = remap_tables({name: pairs[name][0] for name in group}, ids, training=True)
        for name in group:
            native, reference = pairs[name]
            expected = reference.remap(ids[name], True)
            _assert_same(got[name], expected, native, reference, f"{name} step {step}")
