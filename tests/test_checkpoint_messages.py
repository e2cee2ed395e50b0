"""Checkpoint messages a user acts on: a folder of checkpoints given for one, the flag that
replaces another run's checkpoints, a rank without saved RNG state."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from recopt.checkpoint import CheckpointError, CheckpointManager, load, read_manifest
from recopt.checkpoint.cli import main as reshard_main


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _run_with_checkpoints(root: Path, steps: list[int]) -> None:
    with CheckpointManager(root, keep_last=5) as manager:
        for step in steps:
            manager.save(step, _model())


def test_reshard_of_a_folder_of_checkpoints_lists_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "checkpoints"
    _run_with_checkpoints(root, [5, 10])
    assert reshard_main([str(root), str(tmp_path / "out"), "--world-size", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "is a folder of checkpoints, not one checkpoint" in err
    assert "step_000000005, step_000000010" in err
    assert f"e.g. {root / 'step_000000010'}" in err
    assert "interrupted save" not in err
    with pytest.raises(CheckpointError, match="does not exist or is not a directory"):
        read_manifest(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="an interrupted save leaves only"):
        read_manifest(tmp_path / "empty")


def test_refusing_another_runs_checkpoints_names_the_api_and_the_script_flag(
    tmp_path: Path,
) -> None:
    _run_with_checkpoints(tmp_path / "ck", [1])
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(tmp_path / "ck")
    message = str(info.value)
    assert "resume=True (the DLRM script: --resume)" in message
    assert "overwrite=True (the DLRM script: --overwrite-checkpoints)" in message


def test_a_rank_without_saved_rng_state_is_told_the_world_sizes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _run_with_checkpoints(tmp_path / "ck", [1])
    path = tmp_path / "ck" / "step_000000001"
    # As a checkpoint resharded for 3 ranks from a run that had no rank 0 file would be.
    manifest = read_manifest(path)
    del manifest.files["rank_0.json"]
    manifest.world_size = 3
    manifest.write(path)
    with caplog.at_level(logging.WARNING, logger="recopt.checkpoint.save_load"):
        load(path, _model())
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "holds no RNG state for this rank (rank 0 of 1 now; the checkpoint (world size 3)" in (
        message
    )
    assert "grew" not in message
