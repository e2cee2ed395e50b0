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
