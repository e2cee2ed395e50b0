"""Checkpoints of fp16/bf16 tables and state: dtypes and pass counters kept, sharded 2 -> 3
ranks, converting load.

One process: a fused collection round-trips bit-identically in its own dtypes, and loads into
a model of other dtypes with a warning (values rounded to nearest). Then 2 ranks (mixed plan)
train and save, the checkpoint is resharded offline for 3 ranks and loads there unchanged.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import full_state, random_batch
from torch import nn

from recopt.checkpoint import load, read_manifest, save
from recopt.checkpoint.reshard import reshard
from recopt.kernels.config import FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.sharding import (
    ShardingPlan,
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

ROWS = {"f0": 11, "f1": 13, "f2": 7}


def tables(weights: tuple[str, str, str] = ("fp16", "bf16", "fp32")) -> list[EmbeddingBagConfig]:
    dims = {"f0": 8, "f1": 8, "f2": 4}
    return [
        EmbeddingBagConfig(
            name=f"t{i}",
            num_embeddings=ROWS[f],
            embedding_dim=dims[f],
            feature_names=(f,),
            weight_dtype=w,
        )
        for i, (f, w) in enumerate(zip(ROWS, weights, strict=True))
    ]


class Model(nn.Module):
    def __init__(
        self, weights: tuple[str, str, str] = ("fp16", "bf16", "fp32"), state: str = "bf16"
    ):
        super().__init__()
        torch.manual_seed(0)
        config = FusedOptimizerConfig(name="adam", lr=0.05, eps=1e-3, state_dtype=state)
        self.sparse = FusedEmbeddingBagCollection(tables(weights), optimizer=config)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.sparse(kjt).values().square().mean()


def batch(rank: int, step: int) -> KeyedJaggedTensor:
    return random_batch(ROWS, rank, step)


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert sorted(a) == sorted(b)
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def test_round_trip_keeps_dtypes_and_converting_load_warns(tmp_path: Path) -> None:
    model = Model()
    for step in range(2):
        model(batch(0, step)).backward()
    opt = model.sparse.fused_optimizer
    saved = full_state(model, opt)
    save(tmp_path / "ck", model, opt, step=2)
    entries = read_manifest(tmp_path / "ck").tensors
    dtypes = {k.rsplit("/", 1)[-1]: e.dtype for k, e in entries.items()}
    assert dtypes["sparse.embedding_bags.t0.weight"] == "float16"
    assert dtypes["sparse.embedding_bags.t1.weight"] == "bfloat16"
    assert dtypes["t0.exp_avg"] == "bfloat16" and dtypes["t0.step"] == "int64"

    same = Model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same dtypes: no conversion, no warning
        load(tmp_path / "ck", same, same.sparse.fused_optimizer)
    assert _identical(full_state(same, same.sparse.fused_optimizer), saved) == []

    wider = Model(weights=("fp32", "fp32", "bf16"), state="fp32")
    with pytest.warns(
        UserWarning, match=r"loading converts 9 tensors.*t0.weight: float16 -> float32"
    ):
        load(tmp_path / "ck", wider, wider.sparse.fused_optimizer)
    loaded = full_state(wider, wider.sparse.fused_optimizer)
    # t0 and t1 are fp32 with fp32 state now: nothing is rounded, their pass counters dropped.
    assert sorted(set(saved) - set(loaded)) == [
        "embedding_bags.t0.weight/t0.rounding_step",
        "embedding_bags.t1.weight/t1.rounding_step",
    ]
    for key, value in saved.items():
        if key not in loaded:
            continue
        assert loaded[key].dtype == (
            torch.int64
            if key.endswith("step")
            else torch.bfloat16
            if key.endswith("t2.weight")
            else torch.float32
        )
        torch.testing.assert_close(loaded[key], value.to(loaded[key].dtype), rtol=0, atol=0)
    # Training goes on in the new dtypes.
    wider(batch(0, 3)).backward()


def plan(kind: str, world: int) -> ShardingPlan:
    requests: dict[str, Any] = {
        "mixed": {"t0": row_wise(), "t1": column_wise([world - 1, 0]), "t2": table_wise(0)},
        "table_wise": {"t0": table_wise(0), "t1": table_wise(world - 1), "t2": table_wise(1)},
    }[kind]
    return ShardingPlan({"sparse": construct_module_sharding_plan(tables(), requests, world)})


def _build(kind: str, world: int) -> tuple[nn.Module, Any]:
    from recopt.sharding.model_parallel import DistributedModelParallel

    dmp = DistributedModelParallel(Model(), plan(kind, world))
    return dmp, dmp.fused_optimizer


def _two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    model, opt = _build("mixed", world)
    for step in range(2):
        model(batch(rank, step)).backward()
    local = {
        k: [s.tensor.dtype for s in v.local_shards()]
        for k, v in model.state_dict().items()
        if hasattr(v, "local_shards")
    }
    save(Path(root) / "ck", model, opt, step=2)
    return {"saved": full_state(model, opt), "local": local}


def _three_ranks(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    model, opt = _build("table_wise", world)
    load(Path(root) / "ck3", model, opt)
    return full_state(model, opt)


@pytest.mark.multiprocess
def test_sharded_reduced_precision_reshards_two_to_three_ranks(tmp_path: Path) -> None:
    two = run_on_ranks(_two_ranks, 2, str(tmp_path), timeout_s=240)
    local = two[0]["local"]
    assert set(local["sparse.embedding_bags.t0.weight"]) == {torch.float16}
    assert set(local["sparse.embedding_bags.t1.weight"]) == {torch.bfloat16}
    saved = two[0]["saved"]
    assert _identical(two[1]["saved"], saved) == []
    # bf16 state: every table rounds and counts its passes, held or mirrored on each rank.
    counters = {k: int(v) for k, v in saved.items() if k.endswith("rounding_step")}
    assert len(counters) == 3 and set(counters.values()) == {2}
    reshard(tmp_path / "ck", tmp_path / "ck3", world_size=3, plan=plan("table_wise", 3))
    for result in run_on_ranks(_three_ranks, 3, str(tmp_path), timeout_s=240):
        assert _identical(result, saved) == []


class RowWiseModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.05, state_dtype="bf16")
        self.sparse = FusedEmbeddingBagCollection(tables(), optimizer=config)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.sparse(kjt).values().square().mean()


def _column_shards_on_rank_zero(rank: int, world: int, root: str) -> dict[str, Any]:
    from recopt import comm
    from recopt.sharding.model_parallel import DistributedModelParallel

    # What each rank broadcasts: NCCL needs every rank to enter with the same dtype and size
    # (gloo here lets a mismatch pass unnoticed).
    broadcasts: list[tuple[torch.dtype, int]] = []
    plain_broadcast = comm.broadcast

    def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        broadcasts.append((tensor.dtype, tensor.numel()))
        return plain_broadcast(tensor, *args, **kwargs)

    comm.broadcast = recorded  # type: ignore[assignment]

    # t1 is column-wise with its one shard on rank 0: rank 1 holds no piece of it, and after
    # a load receives its row-wise (bf16) state in a buffer of its own making.
    requests = {"t0": table_wise(0), "t1": column_wise([0]), "t2": table_wise(0)}
    sharding = ShardingPlan({"sparse": construct_module_sharding_plan(tables(), requests, world)})
    model = DistributedModelParallel(RowWiseModel(), sharding)
    model(batch(rank, 0)).backward()
    save(Path(root) / "ck", model, model.fused_optimizer, step=1)
    again = DistributedModelParallel(RowWiseModel(), sharding)
    load(Path(root) / "ck", again, again.fused_optimizer)
    return {"state": full_state(again, again.fused_optimizer), "broadcasts": broadcasts}


@pytest.mark.multiprocess
def test_row_wise_bf16_state_of_a_column_shard_loads_on_a_rank_without_it(
    tmp_path: Path,
) -> None:
    first, second = run_on_ranks(_column_shards_on_rank_zero, 2, str(tmp_path), timeout_s=120)
    assert _identical(first["state"], second["state"]) == []
    assert (torch.bfloat16, 13) in first["broadcasts"]  # t1's momentum1, from rank 0
    assert first["broadcasts"] == second["broadcasts"]
