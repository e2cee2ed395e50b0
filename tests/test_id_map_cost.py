"""The id map's cheaper paths (issue 26's cost) against their references: the fresh rows of
all tables reset in one native call, lfu's eviction head without a full sort, and the
vectorised `apply_rows`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest
import torch

from recopt.kernels import cpu_id_map
from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, IdMapConfig
from recopt.modules.id_map import Remapped
from recopt.modules.id_map_batch import apply_rows, table_ids
from recopt.modules.id_map_rows import ResetTarget, hash_uniform_torch
from recopt.modules.inputs import FeatureLayout
from recopt.sparse import KeyedJaggedTensor

native_only = pytest.mark.skipif(not cpu_id_map.available(), reason="no C compiler")


def _views(storage: torch.Tensor) -> list[torch.Tensor]:
    """Two tables in one flat storage (row strides wider than the rows) and a third."""
    return [storage[:1000].view(50, 20)[:, 2:18], storage[1000:2200].view(40, 30)[:, :8],
            storage[2200:2320].view(30, 4)]  # fmt: skip


@native_only
@pytest.mark.parametrize("made_once", [False, True], ids=["reset_many", "reset_tables"])
def test_reset_many_equals_torch_init_and_zeroed_states(made_once: bool) -> None:
    """`reset_many` writes the hashed init and zeroes the states; so does `prepare_reset_at`
    with the tables' part made once (`ResetTables`, what a collection keeps between steps)
    and the rows by address."""
    gen = torch.Generator().manual_seed(0)
    storage = torch.rand(2400, generator=gen)
    expected_storage = storage.clone()
    weights, expected = _views(storage), _views(expected_storage)
    per_row = [torch.rand(len(w), generator=gen) + 1 for w in weights]
    per_element = [torch.rand(*w.shape, generator=gen).to(torch.bfloat16) + 1 for w in weights]
    expected_row = [s.clone() for s in per_row]
    expected_element = [s.clone() for s in per_element]
    resets = []
    for t, weight in enumerate(weights):
        rows = torch.randperm(len(weight), generator=gen)[: 7 + t]
        ids = torch.randint(-(2**62), 2**62, (rows.numel(),), generator=gen)
        lo, hi, step = -0.1 * (t + 1), 0.2, 5 + t
        states = [per_row[t], per_element[t]] if t != 1 else [per_row[t]]
        resets.append(cpu_id_map.RowReset(weight, rows, ids, step, lo, hi, states))
        unit = hash_uniform_torch(ids, step, weight.shape[1])  # the torch path's init_rows
        expected[t][rows] = (lo + (hi - lo) * unit).float()
        expected_row[t][rows] = 0
        if t != 1:
            expected_element[t][rows] = 0
    resets.append(cpu_id_map.RowReset(weights[0], rows[:0], ids[:0], 1, 0.0, 1.0, []))  # empty
    assert all(cpu_id_map.can_reset(r.weight, r.states) for r in resets)
    versions = [w._version for w in weights] + [s._version for s in per_row]
    if made_once:
        fixed = cpu_id_map.ResetTables.of(
            [cpu_id_map.ResetTable.of(r.weight, r.states, r.lo, r.hi) for r in resets]
        )
        at = [
            cpu_id_map.RowsAt(r.rows.data_ptr(), r.ids.data_ptr(), r.rows.numel(), r.step, None)
            for r in resets
        ]
        cpu_id_map.prepare_reset_at(fixed, at, resets)(2)
    else:
        cpu_id_map.reset_many(resets, threads=2)
    assert torch.equal(storage, expected_storage)  # the rows, and nothing beside them
    for t in range(3):
        assert torch.equal(per_row[t], expected_row[t]), t
        assert torch.equal(per_element[t], expected_element[t]), t
    assert all(new > old for new, old in zip(
        [w._version for w in weights] + [s._version for s in per_row], versions, strict=True
    ))  # fmt: skip


@native_only
def test_reset_many_refuses_what_it_cannot_write() -> None:
    weight = torch.zeros(6, 4)
    assert cpu_id_map.can_reset(weight, [torch.zeros(6), torch.zeros(6, 4)])
    assert not cpu_id_map.can_reset(weight.double(), [])
    assert not cpu_id_map.can_reset(weight.t(), [])  # columns not contiguous
    assert not cpu_id_map.can_reset(weight, [torch.zeros(4, 6).t()])


@native_only
def test_reset_route_is_worked_out_once_per_table() -> None:
    """A collection's tables keep their reset's route (`ResetTarget`): the native call for
    uniform-initialised float32 CPU tables, one by one for an ``init_fn`` or another dtype."""
    table = EmbeddingBagConfig(name="t", num_embeddings=8, embedding_dim=4, feature_names=("f",))
    states = {"momentum1": torch.zeros(8)}
    native = ResetTarget.of(table, "row_wise_adagrad", torch.zeros(8, 4), states)
    assert native.route.way == "native" and native.route.zeroed == [states["momentum1"]]
    assert (native.route.lo, native.route.hi) == table.init_bounds()
    with_fn = dataclasses.replace(table, init_fn=torch.nn.init.zeros_)
    assert ResetTarget.of(with_fn, "sgd", torch.zeros(8, 4), {}).route.way == "each"
    half = torch.zeros(8, 4, dtype=torch.float16)
    assert ResetTarget.of(table, "row_wise_adagrad", half, states).route.way == "each"
    module = _collection("row_wise_adagrad", 2)
    targets = module._reset_targets()
    assert targets is module._reset_targets()  # made once, with their routes
    assert [t.route.way for t in targets.values()] == ["native", "native"]


def _collection(optimizer: str, tables: int) -> FusedEmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(
            name=f"t{i}",
            num_embeddings=16 + 4 * i,
            embedding_dim=4 * (i + 1),
            feature_names=(f"f{i}",),
            id_map=IdMapConfig(policy="lru"),
        )
        for i in range(tables)
    ]
    torch.manual_seed(0)
    return FusedEmbeddingBagCollection(
        configs, optimizer=FusedOptimizerConfig(name=optimizer, lr=0.1)
    )


def _state(module: FusedEmbeddingBagCollection) -> dict[str, torch.Tensor]:
    out = dict(module.state_dict())
    for k, kernel in enumerate(module.kernels()):
        for t, states in enumerate(kernel.split_optimizer_states()):
            out.update({f"{k}.{t}.{name}": s.clone() for name, s in states.items()})
    return out


@pytest.mark.parametrize("optimizer", ["row_wise_adagrad", "adam"])
def test_fused_collection_resets_as_the_per_table_torch_path(
    optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many steps that evict: the one-call native reset leaves every weight and state bit
    equal to the per-table torch ops (the reference, forced by refusing every table)."""
    native, reference = _collection(optimizer, 3), _collection(optimizer, 3)
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        ids = {f"f{i}": torch.randint(0, 60, (24,), generator=gen) * 7919 + step for i in range(3)}
        kjt = KeyedJaggedTensor.from_lengths_sync(
            list(ids), torch.cat(list(ids.values())), torch.ones(72, dtype=torch.int64)
        )
        native(kjt).values().sum().backward()
        with monkeypatch.context() as patch:
            patch.setattr(cpu_id_map, "can_reset", lambda *_: False)
            reference(kjt).values().sum().backward()
    assert sum(native.stats()[t]["evictions"] for t in native.stats()) > 0
    got, expected = _state(native), _state(reference)
    assert got.keys() == expected.keys()
    for key, value in got.items():
        assert torch.equal(value, expected[key]), key


def _kjt(bags: Mapping[str, list[list[int]]], weighted: bool) -> KeyedJaggedTensor:
    kjt = KeyedJaggedTensor.from_id_lists(dict(bags))
    if not weighted:
        return kjt
    weights = torch.arange(kjt.values().numel(), dtype=torch.float32) + 1
    return KeyedJaggedTensor(kjt.keys(), kjt.values(), weights=weights, lengths=kjt.lengths())


def _apply_rows_reference(
    kjt: KeyedJaggedTensor, layout: FeatureLayout, results: Mapping[str, Remapped]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The rows, the kept bag lengths and weights, span by span (what `apply_rows` must give)."""
    values, bounds = kjt.values(), kjt.offset_per_key()
    rows, dropped = values.clone(), torch.zeros(values.numel(), dtype=torch.bool)
    for name, result in results.items():
        start = 0
        for f, table in enumerate(layout.table_names):
            if table == name:
                a, b = bounds[f], bounds[f + 1]
                rows[a:b] = result.rows_M[start : start + b - a]
                dropped[a:b] = result.rows_M[start : start + b - a] < 0
                start += b - a
    bags = torch.repeat_interleave(torch.arange(kjt.lengths().numel()), kjt.lengths())
    kept = torch.zeros_like(kjt.lengths()).index_add_(0, bags, (~dropped).long())
    weights = kjt.weights_or_none()
    return rows[~dropped], kept, None if weights is None else weights[~dropped]


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_apply_rows_equals_the_span_by_span_reference(drop: bool, weighted: bool) -> None:
    tables = [
        EmbeddingBagConfig(name="a", num_embeddings=9, embedding_dim=4, feature_names=("a1", "a2")),
        EmbeddingBagConfig(name="u", num_embeddings=9, embedding_dim=4, feature_names=("u1",)),
        EmbeddingBagConfig(name="b", num_embeddings=9, embedding_dim=4, feature_names=("b1",)),
    ]
    layout = FeatureLayout(tables)
    bags = {"a1": [[1, 2], [3]], "a2": [[], [4, 5, 6]], "u1": [[7], [8]], "b1": [[9], []]}
    kjt = _kjt({name: bags[name] for name in layout.feature_names}, weighted)
    ids = table_ids(kjt, layout, ["b", "a"])  # a table's features one after the other
    assert list(ids) == ["b", "a"]
    assert ids["a"].tolist() == [1, 2, 3, 4, 5, 6] and ids["b"].tolist() == [9]
    rows_a = torch.tensor([10, 11, 12, 13, 14, 15])
    if drop:
        rows_a[[1, 4]] = -1
    results = {
        "a": Remapped(rows_a, rows_a[:0], rows_a[:0]),
        "b": Remapped(torch.tensor([20]), rows_a[:0], rows_a[:0]),
    }
    batch = apply_rows(kjt, layout, results)
    rows, kept, weights = _apply_rows_reference(kjt, layout, results)
    assert torch.equal(batch.features.values(), rows)
    assert torch.equal(batch.features.lengths(), kept)
    assert (batch.lengths_before is not None) == drop
    if drop:
        assert torch.equal(batch.lengths_before, kjt.lengths())
    got_weights = batch.features.weights_or_none()
    assert (got_weights is None) == (weights is None)
    if weights is not None and got_weights is not None:
        assert torch.equal(got_weights, weights)


@native_only
def test_rows_written_into_the_batch_equal_the_rows_put_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where every feature is id-mapped and each table's features sit together, the native
    remap writes the rows straight into the batch's new values (`rows_buffer`): the same
    batch, drops, fresh rows and maps as putting each table's rows in its place."""
    from recopt.modules import id_map_batch
    from recopt.modules.id_map_lookup import IdMaps

    admit = IdMapConfig(policy="lru", admit_after=2)  # some ids read the zero row
    tables = [
        EmbeddingBagConfig(name="a", num_embeddings=6, embedding_dim=4,
                           feature_names=("a1", "a2"), id_map=IdMapConfig(policy="lfu")),
        EmbeddingBagConfig(name="b", num_embeddings=5, embedding_dim=4,
                           feature_names=("b1",), id_map=admit),
    ]  # fmt: skip
    layout = FeatureLayout(tables)
    direct, together = IdMaps(tables, "cpu"), IdMaps(tables, "cpu")
    gen = torch.Generator().manual_seed(3)
    dropped = 0
    for step in range(12):
        lengths = torch.randint(0, 4, (3 * 4,), generator=gen)
        ids = torch.randint(0, 12, (int(lengths.sum()),), generator=gen) * 7919 + step // 4
        kjt = KeyedJaggedTensor(list(layout.feature_names), ids, lengths=lengths)
        assert id_map_batch.rows_buffer(kjt, layout, list(direct)) is not None
        with monkeypatch.context() as patch:  # the rows must not be put together here
            patch.setattr(id_map_batch, "_row_pieces", None)
            got = direct.remap(kjt, layout, True)
        results = together.remap_ids(table_ids(kjt, layout, list(together)), True)
        expected = apply_rows(kjt, layout, results)
        assert torch.equal(got.features.values(), expected.features.values()), step
        assert torch.equal(got.features.lengths(), expected.features.lengths()), step
        assert (got.lengths_before is None) == (expected.lengths_before is None), step
        dropped += got.lengths_before is not None
        for name in results:
            for field in ("rows_M", "fresh_rows", "fresh_ids"):
                a, b = getattr(got.fresh[name], field), getattr(expected.fresh[name], field)
                assert torch.equal(a, b), (step, name, field)
    assert dropped > 0
    got_state, expected_state = direct.state_dict(), together.state_dict()
    for key, value in expected_state.items():
        assert torch.equal(got_state[key], value), key


def test_rows_buffer_only_where_the_rows_fill_the_batch_in_order() -> None:
    """No buffer (the rows are put together) with an unmapped feature, values past the
    features, or the maps in another order than the features."""
    from recopt.modules.id_map_batch import rows_buffer

    def table(name: str, mapped: bool) -> EmbeddingBagConfig:
        id_map = IdMapConfig(policy="lru") if mapped else None
        return EmbeddingBagConfig(name=name, num_embeddings=4, embedding_dim=4,
                                  feature_names=(f"{name}1",), id_map=id_map)  # fmt: skip

    layout = FeatureLayout([table("a", True), table("b", True)])
    kjt = KeyedJaggedTensor.from_id_lists({"a1": [[1], [2, 3]], "b1": [[4], []]})
    buffer = rows_buffer(kjt, layout, ["a", "b"])
    assert buffer is not None and buffer.shape == kjt.values().shape
    assert buffer.data_ptr() != kjt.values().data_ptr()
    assert rows_buffer(kjt, layout, ["b", "a"]) is None
    assert rows_buffer(kjt, FeatureLayout([table("a", True)]), ["a"]) is None  # "b1" past it
    mixed = FeatureLayout([table("a", True), table("b", False)])
    assert rows_buffer(kjt, mixed, ["a"]) is None


@native_only
def test_reset_plan_with_the_targets_fixed_part_equals_one_made_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A collection's `ResetTargets` keep the native reset's fixed part of all its tables
    (made once; a table without fresh rows in a step passes none): the same bits as a plan
    whose fixed part is made for its step's tables."""
    from recopt.modules.id_map import RemapStats
    from recopt.modules.id_map_rows import FreshTable, ResetPlan

    made = []
    of = cpu_id_map.ResetTables.of
    monkeypatch.setattr(cpu_id_map.ResetTables, "of", lambda t: made.append(len(t)) or of(t))
    kept, each = _collection("row_wise_adagrad", 3), _collection("row_wise_adagrad", 3)
    for step in range(6):
        fresh_tables = [0, 2] if step % 2 else [1]  # the others have no fresh rows
        for module, with_targets in ((kept, True), (each, False)):
            targets = module._reset_targets()
            gen_step = torch.Generator().manual_seed(step)
            fresh = []
            for i in fresh_tables:
                name = f"t{i}"
                rows = torch.randperm(16 + 4 * i, generator=gen_step)[: 3 + i]
                ids = torch.randint(0, 2**40, (rows.numel(),), generator=gen_step)
                result = Remapped(rows, rows, ids, RemapStats(step=step + 1))
                fresh.append(FreshTable(targets[name], result))
            assert module.id_maps is not None
            ResetPlan(fresh, targets if with_targets else None).run(module.id_maps)
    assert made[0] == 3 and made.count(3) == 1  # the three tables' part, once
    assert len(made) == 1 + 6  # and the plan without the targets made its own each step
    got, expected = _state(kept), _state(each)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


@native_only
def test_a_trained_collection_copies_and_pickles_and_trains_on_alike() -> None:
    """After steps that reset rows (its `ResetTargets` then hold C arrays of its addresses), a
    collection deep-copies and pickles, and the copies train on as the original does."""
    import copy
    import io

    module = _collection("row_wise_adagrad", 2)
    gen = torch.Generator().manual_seed(4)

    def batch() -> KeyedJaggedTensor:
        ids = torch.randint(0, 50, (16,), generator=gen) * 7919
        return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], ids, torch.ones(16).long())

    for _ in range(4):
        module(batch()).values().sum().backward()
    assert module._reset_targets()._native is not None
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(module), torch.load(buffer, weights_only=False)]
    for _ in range(4):
        features = batch()
        for m in (module, *copies):
            m(features).values().sum().backward()
    expected = _state(module)
    for other in copies:
        got = _state(other)
        for key, value in expected.items():
            assert torch.equal(got[key], value), key
