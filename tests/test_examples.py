"""The examples run end to end (short versions)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

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


def test_torchrec_style_loop_trains_on_one_rank(capsys: pytest.CaptureFixture[str]) -> None:
    module = load("examples/torchrec_style/train.py")
    argv = ["--steps", "40", "--batch-size", "64", "--log-every", "1"]
    assert module.main(argv) == 0
    losses = [float(line.split()[3]) for line in capsys.readouterr().out.splitlines()]
    assert len(losses) == 40 and all(0.0 < x < 5.0 for x in losses)
    assert sum(losses[-10:]) / 10 < sum(losses[:3]) / 3  # it learns


def _torchrec_style_on_rank(rank: int, world: int) -> list[float]:
    module = load("examples/torchrec_style/train.py")
    assert module.main(["--steps", "3", "--batch-size", "32"]) == 0  # joins the running group
    return module.train(steps=2, batch_size=16, seed=1, log_every=10)  # type: ignore[no-any-return]


def test_torchrec_style_loop_runs_on_two_ranks() -> None:
    from recopt.testing import run_on_ranks

    results = run_on_ranks(_torchrec_style_on_rank, 2, timeout_s=180)
    assert all(len(losses) == 2 for losses in results)
    assert results[0] != results[1]  # each rank trains on its own batches
