"""The examples run end to end (short versions)."""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

import pytest

from recopt.testing import run_on_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(path: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(path.replace("/", "_"), ROOT / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_click_model_loss_falls(capsys: pytest.CaptureFixture[str]) -> None:
    module = load("examples/click_model/train.py")
    assert module.main(["--steps", "100", "--batch-size", "512"]) == 0
    losses = [float(line.split()[3]) for line in capsys.readouterr().out.splitlines()]
    assert len(losses) == 2 and losses[-1] < losses[0]


def _learns(losses: list[float]) -> bool:
    return sum(losses[-10:]) / 10 < sum(losses[:3]) / 3


def test_torchrec_style_loop_trains_on_one_rank(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    module = load("examples/torchrec_style/train.py")
    argv = ["--steps", "40", "--batch-size", "64", "--log-every", "1"]
    assert module.main([*argv, "--checkpoint-dir", str(tmp_path / "ckpt")]) == 0
    lines = capsys.readouterr().out.splitlines()
    losses = [float(line.split()[3]) for line in lines if line.startswith("step")]
    assert len(losses) == 40 and all(0.0 < x < 5.0 for x in losses)
    assert _learns(losses)
    saved, restored = (float(x) for x in lines[-1].split()[2::2])  # "checkpoint loss A restored B"
    assert saved == restored  # the DCP checkpoint loads back exactly
    assert (tmp_path / "ckpt" / ".metadata").exists()


def _torchrec_style_setup(rank: int, world: int) -> dict[str, Any]:
    module = load("examples/torchrec_style/train.py")
    model, optimizer = module.build(seed=0)
    fused = model.fused_optimizer
    name_of = {id(p): n for n, p in fused.params.items()}
    groups = {
        name_of[id(p)].split(".")[-2]: (g["optimizer"], float(g["lr"]), g["eps"])
        for g in fused.param_groups
        for p in g["params"]
    }
    plan = {
        table: sharding.sharding_type.value
        for shardings in model.plan.plan.values()
        for table, sharding in shardings.items()
    }
    return {"groups": groups, "plan": plan, "dense": sorted(dict(model.named_parameters()))}


def test_torchrec_style_honours_torchrec_optimizers_and_constraints() -> None:
    for result in run_on_ranks(_torchrec_style_setup, 2, timeout_s=180):
        # apply_optimizer_in_backward(RowWiseAdagrad, lr 0.1) on the user tables; the item
        # table's sharder fused_params: EXACT_ADAGRAD, learning_rate 0.1 (fbgemm's eps 1e-8).
        assert result["groups"] == {
            "user": ("row_wise_adagrad", 0.1, 1e-10),
            "category": ("row_wise_adagrad", 0.1, 1e-10),
            "item": ("adagrad", 0.1, 1e-8),
        }
        assert result["plan"]["category"] == "data_parallel"
        assert result["plan"]["item"] == "table_wise"
        assert result["plan"]["user"] in ("row_wise", "table_wise")
        assert all(name.startswith("over.") for name in result["dense"])


def _torchrec_style_on_rank(rank: int, world: int, folder: str) -> list[float]:
    module = load("examples/torchrec_style/train.py")
    return module.train(  # type: ignore[no-any-return]
        steps=40, batch_size=64, seed=1, log_every=100, checkpoint_dir=folder
    )


def test_torchrec_style_loop_learns_on_two_ranks(tmp_path: pathlib.Path) -> None:

    results = run_on_ranks(_torchrec_style_on_rank, 2, str(tmp_path / "ckpt"), timeout_s=270)
    for losses in results:
        assert len(losses) == 42 and _learns(losses[:40])
        assert losses[40] == losses[41]  # saved, then loaded back after one more step
    assert results[0][:40] != results[1][:40]  # each rank trains on its own batches
