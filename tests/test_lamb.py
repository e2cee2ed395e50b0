"""LAMB and row-wise LAMB: recopt's kernel against a plain torch reference of fbgemm's formula.

fbgemm's CUDA LAMB / PARTIAL_ROWWISE_LAMB (codegen/genscript/optimizers.py) are the definition:
Adam's moments of the row's summed gradient, the direction ``r = m_hat / (sqrt(v_hat) + eps) +
weight_decay * w`` and the step ``w -= lr * ||w|| / ||r|| * r`` per row. The reference below is
that, written out row by row in float64. Also: state, config checks, backend choice, sharding
refusals, planner bytes and a checkpoint round trip (the DLRM config: tests/test_dlrm.py; the
sharding contract: tests/test_sharding_contract.py; fbgemm's real CUDA kernel: tests/test_cuda.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from recopt.kernels.config import (
    Backend,
    FusedOptimizerConfig,
    PoolingType,
    TableSpec,
    optimizer_state_floats,
)
from recopt.kernels.factory import auto_candidates, create_kernel
from recopt.kernels.fbgemm_backend import fbgemm_problems
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding
from recopt.kernels.registry import OPTIMIZERS, fbgemm_spec_names
from recopt.sharding.layout import sharding_refusal
from recopt.sharding.plan import ShardingType

CPU = torch.device("cpu")
NAMES = ["lamb", "row_wise_lamb"]
# Two tables; features 0 and 2 share table 0 (a row's gradient sums over both features).
TABLES = [
    TableSpec(name="t0", num_embeddings=9, embedding_dim=8),
    TableSpec(name="t1", num_embeddings=6, embedding_dim=4),
]
FEATURE_TABLES = [0, 1, 0]
BATCH = 4


Tensor = torch.Tensor


def _kernel(
    config: FusedOptimizerConfig, pooling: PoolingType, native: bool
) -> RecoptTableBatchedEmbedding:
    torch.manual_seed(0)
    return RecoptTableBatchedEmbedding(
        TABLES, FEATURE_TABLES, config, pooling, CPU, use_native=native
    )


def _batch(gen: torch.Generator, weighted: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per feature and bag a few ids, with repeats inside bags and across features."""
    ids, lengths = [], []
    for t in FEATURE_TABLES:
        rows = TABLES[t].num_embeddings
        for _ in range(BATCH):
            n = int(torch.randint(0, 4, (1,), generator=gen))
            ids.append(torch.randint(0, min(rows, 5), (n,), generator=gen))  # few rows: repeats
            lengths.append(n)
    indices = torch.cat(ids)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths).cumsum(0)])
    psw = torch.rand(indices.numel(), generator=gen) + 0.5 if weighted else None
    return indices, offsets, psw


def _dense_grads(
    weights: list[Tensor],
    indices: Tensor,
    offsets: Tensor,
    psw: Tensor | None,
    pooling: PoolingType,
    upstream: Tensor,
) -> tuple[list[Tensor], list[Tensor]]:
    """Each table's dense gradient of ``sum(pooled * upstream)``, by autograd on plain torch."""
    leaves = [w.detach().double().clone().requires_grad_(True) for w in weights]
    pooled: list[Tensor] = []
    ids_per_table: list[list[Tensor]] = [[] for _ in TABLES]
    for f, t in enumerate(FEATURE_TABLES):
        offs = offsets[f * BATCH : (f + 1) * BATCH + 1]
        ids = indices[offs[0] : offs[-1]]
        ids_per_table[t].append(ids)
        w = None if psw is None else psw[offs[0] : offs[-1]].double()
        out = F.embedding_bag(ids, leaves[t], offs[:-1] - offs[0], mode="sum", per_sample_weights=w)
        if pooling == PoolingType.MEAN:
            out = out / offs.diff().clamp(min=1).unsqueeze(1).double()
        pooled.append(out)
    (torch.cat(pooled, dim=1) * upstream.double()).sum().backward()
    touched = [torch.unique(torch.cat(parts)) for parts in ids_per_table]
    grads = [leaf.grad for leaf in leaves]
    assert all(g is not None for g in grads)
    return [g for g in grads if g is not None], touched


def reference_lamb_step(
    w: Tensor,
    m: Tensor,
    v: Tensor,
    grad: Tensor,
    rows: Tensor,
    step: int,
    config: FusedOptimizerConfig,
    row_wise: bool,
) -> None:
    """fbgemm's (PARTIAL_ROWWISE_)LAMB on each touched row, in float64, one row at a time."""
    beta1, beta2 = config.betas
    eps, wd, lr = config.eps, config.weight_decay, config.lr
    for r in rows.tolist():
        g = -grad[r] if config.maximize else grad[r]
        m[r] = beta1 * m[r] + (1 - beta1) * g
        # Row-wise: one second moment per row, of the row's mean squared gradient.
        v[r] = beta2 * v[r] + (1 - beta2) * ((g * g).mean() if row_wise else g * g)
        v_hat = v[r] / (1 - beta2**step)
        direction = (m[r] / (1 - beta1**step)) / (torch.sqrt(v_hat) + eps) + wd * w[r]
        trust = torch.linalg.vector_norm(w[r]) / torch.linalg.vector_norm(direction)
        w[r] = w[r] - lr * trust * direction


CASES = [
    pytest.param(name, pooling, weighted, extra, id=f"{name}-{pooling}-{weighted}-{bool(extra)}")
    for name in NAMES
    for pooling, weighted, extra in [
        (PoolingType.SUM, False, {}),
        (PoolingType.SUM, True, {"weight_decay": 0.05}),
        (PoolingType.MEAN, True, {"maximize": True, "betas": (0.8, 0.95), "eps": 0.1}),
        (PoolingType.MEAN, False, {"weight_decay": 0.01}),
    ]
]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("name", "pooling", "weighted", "extra"), CASES)
def test_kernel_equals_fbgemms_formula_over_steps(
    name: str, pooling: PoolingType, weighted: bool, extra: dict, native: bool
) -> None:
    config = FusedOptimizerConfig(name=name, lr=0.05, **extra)
    kernel = _kernel(config, pooling, native)
    row_wise = name == "row_wise_lamb"
    weights = [w.detach().double().clone() for w in kernel.split_embedding_weights()]
    moments = [
        (
            torch.zeros_like(w),
            torch.zeros(w.shape[0], dtype=torch.float64) if row_wise else torch.zeros_like(w),
        )
        for w in weights
    ]
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 6):
        indices, offsets, psw = _batch(gen, weighted)
        out = kernel(indices, offsets, psw)
        upstream = torch.randn(out.shape, generator=gen)
        grads, touched = _dense_grads(weights, indices, offsets, psw, pooling, upstream)
        out.backward(upstream)
        for t, (w, (m, v)) in enumerate(zip(weights, moments, strict=True)):
            reference_lamb_step(w, m, v, grads[t], touched[t], step, config, row_wise)
    states = kernel.split_optimizer_states()
    for t, w in enumerate(kernel.split_embedding_weights()):
        torch.testing.assert_close(w.double(), weights[t], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            states[t]["exp_avg"].double(), moments[t][0], rtol=1e-5, atol=1e-7
        )
        torch.testing.assert_close(
            states[t]["exp_avg_sq"].double(), moments[t][1], rtol=1e-5, atol=1e-9
        )
        assert int(states[t]["step"]) == 5


def test_a_row_whose_direction_is_zero_stays_put() -> None:
    """Zero per-sample weights on step 1: m = 0, so r = 0 (no decay); fbgemm would write
    NaN (``||w|| / 0 * 0``), recopt leaves the row as it was."""
    config = FusedOptimizerConfig(name="lamb", lr=0.1)
    kernel = RecoptTableBatchedEmbedding(TABLES[:1], [0], config, PoolingType.SUM, CPU)
    before = kernel.split_embedding_weights()[0].detach().clone()
    indices, offsets = torch.tensor([2, 3]), torch.tensor([0, 1, 2])
    out = kernel(indices, offsets, torch.tensor([0.0, 1.0]))
    out.backward(torch.ones_like(out))
    after = kernel.split_embedding_weights()[0]
    assert torch.isfinite(after).all()
    assert torch.equal(after[2], before[2])  # zero gradient: zero direction
    assert not torch.equal(after[3], before[3])


@pytest.mark.parametrize("name", NAMES)
def test_state_keys_shapes_and_planner_bytes(name: str) -> None:
    config = FusedOptimizerConfig(name=name)
    kernel = RecoptTableBatchedEmbedding(TABLES, [0, 1], config, PoolingType.SUM, CPU)
    per_row = name == "row_wise_lamb"
    for table, state in zip(TABLES, kernel.split_optimizer_states(), strict=True):
        rows, dim = table.num_embeddings, table.embedding_dim
        assert set(state) == {"exp_avg", "exp_avg_sq", "step"}
        assert state["exp_avg"].shape == (rows, dim)
        assert state["exp_avg_sq"].shape == ((rows,) if per_row else (rows, dim))
        assert state["step"].shape == () and state["step"].dtype == torch.int64
    floats = 1000 * 16 + (1000 if per_row else 1000 * 16)
    assert optimizer_state_floats(name, 1000, 16) == floats
    spec = OPTIMIZERS[name]
    assert spec.fbgemm_states == ("exp_avg", "exp_avg_sq")  # fbgemm's momentum1, momentum2
    assert spec.fbgemm_cuda == {"lamb": "LAMB", "row_wise_lamb": "PARTIAL_ROWWISE_LAMB"}[name]
    assert spec.fbgemm_cpu is None and spec.c_code is None
    assert not spec.fbgemm_remap_eps and not spec.fbgemm_decoupled_weight_decay


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -0.1}, "'lamb': lr should be >= 0 but is -0.1"),
        ({"eps": -1e-8}, r"'lamb': eps \(eps1\) should be >= 0"),
        ({"weight_decay": -0.5}, "'lamb': weight_decay should be >= 0 but is -0.5"),
        ({"betas": (1.0, 0.999)}, r"'lamb': betas\[0\] \(beta1\) should be in \[0, 1\)"),
        ({"betas": (0.9, -0.1)}, r"'lamb': betas\[1\] \(beta2\) should be in \[0, 1\)"),
        ({"betas": (0.9, float("nan"))}, r"betas\[1\] \(beta2\) should be in \[0, 1\)"),
        ({"betas": (0.9,)}, r"'lamb': betas should be two numbers.*betas=\(0.9, 0.999\)"),
        ({"betas": ("a", 0.9)}, "betas should be two numbers"),
    ],
)
def test_bad_hyperparameters_raise_naming_field_value_and_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FusedOptimizerConfig(name="lamb", **kwargs)


def test_betas_from_a_toml_list_become_a_tuple_of_floats() -> None:
    config = FusedOptimizerConfig(name="row_wise_lamb", betas=[0, 0.5])  # type: ignore[arg-type]
    assert config.betas == (0.0, 0.5)
    assert config.lr == 0.01 and config.eps == 1e-8  # fbgemm's TBE defaults


@pytest.mark.real_backend  # the refusals decide, not a pin
@pytest.mark.parametrize("name", NAMES)
def test_fbgemm_runs_lamb_on_cuda_only_and_auto_picks_recopt_on_cpu(name: str) -> None:
    decayed = FusedOptimizerConfig(name=name, weight_decay=0.01)
    # On CUDA fbgemm's formula is recopt's, weight decay included: nothing to refuse.
    assert name in fbgemm_spec_names("cuda") and name not in fbgemm_spec_names("cpu")
    assert fbgemm_problems(TABLES, decayed, torch.device("cuda")) == []
    (problem,) = fbgemm_problems(TABLES, decayed, CPU)
    assert f"fused optimizer {name!r} is not supported by the fbgemm backend on cpu" in problem
    assert "backend='recopt' or 'auto'" in problem
    request = auto_candidates(TABLES, decayed, CPU)
    assert request is not None and request[1] == [Backend.RECOPT]
    kernel = create_kernel(TABLES, [0, 1], decayed, PoolingType.SUM, CPU)
    assert kernel.backend is Backend.RECOPT
    forced = FusedOptimizerConfig(name=name, backend=Backend.FBGEMM)
    with pytest.raises(ValueError, match=f"{name!r} is not supported by the fbgemm backend on cpu"):
        create_kernel(TABLES, [0, 1], forced, PoolingType.SUM, CPU)


def test_fbgemm_steps_keep_lambs_eps_and_set_the_counter() -> None:
    from types import SimpleNamespace

    from recopt.kernels.fbgemm_steps import FbgemmSteps

    args = SimpleNamespace(eps=1e-3, _replace=None)
    tbe = SimpleNamespace(
        iter=torch.zeros(1, dtype=torch.int64),
        iter_cpu=torch.zeros(1, dtype=torch.int64),
        optimizer_args=args,
    )
    step = torch.zeros((), dtype=torch.int64)
    steps = FbgemmSteps([step], ["t0"], 1e-3, 0.999, remap_eps=False)
    step.fill_(4)  # as a checkpoint load writes it
    assert steps.before_forward(tbe, [step]) == 5
    assert int(tbe.iter) == 4 and int(tbe.iter_cpu) == 4  # fbgemm adds one in its forward
    assert tbe.optimizer_args is args and args.eps == 1e-3  # untouched: no _replace call
    steps.after_update([step])
    assert int(step) == 5


@pytest.mark.parametrize("name", NAMES)
def test_column_splits_are_refused_and_the_planner_avoids_them(name: str) -> None:
    from recopt.modules.config import EmbeddingBagConfig
    from recopt.sharding import PlanError, column_wise, construct_module_sharding_plan, row_wise
    from recopt.sharding.layout import resolve_optimizer
    from recopt.sharding.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from recopt.sharding.planner.planner import PlannerError

    refused = {k for k in ShardingType if sharding_refusal(k, name)}
    assert refused == {ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE}
    assert "norms over the full row" in sharding_refusal(ShardingType.COLUMN_WISE, name)
    big = EmbeddingBagConfig(
        name="big", num_embeddings=4096, embedding_dim=128, feature_names=["f"]
    )
    tables = {"m": [big]}
    config = FusedOptimizerConfig(name=name)
    columns = construct_module_sharding_plan([big], {"big": column_wise([0, 1])}, 2)["big"]
    with pytest.raises(PlanError, match=f"table 'big' \\(module 'm'\\): {name} scales each row"):
        resolve_optimizer(big, columns, config, "m")
    rows = construct_module_sharding_plan([big], {"big": row_wise()}, 2)["big"]
    assert resolve_optimizer(big, rows, config, "m").name == name
    topology = Topology(world_size=4)
    only_columns = {
        "big": ParameterConstraints(sharding_types=(ShardingType.COLUMN_WISE,), optimizer=config)
    }
    with pytest.raises(
        PlannerError,
        match=f"{name} supports table_wise, row_wise, table_row_wise and data_parallel sharding",
    ):
        EmbeddingShardingPlanner(topology, constraints=only_columns).plan(tables)
    plan = EmbeddingShardingPlanner(topology, default_optimizer=config).plan(tables)
    assert not plan["m"]["big"].sharding_type.splits_columns


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip_resumes_exactly(name: str, tmp_path: Path) -> None:
    from recopt.checkpoint import load, save
    from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
    from recopt.sparse import KeyedJaggedTensor

    tables = [
        EmbeddingBagConfig(name="t0", num_embeddings=20, embedding_dim=8, feature_names=["a", "b"]),
        EmbeddingBagConfig(name="t1", num_embeddings=10, embedding_dim=4, feature_names=["c"]),
    ]
    config = FusedOptimizerConfig(name=name, lr=0.05, weight_decay=0.01)

    def make(seed: int) -> FusedEmbeddingBagCollection:
        torch.manual_seed(seed)
        return FusedEmbeddingBagCollection(tables, optimizer=config)

    def train(ebc: FusedEmbeddingBagCollection, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(step)
            bags = {
                f: [torch.randint(0, rows, (3,), generator=g).tolist() for _ in range(4)]
                for f, rows in (("a", 20), ("b", 20), ("c", 10))
            }
            pooled = ebc(KeyedJaggedTensor.from_id_lists(bags)).values()
            (pooled * torch.randn(pooled.shape, generator=g)).sum().backward()

    whole, first = make(0), make(0)
    train(whole, range(5))
    train(first, range(3))
    save(tmp_path / "ck", first, first.fused_optimizer)
    resumed = make(7)  # other weights: everything must come from the checkpoint
    load(tmp_path / "ck", resumed, resumed.fused_optimizer)
    saved = first.fused_optimizer.state_dict()["state"]
    for param, states in resumed.fused_optimizer.state_dict()["state"].items():
        assert {key.split(".")[-1] for key in states} == {"exp_avg", "exp_avg_sq", "step"}
        for key, value in states.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(saved[param][key]))
    train(resumed, range(3, 5))
    for key, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    mine = resumed.fused_optimizer.state_dict()["state"]
    for param, states in whole.fused_optimizer.state_dict()["state"].items():
        for key, value in states.items():
            assert torch.equal(torch.as_tensor(mine[param][key]), torch.as_tensor(value))
