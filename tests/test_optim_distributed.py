"""recopt.optim on spawned gloo ranks: ShardedTensor state loading, global clipping norms.

One spawned group per world size; every case runs inside it (starting ranks costs seconds).
"""

from __future__ import annotations

import datetime
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, init_from_local_shards

from recopt.optim import (
    GradientClipping,
    GradientClippingOptimizer,
    KeyedOptimizer,
)
from recopt.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

ROWS, COLS = 6, 4


class _Keyed(KeyedOptimizer):
    def step(self, closure: Any = None) -> None:
        return None


def _sharded(full: torch.Tensor, rank: int, world: int) -> ShardedTensor:
    """Row-wise ShardedTensor of ``full`` with this rank's rows as its one local shard."""
    rows = full.shape[0] // world
    local = full[rank * rows : (rank + 1) * rows].clone()
    shard = Shard.from_tensor_and_offsets(local, shard_offsets=[rank * rows, 0], rank=rank)
    return init_from_local_shards([shard], list(full.shape))


# ---------------------------------------------------------------- one rank: state loading
def _sharded_state_cases(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    weight = _sharded(torch.zeros(ROWS, COLS), rank, world)
    momentum = _sharded(torch.ones(ROWS, COLS), rank, world)
    state = {weight: {"momentum": momentum, "nested": {"rows": [torch.zeros(ROWS)]}, "step": 3}}
    opt = _Keyed({"table.weight": weight}, state, [{"params": [weight], "lr": 0.1}])
    sd = opt.state_dict()
    out["aliases"] = sd["state"]["table.weight"]["momentum"] is momentum
    new = {
        "state": {
            "table.weight": {
                "momentum": _sharded(
                    torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, COLS), rank, world
                ),
                "nested": {"rows": [torch.full((ROWS,), 2.0)]},
                "step": 7,
            }
        }
    }
    local_before = momentum.local_shards()[0].tensor
    opt.load_state_dict(new)
    out["same_object"] = opt.state[weight]["momentum"] is momentum
    out["same_shard_tensor"] = momentum.local_shards()[0].tensor is local_before
    out["loaded"] = momentum.local_shards()[0].tensor.clone()
    out["nested"] = state[weight]["nested"]["rows"][0].clone()
    out["step"] = state[weight]["step"]
    errors = {}
    bad_shape = {
        "state": {
            "table.weight": {
                **new["state"]["table.weight"],
                "momentum": _sharded(torch.zeros(ROWS, COLS + 1), rank, world),
            }
        }
    }
    bad_dtype = {
        "state": {
            "table.weight": {
                **new["state"]["table.weight"],
                "momentum": _sharded(torch.zeros(ROWS, COLS, dtype=torch.float64), rank, world),
            }
        }
    }
    plain = {
        "state": {
            "table.weight": {**new["state"]["table.weight"], "momentum": torch.zeros(ROWS, COLS)}
        }
    }
    for name, bad in (("shape", bad_shape), ("dtype", bad_dtype), ("plain", plain)):
        try:
            opt.load_state_dict(bad)
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    out["unchanged"] = torch.equal(momentum.local_shards()[0].tensor, out["loaded"])
    return out


def test_sharded_tensor_state_loads_in_place_on_one_rank() -> None:
    (out,) = run_on_ranks(_sharded_state_cases, 1, timeout_s=120)
    assert out["aliases"] and out["same_object"] and out["same_shard_tensor"]
    torch.testing.assert_close(
        out["loaded"], torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, COLS)
    )
    assert torch.all(out["nested"] == 2.0) and out["step"] == 7
    assert (
        "global shape (6, 5) in the state_dict does not match the optimizer's (6, 4)"
        in out["errors"]["shape"]
    )
    assert (
        "parameter 'table.weight'.momentum (local shard 0): dtype torch.float64"
        in out["errors"]["dtype"]
    )
    assert "holds a ShardedTensor but the state_dict has a tensor" in out["errors"]["plain"]
    assert out["unchanged"]


# ---------------------------------------------------------------- two ranks: clipping
def _split_setup(
    rank: int,
    world: int,
    full_grad: torch.Tensor,
    repl_grad: torch.Tensor,
    use_sharded: bool,
    **kw: Any,
) -> tuple[GradientClippingOptimizer, list[torch.Tensor]]:
    """A parameter split row-wise (plain + split_params, or ShardedTensor) and a replicated one."""
    rows = ROWS // world
    mine = slice(rank * rows, (rank + 1) * rows)
    repl = nn.Parameter(torch.zeros_like(repl_grad))
    repl.grad = repl_grad.clone()
    if use_sharded:
        table = _sharded(torch.zeros(ROWS, COLS), rank, world)
        holder = table.local_shards()[0].tensor
        holder.requires_grad_(True)
        holder.grad = full_grad[mine].clone()
        opt = _Keyed({"table": table, "repl": repl}, {}, [{"params": [repl], "lr": 1.0}])
        split = None
    else:
        holder = nn.Parameter(torch.zeros(rows, COLS))
        holder.grad = full_grad[mine].clone()
        opt = _Keyed({"table": holder, "repl": repl}, {}, [{"params": [holder, repl], "lr": 1.0}])
        split = {"table": None}
    timeout = datetime.timedelta(seconds=30)
    clip = GradientClippingOptimizer(opt, split_params=split, timeout=timeout, **kw)
    return clip, [holder, repl]


def _clipping_cases(rank: int, world: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)  # same full gradients on every rank
    full_grad = torch.randn(ROWS, COLS, generator=gen) * 3
    repl_grad = torch.randn(5, generator=gen) * 3
    out: dict[str, Any] = {}
    for use_sharded in (False, True):
        for p in (2.0, 1.0, math.inf):
            clip, holders = _split_setup(
                rank,
                world,
                full_grad,
                repl_grad,
                use_sharded,
                clipping=GradientClipping.NORM,
                max_gradient=1.0,
                norm_type=p,
            )
            clip.step()
            key = f"{'sharded' if use_sharded else 'split'} p={p}"
            out[key] = (float(clip.last_norm), holders[0].grad.clone(), holders[1].grad.clone())  # type: ignore[arg-type]
        clip, holders = _split_setup(
            rank,
            world,
            full_grad,
            repl_grad,
            use_sharded,
            clipping=GradientClipping.VALUE,
            max_gradient=0.5,
        )
        clip.step()
        out[f"value sharded={use_sharded}"] = holders[0].grad.clone()
    # Rank 1 has no gradient at all; both ranks still agree on the norm (no hang).
    no_grad, holders = _split_setup(
        rank, world, full_grad, repl_grad, False, clipping=GradientClipping.NORM, max_gradient=100.0
    )
    if rank == 1:
        for h in holders:
            h.grad = None
    no_grad.step()
    out["no_grad_norm"] = float(no_grad.last_norm)  # type: ignore[arg-type]
    # A non-finite piece on rank 1 only: every rank skips (the norm is global).
    bad = full_grad.clone()
    bad[-1, -1] = math.inf
    skip, holders = _split_setup(
        rank, world, bad, repl_grad, False, clipping=GradientClipping.NORM, skip_nonfinite=True
    )
    skip.step()
    out["skipped"] = skip.num_skipped_steps
    dist.barrier()
    return out


def test_global_norm_across_two_ranks() -> None:
    results = run_on_ranks(_clipping_cases, 2, timeout_s=180)
    gen = torch.Generator().manual_seed(0)
    full_grad = torch.randn(ROWS, COLS, generator=gen) * 3
    repl_grad = torch.randn(5, generator=gen) * 3
    everything = torch.cat([full_grad.flatten(), repl_grad])
    for kind in ("split", "sharded"):
        for p in (2.0, 1.0, math.inf):
            expected = float(torch.linalg.vector_norm(everything.double(), p))
            coef = min(1.0, 1.0 / (expected + 1e-6))
            for rank, out in enumerate(results):
                norm, table_grad, repl = out[f"{kind} p={p}"]
                assert norm == pytest.approx(expected, rel=1e-6), (kind, p, rank)
                torch.testing.assert_close(table_grad, full_grad[rank * 3 : rank * 3 + 3] * coef)
                torch.testing.assert_close(repl, repl_grad * coef)
    for rank, out in enumerate(results):
        for sharded in (False, True):
            expected_value = full_grad[rank * 3 : rank * 3 + 3].clamp(-0.5, 0.5)
            assert torch.equal(out[f"value sharded={sharded}"], expected_value)
    rank0_only = torch.cat([full_grad[:3].flatten(), repl_grad])
    # Rank 1 contributes nothing to the split sum and has no replicated gradient of its own.
    expected_no_grad = [float(rank0_only.norm()), float(full_grad[:3].norm())]
    assert [out["no_grad_norm"] for out in results] == pytest.approx(expected_no_grad)
    assert [out["skipped"] for out in results] == [1, 1]
