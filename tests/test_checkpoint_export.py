"""The safetensors export's names (a table once, not its collection's dict twice), reading an
export back as a state dict, and docs/checkpoint.md's nn.EmbeddingBag snippet, run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from recopt.checkpoint import export_full, save
from recopt.checkpoint.reshard import model_export_names, read_model_export
from recopt.modules import EmbeddingBagCollection, EmbeddingBagConfig
from recopt.sparse import KeyedJaggedTensor

DOC = Path(__file__).resolve().parents[1] / "docs" / "checkpoint.md"


class TwoTowers(torch.nn.Module):
    """Named as the DLRM model names its collection: ``embedding_bags``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        tables = [
            EmbeddingBagConfig(name="t0", num_embeddings=7, embedding_dim=4, feature_names=["f0"]),
            EmbeddingBagConfig(name="t1", num_embeddings=5, embedding_dim=8, feature_names=["f1"]),
        ]
        self.embedding_bags = EmbeddingBagCollection(tables)
        self.dense = torch.nn.Linear(3, 2)


def _export(tmp_path: Path) -> TwoTowers:
    model = TwoTowers()
    save(tmp_path / "ck", model, step=4)
    export_full(tmp_path / "ck", tmp_path / "full")
    return model


def test_export_names_each_table_once_and_reads_back_as_the_state_dict(tmp_path: Path) -> None:
    from safetensors import safe_open

    model = _export(tmp_path)
    assert "embedding_bags.embedding_bags.t0.weight" in model.state_dict()
    with safe_open(str(tmp_path / "full" / "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
        exported = {name: f.get_tensor(name) for name in names}
    assert names == [
        "dense.bias",
        "dense.weight",
        "embedding_bags.t0.weight",
        "embedding_bags.t1.weight",
    ]
    state = model.state_dict()
    assert torch.equal(
        exported["embedding_bags.t1.weight"], state["embedding_bags.embedding_bags.t1.weight"]
    )
    back = read_model_export(tmp_path / "full")
    assert sorted(back) == sorted(state)
    for key, value in state.items():
        assert torch.equal(back[key], value), key
    fresh = TwoTowers()
    torch.nn.init.zeros_(fresh.dense.weight)
    fresh.load_state_dict(back)
    assert torch.equal(fresh.dense.weight, model.dense.weight)


def test_an_older_export_with_state_dict_names_still_reads(tmp_path: Path) -> None:
    state = {k: v.contiguous() for k, v in TwoTowers().state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    back = read_model_export(tmp_path / "model.safetensors")
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_export_names_at_the_root_and_on_a_clash() -> None:
    names = model_export_names(
        [
            "model/embedding_bags.t0.weight",  # a collection at the root
            "model/sparse.ebc.embeddings.u.weight",  # an unpooled collection
            "model/x.embedding_bags.t1.weight",  # short name taken by the next key
            "model/x.t1.weight",
        ]
    )
    assert names == {
        "model/embedding_bags.t0.weight": "t0.weight",
        "model/sparse.ebc.embeddings.u.weight": "sparse.ebc.u.weight",
        "model/x.embedding_bags.t1.weight": "x.embedding_bags.t1.weight",
        "model/x.t1.weight": "x.t1.weight",
    }


def _snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    found = [b for b in blocks if "torch.nn.EmbeddingBag" in b and "model.safetensors" in b]
    assert len(found) == 1, "docs/checkpoint.md lost its nn.EmbeddingBag snippet"
    return found[0]


def test_the_docs_embedding_bag_snippet_pools_as_the_collection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _export(tmp_path)
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {}
    exec(compile(_snippet(), str(DOC), "exec"), scope)
    pooled = scope["pooled"]
    assert isinstance(pooled, torch.Tensor)
    # The same two bags through the recopt collection that was exported.
    features = KeyedJaggedTensor.from_id_lists({"f0": [[1, 2], [3]], "f1": [[0], [4]]})
    want = model.embedding_bags(features)["f0"]
    assert pooled.shape == want.shape == (2, 4)
    assert torch.equal(pooled.detach(), want.detach())
