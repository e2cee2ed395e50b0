"""Id-mapped tables in EmbeddingBagCollection and FusedEmbeddingBagCollection (docs/id_map.md)."""

from __future__ import annotations

import pytest
import torch

from recopt.kernels.config import FusedOptimizerConfig, PoolingType
from recopt.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
    IdMapConfig,
    InvalidIdError,
    NonFiniteWeightError,
)
from recopt.modules.id_map_rows import hash_uniform
from recopt.sparse import KeyedJaggedTensor

BIG = 2**40


def _table(
    rows: int, id_map: IdMapConfig | None, pooling: PoolingType = PoolingType.SUM
) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name="t",
        num_embeddings=rows,
        embedding_dim=4,
        feature_names=("f",),
        pooling=pooling,
        id_map=id_map,
    )


def _kjt(bags: list[list[int]]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_id_lists({"f": bags})


def _init_row(table: EmbeddingBagConfig, raw_id: int, step: int) -> torch.Tensor:
    lo, hi = table.init_bounds()
    return (lo + (hi - lo) * hash_uniform(torch.tensor([raw_id]), step, 4))[0].float()


def _rows_of(module: torch.nn.Module) -> dict[int, int]:
    idmap = module.id_maps["t"]  # type: ignore[index]
    rows = idmap.occupied.nonzero().squeeze(1).tolist()
    return {int(idmap.row_ids[r]): r for r in rows}


@pytest.mark.parametrize("fused", [False, True])
def test_raw_ids_look_up_their_own_rows(fused: bool) -> None:
    torch.manual_seed(0)
    table = _table(8, IdMapConfig(policy="lru"))
    module = FusedEmbeddingBagCollection([table]) if fused else EmbeddingBagCollection([table])
    bags = [[BIG + 5, -3], [7], [BIG + 5, 7, 123456789]]
    out = module(_kjt(bags))["f"]
    rows = _rows_of(module)
    assert len(rows) == 4 and len(set(rows.values())) == 4
    weight = module.embedding_bags["t"].weight.detach()
    for b, bag in enumerate(bags):
        expected = sum(weight[rows[i]] for i in bag)
        torch.testing.assert_close(out[b], expected)
    for raw, row in rows.items():  # each new row holds the table's (hashed) initialisation
        torch.testing.assert_close(weight[row], _init_row(table, raw, step=1))
    assert module.stats()["t"]["new_ids"] == 4.0
    assert module.stats()["t"]["occupancy"] == 0.5


def test_fused_evicted_row_is_reinitialised_and_its_state_zeroed() -> None:
    torch.manual_seed(0)
    table = _table(2, IdMapConfig(policy="lru"))
    optimizer = FusedOptimizerConfig(name="adagrad", lr=0.5)
    fused = FusedEmbeddingBagCollection([table], optimizer=optimizer)
    fused(_kjt([[11], [22]]))["f"].sum().backward()  # rows 0, 1 trained: state non-zero
    state = fused.kernels()[0].split_optimizer_states()[0]["momentum1"]
    assert bool((state != 0).all())
    kept_row, kept_state = fused.embedding_bags["t"].weight[1].clone(), state[1].clone()
    out = fused(_kjt([[33]]))["f"]  # step 2: full, 11 and 22 tie in recency, row 0 goes
    assert _rows_of(fused) == {33: 0, 22: 1}
    fresh_init = _init_row(table, 33, step=2)
    torch.testing.assert_close(fused.embedding_bags["t"].weight[0], fresh_init)
    assert bool((state[0] == 0).all())
    torch.testing.assert_close(out[0], fresh_init)
    (out * 3).sum().backward()
    # reference: a one-row table starting from the same row and zero state, same gradient
    reference = FusedEmbeddingBagCollection([_table(1, None)], optimizer=optimizer)
    with torch.no_grad():
        reference.embedding_bags["t"].weight[0] = fresh_init
    (reference(_kjt([[0]]))["f"] * 3).sum().backward()
    torch.testing.assert_close(
        fused.embedding_bags["t"].weight[0], reference.embedding_bags["t"].weight[0]
    )
    torch.testing.assert_close(
        state[0], reference.kernels()[0].split_optimizer_states()[0]["momentum1"][0]
    )
    torch.testing.assert_close(fused.embedding_bags["t"].weight[1], kept_row)  # untouched
    torch.testing.assert_close(state[1], kept_state)


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_fused_sgd_equals_plain_module_with_torch_sgd(pooling: PoolingType) -> None:
    config = IdMapConfig(policy="lfu", decay=0.9, ttl_steps=4, admit_after=2)
    table = _table(6, config, pooling)
    torch.manual_seed(0)
    plain = EmbeddingBagCollection([table])
    torch.manual_seed(0)
    fused = FusedEmbeddingBagCollection([table], optimizer=FusedOptimizerConfig(name="sgd", lr=0.1))
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(15):
        ids = (torch.randint(0, 12, (10,), generator=gen) * BIG).tolist()
        bags = [ids[0:3], ids[3:4], [], ids[4:10]]
        target = torch.randn(4, 4, generator=gen)
        a, b = plain(_kjt(bags))["f"], fused(_kjt(bags))["f"]
        torch.testing.assert_close(a, b)
        sgd.zero_grad()
        ((a - target) ** 2).sum().backward()
        sgd.step()
        ((b - target) ** 2).sum().backward()
        torch.testing.assert_close(
            plain.embedding_bags["t"].weight, fused.embedding_bags["t"].weight
        )
    for key, value in plain.id_maps.state_dict().items():  # type: ignore[union-attr]
        assert torch.equal(value, fused.id_maps.state_dict()[key]), key  # type: ignore[union-attr]


def test_mean_bag_counts_the_zero_row_of_unadmitted_ids() -> None:
    torch.manual_seed(0)
    table = _table(4, IdMapConfig(policy="lru", admit_after=2), PoolingType.MEAN)
    ebc = EmbeddingBagCollection([table])
    ebc(_kjt([[1, 1]]))  # 1 admitted (two occurrences)
    out = ebc(_kjt([[1, 2, 3], [4]]))["f"]  # 2, 3 and 4 seen once: zero rows
    row = ebc.embedding_bags["t"].weight[_rows_of(ebc)[1]]
    torch.testing.assert_close(out[0], row / 3)
    torch.testing.assert_close(out[1], torch.zeros(4))
    assert ebc.stats()["t"]["zero_row_ids"] == 3.0


def test_eval_reads_unknown_ids_as_zero_and_changes_no_map() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([_table(4, IdMapConfig(policy="lru"))])
    ebc(_kjt([[5], [6]]))
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    ebc.eval()
    out = ebc(_kjt([[5, 99], [99]]))["f"]
    torch.testing.assert_close(out[0], ebc.embedding_bags["t"].weight[_rows_of(ebc)[5]])
    torch.testing.assert_close(out[1], torch.zeros(4))
    for key, value in ebc.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_bad_id_of_an_unmapped_table_raises_before_the_map_moves() -> None:
    tables = [
        _table(4, IdMapConfig(policy="lru")),
        EmbeddingBagConfig(name="u", num_embeddings=3, embedding_dim=4, feature_names=("g",)),
    ]
    fused = FusedEmbeddingBagCollection(tables)
    bad = KeyedJaggedTensor.from_id_lists({"f": [[BIG]], "g": [[3]]})
    with pytest.raises(InvalidIdError, match="table 'u', feature 'g': id 3"):
        fused(bad)
    assert int(fused.id_maps["t"].step) == 0 and not fused.id_maps["t"].occupied.any()  # type: ignore[index]
    fused(KeyedJaggedTensor.from_id_lists({"f": [[BIG]], "g": [[2]]}))
    assert _rows_of(fused) == {BIG: 0}


def test_all_mapped_collection_still_checks_id_dtype_and_weights() -> None:
    """With every table mapped there is no id range to check, but float ids and non-finite
    per-id weights still raise before the map moves."""
    fused = FusedEmbeddingBagCollection([_table(4, IdMapConfig(policy="lru"))])
    lengths = torch.tensor([1, 1])
    floats = KeyedJaggedTensor(["f"], torch.tensor([1.0, 2.0]), lengths=lengths)
    with pytest.raises(InvalidIdError, match="table 't', feature 'f'"):
        fused(floats)
    weighted = FusedEmbeddingBagCollection([_table(4, IdMapConfig(policy="lru"))], is_weighted=True)
    ids = torch.tensor([BIG, 7])
    nan = KeyedJaggedTensor(["f"], ids, weights=torch.tensor([1.0, float("nan")]), lengths=lengths)
    with pytest.raises(NonFiniteWeightError, match="table 't', feature 'f'"):
        weighted(nan)
    for module in (fused, weighted):
        assert int(module.id_maps["t"].step) == 0  # type: ignore[index]
        assert not module.id_maps["t"].occupied.any()  # type: ignore[index]
    fine = KeyedJaggedTensor(["f"], ids, weights=torch.tensor([1.0, 2.0]), lengths=lengths)
    weighted(fine)
    assert _rows_of(weighted) == {7: 0, BIG: 1}  # new ids take rows in ascending id order


def test_skipped_nonfinite_step_keeps_the_map_update_and_trains_nothing() -> None:
    torch.manual_seed(0)
    table = _table(2, IdMapConfig(policy="lru"))
    fused = FusedEmbeddingBagCollection(
        [table], optimizer=FusedOptimizerConfig(name="adagrad", lr=0.5)
    )
    fused(_kjt([[1], [2]]))["f"].sum().backward()
    out = fused(_kjt([[3], [2]]))["f"]  # 3 evicts 1 (row 0)
    weights = fused.embedding_bags["t"].weight.clone()
    state = fused.kernels()[0].split_optimizer_states()[0]["momentum1"].clone()
    with pytest.warns(RuntimeWarning, match="skipped"):
        (out * float("nan")).sum().backward()
    assert fused.skipped_nonfinite_steps == 1
    assert _rows_of(fused) == {3: 0, 2: 1}  # the map's update stands
    torch.testing.assert_close(fused.embedding_bags["t"].weight, weights)  # nothing trained
    torch.testing.assert_close(fused.embedding_bags["t"].weight[0], _init_row(table, 3, 2))
    torch.testing.assert_close(fused.kernels()[0].split_optimizer_states()[0]["momentum1"], state)
    assert bool((state[0] == 0).all())


def test_id_maps_are_in_the_state_dict() -> None:
    fused = FusedEmbeddingBagCollection([_table(4, IdMapConfig(policy="lfu", admit_after=2))])
    keys = set(fused.state_dict())
    assert {"id_maps.t.row_ids", "id_maps.t.frequency", "id_maps.t.candidate_ids"} <= keys


def test_fused_embedding_collection_maps_raw_ids_to_rows() -> None:
    torch.manual_seed(0)
    table = EmbeddingConfig(
        name="t",
        num_embeddings=4,
        embedding_dim=4,
        feature_names=("f",),
        id_map=IdMapConfig(policy="lru", admit_after=2),
    )
    fec = FusedEmbeddingCollection([table])
    assert "id_maps.t.row_ids" in fec.state_dict()
    out = fec(_kjt([[BIG, BIG], [7]]))["f"]  # BIG admitted (twice), 7 not yet
    rows = _rows_of(fec)
    assert list(rows) == [BIG]
    weight = fec.embeddings["t"].weight
    torch.testing.assert_close(out.values()[0], weight[rows[BIG]])
    torch.testing.assert_close(out.values()[1], weight[rows[BIG]])
    torch.testing.assert_close(out.values()[2], torch.zeros(4))
    assert fec.stats()["t"]["zero_row_ids"] == 1.0
    fec.eval()
    fec(_kjt([[99]]))
    assert list(_rows_of(fec)) == [BIG]  # eval reaches the engine: no new id placed


def _unpooled(
    name: str, rows: int, features: tuple[str, ...], id_map: IdMapConfig | None
) -> EmbeddingConfig:
    return EmbeddingConfig(
        name=name, num_embeddings=rows, embedding_dim=4, feature_names=features, id_map=id_map
    )


def test_plain_embedding_collection_with_torch_sgd_equals_fused_sgd() -> None:
    """Raw ids, a table shared by two features, admission (zero rows), ttl, evictions, an
    unmapped table beside: the plain module trained by torch's SGD equals the fused one."""
    tables = [
        _unpooled(
            "t", 6, ("f", "g"), IdMapConfig(policy="lfu", decay=0.9, ttl_steps=4, admit_after=2)
        ),
        _unpooled("u", 5, ("h",), None),
    ]
    torch.manual_seed(0)
    plain = EmbeddingCollection(tables)
    fused = FusedEmbeddingCollection(tables, optimizer=FusedOptimizerConfig(name="sgd", lr=0.1))
    fused.load_state_dict(plain.state_dict())
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    zero_rows = evictions = 0.0
    for _ in range(15):
        ids = (torch.randint(0, 12, (9,), generator=gen) * BIG - 1).tolist()
        kjt = KeyedJaggedTensor.from_id_lists(
            {"f": [ids[0:3], ids[3:4], []], "g": [ids[4:6], [], ids[6:9]], "h": [[1, 4], [0], []]}
        )
        a, b = plain(kjt), fused(kjt)
        assert sorted(a) == sorted(b) == ["f", "g", "h"]
        for key in a:
            torch.testing.assert_close(a[key].values(), b[key].values(), msg=key)
            assert torch.equal(a[key].lengths(), b[key].lengths())
        assert plain.stats() == fused.stats()
        zero_rows += plain.stats()["t"]["zero_row_ids"]
        evictions += plain.stats()["t"]["evictions"]
        target = torch.randn(9, 4, generator=gen)
        loss_a = ((torch.cat([a["f"].values(), a["g"].values()]) - target) ** 2).sum()
        loss_b = ((torch.cat([b["f"].values(), b["g"].values()]) - target) ** 2).sum()
        sgd.zero_grad()
        (loss_a + a["h"].values().sum()).backward()
        sgd.step()
        (loss_b + b["h"].values().sum()).backward()
        for key, value in fused.state_dict().items():
            torch.testing.assert_close(plain.state_dict()[key], value, msg=key)
    assert zero_rows > 0 and evictions > 0  # admission and eviction both happened
    plain.eval()
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    out = plain(KeyedJaggedTensor.from_id_lists({"f": [[99 * BIG]], "g": [[]], "h": [[2]]}))
    assert torch.equal(out["f"].values(), torch.zeros(1, 4))  # unknown in eval: zeros
    for key, value in plain.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_plain_embedding_collection_checks_unmapped_ids_before_the_map_moves() -> None:
    tables = [_unpooled("t", 4, ("f",), IdMapConfig()), _unpooled("u", 3, ("h",), None)]
    plain = EmbeddingCollection(tables)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    bad = KeyedJaggedTensor.from_id_lists({"f": [[BIG]], "h": [[3]]})
    with pytest.raises(InvalidIdError, match="table 'u'"):
        plain(bad)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert "id_maps.t.row_ids" in plain.state_dict()


def test_sharded_id_maps_refuse_an_init_fn() -> None:
    from recopt.modules.id_map_lookup import refuse_init_fn

    table = EmbeddingBagConfig(
        name="t",
        num_embeddings=4,
        embedding_dim=4,
        feature_names=("f",),
        init_fn=torch.nn.init.zeros_,
        id_map=IdMapConfig(),
    )
    with pytest.raises(ValueError, match=r"tables \['t'\] have id_map and init_fn"):
        refuse_init_fn([table], "on every rank", "do not shard")
    # The default uniform init is accepted.
    refuse_init_fn([_table(4, IdMapConfig())], "on every rank", "do not shard")
