"""The sharded output exchange keeps no large per-step temporary (each costs page faults).

A buffer of megabytes allocated and freed every step is fresh pages every step wherever the
allocator hands large blocks back to the system (glibc does): up to 10 ms a step on the row-wise
benchmark (benchmarks/README.md, "Non-finite gradient gate"). On 2 gloo ranks, with the
NaN/inf gate on and off: the returning gradients land in the memory the pooled outputs were
sent from, and row-wise layouts receive and send back through one buffer kept across steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from recopt.kernels import FusedOptimizerConfig
from recopt.modules import EmbeddingBagConfig
from recopt.sharding.output_exchange import ScratchBuffer
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

NUM_TABLES, BATCH, DIM = 4, 64, 16


def test_scratch_buffer_keeps_its_memory_and_grows() -> None:
    scratch = ScratchBuffer()
    like = torch.zeros(1)
    first = scratch.get(100, like)
    assert first.numel() == 100 and scratch.get(60, like).data_ptr() == first.data_ptr()
    grown = scratch.get(200, like)
    assert grown.numel() == 200 and scratch.get(150, like).data_ptr() == grown.data_ptr()
    assert scratch.get(10, torch.zeros(1, dtype=torch.float64)).dtype == torch.float64


def _buffers(rank: int, world: int, kind: str, gated: bool) -> dict[str, Any]:
    from recopt.sharding import (
        ShardedEmbeddingBagCollection,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=1000, embedding_dim=DIM, feature_names=(f"f{i}",)
        )
        for i in range(NUM_TABLES)
    ]
    requests = {
        t.name: row_wise() if kind == "row_wise" else table_wise(i % world)
        for i, t in enumerate(tables)
    }
    module = ShardedEmbeddingBagCollection(
        tables,
        construct_module_sharding_plan(tables, requests, world),
        optimizer=FusedOptimizerConfig(name="row_wise_adagrad", lr=0.01),
        skip_nonfinite=gated,
    )
    sent_from: list[int] = []
    grad_in: list[int] = []
    lookup = module._lookup_model_parallel

    def recording_lookup(inputs: Any, received: Any) -> torch.Tensor:
        mp_send: torch.Tensor = lookup(inputs, received)
        sent_from.append(mp_send.data_ptr())
        mp_send.register_hook(lambda grad: grad_in.append(grad.data_ptr()))
        return mp_send

    module._lookup_model_parallel = recording_lookup  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(rank)
    scratch: list[int] = []
    for _ in range(3):
        ids = torch.randint(0, 1000, (NUM_TABLES * BATCH,), generator=gen)
        lengths = torch.ones(NUM_TABLES * BATCH, dtype=torch.int64)
        kjt = KeyedJaggedTensor(
            keys=[t.feature_names[0] for t in tables], values=ids, lengths=lengths
        )
        module(kjt).values().sum().backward()  # a stride-0 gradient, as in the benchmarks
        scratch.append(module._scratch._buffer.data_ptr())
    return {"same_memory": sent_from == grad_in, "scratch": scratch}


@pytest.mark.parametrize("kind", ["row_wise", "table_wise"])
@pytest.mark.parametrize("gated", [True, False])
def test_gradients_come_back_into_the_sent_outputs(kind: str, gated: bool) -> None:
    for result in run_on_ranks(_buffers, 2, kind, gated, timeout_s=120):
        assert result["same_memory"]
        # Row-wise: received blocks and the repeated gradient; table-wise: the stride-0
        # gradient made contiguous. The same memory every step.
        assert len(set(result["scratch"])) == 1
