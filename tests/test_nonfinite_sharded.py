"""A NaN/inf output gradient on ONE rank of a sharded collection updates nothing on ANY rank.

One spawned group per world size (2 and 3) runs every sharding type in a loop: the bad rank's
output gradient holds NaN (then inf); every rank's local shards, optimizer state and step
counters stay bit-identical, every rank counts the skip (DistributedModelParallel shows it), and
the next finite step equals a model that never saw the bad steps. The cuda variant runs the
same on 2 ranks sharing one GPU in a ``cuda:gloo`` group (which, like NCCL, refuses CPU tensors:
the skip vote must run on the device).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recopt.kernels import FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=11, embedding_dim=8, feature_names=("f0",)),
    EmbeddingBagConfig(name="t1", num_embeddings=13, embedding_dim=8, feature_names=("f1",)),
]
KINDS = ["table_wise", "row_wise", "column_wise", "data_parallel", "mixed"]


def _plan(kind: str, world: int) -> Any:
    from recopt.sharding import (
        ShardingPlan,
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_wise,
    )

    last = world - 1
    requests = {
        "table_wise": {"t0": table_wise(0), "t1": table_wise(last)},
        "row_wise": {"t0": row_wise(), "t1": row_wise()},
        "column_wise": {"t0": column_wise([last, 0]), "t1": column_wise([0, last])},
        "data_parallel": {"t0": data_parallel(), "t1": data_parallel()},
        "mixed": {"t0": row_wise(), "t1": column_wise([last, 0])},
    }[kind]
    sharding = construct_module_sharding_plan(TABLES, requests, world_size=world)
    return ShardingPlan({"": sharding})


def _features(rank: int, step: int, device: torch.device) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(1, 3, (6,), generator=gen)  # 2 features x 3 bags
    n0 = int(lengths[:3].sum())
    ids = torch.cat(
        [
            torch.randint(0, 11, (n0,), generator=gen),
            torch.randint(0, 13, (int(lengths.sum()) - n0,), generator=gen),
        ]
    )
    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], ids, lengths).to(device)


def _build(kind: str, world: int, optimizer: str, device: torch.device) -> Any:
    from recopt.sharding import DistributedModelParallel

    torch.manual_seed(0)
    ebc = FusedEmbeddingBagCollection(
        TABLES, optimizer=FusedOptimizerConfig(name=optimizer, lr=0.1, eps=1e-3), device=device
    )
    return DistributedModelParallel(ebc, plan=_plan(kind, world), device=device)


def _step(dmp: Any, rank: int, step: int, scale: float = 1.0) -> None:
    out = dmp(_features(rank, step, dmp.sharded_modules()[0][1].device)).values()
    weights = torch.arange(1, out.numel() + 1, device=out.device).view_as(out)
    (out * weights * scale).sum().backward()


def _local(value: Any) -> list[torch.Tensor]:
    if isinstance(value, ShardedTensor):
        return [s.tensor.clone() for s in value.local_shards()]
    return [value.clone()] if isinstance(value, torch.Tensor) else []


def _local_state(dmp: Any) -> dict[str, list[torch.Tensor]]:
    """This rank's shards of every weight and optimizer state (no collective)."""
    state = {k: _local(v) for k, v in dmp.state_dict().items()}
    for key, value in dmp.fused_optimizer.state_dict()["state"].items():
        for name, tensor in value.items():
            state[f"opt.{key}.{name}"] = _local(tensor)
    return state


def _assert_same(got: dict[str, list[torch.Tensor]], want: dict[str, list[torch.Tensor]]) -> None:
    assert sorted(got) == sorted(want)
    for key, tensors in want.items():
        assert len(got[key]) == len(tensors), key
        for a, b in zip(got[key], tensors, strict=True):
            assert torch.equal(a, b), key


def _one_rank_bad(rank: int, world: int, device_type: str = "cpu") -> None:
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    bad = world - 1
    for kind in KINDS:
        for optimizer in ("adam", "row_wise_adagrad"):
            dmp = _build(kind, world, optimizer, device)
            reference = _build(kind, world, optimizer, device)
            _step(dmp, rank, 1)
            _step(reference, rank, 1)
            before = _local_state(dmp)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _step(dmp, rank, 2, scale=float("nan") if rank == bad else 1.0)
                _step(dmp, rank, 3, scale=float("inf") if rank == bad else 1.0)
            messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
            assert len([m for m in messages if "NaN or inf" in m]) == 1, (kind, messages)
            _assert_same(_local_state(dmp), before)
            assert dmp.skipped_nonfinite_steps == 2, kind
            _step(dmp, rank, 4)
            _step(reference, rank, 4)
            _assert_same(_local_state(dmp), _local_state(reference))
            assert reference.skipped_nonfinite_steps == 0
            assert dmp.skipped_nonfinite_steps == 2


@pytest.mark.parametrize("world", [2, 3])
def test_non_finite_gradient_on_one_rank_skips_every_rank(world: int) -> None:
    run_on_ranks(_one_rank_bad, world, timeout_s=240)


def _one_rank_bad_received_by_copy(rank: int, world: int) -> None:
    """`_one_rank_bad` with an all-to-all that writes what it receives by ``copy_`` from a
    buffer of its own, as gloo does for a CUDA tensor: that write bumps the receiving
    tensor's version counter (the output exchange must not receive into a tensor whose
    counter autograd checks; found on a GPU, reproduced here on CPU)."""
    import torch.distributed as dist

    real = dist.all_to_all_single

    def staged(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        received = torch.empty_like(output)
        work = real(received, input, *args, **kwargs)
        if work is not None:
            work.wait()
        output.copy_(received)
        return work

    dist.all_to_all_single = staged
    try:
        _one_rank_bad(rank, world)
    finally:
        dist.all_to_all_single = real


def test_a_collective_receiving_by_copy_keeps_the_gate_working() -> None:
    run_on_ranks(_one_rank_bad_received_by_copy, 2, timeout_s=240)


@pytest.mark.cuda
def test_non_finite_gradient_on_one_rank_skips_every_rank_on_a_gpu() -> None:
    run_on_ranks(_one_rank_bad, 2, "cuda", timeout_s=270, backend="cuda:gloo")


def _without_skip(rank: int, world: int) -> None:
    from recopt.sharding import DistributedModelParallel

    torch.manual_seed(0)
    ebc = FusedEmbeddingBagCollection(
        TABLES, optimizer=FusedOptimizerConfig(name="sgd", lr=0.1), skip_nonfinite=False
    )
    dmp = DistributedModelParallel(ebc, plan=_plan("table_wise", world), device="cpu")
    _step(dmp, rank, 1, scale=float("nan") if rank == 0 else 1.0)
    assert dmp.skipped_nonfinite_steps == 0
    # Rank 0's NaN went to both tables' holders (rank 0 holds t0, the last rank t1).
    weights = _local_state(dmp)
    key = "embedding_bags.t0.weight" if rank == 0 else "embedding_bags.t1.weight"
    assert not torch.isfinite(weights[key][0]).all()


def test_skip_nonfinite_false_is_kept_by_model_parallel() -> None:
    run_on_ranks(_without_skip, 2, timeout_s=240)
