"""Shared pieces of the pipelined-training tests: a tiny model, its data, the plain loop.

The plain loop (zero_grad, forward, backward, step per batch) is the reference every pipelined
run is compared with, exactly: losses, outputs, weights and optimizer state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from recopt.data.batch import Batch
from recopt.modules import EmbeddingBagConfig
from recopt.sparse import KeyedJaggedTensor
from recopt.testing import run_on_ranks

NUM_TABLES = 4
NUM_ROWS = 40
DIM = 12


def tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=NUM_ROWS, embedding_dim=DIM, feature_names=[f"f{i}"]
        )
        for i in range(NUM_TABLES)
    ]


class TinyModel(nn.Module):
    """``forward(batch) -> (loss, (loss, logits))``: pooled embeddings through a linear layer
    (``dense=False``: their plain sum, no dense parameter)."""

    def __init__(self, embedding: nn.Module, dense: bool = True) -> None:
        super().__init__()
        self.embedding_bags = embedding
        self.top = nn.Linear(NUM_TABLES * DIM, 1) if dense else None

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        pooled = self.embedding_bags(batch.sparse).values()
        logits = self.top(pooled).squeeze(1) if self.top is not None else pooled.sum(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach())


def embedding_configs(bag_tables: list[EmbeddingBagConfig]) -> list[Any]:
    """``bag_tables`` as `EmbeddingConfig`s (one row per id): names, sizes, features and
    ``id_map`` kept."""
    from recopt.modules import EmbeddingConfig

    return [
        EmbeddingConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=t.feature_names,
            id_map=t.id_map,
        )
        for t in bag_tables
    ]


class UnpooledModel(nn.Module):
    """An `EmbeddingCollection` (one row per id) of ``bag_tables``' tables (their ``id_map``
    kept) under a loss: ``batch -> (loss, loss)``."""

    def __init__(self, bag_tables: list[EmbeddingBagConfig]) -> None:
        from recopt.modules import EmbeddingCollection

        super().__init__()
        self.embeddings = EmbeddingCollection(embedding_configs(bag_tables))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.embeddings(batch.sparse)
        loss = sum((jt.values() * (k + 1)).square().sum() for k, jt in enumerate(rows.values()))
        assert isinstance(loss, torch.Tensor)
        return loss, loss.detach()


def fused_state(model: TinyModel, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """A one-process TinyModel's state: its state_dict, its fused and its dense optimizer's."""
    fused = model.embedding_bags.fused_optimizer.state_dict()
    return (
        local_tensors(model.state_dict())
        + local_tensors(fused)
        + local_tensors(optimizer.state_dict())
    )


def dmp_state(model: Any, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """A sharded model's state on this rank: its state_dict, its fused optimizer's and (if
    given) its dense optimizer's."""
    state = local_tensors(model.state_dict()) + local_tensors(model.fused_optimizer.state_dict())
    if optimizer is not None:
        state += local_tensors(optimizer.state_dict())
    return state


Runner = Callable[[int, int, dict[str, Any], str], dict[str, bool]]


def _run_cases(
    rank: int, world: int, runners: dict[str, Runner], cases: list[dict[str, Any]], tmp: str
) -> list[dict[str, bool]]:
    """On each rank: every case by its runner (``case["runner"]``, default "compare")."""
    return [runners[c.get("runner", "compare")](rank, world, c, tmp) for c in cases]


def failed_cases(
    runners: dict[str, Runner], world: int, cases: list[dict[str, Any]], tmp: str
) -> list[Any]:
    """Run ``cases`` in one spawned group of ``world`` ranks (each case by its runner of
    ``runners``, module-level functions returning check -> ok); ``(rank, case, check)`` of
    every check that failed."""
    results = run_on_ranks(_run_cases, world, runners, cases, tmp, timeout_s=270.0)
    return [
        (rank, case, name)
        for rank, per_rank in enumerate(results)
        for case, result in zip(cases, per_rank, strict=True)
        for name, ok in result.items()
        if not ok
    ]


def make_batch(
    rank: int, index: int, *, bad_id: bool = False, nan_label: bool = False, vbe: bool = False
) -> Batch:
    """Batch ``index`` of ``rank``: uneven batch sizes over ranks and steps, some empty bags."""
    gen = torch.Generator().manual_seed(1000 * rank + index)
    size = 4 + (rank + index) % 3
    keys = [f"f{i}" for i in range(NUM_TABLES)]
    if vbe:  # feature f0 has one bag for every two samples
        return _vbe_batch(gen, size, keys, index)
    lengths = torch.randint(0, 4, (NUM_TABLES * size,), generator=gen)
    values = torch.randint(0, NUM_ROWS, (int(lengths.sum()),), generator=gen)
    if bad_id:
        values[-1] = NUM_ROWS + 3
    labels = torch.randint(0, 2, (size,), generator=gen).float()
    if nan_label:
        labels[0] = float("nan")
    sparse = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
    return Batch(torch.zeros(size, 1), sparse, labels, index + 1)


def _vbe_batch(gen: torch.Generator, size: int, keys: list[str], index: int) -> Batch:
    strides = [(size + 1) // 2] + [size] * (NUM_TABLES - 1)
    lengths = torch.randint(0, 4, (sum(strides),), generator=gen)
    values = torch.randint(0, NUM_ROWS, (int(lengths.sum()),), generator=gen)
    inverse = torch.stack([torch.arange(size) // 2] + [torch.arange(size)] * (NUM_TABLES - 1))
    sparse = KeyedJaggedTensor(
        keys=keys,
        values=values,
        lengths=lengths,
        stride_per_key_per_rank=[[s] for s in strides],
        inverse_indices=(keys, inverse),
    )
    labels = torch.randint(0, 2, (size,), generator=gen).float()
    return Batch(torch.zeros(size, 1), sparse, labels, index + 1)


RAW_ROWS = 12  # rows of the id-mapped tests' tables: few for many raw ids (evictions)


def raw_tables(id_maps: list[Any]) -> list[EmbeddingBagConfig]:
    """`tables` with RAW_ROWS rows, table ``i`` id-mapped by ``id_maps[i]`` (an `IdMapConfig`
    or None; the last table stays unmapped: `raw_batch` gives it row ids)."""
    return [
        dataclasses.replace(t, num_embeddings=RAW_ROWS, id_map=m)
        for t, m in zip(tables(), [*id_maps[: NUM_TABLES - 1], None], strict=True)
    ]


def raw_batch(index: int, rank: int = 0, bad_id: bool = False) -> Batch:
    """`make_batch` of ``rank`` with raw ids from a space of 5 x RAW_ROWS ids for every
    table but the last, which keeps row ids below RAW_ROWS (unmapped; ``bad_id``: its last id
    out of range)."""
    batch = make_batch(rank, index)
    sparse = batch.sparse
    gen = torch.Generator().manual_seed(500 + 1000 * rank + index)
    values = torch.randint(0, 5 * RAW_ROWS, (sparse.values().numel(),), generator=gen)
    values = values * 7919 - 3
    last = sparse.offset_per_key()[NUM_TABLES - 1]
    values[last:] = sparse.values()[last:] % RAW_ROWS
    if bad_id and values.numel() > last:
        values[-1] = RAW_ROWS + 1
    kjt = KeyedJaggedTensor(sparse.keys(), values, lengths=sparse.lengths())
    return batch._replace(sparse=kjt)


ID_MAP_POLICIES = {  # (IdMapConfig's keyword arguments: built where recopt is imported)
    "lru": {"policy": "lru"},
    "lfu": {"policy": "lfu", "decay": 0.9},
    "admit2-ttl": {"policy": "lru", "admit_after": 2, "ttl_steps": 3},
}


def id_map_model(policy: str, native: bool = True) -> tuple[TinyModel, torch.optim.Optimizer]:
    """A `TinyModel` over a fused collection of `raw_tables`, every mapped table under
    ``policy`` (an `ID_MAP_POLICIES` key; ``native``: the native remap, else torch ops), row-wise
    Adagrad; and the dense layer's SGD. The same initial weights every call."""
    from recopt.kernels import FusedOptimizerConfig
    from recopt.modules import FusedEmbeddingBagCollection, IdMapConfig

    torch.manual_seed(0)
    optimizer = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.3)
    id_map = IdMapConfig(**ID_MAP_POLICIES[policy])
    ebc = FusedEmbeddingBagCollection(raw_tables([id_map] * NUM_TABLES), optimizer)
    assert ebc.id_maps is not None
    for name in ebc.id_maps:
        ebc.id_maps.table_map(name).native = native
    model = TinyModel(ebc)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


class Batches:
    """A resumable iterator over ``batches`` (a list), its position saved by `state_dict`."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches
        self.position = 0

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Batch:
        if self.position >= len(self.batches):
            raise StopIteration
        self.position += 1
        return self.batches[self.position - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


def plain_loop(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, batches: list[Batch]
) -> list[Any]:
    """The unpipelined reference: one step per batch; a batch that raises is skipped (its
    exception type recorded in place of its output)."""
    outputs: list[Any] = []
    for batch in batches:
        if optimizer is not None:
            optimizer.zero_grad()
        try:
            loss, output = model(batch)
        except ValueError as e:
            outputs.append(type(e).__name__)
            continue
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        outputs.append(output)
    return outputs


def pipelined_loop(pipeline: Any, iterator: Any) -> list[Any]:
    """`progress` until StopIteration; a step that raises is recorded like `plain_loop`."""
    outputs: list[Any] = []
    while True:
        try:
            outputs.append(pipeline.progress(iterator))
        except StopIteration:
            return outputs
        except ValueError as e:
            outputs.append(type(e).__name__)


def local_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor of a (sharded) state dict, flattened in key order; ShardedTensors as this
    rank's shards."""
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in local_tensors(value[k])]
    if isinstance(value, list | tuple):
        return [t for v in value for t in local_tensors(v)]
    if hasattr(value, "local_shards"):
        return [s.tensor.detach().clone().flatten() for s in value.local_shards()]
    if isinstance(value, torch.Tensor):
        return [value.detach().clone().flatten()]
    return []


def same(a: Any, b: Any) -> bool:
    """Exact equality of nested outputs / tensor lists (NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    if isinstance(a, list | tuple):
        return (
            isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)
