"""The optimizer registry: per-optimizer defaults against torch's optimizers, validation, and
that every other part of recopt reads the registry instead of naming optimizers itself."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

from recopt.kernels.config import (
    FusedOptimizerConfig,
    PoolingType,
    TableSpec,
    optimizer_state_floats,
)
from recopt.kernels.fbgemm_backend import FBGEMM_OPTIMIZERS
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding
from recopt.kernels.registry import OPTIMIZERS, StateShape
from recopt.kernels.updates import init_state
from recopt.sharding.plan import ShardingType
from recopt.sharding.plan_helpers import ShardingRequest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS, DIM, BATCH = 12, 8, 4
CPU = torch.device("cpu")


def _kernel(cfg: FusedOptimizerConfig, native: bool) -> RecoptTableBatchedEmbedding:
    table = TableSpec(name="t", num_embeddings=ROWS, embedding_dim=DIM)
    return RecoptTableBatchedEmbedding([table], [0], cfg, PoolingType.SUM, CPU, use_native=native)


def _batch(gen: torch.Generator, all_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = (
        torch.randperm(ROWS, generator=gen)
        if all_rows
        else torch.randint(0, ROWS, (6,), generator=gen)
    )
    cuts = torch.sort(torch.randint(0, ids.numel() + 1, (BATCH - 1,), generator=gen)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([ids.numel()])])
    return ids, offsets


def _grad(
    weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, up: torch.Tensor
) -> torch.Tensor:
    leaf = weight.detach().clone().requires_grad_(True)
    (F.embedding_bag(ids, leaf, offsets[:-1], mode="sum") * up).sum().backward()
    assert leaf.grad is not None
    return leaf.grad


@pytest.mark.parametrize("native", [True, False])
def test_fused_adam_defaults_equal_sparse_adam_defaults(native: bool) -> None:
    cfg = FusedOptimizerConfig(name="adam")
    assert cfg.lr == 1e-3  # torch.optim.SparseAdam's default, visible on the config
    kernel = _kernel(cfg, native)
    param = torch.nn.Parameter(kernel.split_embedding_weights()[0].detach().clone())
    reference = torch.optim.SparseAdam([param])
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids, offsets = _batch(gen, all_rows=False)
        out = kernel(ids, offsets)
        up = torch.randn(out.shape, generator=gen)
        out.backward(up)
        dense = _grad(param, ids, offsets, up)
        rows = torch.unique(ids)
        param.grad = torch.sparse_coo_tensor(rows[None], dense[rows], dense.shape)
        reference.step()
    torch.testing.assert_close(
        kernel.split_embedding_weights()[0], param.detach(), rtol=1e-5, atol=1e-6
    )


def test_fused_adafactor_default_eps_equals_torch_adafactor() -> None:
    cfg = FusedOptimizerConfig(name="adafactor")
    assert cfg.eps is None and cfg.lr == 0.01  # torch's defaults: eps1 None, lr 1e-2
    kernel = _kernel(cfg, native=False)
    param = torch.nn.Parameter(kernel.split_embedding_weights()[0].detach().clone())
    reference = torch.optim.Adafactor([param])
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids, offsets = _batch(gen, all_rows=True)
        out = kernel(ids, offsets)
        up = torch.randn(out.shape, generator=gen)
        out.backward(up)
        param.grad = _grad(param, ids, offsets, up)
        reference.step()
    torch.testing.assert_close(
        kernel.split_embedding_weights()[0], param.detach(), rtol=1e-5, atol=1e-6
    )


def test_torch_argument_forms_of_adafactor() -> None:
    cfg = FusedOptimizerConfig(name="adafactor", eps=(None, 1e-2), d=2.0)
    assert (cfg.eps, cfg.eps2, cfg.clip_threshold) == (None, 1e-2, 2.0)
    assert cfg == FusedOptimizerConfig(name="adafactor", eps2=1e-2, clip_threshold=2.0)


def test_explicit_lr_is_kept() -> None:
    assert FusedOptimizerConfig(name="adam", lr=0.05).lr == 0.05
    assert FusedOptimizerConfig(name="row_wise_adagrad").lr == 0.01


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "lr should be >= 0"),
        ({"beta2_decay": 0.5}, "beta2_decay should be <= 0"),
        ({"eps": (-1.0, 1e-3)}, "eps1.* should be >= 0"),
        ({"eps": (None, -1e-3)}, "eps2 should be >= 0"),
        ({"eps2": -1.0}, "eps2 should be >= 0"),
        ({"d": 0.5}, "clip_threshold.* should be >= 1"),
        ({"clip_threshold": 0.5}, "clip_threshold.* should be >= 1"),
        ({"weight_decay": -0.1}, "weight_decay should be >= 0"),
        ({"d": 2.0, "clip_threshold": 3.0}, "name the same setting"),
        ({"name": "lion"}, "'lion' is unknown"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\] \(beta2\) should be in \[0, 1\) but is 1.0"),
        ({"betas": (-0.1, 0.9)}, r"betas\[0\] \(beta1\) should be in \[0, 1\)"),
        ({"betas": 0.9}, r"betas should be two numbers \(beta1, beta2\) but is 0.9"),
    ],
)
def test_invalid_adafactor_arguments_raise_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FusedOptimizerConfig(**{"name": "adafactor", **kwargs})


def test_eps_pair_only_for_adafactor() -> None:
    with pytest.raises(ValueError, match="only adafactor takes"):
        FusedOptimizerConfig(name="adam", eps=(1e-8, 1e-3))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_spec_state_matches_init_state_and_storage(name: str) -> None:
    spec = OPTIMIZERS[name]
    state = init_state(name, ROWS, DIM, CPU)
    floats = {k: v for k, v in state.items() if k != "step"}
    assert [k for k, _ in spec.states] == list(floats)
    assert ("step" in state) == spec.stepped
    assert sum(v.numel() for v in floats.values()) == optimizer_state_floats(name, ROWS, DIM)
    assert set(spec.fbgemm_states) <= set(floats)
    if spec.row_wise:
        assert any(shape is StateShape.PER_ROW for _, shape in spec.states)
    assert (name in FBGEMM_OPTIMIZERS) == (spec.fbgemm_cpu is not None)


def test_optimizer_names_live_only_in_the_registry() -> None:
    names = "|".join(re.escape(n) for n in OPTIMIZERS)
    pattern = re.compile(rf"""["']({names})["']""")
    offenders = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for path in sorted((ROOT / "recopt").rglob("*.py"))
        if path.name != "registry.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, "optimizer names outside kernels/registry.py:\n" + "\n".join(offenders)


@pytest.mark.parametrize("ranks", [None, (), (0, 1)])
def test_table_wise_request_without_one_rank_is_a_value_error(
    ranks: tuple[int, ...] | None,
) -> None:
    with pytest.raises(ValueError, match=r"needs exactly one rank.*table_wise\(r\)"):
        ShardingRequest(sharding_type=ShardingType.TABLE_WISE, ranks=ranks)


def test_sharding_type_traits() -> None:
    rows = {t for t in ShardingType if t.splits_rows}
    cols = {t for t in ShardingType if t.splits_columns}
    host = {t for t in ShardingType if t.host_local}
    whole = {t for t in ShardingType if t.whole_table}
    assert rows == {ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE}
    assert cols == {ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE}
    assert host == {ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE}
    assert whole == {ShardingType.TABLE_WISE, ShardingType.DATA_PARALLEL}
    assert [t for t in ShardingType if t.replicated] == [ShardingType.DATA_PARALLEL]
