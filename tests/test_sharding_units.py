"""Unit tests of the sharding engine's pure pieces: bucketization, segment reordering, weight
packing and the optimizer / sharding-type rules (no process group)."""

from __future__ import annotations

import pytest
import torch

from recopt.kernels import cpu_bucketize
from recopt.kernels.config import Backend, FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig
from recopt.sharding import (
    PlanError,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from recopt.sharding.bucketizer import Bucketizer
from recopt.sharding.input_dist import pack_weights, unpack_weights
from recopt.sharding.kernel_inputs import segment_transpose
from recopt.sharding.layout import ShardedLayout, resolve_optimizer
from recopt.sparse import KeyedJaggedTensor

TABLES = [
    EmbeddingBagConfig(name="a", num_embeddings=10, embedding_dim=8, feature_names=("fa",)),
    EmbeddingBagConfig(name="b", num_embeddings=7, embedding_dim=12, feature_names=("fb", "fc")),
    EmbeddingBagConfig(name="c", num_embeddings=5, embedding_dim=4, feature_names=("fd",)),
]
OPT = FusedOptimizerConfig(name="sgd")


def _layout(requests: dict[str, object], world: int, rank: int = 0) -> ShardedLayout:
    shardings = construct_module_sharding_plan(TABLES, requests, world)  # type: ignore[arg-type]
    return ShardedLayout(TABLES, shardings, {t.name: OPT for t in TABLES}, world, rank)


def _random_kjt(seed: int, batch: int, weighted: bool) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    rows = [10, 7, 7, 5]
    lengths = torch.randint(0, 4, (4 * batch,), generator=g)
    values = torch.cat(
        [
            torch.randint(
                0, rows[f], (int(lengths[f * batch : (f + 1) * batch].sum()),), generator=g
            )
            for f in range(4)
        ]
    )
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(
        keys=["fa", "fb", "fc", "fd"], values=values, lengths=lengths, weights=weights
    )


def _reference(
    layout: ShardedLayout, kjt: KeyedJaggedTensor, hashed: frozenset[int] = frozenset()
) -> tuple[list[int], list[float], list[int], list[list[int]]]:
    """Bag by bag, in Python: what each destination's virtual features receive (the features
    in ``hashed``: id-mapped, each raw id to the shard `route_shard` names, as it is)."""
    from recopt.modules.id_map_rows import route_shard

    batch = kjt.stride()
    lengths = kjt.lengths().tolist()
    values = kjt.values().tolist()
    weights = kjt.weights_or_none()
    wl = weights.tolist() if weights is not None else [0.0] * len(values)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    ids: list[int] = []
    ws: list[float] = []
    counts = [0] * layout.world_size
    bag_lengths: list[list[int]] = []
    for d, vfs in enumerate(layout.dest_features):
        for vf in vfs:
            row = []
            for b in range(batch):
                bag = vf.feature * batch + b
                n = 0
                for i in range(offsets[bag], offsets[bag + 1]):
                    if vf.feature in hashed:
                        shards = sum(
                            v.feature == vf.feature for d in layout.dest_features for v in d
                        )
                        if int(route_shard(torch.tensor([values[i]]), shards)) == vf.shard:
                            ids.append(values[i])
                            ws.append(wl[i])
                            n += 1
                    elif vf.row_offset <= values[i] < vf.row_offset + vf.num_rows:
                        ids.append(values[i] - vf.row_offset)
                        ws.append(wl[i])
                        n += 1
                row.append(n)
                counts[d] += n
            bag_lengths.append(row)
    return ids, ws, counts, bag_lengths


@pytest.fixture(params=["native", "torch"])
def routing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Bucketization by the native library (`cpu_bucketize`; its calls counted) or by the
    torch ops and fbgemm's pass (the library switched off)."""
    calls = {"native": 0}
    if request.param == "native":
        assert cpu_bucketize.available()
        real = cpu_bucketize.bucketize

        def counted(*args: object, **kwargs: object) -> object:
            calls["native"] += 1
            return real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(cpu_bucketize, "bucketize", counted)
    else:
        monkeypatch.setattr(Bucketizer, "native", False)
    return calls


def _check_route(bucketizer: Bucketizer, routing: dict[str, int], native: bool) -> None:
    """Row-split layouts went through the native library exactly when it is on."""
    if not bucketizer.whole_features:
        assert (routing["native"] > 0) == native, routing


@pytest.mark.parametrize(
    "requests",
    [
        {"a": table_wise(1), "b": table_wise(0), "c": table_wise(2)},
        {"a": row_wise(), "b": row_wise(), "c": row_wise([0, 2])},
        {"a": row_wise(), "b": row_wise(), "c": row_wise()},
        {"a": column_wise([2, 0]), "b": column_wise([0, 0, 1]), "c": column_wise([1])},
        {"a": row_wise(), "b": column_wise([1, 2]), "c": data_parallel()},
        {"a": data_parallel(), "b": data_parallel(), "c": data_parallel()},
    ],
    ids=["table_wise", "row_wise_partial", "row_wise", "column_wise", "mixed", "data_parallel"],
)
@pytest.mark.parametrize("weighted", [False, True])
def test_bucketize_matches_bag_by_bag_reference(
    requests: dict[str, object], weighted: bool, routing: dict[str, int]
) -> None:
    layout = _layout(requests, world=3)
    bucketizer = Bucketizer(
        layout.features.num_rows, layout.dest_features, layout.dp_features, torch.device("cpu")
    )
    if all(r.sharding_type == "row_wise" and r.ranks is None for r in requests.values()):  # type: ignore[attr-defined]
        assert bucketizer.row_split  # the native path is the one under test
    for seed, batch in [(0, 4), (1, 1), (2, 6)]:
        kjt = _random_kjt(seed, batch, weighted)
        ids, ws, lengths_G_B = bucketizer.bucketize(kjt)
        ref_ids, ref_ws, ref_counts, ref_lengths = _reference(layout, kjt)
        assert ids.tolist() == ref_ids
        assert _per_destination(bucketizer, lengths_G_B) == ref_counts
        assert lengths_G_B.tolist() == ref_lengths or (not ref_lengths and lengths_G_B.numel() == 0)
        if weighted:
            assert ws is not None and ws.tolist() == ref_ws
        else:
            assert ws is None
    _check_route(bucketizer, routing, Bucketizer.native)


_ROW_WISE = {"a": row_wise(), "b": row_wise(), "c": row_wise()}
_MIXED = {"a": table_wise(1), "b": row_wise(), "c": row_wise([0, 2])}


@pytest.mark.parametrize(
    ("requests", "mapped"),
    [
        (_ROW_WISE, "ac"),
        (_ROW_WISE, "abc"),
        (_MIXED, "ac"),
        (_MIXED, "abc"),
        ({"a": row_wise(), "b": column_wise([1, 2]), "c": table_wise(0)}, "ac"),
    ],
    ids=["row_wise", "row_wise_all", "mixed", "mixed_all", "with_column_wise"],
)
@pytest.mark.parametrize("weighted", [False, True])
def test_bucketize_routes_id_mapped_raw_ids_by_their_hash(
    requests: dict[str, object], mapped: str, weighted: bool, routing: dict[str, int]
) -> None:
    """Id-mapped features (of the tables in ``mapped``): each raw id (any int64) goes,
    unchanged and in its bag, to the shard `route_shard` names; the other features are routed
    by row as ever. Without the native library, row-wise layouts take fbgemm's pass (the raw
    ids written back after it)."""
    layout = _layout(requests, world=3)
    hashed = frozenset(f for f, t in enumerate(layout.features.table_names) if t in mapped)
    bucketizer = Bucketizer(
        layout.features.num_rows,
        layout.dest_features,
        layout.dp_features,
        torch.device("cpu"),
        hashed=[f in hashed for f in range(len(layout.features.table_names))],
    )
    assert bucketizer.row_split == all(r.sharding_type == "row_wise" for r in requests.values())  # type: ignore[attr-defined]
    for seed, batch in [(0, 4), (1, 1), (2, 6)]:
        kjt = _random_kjt(seed, batch, weighted)
        values = kjt.values().clone()
        g = torch.Generator().manual_seed(seed)
        for f in hashed:
            a, b = kjt.offset_per_key()[f], kjt.offset_per_key()[f + 1]
            values[a:b] = torch.randint(-(2**62), 2**62, (b - a,), generator=g)
        kjt = KeyedJaggedTensor(
            keys=kjt.keys(), values=values, lengths=kjt.lengths(), weights=kjt.weights_or_none()
        )
        ids, ws, lengths_G_B = bucketizer.bucketize(kjt)
        ref_ids, ref_ws, ref_counts, ref_lengths = _reference(layout, kjt, hashed)
        assert ids.tolist() == ref_ids
        assert _per_destination(bucketizer, lengths_G_B) == ref_counts
        assert lengths_G_B.tolist() == ref_lengths
        assert (ws is None) != weighted and (ws is None or ws.tolist() == ref_ws)
    _check_route(bucketizer, routing, Bucketizer.native)


_BIG = [
    EmbeddingBagConfig(name=f"t{i}", num_embeddings=n, embedding_dim=8, feature_names=(f"f{i}",))
    for i, n in enumerate([1000, 997, 64, 5000, 3])
]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(
    "plan",
    ["row_wise", "mixed", "with_column_wise"],
)
def test_native_bucketize_equals_the_torch_ops_on_large_batches(world: int, plan: str) -> None:
    """The native routing against the torch ops (and fbgemm's pass) on batches of thousands of
    ids: every table row-wise (some over a subset of the ranks), or row-, table- and
    column-wise side by side; id-mapped or not (raw ids over the whole int64 range, their
    shard counts 1 to 4), weighted or not, bags of 0 to 6 ids. Bit for bit: ids, weights and
    every virtual feature's bag lengths."""
    assert cpu_bucketize.available()
    kinds = {
        "row_wise": [row_wise(), row_wise(), row_wise([0, world - 1]), row_wise(), row_wise()],
        "mixed": [table_wise(world - 1), row_wise(), row_wise([1]), row_wise(), table_wise(0)],
        "with_column_wise": [row_wise(), column_wise([0, world - 1]), row_wise(), table_wise(1),
                             column_wise([1, 0])],
    }[plan]  # fmt: skip
    requests = {t.name: kind for t, kind in zip(_BIG, kinds, strict=True)}
    shardings = construct_module_sharding_plan(_BIG, requests, world)  # type: ignore[arg-type]
    layout = ShardedLayout(_BIG, shardings, {t.name: OPT for t in _BIG}, world, 0)
    rows = layout.features.num_rows
    g = torch.Generator().manual_seed(world * 10 + len(plan))
    for mapped in [(), (0, 2), (0, 1, 2, 3, 4)]:
        hashed = [f in mapped and kinds[f].sharding_type == "row_wise" for f in range(len(rows))]
        bucketizer = Bucketizer(
            rows, layout.dest_features, layout.dp_features, torch.device("cpu"), hashed=hashed
        )
        for weighted, batch in [(False, 300), (True, 257), (False, 0)]:
            lengths = torch.randint(0, 7, (len(rows), batch), generator=g)
            parts = []
            for f, n in enumerate(rows):
                count = int(lengths[f].sum())
                if hashed[f]:
                    parts.append(torch.randint(-(2**63), 2**63 - 1, (count,), generator=g))
                else:
                    parts.append(torch.randint(0, n, (count,), generator=g))
            values = torch.cat(parts)
            weights = torch.rand(values.numel(), generator=g) if weighted else None
            kjt = KeyedJaggedTensor(
                keys=[f"f{f}" for f in range(len(rows))],
                values=values,
                lengths=lengths.flatten(),
                weights=weights,
            )
            native = bucketizer.bucketize(kjt)
            Bucketizer.native = False
            try:
                reference = bucketizer.bucketize(kjt)
            finally:
                Bucketizer.native = True
            where = (mapped, weighted, batch)
            assert torch.equal(native[0], reference[0]), where
            assert torch.equal(native[2], reference[2]), where
            assert (native[1] is None) == (reference[1] is None), where
            assert native[1] is None or torch.equal(native[1], reference[1]), where


def test_native_bucketize_refuses_lengths_that_do_not_sum_to_the_ids() -> None:
    """The native passes index the ids by the bag lengths: lengths summing to more (or fewer)
    ids than there are route nothing and write nothing (the caller then takes the torch ops)."""
    layout = _layout({"a": row_wise(), "b": row_wise(), "c": row_wise()}, world=2)
    bucketizer = Bucketizer(
        layout.features.num_rows, layout.dest_features, layout.dp_features, torch.device("cpu")
    )
    kjt = _random_kjt(0, 4, False)
    assert bucketizer._bucketize_native(kjt) is not None
    assert bucketizer._native_tables is not None
    lengths = kjt.lengths().clone()
    for delta in (1, -1):
        lengths[3] += delta
        args = (lengths, kjt.values(), None, 4, bucketizer._native_tables)
        assert cpu_bucketize.bucketize(*args, bucketizer.num_virtual, 1) is None, delta
        lengths[3] -= delta


def _per_destination(bucketizer: Bucketizer, lengths_G_B: torch.Tensor) -> list[int]:
    """The ids routed to each destination (what the count exchange sends, summed per rank)."""
    per_feature = lengths_G_B.sum(1).tolist() if lengths_G_B.numel() else [0] * len(lengths_G_B)
    out, start = [], 0
    for n in bucketizer.dest_counts:
        out.append(sum(per_feature[start : start + n]))
        start += n
    return out


def test_bucketize_empty_batch_and_empty_features() -> None:
    layout = _layout({"a": row_wise(), "b": column_wise([0, 1]), "c": table_wise(1)}, world=2)
    bucketizer = Bucketizer(
        layout.features.num_rows, layout.dest_features, layout.dp_features, torch.device("cpu")
    )
    kjt = KeyedJaggedTensor(
        keys=["fa", "fb", "fc", "fd"],
        values=torch.zeros(0, dtype=torch.int64),
        lengths=torch.zeros(8, dtype=torch.int64),
    )
    ids, _, lengths_G_B = bucketizer.bucketize(kjt)
    assert ids.numel() == 0 and _per_destination(bucketizer, lengths_G_B) == [0, 0]
    assert lengths_G_B.shape == (bucketizer.num_virtual, 2) and int(lengths_G_B.sum()) == 0


def test_segment_transpose_matches_python() -> None:
    g = torch.Generator().manual_seed(0)
    for w, v in [(1, 3), (3, 1), (2, 3), (4, 5)]:
        seg = torch.randint(0, 4, (w, v), generator=g)
        values = torch.arange(int(seg.sum()))
        pieces = list(values.split(seg.reshape(-1).tolist()))
        expected = [pieces[i * v + j] for j in range(v) for i in range(w)]
        want = torch.cat(expected) if expected else values
        assert segment_transpose(values, seg).tolist() == want.tolist()


def test_weight_packing_is_bit_exact() -> None:
    w = torch.tensor([0.0, -0.0, 1e-42, -3.5, float("inf"), 1.1754944e-38, 123456.789])
    back = unpack_weights(pack_weights(w))
    assert torch.equal(back.view(torch.int32), w.view(torch.int32))
    assert pack_weights(w).dtype == torch.int64


def test_adafactor_only_table_wise_or_data_parallel() -> None:
    ada = FusedOptimizerConfig(name="adafactor")
    for request in (row_wise(), column_wise([0, 1])):
        ps = construct_module_sharding_plan(TABLES[:1], {"a": request}, 2)["a"]
        with pytest.raises(PlanError, match="'a'.*adafactor.*table_wise and data_parallel"):
            resolve_optimizer(TABLES[0], ps, ada, "m")
    for request in (table_wise(1), data_parallel()):
        ps = construct_module_sharding_plan(TABLES[:1], {"a": request}, 2)["a"]
        assert resolve_optimizer(TABLES[0], ps, ada, "m").name == "adafactor"


def test_column_shards_with_row_wise_optimizers_run_on_recopt() -> None:
    rw = FusedOptimizerConfig(name="row_wise_adagrad")
    auto = construct_module_sharding_plan(TABLES[:1], {"a": column_wise([0, 1])}, 2)["a"]
    assert resolve_optimizer(TABLES[0], auto, rw, "m").backend is Backend.RECOPT
    forced = construct_module_sharding_plan(
        TABLES[:1], {"a": column_wise([0, 1], backend=Backend.FBGEMM)}, 2
    )["a"]
    with pytest.raises(PlanError, match="'a'.*row_wise_adagrad.*'recopt'"):
        resolve_optimizer(TABLES[0], forced, rw, "m")
    # Element-wise optimizers keep the requested backend.
    sgd = resolve_optimizer(TABLES[0], forced, FusedOptimizerConfig(name="sgd"), "m")
    assert sgd.backend is Backend.FBGEMM


def test_layout_groups_and_output_columns_cover_every_column() -> None:
    layout = _layout({"a": row_wise(), "b": column_wise([1, 0, 1]), "c": data_parallel()}, 2, 1)
    cols = layout.output_columns()
    total = 8 + 12 * 2 + 4
    assert sorted(set(cols)) == list(range(total))
    # Row-wise table a: its 8 columns arrive once from each of the 2 ranks.
    assert len(cols) == total + 8
    # Rank 1 holds a's second row range and b's first and third column shards.
    assert [(t, k) for g in layout.mp_groups for t, k in g.tables] == [(0, 1), (1, 0), (1, 2)]
    assert layout.dp_features == [3]


def test_a_rank_without_a_shard_reduces_on_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # The placement names the owner's GPU (rank 0: cuda:0); rank 1 of a job with a GPU per
    # rank must build its zeros on cuda:1, or NCCL sees two ranks on one device.
    from recopt.sharding.state import _own_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert _own_device(torch.device("cuda", 0)) == torch.device("cuda", 1)
    assert _own_device(torch.device("cpu")) == torch.device("cpu")
    assert _own_device(None) == torch.device("cpu")
