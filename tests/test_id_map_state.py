"""Id maps as state: checkpoint resume equals an uninterrupted run; the export writes row ids."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recopt.checkpoint import load, save
from recopt.checkpoint.reshard import export_full
from recopt.kernels.config import FusedOptimizerConfig, PoolingType
from recopt.modules import EmbeddingBagConfig, FusedEmbeddingBagCollection, IdMapConfig
from recopt.sparse import KeyedJaggedTensor

TABLES = [
    EmbeddingBagConfig(
        name="user",
        num_embeddings=16,
        embedding_dim=4,
        feature_names=("user_id",),
        id_map=IdMapConfig(policy="lfu", decay=0.9, ttl_steps=5, admit_after=2),
    ),
    EmbeddingBagConfig(
        name="item",
        num_embeddings=12,
        embedding_dim=4,
        feature_names=("item_id", "item_hist"),
        pooling=PoolingType.MEAN,
        id_map=IdMapConfig(policy="lru"),
    ),
    EmbeddingBagConfig(name="plain", num_embeddings=5, embedding_dim=4, feature_names=("c",)),
]


class Model(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        optimizer = FusedOptimizerConfig(name="row_wise_adagrad", lr=0.1)
        self.sparse = FusedEmbeddingBagCollection(TABLES, optimizer=optimizer)
        self.dense = nn.Linear(16, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.sparse(kjt).values()).square().mean()


def _batch(step: int) -> KeyedJaggedTensor:
    """Raw ids from a space that drifts with the step (so rows are evicted and expire)."""
    gen = torch.Generator().manual_seed(step)

    def bags(space: int, count: int) -> list[list[int]]:
        ids = (torch.randint(0, space, (count,), generator=gen) + 3 * step) * 2**35
        return [ids[i : i + 2].tolist() for i in range(0, count, 2)]

    return KeyedJaggedTensor.from_id_lists(
        {
            "user_id": bags(20, 8),
            "item_id": bags(10, 8),
            "item_hist": bags(14, 8),
            "c": [[int(v)] for v in torch.randint(0, 5, (4,), generator=gen)],
        }
    )


def _build(seed: int) -> tuple[Model, dict[str, Any]]:
    model = Model(seed)
    dense = torch.optim.Adam(model.dense.parameters(), lr=0.01)
    return model, {"fused": model.sparse.fused_optimizer, "dense": dense}


def _train(
    model: Model, optimizers: dict[str, Any], steps: range, churn: list[float] | None = None
) -> list[float]:
    losses = []
    for step in steps:
        loss = model(_batch(step))
        optimizers["dense"].zero_grad()
        loss.backward()
        optimizers["dense"].step()
        losses.append(loss.item())
        for stats in model.sparse.stats().values():
            if churn is not None:
                churn.append(stats["evictions"] + stats["expired"])
    return losses


def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path: Path) -> None:
    model, optimizers = _build(seed=0)
    churn: list[float] = []
    _train(model, optimizers, range(8), churn)
    assert sum(churn) > 0  # the drift evicts or expires rows before the checkpoint
    save(tmp_path / "ck", model, optimizers, step=8)
    uninterrupted = _train(model, optimizers, range(8, 16))

    resumed_model, resumed_optimizers = _build(seed=1)  # other weights until the load
    resumed_model.sparse(_batch(99))  # and a map that already moved
    load(tmp_path / "ck", resumed_model, resumed_optimizers)
    resumed = _train(resumed_model, resumed_optimizers, range(8, 16))
    assert resumed == uninterrupted
    expected = model.state_dict()
    for key, value in resumed_model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    states = model.sparse.fused_optimizer.state_dict()["state"]
    resumed_states = resumed_model.sparse.fused_optimizer.state_dict()["state"]
    for param, state in states.items():
        for name, value in state.items():
            assert torch.equal(resumed_states[param][name], value), name
    assert model.sparse.id_maps is not None
    assert int(model.sparse.id_maps["item"].step) == 16  # type: ignore[call-overload]


def test_stats_after_a_load_say_the_loaded_step_and_occupancy(tmp_path: Path) -> None:
    """After a checkpoint load or a load_state_dict, stats() reports the loaded maps' step
    and occupancy (the counts of the step that made them are not saved: zero), not an empty
    map's."""
    model, optimizers = _build(seed=0)
    _train(model, optimizers, range(6))
    saved = model.sparse.stats()
    assert all(s["step"] == 6 and s["occupancy"] > 0.5 for s in saved.values())
    save(tmp_path / "ck", model, optimizers, step=6)
    loaded_by = {}
    loaded_by["checkpoint"], optimizers = _build(seed=1)
    load(tmp_path / "ck", loaded_by["checkpoint"], optimizers)
    loaded_by["state_dict"], _ = _build(seed=1)
    loaded_by["state_dict"].load_state_dict(model.state_dict())
    for how, loaded in loaded_by.items():
        for name, stats in loaded.sparse.stats().items():
            assert stats["step"] == saved[name]["step"], (how, name)
            assert stats["occupancy"] == saved[name]["occupancy"], (how, name)
            assert stats["new_ids"] == stats["evictions"] == 0, (how, name)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    dtypes = {"I64": torch.int64, "BOOL": torch.bool, "F64": torch.float64, "F32": torch.float32}
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    body = data[8 + size :]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        raw = torch.frombuffer(bytearray(body[start:end]), dtype=torch.uint8)
        out[name] = raw.view(dtypes[entry["dtype"]]).reshape(entry["shape"])
    return out


def test_safetensors_export_writes_each_rows_id(tmp_path: Path) -> None:
    model, optimizers = _build(seed=0)
    _train(model, optimizers, range(6))
    save(tmp_path / "ck", model, optimizers, step=6)
    export_full(tmp_path / "ck", tmp_path / "full")
    exported = _read_safetensors(tmp_path / "full" / "model.safetensors")
    for table in ("user", "item"):
        idmap = model.sparse.id_maps[table]  # type: ignore[index]
        assert torch.equal(exported[f"sparse.id_maps.{table}.row_ids"], idmap.row_ids)
        assert torch.equal(exported[f"sparse.id_maps.{table}.occupied"], idmap.occupied)
        assert torch.equal(  # tables export as <module>.<table>.weight
            exported[f"sparse.{table}.weight"], model.sparse.embedding_bags[table].weight
        )
    live = exported["sparse.id_maps.item.row_ids"][exported["sparse.id_maps.item.occupied"]]
    assert live.numel() > 0 and bool((live % 2**35 == 0).all())  # raw ids, not row numbers
