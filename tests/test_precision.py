"""Reduced-precision weights and optimizer state: stochastic rounding, kernels, modules, configs.

Tiers: the rounding function alone, then one kernel against an fp32 reference, then modules.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

from recopt.kernels import registry
from recopt.kernels.config import Backend, FusedOptimizerConfig, PoolingType, TableSpec
from recopt.kernels.factory import choose_backend
from recopt.kernels.precision import (
    Precision,
    make_generator,
    parse_precision,
    stochastic_round,
    stochastic_round_torch,
)
from recopt.kernels.recopt_backend import RecoptTableBatchedEmbedding
from recopt.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    FusedEmbeddingBagCollection,
)
from recopt.sparse import KeyedJaggedTensor

CPU = torch.device("cpu")
REDUCED = [torch.float16, torch.bfloat16]
ROW_OPTIMIZERS = [n for n, s in registry.OPTIMIZERS.items() if not s.whole_table_statistics]


def _neighbours(start: float, dtype: torch.dtype) -> tuple[float, float]:
    lo = torch.tensor(start, dtype=dtype)
    hi = torch.nextafter(lo, torch.tensor(math.inf, dtype=dtype))
    return lo.item(), hi.item()


# Rounding ----------------------------------------------------------------------------------


# The CPU's native pass (when a C compiler is there) and the torch ops every device runs.
ROUNDERS = {"default": stochastic_round, "torch": stochastic_round_torch}


@pytest.mark.parametrize("rounder", ROUNDERS)
@pytest.mark.parametrize("dtype", REDUCED)
@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.77])
@pytest.mark.parametrize("start", [1.0, -3.0, 1e-3, -3e-6])  # -3e-6: fp16 subnormal
def test_stochastic_rounding_is_unbiased(
    rounder: str, dtype: torch.dtype, fraction: float, start: float
) -> None:
    lo, hi = _neighbours(start, dtype)
    x = lo + fraction * (hi - lo)
    n = 200_000
    rounded = ROUNDERS[rounder](torch.full((n,), x), dtype, make_generator(7, CPU))
    values = rounded.float()
    assert set(values.unique().tolist()) <= {lo, hi}
    # Each draw is lo + (hi - lo) * Bernoulli(p); p's estimate has std sqrt(p(1-p)/n).
    p = (x - lo) / (hi - lo)
    bound = 5 * math.sqrt(p * (1 - p) / n) * abs(hi - lo)
    assert abs(values.double().mean().item() - x) < bound
    assert bound < 0.01 * abs(hi - lo)  # the test can tell a 1% bias


@pytest.mark.parametrize("rounder", ROUNDERS)
@pytest.mark.parametrize("dtype", REDUCED)
def test_stochastic_rounding_seeded_reproducible_and_exact_values_kept(
    rounder: str, dtype: torch.dtype
) -> None:
    stochastic_round = ROUNDERS[rounder]
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    first = stochastic_round(x, dtype, make_generator(3, CPU))
    again = stochastic_round(x, dtype, make_generator(3, CPU))
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    gen = make_generator(3, CPU)
    step1, step2 = stochastic_round(x, dtype, gen), stochastic_round(x, dtype, gen)
    assert not torch.equal(step1, step2)  # the stream advances: steps round differently
    exact = x.to(dtype).float()
    torch.testing.assert_close(stochastic_round(exact, dtype, gen).float(), exact, rtol=0, atol=0)
    special = torch.tensor([math.inf, -math.inf, 0.0, -0.0])
    torch.testing.assert_close(
        stochastic_round(special, dtype, gen).float(), special.to(dtype).float(), rtol=0, atol=0
    )
    assert torch.isnan(stochastic_round(torch.tensor([math.nan]), dtype, gen)).all()
    # Every result is one of x's two neighbours in the dtype.
    rounded = stochastic_round(x, dtype, gen).float()
    down = torch.where(
        x.to(dtype).float() <= x,
        x.to(dtype),
        torch.nextafter(x.to(dtype), x.to(dtype).new_tensor(-math.inf)),
    )
    up = torch.nextafter(down, down.new_tensor(math.inf)).float()
    assert torch.all((rounded == down.float()) | (rounded == up))


def test_precision_parsing_and_errors() -> None:
    assert parse_precision("FP16", "x") is Precision.FP16
    assert parse_precision(torch.bfloat16, "x") is Precision.BF16
    assert parse_precision("torch.float32", "x") is Precision.FP32
    assert Precision.FP16.bytes == 2 and Precision.FP32.dtype == torch.float32
    with pytest.raises(ValueError, match=r"table 't': weight_dtype: 'fp8'.*'fp32', 'fp16', 'bf16'"):
        EmbeddingBagConfig(
            name="t", num_embeddings=4, embedding_dim=4, feature_names=["f"], weight_dtype="fp8"
        )
    with pytest.raises(ValueError, match=r"state_dtype: torch.int8"):
        FusedOptimizerConfig(name="adam", state_dtype=torch.int8)
    with pytest.raises(ValueError, match="rounding_seed must be an int, got 1.5"):
        FusedOptimizerConfig(rounding_seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stochastic_rounding must be true or false"):
        FusedOptimizerConfig(stochastic_rounding="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="adafactor.*state_dtype='fp32'"):
        FusedOptimizerConfig(name="adafactor", state_dtype="bf16")
    config = EmbeddingBagConfig(
        name="t", num_embeddings=4, embedding_dim=4, feature_names=["f"], weight_dtype="half"
    )
    assert config.weight_dtype is Precision.FP16
    with pytest.raises(ValueError, match="weight_dtype 'fp16' with 'adafactor'"):
        FusedEmbeddingBagCollection([config], optimizer=FusedOptimizerConfig(name="adafactor"))


# One kernel against an fp32 reference -------------------------------------------------------


def _train_kernel(
    weight_dtype: str,
    optimizer: FusedOptimizerConfig,
    steps: int = 3,
    backend: str = "recopt",
    device: torch.device = CPU,
    native: bool = True,
) -> torch.Tensor:
    spec = TableSpec(name="t", num_embeddings=64, embedding_dim=8, weight_dtype=weight_dtype)
    if backend == "recopt":
        kernel: torch.nn.Module = RecoptTableBatchedEmbedding(
            [spec], [0], optimizer, PoolingType.MEAN, device, use_native=native
        )
    else:
        from recopt.kernels.fbgemm_backend import FbgemmTableBatchedEmbedding

        kernel = FbgemmTableBatchedEmbedding([spec], [0], optimizer, PoolingType.MEAN, device)
    start = torch.linspace(-1, 1, 64 * 8).view(64, 8)
    # Start every run from values every dtype holds exactly.
    start = start.to(torch.bfloat16).float()
    with torch.no_grad():
        kernel.split_embedding_weights()[0].copy_(start)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 64, (48,), generator=gen).to(device)
        out = kernel(ids, torch.arange(0, 49, 4, device=device))
        assert out.dtype == torch.float32
        # Gradients of order 1: fp16 state holds their squares (see the precision docs).
        (out * torch.randn(out.shape, generator=gen).add(3.0).to(device)).sum().backward()
    return kernel.split_embedding_weights()[0].float().cpu()


@pytest.mark.parametrize("native", [True, False])  # the C pass and torch ops
@pytest.mark.parametrize("name", ROW_OPTIMIZERS)
@pytest.mark.parametrize(
    ("weights", "state"),
    [("fp16", "fp32"), ("bf16", "fp32"), ("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp16")],
)
def test_reduced_update_matches_fp32_within_rounding(
    native: bool, name: str, weights: str, state: str
) -> None:
    steps = 3
    reference = _train_kernel("fp32", FusedOptimizerConfig(name=name, lr=0.05), steps)
    config = FusedOptimizerConfig(name=name, lr=0.05, state_dtype=state)
    reduced = _train_kernel(weights, config, steps, native=native)
    # Each step rounds a weight to a neighbour (error < one unit in the last place, ulp <=
    # eps * |w|), and rounded state changes the step's size by a relative error of order eps;
    # over `steps` steps the weights differ by at most a few ulps of the largest weight.
    eps = torch.finfo(Precision(weights if weights != "fp32" else state).dtype).eps
    bound = 2 * steps * eps * reference.abs().max().item()
    assert (reduced - reference).abs().max().item() <= bound
    assert not torch.equal(reduced, reference) or name == "sgd"


@pytest.mark.parametrize("name", ["sgd", "adagrad", "row_wise_adagrad"])
def test_fbgemm_fp16_matches_recopt_rounded_to_nearest(name: str) -> None:
    pytest.importorskip("fbgemm_gpu")
    config = FusedOptimizerConfig(name=name, lr=0.05, stochastic_rounding=False)
    ours = _train_kernel("fp16", config, backend="recopt")
    theirs = _train_kernel("fp16", config, backend="fbgemm")
    assert (ours - theirs).abs().max().item() <= 2 * torch.finfo(torch.float16).eps


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["recopt", "fbgemm"])
def test_cuda_reduced_update_matches_fp32_and_repeats(backend: str) -> None:
    if backend == "fbgemm":
        pytest.importorskip("fbgemm_gpu")
    cuda = torch.device("cuda")
    name = "row_wise_adagrad"
    reference = _train_kernel("fp32", FusedOptimizerConfig(name=name, lr=0.05), device=cuda)
    config = FusedOptimizerConfig(name=name, lr=0.05)
    first = _train_kernel("fp16", config, backend=backend, device=cuda)
    bound = 2 * 3 * torch.finfo(torch.float16).eps * reference.abs().max().item()
    assert (first - reference).abs().max().item() <= bound
    if backend == "recopt":  # seeded on the device's generator: a second run is identical
        torch.testing.assert_close(
            _train_kernel("fp16", config, device=cuda), first, rtol=0, atol=0
        )


def test_native_pass_runs_fp16_and_bf16_weights_and_state() -> None:
    from recopt.kernels import cpu_fused

    if not cpu_fused.available():
        pytest.skip("no C compiler: the native pass is not built")
    tables = [
        TableSpec(name="a", num_embeddings=40, embedding_dim=8, weight_dtype="fp16"),
        TableSpec(name="b", num_embeddings=30, embedding_dim=4, weight_dtype="bf16"),
    ]
    config = FusedOptimizerConfig(name="adam", lr=0.05)
    kernel = RecoptTableBatchedEmbedding(tables, [0, 1], config, PoolingType.SUM, CPU)
    ids, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3, 4])
    out = kernel(ids, offsets)
    reference = RecoptTableBatchedEmbedding(
        tables, [0, 1], config, PoolingType.SUM, CPU, use_native=False
    )
    with torch.no_grad():
        for mine, theirs in zip(kernel.weights, reference.weights, strict=True):
            theirs.copy_(mine)
    # The native pooling sums the rows in float32, as the torch path does.
    torch.testing.assert_close(out, reference(ids, offsets), rtol=0, atol=1e-6)
    assert kernel._native_ok(out, ids, offsets, None)  # fp32 state, stochastic: native
    for state in ("fp32", "fp16", "bf16"):  # and any state dtype, rounded either way
        for stochastic in (True, False):
            other = dataclasses.replace(config, state_dtype=state, stochastic_rounding=stochastic)
            kernel = RecoptTableBatchedEmbedding(tables, [0, 1], other, PoolingType.SUM, CPU)
            assert kernel._native_ok(out, ids, offsets, None)


def test_small_updates_survive_stochastic_rounding_not_nearest() -> None:
    # lr * grad = 1e-4 per step is under half an fp16 ulp at 1.0 (2^-11 ~ 4.9e-4): rounding
    # to nearest loses every step; stochastic rounding keeps them on average.
    steps, rows = 100, 256

    def run(stochastic: bool) -> torch.Tensor:
        config = FusedOptimizerConfig(name="sgd", lr=1e-4, stochastic_rounding=stochastic)
        spec = TableSpec(name="t", num_embeddings=rows, embedding_dim=8, weight_dtype="fp16")
        kernel = RecoptTableBatchedEmbedding([spec], [0], config, PoolingType.SUM, CPU)
        with torch.no_grad():
            kernel.split_embedding_weights()[0].fill_(1.0)
        ids, offsets = torch.arange(rows), torch.arange(rows + 1)
        for _ in range(steps):
            kernel(ids, offsets).sum().backward()
        return kernel.split_embedding_weights()[0].double()

    expected = 1.0 - steps * 1e-4
    assert torch.all(run(False) == 1.0)
    stochastic = run(True)
    # Per element, the sum of `steps` independent roundings of gap <= 2^-11 each: std at most
    # sqrt(steps) * 2^-11 / 2; the mean of rows * 8 elements has that over sqrt(rows * 8).
    bound = 5 * math.sqrt(steps) * 2**-12 / math.sqrt(rows * 8)
    assert abs(stochastic.mean().item() - expected) < bound


@pytest.mark.real_backend  # the refusals decide, not a pin
def test_fbgemm_refuses_what_its_cpu_build_lacks_and_auto_picks_recopt() -> None:
    fp16 = [TableSpec(name="t", num_embeddings=8, embedding_dim=8, weight_dtype="fp16")]
    bf16 = [TableSpec(name="t", num_embeddings=8, embedding_dim=8, weight_dtype="bf16")]
    cases = [
        (fp16, FusedOptimizerConfig(name="sgd"), "stochastic_rounding=False"),
        (bf16, FusedOptimizerConfig(name="sgd", stochastic_rounding=False), "bf16 weights"),
        (
            [TableSpec(name="t", num_embeddings=8, embedding_dim=8)],
            FusedOptimizerConfig(name="adagrad", state_dtype="fp16"),
            "state_dtype 'fp16'",
        ),
    ]
    for tables, optimizer, message in cases:
        with pytest.raises(ValueError, match=message):
            choose_backend(tables, dataclasses.replace(optimizer, backend=Backend.FBGEMM), CPU)
        assert choose_backend(tables, optimizer, CPU) is Backend.RECOPT


# Modules ------------------------------------------------------------------------------------


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="t16",
            num_embeddings=20,
            embedding_dim=4,
            feature_names=["a"],
            weight_dtype=torch.float16,
        ),
        EmbeddingBagConfig(
            name="tb16",
            num_embeddings=20,
            embedding_dim=4,
            feature_names=["b"],
            weight_dtype="bf16",
        ),
        EmbeddingBagConfig(name="t32", num_embeddings=20, embedding_dim=4, feature_names=["c"]),
    ]


def _batch() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_id_lists(
        {"a": [[1, 2], [3]], "b": [[4], [5, 6, 7]], "c": [[8], []]}
    )


def test_fused_collection_keeps_each_tables_dtype_and_is_reproducible() -> None:
    def build(seed: int) -> FusedEmbeddingBagCollection:
        torch.manual_seed(0)
        optimizer = FusedOptimizerConfig(
            name="adam", lr=0.1, state_dtype="bf16", rounding_seed=seed
        )
        return FusedEmbeddingBagCollection(_tables(), optimizer=optimizer)

    first, second, other = build(0), build(0), build(1)
    for ebc in (first, second, other):
        for _ in range(3):
            pooled = ebc(_batch())
            assert pooled.values().dtype == torch.float32
            pooled.values().square().sum().backward()
    weights = first.state_dict()
    assert weights["embedding_bags.t16.weight"].dtype == torch.float16
    assert weights["embedding_bags.tb16.weight"].dtype == torch.bfloat16
    assert weights["embedding_bags.t32.weight"].dtype == torch.float32
    state = first.fused_optimizer.state_dict()["state"]
    assert state["embedding_bags.t16.weight"]["t16.exp_avg"].dtype == torch.bfloat16
    assert state["embedding_bags.t16.weight"]["t16.step"].dtype == torch.int64
    for key, value in weights.items():
        torch.testing.assert_close(second.state_dict()[key], value, rtol=0, atol=0)
    assert not torch.equal(
        other.state_dict()["embedding_bags.t16.weight"], weights["embedding_bags.t16.weight"]
    )


def test_plain_collection_stores_reduced_weights_and_returns_fp32() -> None:
    ebc = EmbeddingBagCollection(_tables())
    assert ebc.embedding_bags["t16"].weight.dtype == torch.float16
    pooled = ebc(_batch())
    assert pooled.values().dtype == torch.float32
    pooled.values().sum().backward()
    assert ebc.embedding_bags["tb16"].weight.grad is not None
    assert ebc.embedding_bags["tb16"].weight.grad.dtype == torch.bfloat16


# Planner and plan ---------------------------------------------------------------------------


def test_storage_counts_bytes_per_weight_and_state_value_from_the_dtypes() -> None:
    from recopt.sharding import ShardingType
    from recopt.sharding.planner.constraints import TableWorkload
    from recopt.sharding.planner.storage import shard_storage_bytes

    rows, dim = 1000, 64

    def storage(weights: str, state: str) -> int:
        optimizer = FusedOptimizerConfig(name="adam", state_dtype=state)
        workload = TableWorkload(
            batch_size=8,
            num_features=1,
            pooling_factor=2.0,
            optimizer=optimizer,
            weight_dtype=Precision(weights),
        )
        return shard_storage_bytes(ShardingType.TABLE_WISE, rows, dim, rows, workload, 1)

    # 2 bytes saved per weight; adam holds 2 * rows * dim state values, 2 bytes saved each.
    assert storage("fp32", "fp32") - storage("fp16", "fp32") == 2 * rows * dim
    assert storage("fp16", "fp32") - storage("bf16", "bf16") == 2 * 2 * rows * dim


def test_planner_keeps_fbgemm_off_what_it_cannot_run_and_plans_keep_state_dtype() -> None:
    from recopt.sharding import ShardingPlan, construct_module_sharding_plan, table_wise
    from recopt.sharding.planner import EmbeddingShardingPlanner, Topology

    table = EmbeddingBagConfig(
        name="t", num_embeddings=100, embedding_dim=8, feature_names=["f"], weight_dtype="fp16"
    )
    optimizer = FusedOptimizerConfig(name="sgd", backend="fbgemm")
    planner = EmbeddingShardingPlanner(Topology(world_size=1), default_optimizer=optimizer)
    with pytest.raises(ValueError, match="stochastic_rounding=False"):
        planner.plan({"": [table]})
    state = FusedOptimizerConfig(name="adam", state_dtype="bf16", rounding_seed=5)
    shardings = construct_module_sharding_plan([table], {"t": table_wise(0, optimizer=state)}, 1)
    plan = ShardingPlan.from_json(ShardingPlan({"": shardings}).to_json())
    restored = plan.plan[""]["t"].optimizer
    assert restored == state and restored.state_dtype is Precision.BF16


def test_plan_cli_reads_the_section_weight_dtype_with_per_table_override(tmp_path) -> None:
    from recopt.sharding.planner.cli import read_config

    config = tmp_path / "model.toml"
    config.write_text(
        '[embedding]\nweight_dtype = "bf16"\n[embedding.optimizer]\nname = "adam"\n'
        'state_dtype = "bf16"\n'
        '[[embedding.tables]]\nname = "a"\nnum_embeddings = 10\nembedding_dim = 8\n'
        'feature_names = ["fa"]\n'
        '[[embedding.tables]]\nname = "b"\nnum_embeddings = 10\nembedding_dim = 8\n'
        'feature_names = ["fb"]\nweight_dtype = "fp32"\n'
    )
    planned = read_config(str(config))
    assert [t.weight_dtype for t in planned.tables] == [Precision.BF16, Precision.FP32]
    assert planned.optimizer is not None and planned.optimizer.state_dtype is Precision.BF16


def test_fp16_state_warns_that_small_squared_gradients_vanish() -> None:
    with pytest.warns(UserWarning, match="state_dtype='bf16' halves the memory"):
        FusedOptimizerConfig(name="adam", state_dtype="fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FusedOptimizerConfig(name="adam", state_dtype="bf16")
        FusedOptimizerConfig(name="sgd", state_dtype="fp16")  # no state to lose
