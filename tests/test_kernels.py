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
from recopt.kernels.registry import OPTIMIZERS

CPU = torch.device("cpu")
TABLES = [
    TableSpec(name="t0", num_embeddings=40, embedding_dim=8),
    TableSpec(name="t1", num_embeddings=7, embedding_dim=4),
]
FEATURE_TABLE_MAP = [0, 1, 0]  # features 0 and 2 share table 0
BATCH = 5
NATIVE = [pytest.param(True, id="native"), pytest.param(False, id="torch")]
# From the registry: the optimizers with a native update (the rest, lamb and adafactor, have
# parity tests of their own: tests/test_lamb.py and the SparseAdam/Adafactor tests below), and
# those fbgemm's CPU build runs.
NATIVE_OPTIMIZERS = [name for name, spec in OPTIMIZERS.items() if spec.c_code is not None]
FBGEMM_CPU_OPTIMIZERS = [name for name, spec in OPTIMIZERS.items() if spec.fbgemm_cpu]


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
@pytest.mark.parametrize("name", NATIVE_OPTIMIZERS)
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
@pytest.mark.parametrize("name", NATIVE_OPTIMIZERS)
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


def _make_kernel(
    cfg: FusedOptimizerConfig, native: bool = True, **kw: object
) -> RecoptTableBatchedEmbedding:
    pooling = kw.pop("pooling", PoolingType.SUM)
    assert isinstance(pooling, PoolingType)
    return RecoptTableBatchedEmbedding(
        TABLES, FEATURE_TABLE_MAP, cfg, pooling, CPU, use_native=native
    )


def _dense_grads(
    weights: list[torch.Tensor],
    indices: torch.Tensor,
    offsets: torch.Tensor,
    upstream: torch.Tensor,
) -> list[torch.Tensor]:
    """float64 gradient of sum(pool(weights) * upstream) w.r.t. each whole table."""
    leaf = [w.detach().double().requires_grad_(True) for w in weights]
    out = reference_pool(leaf, FEATURE_TABLE_MAP, indices, offsets, None, PoolingType.SUM)
    (out * upstream).sum().backward()
    return [w.grad for w in leaf]  # type: ignore[misc]


@pytest.mark.parametrize("native", NATIVE)
def test_adam_equals_sparse_adam(native: bool) -> None:
    cfg = FusedOptimizerConfig(name="adam", lr=0.02, betas=(0.8, 0.99), eps=1e-7)
    kernel = _make_kernel(cfg, native)
    params = [torch.nn.Parameter(w.double().clone()) for w in kernel.split_embedding_weights()]
    sparse_adam = torch.optim.SparseAdam(params, lr=0.02, betas=(0.8, 0.99), eps=1e-7)
    gen = torch.Generator().manual_seed(3)
    rows = [t.num_embeddings for t in TABLES]
    for step in range(5):
        indices, offsets, _ = make_batch(gen, [rows[t] for t in FEATURE_TABLE_MAP], False)
        if step == 2:  # table 1 (feature 1) gets no ids: its step still advances
            lengths = offsets.diff()
            keep = torch.ones_like(indices, dtype=torch.bool)
            keep[int(offsets[BATCH]) : int(offsets[2 * BATCH])] = False
            indices = indices[keep]
            lengths[BATCH : 2 * BATCH] = 0
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        out = kernel(indices, offsets)
        upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        out.backward(upstream.float())
        grads = _dense_grads(params, indices, offsets, upstream)
        for t, (p, g) in enumerate(zip(params, grads, strict=True)):
            rows_t = touched_rows(FEATURE_TABLE_MAP, t, indices, offsets)
            p.grad = torch.sparse_coo_tensor(
                rows_t[None], g[rows_t], g.shape, check_invariants=True
            )
        sparse_adam.step()
    for t, (w, p) in enumerate(zip(kernel.split_embedding_weights(), params, strict=True)):
        rel = (w.double() - p.detach()).norm() / p.detach().norm()
        assert rel < 1e-6, f"table {t}: relative error {rel:.2e}"
        state = kernel.split_optimizer_states()[t]
        assert int(state["step"]) == sparse_adam.state[p]["step"] == 5
        for name in ("exp_avg", "exp_avg_sq"):
            ref = sparse_adam.state[p][name]
            assert (state[name].double() - ref).norm() / ref.norm() < 1e-6


def _batch_touching_all_rows(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of every table appears (feature 0 covers t0, feature 1 covers t1)."""
    rows = [TABLES[t].num_embeddings for t in FEATURE_TABLE_MAP]
    ids, lengths = [], []
    for f, r in enumerate(rows):
        extra = (
            torch.randint(0, r, (r // 2,), generator=gen)
            if f != 2
            else torch.zeros(0, dtype=torch.int64)
        )
        feature_ids = torch.cat([torch.randperm(r, generator=gen), extra])
        cuts = torch.sort(
            torch.randint(0, feature_ids.numel() + 1, (BATCH - 1,), generator=gen)
        ).values
        bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([feature_ids.numel()])])
        ids.append(feature_ids)
        lengths.append(bounds.diff())
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(lengths).cumsum(0)])
    return torch.cat(ids), offsets


@pytest.mark.parametrize(
    ("weight_decay", "maximize", "lr"), [(0.0, False, 0.01), (0.1, True, 0.5), (0.0, False, 0.002)]
)
def test_adafactor_equals_torch_when_all_rows_touched(
    weight_decay: float, maximize: bool, lr: float
) -> None:
    cfg = FusedOptimizerConfig(
        name="adafactor",
        lr=lr,
        eps=None,
        weight_decay=weight_decay,
        maximize=maximize,
        clip_threshold=1.0,
    )
    kernel = _make_kernel(cfg)
    params = [torch.nn.Parameter(w.double().clone()) for w in kernel.split_embedding_weights()]
    eps1 = torch.finfo(torch.float32).eps  # the kernel's default epsilon1 (float32 weights)
    adafactor = torch.optim.Adafactor(
        params, lr=lr, eps=(eps1, 1e-3), d=1.0, weight_decay=weight_decay, maximize=maximize
    )
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        indices, offsets = _batch_touching_all_rows(gen)
        out = kernel(indices, offsets)
        upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        out.backward(upstream.float())
        for p, g in zip(params, _dense_grads(params, indices, offsets, upstream), strict=True):
            p.grad = g
        adafactor.step()
    for w, p, state in zip(
        kernel.split_embedding_weights(), params, kernel.split_optimizer_states(), strict=True
    ):
        torch.testing.assert_close(w.double(), p.detach(), rtol=1e-5, atol=1e-6)
        ref = adafactor.state[p]
        torch.testing.assert_close(
            state["row_var"].double(), ref["row_var"].squeeze(1), rtol=1e-5, atol=1e-9
        )
        torch.testing.assert_close(
            state["col_var"].double(), ref["col_var"].squeeze(0), rtol=1e-5, atol=1e-9
        )
        assert int(state["step"]) == int(ref["step"]) == 4


def test_adafactor_leaves_absent_rows_and_decays_their_statistic() -> None:
    kernel = _make_kernel(FusedOptimizerConfig(name="adafactor", lr=0.01))
    indices, offsets = _batch_touching_all_rows(torch.Generator().manual_seed(1))
    kernel(indices, offsets).sum().backward()
    before = [w.clone() for w in kernel.split_embedding_weights()]
    row_var = kernel.split_optimizer_states()[0]["row_var"].clone()
    # Step 2 touches only rows 0 and 1 of table 0, and nothing of table 1.
    offsets2 = torch.tensor([0, 2] + [2] * (3 * BATCH - 1))
    kernel(torch.tensor([0, 1]), offsets2).sum().backward()
    after = kernel.split_embedding_weights()
    assert torch.equal(after[0][2:], before[0][2:]) and torch.equal(after[1], before[1])
    assert not torch.equal(after[0][:2], before[0][:2])
    beta2_t = 2.0**-0.8
    torch.testing.assert_close(
        kernel.split_optimizer_states()[0]["row_var"][2:], row_var[2:] * (1 - beta2_t)
    )


# fbgemm's CPU kernels mishandle a table shared by two features (EXACT_ADAGRAD updates once
# per feature, EXACT_ROWWISE_ADAGRAD raises), so the comparison gives each feature its table.
FBGEMM_MAP = [0, 1]


def _fbgemm_tbe(name: str, pooling: PoolingType, lr: float) -> torch.nn.Module:
    tbe_ops = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    common = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_common")
    configs = pytest.importorskip("fbgemm_gpu.split_embedding_configs")
    optim = {
        "sgd": configs.EmbOptimType.EXACT_SGD,
        "adagrad": configs.EmbOptimType.EXACT_ADAGRAD,
        "row_wise_adagrad": configs.EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    }[name]
    mode = common.PoolingMode.SUM if pooling == PoolingType.SUM else common.PoolingMode.MEAN
    specs = [
        (
            t.num_embeddings,
            t.embedding_dim,
            common.EmbeddingLocation.HOST,
            tbe_ops.ComputeDevice.CPU,
        )
        for t in TABLES
    ]
    return tbe_ops.SplitTableBatchedEmbeddingBagsCodegen(
        specs,
        feature_table_map=FBGEMM_MAP,
        optimizer=optim,
        learning_rate=lr,
        eps=1e-8,
        pooling_mode=mode,
        bounds_check_mode=common.BoundsCheckMode.NONE,
    )


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("name", FBGEMM_CPU_OPTIMIZERS)
@pytest.mark.parametrize(
    ("pooling", "weighted"),
    [(PoolingType.SUM, False), (PoolingType.SUM, True), (PoolingType.MEAN, False)],
)
def test_matches_fbgemm(name: str, pooling: PoolingType, weighted: bool, native: bool) -> None:
    tbe = _fbgemm_tbe(name, pooling, lr=0.05)
    cfg = FusedOptimizerConfig(name=name, lr=0.05)
    kernel = RecoptTableBatchedEmbedding(TABLES, FBGEMM_MAP, cfg, pooling, CPU, use_native=native)
    for mine, theirs in zip(
        kernel.split_embedding_weights(), tbe.split_embedding_weights(), strict=True
    ):
        theirs.copy_(mine)
    gen = torch.Generator().manual_seed(11)
    rows = [TABLES[t].num_embeddings for t in FBGEMM_MAP]
    for _ in range(3):
        indices, offsets, psw = make_batch(gen, rows, weighted)
        out = kernel(indices, offsets, psw)
        expected = tbe(indices, offsets, per_sample_weights=psw)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        upstream = torch.randn(out.shape, generator=gen)
        out.backward(upstream)
        expected.backward(upstream)
    for mine, theirs in zip(
        kernel.split_embedding_weights(), tbe.split_embedding_weights(), strict=True
    ):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    if name != "sgd":
        for mine_s, theirs_s in zip(
            kernel.split_optimizer_states(), tbe.split_optimizer_states(), strict=True
        ):
            torch.testing.assert_close(
                mine_s["momentum1"], theirs_s[0].view_as(mine_s["momentum1"])
            )


@pytest.mark.parametrize("native", NATIVE)
def test_learning_rate_change_takes_effect_at_next_backward(native: bool) -> None:
    kernel = _make_kernel(FusedOptimizerConfig(name="sgd", lr=0.1), native)
    indices, offsets, _ = make_batch(torch.Generator().manual_seed(2), [40, 7, 40], False)
    out = kernel(indices, offsets)
    kernel.set_learning_rate(0.0)  # after forward, before backward: backward must use it
    before = [w.clone() for w in kernel.split_embedding_weights()]
    out.sum().backward()
    assert kernel.get_learning_rate() == 0.0
    assert all(
        torch.equal(a, b) for a, b in zip(before, kernel.split_embedding_weights(), strict=True)
    )
    kernel.set_learning_rate(0.25)
    kernel(indices, offsets).sum().backward()
    # d sum / d row = number of occurrences of the row: sgd moves it by lr * count.
    counts = torch.bincount(indices[: int(offsets[BATCH])], minlength=40).float()
    counts += torch.bincount(indices[int(offsets[2 * BATCH]) :], minlength=40).float()
    torch.testing.assert_close(
        kernel.split_embedding_weights()[0], before[0] - 0.25 * counts[:, None]
    )
    with pytest.raises(ValueError, match="learning rate"):
        kernel.set_learning_rate(-1.0)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize(
    "name", ["adagrad", "row_wise_adagrad", "adam", "row_wise_adam", "row_wise_lamb", "adafactor"]
)
def test_state_round_trip(name: str, native: bool) -> None:
    cfg = FusedOptimizerConfig(name=name, lr=0.05)
    gen = torch.Generator().manual_seed(4)
    batches = [make_batch(gen, [40, 7, 40], True) for _ in range(4)]
    first = _make_kernel(cfg, native)
    for indices, offsets, psw in batches[:2]:
        first(indices, offsets, psw).sum().backward()
    second = _make_kernel(cfg, native)
    for dst, src in zip(
        second.split_embedding_weights(), first.split_embedding_weights(), strict=True
    ):
        dst.copy_(src)
    for dst_s, src_s in zip(
        second.split_optimizer_states(), first.split_optimizer_states(), strict=True
    ):
        assert dst_s.keys() == src_s.keys()
        for key in src_s:
            assert dst_s[key].shape == src_s[key].shape
            dst_s[key].copy_(src_s[key])
    for indices, offsets, psw in batches[2:]:
        for kernel in (first, second):
            kernel(indices, offsets, psw).sum().backward()
    for a, b in zip(first.split_embedding_weights(), second.split_embedding_weights(), strict=True):
        assert torch.equal(a, b)


def test_state_names_and_shapes_follow_the_contract() -> None:
    expected = {
        "sgd": {},
        "adagrad": {"momentum1": (40, 8)},
        "row_wise_adagrad": {"momentum1": (40,)},
        "adam": {"exp_avg": (40, 8), "exp_avg_sq": (40, 8), "step": ()},
        "row_wise_adam": {"exp_avg": (40, 8), "exp_avg_sq": (40,), "step": ()},
        "lamb": {"exp_avg": (40, 8), "exp_avg_sq": (40, 8), "step": ()},
        "row_wise_lamb": {"exp_avg": (40, 8), "exp_avg_sq": (40,), "step": ()},
        "adafactor": {"row_var": (40,), "col_var": (8,), "step": ()},
    }
    for name, shapes in expected.items():
        states = _make_kernel(FusedOptimizerConfig(name=name)).split_optimizer_states()
        assert {k: tuple(v.shape) for k, v in states[0].items()} == shapes


def test_native_pass_is_the_one_that_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    if not cpu_fused.available():
        pytest.skip("no C compiler here: the torch-ops path is what runs")
    calls: list[int] = []
    original = cpu_fused.fused_update

    def counting(*args: object, **kwargs: object) -> None:
        calls.append(1)
        original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_fused, "fused_update", counting)
    for native, expected in ((True, 1), (False, 0)):
        calls.clear()
        kernel = _make_kernel(FusedOptimizerConfig(name="adam"), native)
        indices, offsets, psw = make_batch(torch.Generator().manual_seed(0), [40, 7, 40], True)
        kernel(indices, offsets, psw).sum().backward()
        assert len(calls) == expected


@pytest.mark.parametrize("num_keys", [300, 5_000_000])  # one and three radix passes
def test_native_sort_is_a_stable_sort_by_key(num_keys: int) -> None:
    if not cpu_fused.available():
        pytest.skip("no C compiler here: the torch-ops path is what runs")
    gen = torch.Generator().manual_seed(0)
    batch, n = 1000, 100_000  # above the size where the sort goes multi-threaded
    lengths = torch.full((2 * batch,), n // (2 * batch), dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    indices = torch.randint(0, num_keys // 2, (n,), generator=gen)
    psw = torch.rand(n, generator=gen)
    base, col = torch.tensor([0, num_keys // 2]), torch.tensor([0, 8])
    words, scale = cpu_fused.prepare_sorted(
        indices, offsets, psw, True, batch, base, col, 16, num_keys
    )
    bag = torch.arange(2 * batch).repeat_interleave(lengths)
    keys = indices + base[bag // batch]
    goff = (bag % batch) * 16 + col[bag // batch]
    order = torch.sort(keys, stable=True).indices
    assert torch.equal(words >> 32, keys[order])
    assert torch.equal(words & 0xFFFFFFFF, goff[order])
    assert scale is not None
    torch.testing.assert_close(scale, (psw / lengths[bag].float())[order])


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_native_forward_specialised_dims(pooling: PoolingType) -> None:
    # dims 16/32/64/128/256 take the register-accumulator forward; 12 the generic one.
    tables = [
        TableSpec(name=f"d{d}", num_embeddings=30, embedding_dim=d) for d in (16, 12, 64, 256)
    ]
    ftm = [0, 1, 2, 3, 2]
    gen = torch.Generator().manual_seed(9)
    lengths = torch.randint(0, 5, (len(ftm) * BATCH,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    indices = torch.randint(0, 30, (int(offsets[-1]),), generator=gen)
    psw = torch.rand(indices.numel(), generator=gen)
    cfg = FusedOptimizerConfig(name="sgd")
    kernel = RecoptTableBatchedEmbedding(tables, ftm, cfg, pooling, CPU)
    weights64 = [w.double() for w in kernel.split_embedding_weights()]
    for weights in (None, psw):
        expected = reference_pool(weights64, ftm, indices, offsets, weights, pooling)
        out = kernel(indices, offsets, weights)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
