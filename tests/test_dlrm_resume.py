"""The DLRM script's checkpoints at the end of a run and what ``--resume`` loads (issue 29):
the last steps are saved, a diverged run resumes from its newest finite checkpoint, and a
resharded checkpoint is resumed by its path, never written into."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from recopt.checkpoint import read_manifest, reshard

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "dlrm"))
sys.path.insert(0, str(ROOT / "tests"))

import dlrm_config  # noqa: E402
import train as dlrm_train  # noqa: E402
from test_dlrm import _criteo_args, records, small_run  # noqa: E402


def _run(out: pathlib.Path, steps: int, *extra: str) -> list[str]:
    every = ("--set", "checkpoint.every=5", "--set", "checkpoint.keep=5")
    return small_run(out, steps, "--set", "training.eval_every=0", *every, *extra)


def _steps(folder: pathlib.Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in folder.glob("step_*"))


def _last_val(out: pathlib.Path) -> dict[str, float]:
    val = [r for r in records(out) if r["split"] == "val"]
    return {k: v for k, v in val[-1].items() if k != "time_s"}


def test_the_last_steps_are_saved_when_steps_are_reached(tmp_path: pathlib.Path) -> None:
    assert dlrm_train.main(_run(tmp_path / "a", 12)) == 0
    assert _steps(tmp_path / "a" / "checkpoints") == [5, 10, 12]
    assert read_manifest(tmp_path / "a" / "checkpoints" / "step_000000012").step == 12
    # Resumed at the end: nothing to train, nothing saved again.
    assert dlrm_train.main([*_run(tmp_path / "a", 12), "--resume"]) == 0
    assert _steps(tmp_path / "a" / "checkpoints") == [5, 10, 12]


def test_the_last_steps_are_saved_when_the_data_runs_out(tmp_path: pathlib.Path) -> None:
    # 40 Criteo lines, batches of 8: the data ends after step 5, before training.steps.
    every = ("--set", "checkpoint.every=2", "--set", "checkpoint.keep=5")
    assert dlrm_train.main(_criteo_args(tmp_path, 40, 100, *every)) == 0
    assert _steps(tmp_path / "out" / "checkpoints") == [2, 4, 5]


def test_no_checkpoint_at_all_when_checkpoint_every_is_zero(tmp_path: pathlib.Path) -> None:
    assert dlrm_train.main(_run(tmp_path / "a", 7, "--set", "checkpoint.every=0")) == 0
    assert not (tmp_path / "a" / "checkpoints").exists()


def _poison_newest(out: pathlib.Path, steps: int, new_step: int) -> None:
    """Writes ``step_<new_step>``: the newest checkpoint, with a NaN in table t0."""
    config = dlrm_config.load_config(None, _run(out, steps)[1::2])
    env = dlrm_train.RunEnv()
    model = dlrm_train.shard_model(dlrm_train.build_model(config, env.device), config, env)
    trainer = dlrm_train.Trainer(config, env, model, resume=True)
    try:
        trainer.resume()
        with torch.no_grad():
            model.embedding_bags.embedding_bags["t0"].weight[3, 0] = float("nan")
        trainer.step = new_step
        trainer.save()
    finally:
        trainer.checkpoints.close()
    assert read_manifest(out / "checkpoints" / f"step_{new_step:09d}").finite is False


def test_resume_skips_non_finite_checkpoints_and_says_which(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert dlrm_train.main(_run(tmp_path / "whole", 20)) == 0
    assert dlrm_train.main(_run(tmp_path / "parts", 10)) == 0
    _poison_newest(tmp_path / "parts", 10, 14)
    capsys.readouterr()
    assert dlrm_train.main([*_run(tmp_path / "parts", 20), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "skipped step_000000014 (NaN/inf" in err
    assert "resumed from step 10" in err
    assert _last_val(tmp_path / "parts") == _last_val(tmp_path / "whole")  # bit-identical


def test_resume_refuses_a_folder_of_only_non_finite_checkpoints(tmp_path: pathlib.Path) -> None:
    assert dlrm_train.main(_run(tmp_path / "a", 5)) == 0
    _poison_newest(tmp_path / "a", 5, 7)
    (tmp_path / "a" / "checkpoints" / "step_000000005").rename(tmp_path / "kept")
    with pytest.raises(ValueError, match=r"every checkpoint in .* holds NaN or inf.*--resume"):
        dlrm_train.main([*_run(tmp_path / "a", 10), "--resume"])


def test_a_resharded_checkpoint_is_resumed_by_its_path_and_never_written_into(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert dlrm_train.main(_run(tmp_path / "whole", 20)) == 0
    assert dlrm_train.main(_run(tmp_path / "first", 10)) == 0
    resharded = tmp_path / "resharded"
    reshard(tmp_path / "first" / "checkpoints" / "step_000000010", resharded, world_size=1)
    files = sorted(p.relative_to(resharded) for p in resharded.rglob("*"))
    # The repro: the reshard's output as the run's checkpoint directory.
    with pytest.raises(ValueError, match=r"checkpoint\.dir .*resharded is one checkpoint"):
        dlrm_train.main(
            [*_run(tmp_path / "x", 20), "--set", f"checkpoint.dir={resharded}", "--resume"]
        )
    capsys.readouterr()
    assert dlrm_train.main([*_run(tmp_path / "second", 20), "--resume", str(resharded)]) == 0
    assert f"resumed from step 10 (2560 samples seen) of {resharded}" in capsys.readouterr().err
    assert _last_val(tmp_path / "second") == _last_val(tmp_path / "whole")  # bit-identical
    assert sorted(p.relative_to(resharded) for p in resharded.rglob("*")) == files
    assert _steps(tmp_path / "second" / "checkpoints") == [15, 20]


def test_resume_from_another_runs_checkpoints_folder(tmp_path: pathlib.Path) -> None:
    assert dlrm_train.main(_run(tmp_path / "whole", 20)) == 0
    assert dlrm_train.main(_run(tmp_path / "first", 10)) == 0
    folder = tmp_path / "first" / "checkpoints"
    assert dlrm_train.main([*_run(tmp_path / "second", 20), "--resume", str(folder)]) == 0
    assert _last_val(tmp_path / "second") == _last_val(tmp_path / "whole")
    with pytest.raises(ValueError, match=r"--resume .*nowhere: no checkpoint there"):
        dlrm_train.main([*_run(tmp_path / "third", 20), "--resume", str(tmp_path / "nowhere")])
