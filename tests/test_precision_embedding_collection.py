"""fp16 weights (``weight_dtype``) in the embedding collections (EmbeddingConfig tables)."""

from __future__ import annotations

import pytest
import torch

from recopt.kernels.config import FusedOptimizerConfig
from recopt.kernels.placement import Location, Placement
from recopt.modules import EmbeddingCollection, EmbeddingConfig, FusedEmbeddingCollection
from recopt.sharding.planner.constraints import ParameterConstraints, TableWorkload
from recopt.sharding.planner.enumerator import table_workload
from recopt.sharding.planner.storage import CACHE_SLOT_BYTES, resident_bytes
from recopt.sparse import KeyedJaggedTensor

LR = 0.5


def _tables() -> list[EmbeddingConfig]:
    """t0 (fp16) serves a and b, t1 (fp16, dim 8) serves c."""
    return [
        EmbeddingConfig(
            name="t0",
            num_embeddings=10,
            embedding_dim=4,
            feature_names=["a", "b"],
            weight_dtype="fp16",
        ),
        EmbeddingConfig(
            name="t1", num_embeddings=6, embedding_dim=8, feature_names=["c"], weight_dtype="fp16"
        ),
    ]


def _batch() -> KeyedJaggedTensor:
    ids = {"a": [[1, 1, 2], [2]], "b": [[2], [7]], "c": [[0, 5], [5]]}
    return KeyedJaggedTensor.from_id_lists(ids)


@pytest.mark.parametrize(
    "backend, rounding",
    [("recopt", True), ("recopt", False), ("fbgemm", False)],
)
def test_fused_collection_fp16_rows_fp32_outputs_sgd_matches_fp32(
    backend: str, rounding: bool
) -> None:
    if backend == "fbgemm":
        pytest.importorskip("fbgemm_gpu")
    torch.manual_seed(0)
    optimizer = FusedOptimizerConfig(
        name="sgd", lr=LR, backend=backend, stochastic_rounding=rounding
    )
    ec = FusedEmbeddingCollection(_tables(), optimizer=optimizer)
    state = ec.state_dict()
    assert {state[f"embeddings.{t}.weight"].dtype for t in ("t0", "t1")} == {torch.float16}
    before = {t: state[f"embeddings.{t}.weight"].float().clone() for t in ("t0", "t1")}

    features = _batch()
    out = ec(features)
    assert set(out) == {"a", "b", "c"}
    generator = torch.Generator().manual_seed(1)
    loss = torch.zeros(())
    grads = {}
    for key, jt in out.items():
        assert jt.values().dtype == torch.float32
        grads[key] = torch.randn(jt.values().shape, generator=generator)
        loss = loss + (jt.values() * grads[key]).sum()
    # The forward reads the stored fp16 rows exactly (upcast to fp32).
    table_of = {"a": "t0", "b": "t0", "c": "t1"}
    for key, jt in out.items():
        expected = before[table_of[key]][features[key].values()]
        torch.testing.assert_close(jt.values().detach(), expected)
    loss.backward()

    # fp32 reference SGD step: each id's row moves by -lr * its output gradient (summed).
    reference = {t: w.clone() for t, w in before.items()}
    for key in out:
        reference[table_of[key]].index_add_(0, features[key].values(), -LR * grads[key])
    after = ec.state_dict()
    for t in ("t0", "t1"):
        weight = after[f"embeddings.{t}.weight"]
        assert weight.dtype == torch.float16
        # recopt rounds each row once (within one fp16 ulp, 2**-10 relative); fbgemm's CPU
        # kernel rounds once per id occurrence, so a repeated id may be a few ulps off.
        ulps = 1 if backend == "recopt" else 4
        ulp = torch.finfo(torch.float16).eps * reference[t].abs().clamp_min(2**-14)
        assert ((weight.float() - reference[t]).abs() <= ulps * ulp + 1e-7).all()
    untouched = before["t0"][[0, 3, 4, 5, 6, 8, 9]]
    torch.testing.assert_close(
        after["embeddings.t0.weight"].float()[[0, 3, 4, 5, 6, 8, 9]], untouched
    )


def test_plain_collection_fp16_rows_return_fp32() -> None:
    torch.manual_seed(0)
    ec = EmbeddingCollection(_tables())
    weight = ec.state_dict()["embeddings.t0.weight"]
    assert weight.dtype == torch.float16
    out = ec(_batch())
    assert out["a"].values().dtype == torch.float32
    torch.testing.assert_close(out["a"].values(), weight.float()[torch.tensor([1, 1, 2, 2])])


def test_planner_hbm_and_host_bytes_of_an_fp16_table_per_placement() -> None:
    rows, dim = 1000, 16
    table = EmbeddingConfig(
        name="t", num_embeddings=rows, embedding_dim=dim, feature_names=["f"], weight_dtype="fp16"
    )
    optimizer = FusedOptimizerConfig(name="adagrad", state_dtype="fp16", stochastic_rounding=False)
    workload = table_workload(table, ParameterConstraints(), 64, optimizer)
    assert (workload.weight_bytes, workload.state_bytes) == (2, 2)
    values = rows * dim  # weights, and adagrad's state (one value per weight)
    assert resident_bytes(rows, dim, workload) == (2 * values + 2 * values, 0)
    uvm = Placement(location=Location.UVM)
    assert resident_bytes(rows, dim, workload, uvm) == (0, 2 * values + 2 * values)
    cached = Placement(location=Location.UVM_CACHING, cache_load_factor=0.1)
    cache = 100 * (2 * dim + CACHE_SLOT_BYTES)  # 100 slots of fp16 rows
    assert resident_bytes(rows, dim, workload, cached) == (cache, 4 * values)
    # Explicit bytes still win (as placement's own tests pass them).
    explicit = TableWorkload(
        batch_size=64, num_features=1, pooling_factor=1.0, optimizer=optimizer, weight_bytes=4
    )
    assert (explicit.weight_bytes, explicit.state_bytes) == (4, 2)
