"""Tests of recopt's fused embedding kernel against plain-torch references, fbgemm and torch.optim.

Every optimizer runs several steps on batches with repeated ids (within and across bags and
features sharing a table), empty bags, weighted features and both poolings, on the native
CPU pass and on the torch-ops fallback; the reference is written out here in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from recopt.kernels import cpu_fused
from recopt.kernels.config import FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding

CPU = torch.device("cpu")
TABLES = [
    TableSpec(name="t0", num_embeddings=40, embedding_dim=8),
    TableSpec(name="t1", num_embeddings=7, embedding_dim=4),
]
FEATURE_TABLE_MAP = [0, 1, 0]  # features 0 and 2 share table 0
BATCH = 5
NATIVE = [pytest.param(True, id="native"), pytest.param(False, id="torch")]


def make_batch(
    gen: torch.Generator, rows: list[int], weighted: bool, max_len: int = 6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """KJT-layout batch: bag lengths 0..max_len (empty bags), ids drawn with repeats."""
    lengths = torch.randint(0, max_len + 1, (len(rows) * BATCH,), generator=gen)
    lengths[0] = 0  # always one empty bag
    lengths[1] = max_len  # and a long one
    ids = []
    for f, r in enumerate(rows):
        n = int(lengths[f * BATCH : (f + 1) * BATCH].sum())
        ids.append(torch.randint(0, r, (n,), generator=gen))
    indices = torch.cat(ids)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    psw = torch.rand(indices.numel(), generator=gen) + 0.5 if weighted else None
    return indices, offsets, psw


def reference_pool(
    weights: list[torch.Tensor],
    ftm: list[int],
    indices: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None,
    pooling: PoolingType,
) -> torch.Tensor:
    """Bag by bag, the pooled output of the kernel contract."""
    batch = (offsets.numel() - 1) // len(ftm)
    cols = []
    for f, t in enumerate(ftm):
        bags = []
        for b in range(batch):
            lo, hi = int(offsets[f * batch + b]), int(offsets[f * batch + b + 1])
            rows = weights[t][indices[lo:hi]]
            if psw is not None:
                rows = rows * psw[lo:hi, None]
            pooled = rows.sum(0)
            if pooling == PoolingType.MEAN and hi > lo:
                pooled = pooled / (hi - lo)
            bags.append(pooled)
        cols.append(torch.stack(bags))
    return torch.cat(cols, dim=1)


def touched_rows(
    ftm: list[int], t: int, indices: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    batch = (offsets.numel() - 1) // len(ftm)
    ids = [
        indices[int(offsets[f * batch]) : int(offsets[(f + 1) * batch])]
        for f, tt in enumerate(ftm)
        if tt == t
    ]
    return torch.unique(torch.cat(ids)) if ids else torch.zeros(0, dtype=torch.int64)


def reference_update(
    cfg: FusedOptimizerConfig,
    lr: float,
    w: torch.Tensor,
    state: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
) -> None:
    """The optimizers' formulas, written out on the touched rows (float64, in place)."""
    g = -grad[rows] if cfg.maximize else grad[rows]
    eps = cfg.eps if cfg.eps is not None else 1e-8
    if "step" in state:
        state["step"] += 1
    if rows.numel() == 0:
        return
    g = g + cfg.weight_decay * w[rows]
    if cfg.name == "sgd":
        w[rows] -= lr * g
    elif cfg.name == "adagrad":
        state["momentum1"][rows] += g * g
        w[rows] -= lr * g / (state["momentum1"][rows].sqrt() + eps)
    elif cfg.name == "row_wise_adagrad":
        state["momentum1"][rows] += (g * g).mean(1)
        w[rows] -= lr * g / (state["momentum1"][rows].sqrt() + eps)[:, None]
    else:  # adam, row_wise_adam
        b1, b2 = cfg.betas
        step = int(state["step"])
        m = state["exp_avg"]
        m[rows] = b1 * m[rows] + (1 - b1) * g
        v = state["exp_avg_sq"]
        if v.dim() == 2:
            v[rows] = b2 * v[rows] + (1 - b2) * g * g
            denom = v[rows].sqrt() + eps
        else:
            v[rows] = b2 * v[rows] + (1 - b2) * (g * g).mean(1)
            denom = (v[rows].sqrt() + eps)[:, None]
        step_size = lr * math.sqrt(1 - b2**step) / (1 - b1**step)
        w[rows] -= step_size * m[rows] / denom


def run_against_reference(
    cfg: FusedOptimizerConfig,
    pooling: PoolingType,
    weighted: bool,
    native: bool,
    tables: list[TableSpec] = TABLES,
    steps: int = 3,
) -> None:
    kernel = RecoptTableBatchedEmbedding(
        tables, FEATURE_TABLE_MAP, cfg, pooling, CPU, use_native=native
    )
    ref_w = [w.double().clone() for w in kernel.split_embedding_weights()]
    ref_s = [{k: v.double().clone() for k, v in s.items()} for s in kernel.split_optimizer_states()]
    gen = torch.Generator().manual_seed(7)
    rows = [tables[t].num_embeddings for t in FEATURE_TABLE_MAP]
    for _ in range(steps):
        indices, offsets, psw = make_batch(gen, rows, weighted)
        leaf = [w.clone().requires_grad_(True) for w in ref_w]
        psw64 = None if psw is None else psw.double().requires_grad_(True)
        expected = reference_pool(leaf, FEATURE_TABLE_MAP, indices, offsets, psw64, pooling)
        upstream = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
        (expected * upstream).sum().backward()
        psw_in = None if psw is None else psw.clone().requires_grad_(True)
        out = kernel(indices, offsets, psw_in)
        torch.testing.assert_close(out.double(), expected.detach(), rtol=1e-5, atol=1e-6)
        (out * upstream.float()).sum().backward()
        if psw_in is not None and psw64 is not None:
            torch.testing.assert_close(psw_in.grad.double(), psw64.grad, rtol=1e-5, atol=1e-6)
        for t in range(len(tables)):
            rows_t = touched_rows(FEATURE_TABLE_MAP, t, indices, offsets)
            assert leaf[t].grad is not None
            reference_update(cfg, cfg.lr, ref_w[t], ref_s[t], rows_t, leaf[t].grad)
    for t, (w, s) in enumerate(
        zip(kernel.split_embedding_weights(), kernel.split_optimizer_states(), strict=True)
    ):
        torch.testing.assert_close(w.double(), ref_w[t], rtol=1e-5, atol=2e-6)
        for name, value in s.items():
            torch.testing.assert_close(
                value.double(), ref_s[t][name].double(), rtol=1e-5, atol=1e-6
            )


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("name", ["sgd", "adagrad", "row_wise_adagrad", "adam", "row_wise_adam"])
@pytest.mark.parametrize(
    ("pooling", "weighted"),
    [
        (PoolingType.SUM, False),
        (PoolingType.SUM, True),
        (PoolingType.MEAN, False),
        (PoolingType.MEAN, True),
    ],
)
def test_optimizer_matches_reference(
    name: str, pooling: PoolingType, weighted: bool, native: bool
) -> None:
    cfg = FusedOptimizerConfig(name=name, lr=0.05)
    run_against_reference(cfg, pooling, weighted, native)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("name", ["sgd", "adagrad", "row_wise_adagrad", "adam", "row_wise_adam"])
def test_weight_decay_and_maximize(name: str, native: bool) -> None:
    cfg = FusedOptimizerConfig(name=name, lr=0.03, weight_decay=0.1, maximize=True, eps=1e-6)
    run_against_reference(cfg, PoolingType.SUM, True, native)


@pytest.mark.parametrize("native", NATIVE)
def test_few_rows_touched_in_a_large_table(native: bool) -> None:
    tables = [
        TableSpec(name="big", num_embeddings=5000, embedding_dim=8),
        TableSpec(name="small", num_embeddings=7, embedding_dim=4),
    ]
    run_against_reference(
        FusedOptimizerConfig(name="adam", lr=0.05), PoolingType.SUM, False, native, tables
    )


def test_native_library_builds() -> None:
    if not cpu_fused.available():
        pytest.skip("no C compiler here: the torch-ops path is what runs")
    assert cpu_fused.available()
