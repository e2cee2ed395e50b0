"""The DLRM script and NaN/inf steps: counted, reported, and a stop after too many in a row.

A dense learning rate of 1e38 makes the first update finite but huge, so every later forward
overflows to NaN: each such step is skipped (nothing updated) and counted, and the run stops
with an error after ``training.max_consecutive_nonfinite`` of them.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

from recopt.checkpoint.manifest import read_manifest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "dlrm"))

import dlrm_config  # noqa: E402
import train as dlrm_train  # noqa: E402
from dlrm_nonfinite import NonFiniteTrainingError  # noqa: E402


def _argv(out: pathlib.Path, steps: int, limit: int) -> list[str]:
    sets = [
        f"training.steps={steps}",
        "training.log_every=1",
        f"training.output_dir={out}",
        "training.plot=false",
        "training.num_threads=1",
        f"training.max_consecutive_nonfinite={limit}",
        "data.batch_size=64",
        "data.val_batches=0",
        "checkpoint.every=1",
        "checkpoint.keep=1",
        "dense_optimizer.lr=1e38",
    ]
    return [arg for item in sets for arg in ("--set", item)]


def _train_records(out: pathlib.Path) -> list[dict[str, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


@pytest.mark.parametrize("value", [-1, -5])
def test_negative_limit_is_refused_naming_the_key(value: int) -> None:
    with pytest.raises(
        ValueError, match=rf"training\.max_consecutive_nonfinite must be >= 0, got {value}"
    ):
        dlrm_config.load_config(None, [f"training.max_consecutive_nonfinite={value}"])


def test_script_stops_after_the_limit_and_keeps_a_finite_checkpoint(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(NonFiniteTrainingError) as caught:
        dlrm_train.main(_argv(out, 20, 3))
    message = str(caught.value)
    assert "3 training steps in a row (the last at step 4)" in message
    assert "training.max_consecutive_nonfinite = 3" in message
    assert "dense_optimizer.lr 1e+38" in message and "learning rate too high" in message
    records = _train_records(out)
    assert [r["step"] for r in records] == [1, 2, 3]  # step 4 raised before its report
    assert [r["skipped_nonfinite"] for r in records] == [0, 1, 2]
    assert "loss" in records[0] and "loss" not in records[1]  # no NaN in the metrics
    # keep=1: only the newest checkpoint is left, and it is finite (skipped steps change nothing).
    kept = sorted((out / "checkpoints").glob("step_*"))
    assert [p.name for p in kept] == ["step_000000003"]
    assert read_manifest(kept[0]).finite is True


def test_zero_never_stops_and_counts(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run"
    assert dlrm_train.main(_argv(out, 6, 0)) == 0
    assert [r["skipped_nonfinite"] for r in _train_records(out)] == [0, 1, 2, 3, 4, 5]


def test_stopped_script_exits_non_zero(tmp_path: pathlib.Path) -> None:
    script = ROOT / "examples" / "dlrm" / "train.py"
    argv = _argv(tmp_path / "run", 20, 2)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), *argv], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode != 0
    assert "NonFiniteTrainingError: 2 training steps in a row" in done.stderr
    assert "skipped 1 (NaN/inf)" in done.stderr  # the progress line counts them


@pytest.fixture
def solo_torchft(request: pytest.FixtureRequest) -> Any:
    """Settings of one replica group on a torchft lighthouse started here (with its store)."""
    pytest.importorskip("torchft", reason="the ft extra: pip install 'recopt[ft]'")
    import ft_lighthouse

    from recopt.ft.torchft_manager import TorchftConfig

    server = ft_lighthouse.in_process(min_replicas=1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    request.addfinalizer(server.shutdown)
    yield TorchftConfig(
        replica_id="solo",
        lighthouse_addr=ft_lighthouse.address(server),
        store_addr="127.0.0.1",
        store_port=store.port,
        timeout=datetime.timedelta(seconds=20),
    )


def test_fault_tolerant_nan_step_is_dropped_skipped_and_counted(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, solo_torchft: Any
) -> None:
    """One NaN loss (the 3rd attempt) under torchft: the vote drops the step, its batch is
    skipped, not retried (it would fail again), and the metrics log counts it."""
    real_poison, calls = dlrm_train.poison_if_nonfinite, {"n": 0}
    attempts: list[tuple[Any, bool]] = []  # the batches themselves: a freed one's id is reused

    def poison(loss: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return real_poison(loss * float("nan") if calls["n"] == 3 else loss, dense)

    real_step = dlrm_train.Trainer.train_step

    def recorded_step(self: Any, batch: Any) -> bool:
        committed = real_step(self, batch)
        attempts.append((batch, committed))
        return committed

    monkeypatch.setattr(dlrm_train, "poison_if_nonfinite", poison)
    monkeypatch.setattr(dlrm_train.Trainer, "train_step", recorded_step)
    out = tmp_path / "run"
    sets = [f"training.steps={5}", "training.pipeline=false", "dense_optimizer.lr=0.01"]
    config = dlrm_config.load_config(None, _argv(out, 5, 3)[1::2] + sets)
    dlrm_train.train(config, dlrm_train.RunEnv(), ft_config=solo_torchft)
    assert [c for _, c in attempts] == [True, True, False, True, True, True]
    assert len({id(b) for b, _ in attempts}) == 6  # the NaN batch was not tried again
    records = _train_records(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["skipped_nonfinite"] for r in records] == [0, 0, 1, 1, 1]


def test_fault_tolerant_run_counts_dropped_nan_steps_and_stops(
    tmp_path: pathlib.Path, solo_torchft: Any
) -> None:
    # Every step after the first has a NaN loss (lr 1e38): dropped by the vote (reported by
    # the row-gradient hook and the dense all-reduce), counted, and the run stops.
    out = tmp_path / "run"
    argv = _argv(out, 20, 3) + ["--set", "checkpoint.every=0"]
    config = dlrm_config.load_config(None, argv[1::2])
    with pytest.raises(NonFiniteTrainingError, match="3 training steps in a row"):
        dlrm_train.train(config, dlrm_train.RunEnv(), ft_config=solo_torchft)
    records = _train_records(out)
    assert [r["step"] for r in records] == [1]  # dropped steps are not committed steps
    assert records[0]["skipped_nonfinite"] == 0
